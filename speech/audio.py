"""Read audio files as float32 mono 16 kHz."""

from __future__ import annotations

import functools
import io
from pathlib import Path

import numpy as np

from protocol.messages import G711_SUBTYPES
from speech.backend import SAMPLE_RATE


# Largest sample magnitude read (full scale is ±1), as the service takes f32le audio: beyond it
# the mix-down, the resampler or the log-mel's power overflows float32 and Whisper, given NaN,
# writes a line of "!". NaN fails the comparison too.
SAMPLE_LIMIT = 16.0
RAW_SUFFIXES = (".raw", ".pcm", ".s16")  # headerless 16-bit little-endian mono
# Headerless G.711, 8 kHz mono: the names Asterisk's recordings and SoX give such files, and their encodings
G711_SUFFIXES = {".ulaw": "pcm_mulaw", ".ul": "pcm_mulaw", ".mu": "pcm_mulaw",
                 ".alaw": "pcm_alaw", ".al": "pcm_alaw", ".alw": "pcm_alaw"}
G711_RATE = 8000


class AudioError(ValueError):
    """The file cannot be read as audio (missing, empty, corrupt or unsupported)."""


def not_a_file(path: Path) -> str | None:
    """Why there is no file at `path` to open, said before libsndfile says it less clearly ("System
    error." for a missing file, "Format not recognised." for a directory); None when there is one."""
    if path.is_dir():
        return "a directory, not a file"
    return None if path.exists() else "no such file"


def raw_format(path: Path) -> dict[str, object]:
    """What libsndfile must be told to read `path` when it is headerless G.711 (it has no header
    to say): its rate, channels and coding; nothing for any other file."""
    encoding = G711_SUFFIXES.get(path.suffix.lower())
    return {} if encoding is None else {"samplerate": G711_RATE, "channels": 1, "format": "RAW",
                                        "subtype": G711_SUBTYPES[encoding]}


@functools.cache
def g711_levels(encoding: str) -> np.ndarray:
    """The 16-bit level of each of the 256 codes of a G.711 encoding, indexed by the code
    (read-only). libsndfile expands the codes as G.711 defines them: no companding formula of
    our own to get wrong. The ingest decodes its clients' frames with it, a client its input."""
    import soundfile

    levels, _ = soundfile.read(io.BytesIO(bytes(range(256))), format="RAW", subtype=G711_SUBTYPES[encoding],
                               samplerate=G711_RATE, channels=1, dtype="int16")
    levels.flags.writeable = False
    return levels


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

    Headerless ``.raw``/``.pcm``/``.s16`` files are read as 16 kHz signed 16-bit little-endian
    mono, headerless G.711 (``.ulaw``, ``.ul``, ``.mu``; ``.alaw``, ``.al``, ``.alw``) as 8 kHz mono.
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
        audio, rate = sf.read(str(path), dtype="float32", always_2d=True, **raw_format(path))
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as exc:
        raise AudioError(f"{path}: not a readable audio file ({exc})") from exc
    if audio.shape[0] == 0:
        raise AudioError(f"{path}: the file holds no audio samples")
    if not (audio.min() >= -SAMPLE_LIMIT and audio.max() <= SAMPLE_LIMIT):
        raise AudioError(f"{path}: samples must lie within ±{SAMPLE_LIMIT:g} (full scale is ±1); "
                         "this file holds larger ones, NaN or infinity")
    return resample(to_mono(audio), int(rate))
