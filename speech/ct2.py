"""Reader for CTranslate2 `model.bin` files (binary format versions 1 to 6).

Layout (little endian), as written by ctranslate2.specs.model_spec.ModelSpec._serialize:

    u32 binary_version
    str spec_name            (version >= 2; str = u16 length incl. NUL, bytes, NUL)
    u32 spec_revision        (version >= 2)
    u32 n_variables
    n_variables x:
        str  name
        u8   rank
        u32  dims[rank]
        u8   dtype id        (version >= 4: 0 f32, 1 i8, 2 i16, 3 i32, 4 f16, 5 bf16;
                              version < 4: item size in bytes)
        u32  byte count      (version >= 4; element count before)
        bytes data
    u32 n_aliases            (version >= 3)
    n_aliases x: str alias, str target

int8 weights come with a `<name>_scale` float32 vector (one scale per output row):
real = int8 / scale.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16, 5: "bfloat16"}
_ITEMSIZE_DTYPES = {4: np.float32, 2: np.int16, 1: np.int8}


class CT2FormatError(ValueError):
    """The file is not a CTranslate2 model this reader understands."""


class CT2Model:
    """The variables of one model.bin, memory-mapped; `get` resolves aliases and dequantizes."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        buf = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._buf = buf
        mv = memoryview(buf)
        pos = 0

        def u(fmt: str) -> int:
            nonlocal pos
            (v,) = struct.unpack_from("<" + fmt, mv, pos)
            pos += struct.calcsize(fmt)
            return v

        def s() -> str:
            nonlocal pos
            n = u("H")
            raw = bytes(mv[pos : pos + n])
            pos += n
            return raw.rstrip(b"\0").decode("utf-8")

        try:
            self.version = u("I")
            if not 1 <= self.version <= 6:
                raise CT2FormatError(f"{self.path}: unsupported CTranslate2 binary version {self.version}")
            self.spec = s() if self.version >= 2 else ""
            self.revision = u("I") if self.version >= 2 else 1
            self.raw: dict[str, np.ndarray] = {}
            for _ in range(u("I")):
                name = s()
                rank = u("B")
                shape = tuple(u("I") for _ in range(rank))
                if self.version >= 4:
                    tid = u("B")
                    nbytes = u("I")
                    if tid not in _DTYPES:
                        raise CT2FormatError(f"{self.path}: variable {name} has unknown dtype id {tid}")
                    dtype = _DTYPES[tid]
                else:
                    dtype = _ITEMSIZE_DTYPES[u("B")]
                    nbytes = u("I") * np.dtype(dtype).itemsize
                if dtype == "bfloat16":
                    u16 = np.frombuffer(buf, dtype=np.uint16, count=nbytes // 2, offset=pos)
                    arr = (u16.astype(np.uint32) << 16).view(np.float32).reshape(shape)
                else:
                    arr = np.frombuffer(buf, dtype=dtype, count=nbytes // np.dtype(dtype).itemsize, offset=pos)
                    arr = arr.reshape(shape)
                pos += nbytes
                self.raw[name] = arr
            self.aliases: dict[str, str] = {}
            if self.version >= 3 and pos < len(buf):
                for _ in range(u("I")):
                    alias = s()
                    self.aliases[alias] = s()
        except (struct.error, ValueError) as exc:
            if isinstance(exc, CT2FormatError):
                raise
            raise CT2FormatError(f"{self.path}: truncated or corrupt CTranslate2 model ({exc})") from exc

    def names(self) -> list[str]:
        return sorted(set(self.raw) | set(self.aliases))

    def __contains__(self, name: str) -> bool:
        return name in self.raw or name in self.aliases

    def _resolve(self, name: str) -> str:
        seen = set()
        while name in self.aliases and name not in self.raw:
            if name in seen:
                raise CT2FormatError(f"alias cycle at {name}")
            seen.add(name)
            name = self.aliases[name]
        return name

    def get(self, name: str) -> np.ndarray:
        """Variable `name` as float32 (int8/int16 weights dequantized with their scales)."""
        real = self._resolve(name)
        if real not in self.raw:
            raise KeyError(name)
        arr = self.raw[real]
        if arr.dtype in (np.int8, np.int16) and not real.endswith("_scale"):
            scale_name = self._resolve(real + "_scale")
            if scale_name in self.raw:
                scale = self.raw[scale_name].astype(np.float32)
                shape = scale.shape + (1,) * (arr.ndim - scale.ndim)
                return arr.astype(np.float32) / scale.reshape(shape)
            return arr.copy()
        if arr.dtype in (np.float16, np.float32):
            return arr.astype(np.float32)
        return np.array(arr)
