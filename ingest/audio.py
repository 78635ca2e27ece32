"""Client audio to the one format everything downstream uses: 16 kHz float32 mono.

Converting once at the edge means VAD, the shm rings and Whisper never see another format.
"""

from __future__ import annotations

import numpy as np
import soxr

from protocol.messages import MAX_F32_SAMPLE, RATES

TARGET_RATE = 16000
ENCODINGS = ("pcm_s16le", "f32le")

_DTYPES = {"pcm_s16le": np.dtype("<i2"), "f32le": np.dtype("<f4")}
S16_SCALE = np.float32(1 / 32768)


class AudioFormatError(ValueError):
    """The client's audio does not match the format it declared."""


def buffer_len(frames: int, channels: int) -> int:
    """Samples of the kept buffer `decode_pcm` needs for a frame: one lane, and a second to add
    the other channels from."""
    return frames * min(channels, 2)


def decode_pcm(payload: bytes | memoryview, encoding: str, channels: int, out: np.ndarray | None = None) -> np.ndarray:
    """Interleaved little-endian PCM to float32 mono in [-1, 1] (for s16).

    Mono f32le comes back as a read-only view of `payload`; anything else is converted into
    `out` when given, a stream's kept buffer at least as long as the frame (twice, for several
    channels: one lane at a time is converted into the second half and added), so no frame costs
    an array. Each step is a copy or an operation on float32 alone: numpy's mean, or a mixed-type
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
    kept = np.empty(buffer_len(frames, channels), np.float32) if out is None else out
    mono = kept[:frames]
    lanes = raw.reshape(frames, channels)
    np.copyto(mono, lanes[:, 0], casting="same_kind")
    if channels > 1:
        lane = kept[frames: 2 * frames]
        for c in range(1, channels):
            np.copyto(lane, lanes[:, c], casting="same_kind")
            mono += lane
    scale = (S16_SCALE if encoding == "pcm_s16le" else np.float32(1)) / np.float32(channels)
    if scale != 1:
        mono *= scale
    return mono


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
