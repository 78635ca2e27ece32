"""Read audio files as float32 mono 16 kHz."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from speech.backend import SAMPLE_RATE


# Largest sample magnitude read (full scale is ±1), as the service takes f32le audio: beyond it
# the mix-down, the resampler or the log-mel's power overflows float32 and Whisper, given NaN,
# writes a line of "!". NaN fails the comparison too.
SAMPLE_LIMIT = 16.0
RAW_SUFFIXES = (".raw", ".pcm", ".s16")  # headerless 16-bit little-endian mono


class AudioError(ValueError):
    """The file cannot be read as audio (missing, empty, corrupt or unsupported)."""


def not_a_file(path: Path) -> str | None:
    """Why there is no file at `path` to open, said before libsndfile says it less clearly ("System
    error." for a missing file, "Format not recognised." for a directory); None when there is one."""
    if path.is_dir():
        return "a directory, not a file"
    return None if path.exists() else "no such file"


def resample(audio: np.ndarray, rate: int, target: int = SAMPLE_RATE) -> np.ndarray:
    if rate == target:
        return np.ascontiguousarray(audio, dtype=np.float32)
    import soxr

    return soxr.resample(np.ascontiguousarray(audio, dtype=np.float32), rate, target, quality="HQ").astype(np.float32)


def to_mono(audio: np.ndarray) -> np.ndarray:
    audio = np.asarray(audio, dtype=np.float32)
    return audio.mean(axis=1, dtype=np.float32) if audio.ndim == 2 else audio.reshape(-1)


def load_audio(path: str | Path, raw_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Float32 mono 16 kHz samples of `path` (WAV/FLAC/OGG/... via libsndfile, any rate, any channels).

    Headerless ``.raw``/``.pcm`` files are read as 16 kHz signed 16-bit little-endian mono.
    """
    import soundfile as sf

    path = Path(path)
    if why := not_a_file(path):
        raise AudioError(f"{path}: {why}")
    if not path.is_file():  # a pipe, a device: its size below says nothing
        raise AudioError(f"{path}: not a regular file")
    size = path.stat().st_size
    if size == 0:
        raise AudioError(f"{path}: empty file")
    if path.suffix.lower() in RAW_SUFFIXES:
        data = np.fromfile(path, dtype="<i2")
        if data.size == 0:
            raise AudioError(f"{path}: no samples in raw file")
        return resample(data.astype(np.float32) / 32768.0, raw_rate)
    try:
        audio, rate = sf.read(str(path), dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as exc:
        raise AudioError(f"{path}: not a readable audio file ({exc})") from exc
    if audio.shape[0] == 0:
        raise AudioError(f"{path}: the file holds no audio samples")
    if not (audio.min() >= -SAMPLE_LIMIT and audio.max() <= SAMPLE_LIMIT):
        raise AudioError(f"{path}: samples must lie within ±{SAMPLE_LIMIT:g} (full scale is ±1); "
                         "this file holds larger ones, NaN or infinity")
    return resample(to_mono(audio), int(rate))
