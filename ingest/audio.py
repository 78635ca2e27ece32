"""Client audio to the one format everything downstream uses: 16 kHz float32 mono.

Converting once at the edge means VAD, the shm rings and Whisper never see another format.
"""

from __future__ import annotations

import numpy as np
import soxr

from protocol.messages import ENCODINGS, G711_SUBTYPES, MAX_F32_SAMPLE, RATES
from speech.audio import g711_levels

TARGET_RATE = 16000

_DTYPES = {"pcm_s16le": np.dtype("<i2"), "f32le": np.dtype("<f4"), "pcm_mulaw": np.dtype("u1"), "pcm_alaw": np.dtype("u1")}
S16_SCALE = np.float32(1 / 32768)
_INDEX_SLOTS = np.dtype(np.intp).itemsize // np.dtype(np.float32).itemsize  # float32 slots an index takes
# Float32 level of each of the 256 codes of a G.711 encoding, on the pcm_s16le scale
_TABLES = {encoding: g711_levels(encoding).astype(np.float32) * S16_SCALE for encoding in G711_SUBTYPES}


class AudioFormatError(ValueError):
    """The client's audio does not match the format it declared."""


def buffer_len(frames: int, channels: int, encoding: str) -> int:
    """Samples of the kept buffer `decode_pcm` needs for a frame: one lane, a second to add the
    other channels from and, for G.711, one lane's codes as the intp indices numpy's `take` reads
    (given any other type, it would convert them into an array of its own), 8-byte aligned."""
    if encoding not in _TABLES:
        return frames * min(channels, 2)
    return _index_start(frames, channels) + frames * _INDEX_SLOTS


def _index_start(frames: int, channels: int) -> int:
    """Where a G.711 frame's indices begin in the kept buffer: past the lanes, 8-byte aligned."""
    lanes = frames * min(channels, 2)
    return lanes + -lanes % _INDEX_SLOTS


def decode_pcm(payload: bytes | memoryview, encoding: str, channels: int, out: np.ndarray | None = None) -> np.ndarray:
    """Interleaved little-endian PCM, or G.711 codes, to float32 mono in [-1, 1] (for s16 and G.711).

    Mono f32le comes back as a read-only view of `payload`; anything else is converted into
    `out` when given, a stream's kept buffer of at least `buffer_len` samples (several channels:
    one lane at a time is converted into the second lane and added), so no frame costs an array.
    Each step is a copy or an operation on float32 alone: numpy's mean, or a mixed-type
    operation, would cast through buffers of its own.
    """
    dtype = _DTYPES.get(encoding)
    if dtype is None:
        raise AudioFormatError(f"unknown encoding {encoding!r}; expected one of {ENCODINGS}")
    if channels < 1:
        raise AudioFormatError(f"channels must be >= 1, got {channels}")
    nbytes = memoryview(payload).nbytes
    if nbytes % (dtype.itemsize * channels):
        raise AudioFormatError(f"{nbytes} bytes is not a whole number of {channels}-channel {encoding} frames")
    raw = np.frombuffer(payload, dtype=dtype)
    # min and max carry any NaN or out-of-range sample, without the per-sample mask a check of
    # every sample would allocate
    if encoding == "f32le" and raw.size and not (raw.min() >= -MAX_F32_SAMPLE and raw.max() <= MAX_F32_SAMPLE):
        raise AudioFormatError(f"f32le samples must lie within ±{MAX_F32_SAMPLE:g} (full scale is ±1); "
                               "this frame holds NaN, infinity or a value beyond that")
    if channels == 1 and encoding == "f32le":
        return raw.astype(np.float32, copy=False)
    frames = len(raw) // channels
    kept = np.empty(buffer_len(frames, channels, encoding), np.float32) if out is None else out
    mono = kept[:frames]
    lanes = raw.reshape(frames, channels)
    table = _TABLES.get(encoding)
    index = None
    if table is not None:
        start = _index_start(frames, channels)
        index = kept[start: start + frames * _INDEX_SLOTS].view(np.intp)
    _convert(mono, lanes[:, 0], table, index)
    if channels > 1:
        lane = kept[frames: 2 * frames]
        for c in range(1, channels):
            _convert(lane, lanes[:, c], table, index)
            mono += lane
    scale = (S16_SCALE if encoding == "pcm_s16le" else np.float32(1)) / np.float32(channels)
    if scale != 1:
        mono *= scale
    return mono


def _convert(dst: np.ndarray, src: np.ndarray, table: np.ndarray | None, index: np.ndarray | None) -> None:
    """One lane into `dst` as float32: copied, or its G.711 codes looked up in `table` through `index`."""
    if table is None:
        np.copyto(dst, src, casting="same_kind")
        return
    np.copyto(index, src, casting="safe")
    np.take(table, index, out=dst, mode="clip")  # "clip": "raise" would buffer `out`; codes are 0..255 anyway


class Resampler:
    """Streaming resampler to 16 kHz for one stream; keeps filter state across chunks.

    Output lags input by the filter delay; `process(..., last=True)` drains it so the total
    output length matches the input duration.
    """

    def __init__(self, rate: int) -> None:
        if rate not in RATES:
            raise AudioFormatError(f"unsupported sample rate {rate}; expected one of {RATES}")
        self.rate = rate
        self._stream = None if rate == TARGET_RATE else soxr.ResampleStream(rate, TARGET_RATE, 1, dtype="float32")

    def process(self, x: np.ndarray, last: bool = False) -> np.ndarray:
        """Resample a float32 mono chunk; at 16 kHz returns `x` itself."""
        if self._stream is None:
            return x
        return self._stream.resample_chunk(x, last=last)
