"""Whisper's log-mel spectrogram in numpy.

Matches openai/whisper `log_mel_spectrogram`: 16 kHz audio, n_fft 400 (25 ms), hop 160 (10 ms),
periodic Hann window, centred STFT with reflect padding, the last frame dropped, power spectrum,
80 Slaney-style mel filters (librosa's `mel(sr=16000, n_fft=400, n_mels=80)`: htk=False,
norm="slaney"), log10 clamped at 1e-10 and to (max - 8), then (x + 4) / 4.
"""

from __future__ import annotations

import functools

import numpy as np

SAMPLE_RATE = 16_000
N_FFT = 400
HOP_LENGTH = 160
N_MELS = 80
CHUNK_SECONDS = 30
N_SAMPLES = SAMPLE_RATE * CHUNK_SECONDS  # 480000
N_FRAMES = N_SAMPLES // HOP_LENGTH  # 3000 mel frames per 30 s window
FRAMES_PER_SECOND = SAMPLE_RATE // HOP_LENGTH  # 100


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    f = np.asanyarray(f, dtype=np.float64)
    f_sp = 200.0 / 3
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / f_sp
    logstep = np.log(6.4) / 27.0
    return np.where(f >= min_log_hz, min_log_mel + np.log(np.maximum(f, 1e-10) / min_log_hz) / logstep, f / f_sp)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asanyarray(m, dtype=np.float64)
    f_sp = 200.0 / 3
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / f_sp
    logstep = np.log(6.4) / 27.0
    return np.where(m >= min_log_mel, min_log_hz * np.exp(logstep * (m - min_log_mel)), f_sp * m)


@functools.lru_cache(maxsize=4)
def mel_filters(n_mels: int = N_MELS, sr: int = SAMPLE_RATE, n_fft: int = N_FFT) -> np.ndarray:
    """(n_mels, n_fft//2 + 1) float32 filterbank, same as librosa.filters.mel(sr, n_fft, n_mels)."""
    fftfreqs = np.linspace(0.0, sr / 2.0, 1 + n_fft // 2)
    mel_pts = np.linspace(_hz_to_mel(0.0), _hz_to_mel(sr / 2.0), n_mels + 2)
    mel_f = _mel_to_hz(mel_pts)
    fdiff = np.diff(mel_f)
    ramps = mel_f[:, None] - fftfreqs[None, :]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    enorm = 2.0 / (mel_f[2 : n_mels + 2] - mel_f[:n_mels])
    weights *= enorm[:, None]
    out = weights.astype(np.float32)
    out.flags.writeable = False
    return out


@functools.lru_cache(maxsize=1)
def _window() -> np.ndarray:
    n = np.arange(N_FFT, dtype=np.float64)
    w = (0.5 - 0.5 * np.cos(2.0 * np.pi * n / N_FFT)).astype(np.float32)  # periodic Hann
    w.flags.writeable = False
    return w


def log_mel(audio: np.ndarray, n_frames: int = N_FRAMES) -> np.ndarray:
    """(80, n_frames) float32 log-mel of `audio` (float32 16 kHz, cut to n_frames*160 samples).

    As Whisper's transcribe does, the spectrogram is computed on the audio followed by zeros,
    only the frames covering the audio (len // 160) are kept and the rest of the window is
    filled with 0 in log-mel space (pad_or_trim of the mel, not the mel of silence).
    """
    n_samples = n_frames * HOP_LENGTH
    audio = np.asarray(audio, dtype=np.float32).reshape(-1)
    padded = np.zeros(n_samples + N_FFT, dtype=np.float32)  # reflect margins of N_FFT//2 each side
    n = min(len(audio), n_samples)
    half = N_FFT // 2
    padded[half : half + n] = audio[:n]
    # reflect padding at both ends of the (zero-padded) signal, as torch.stft(center=True) does
    body = padded[half : half + n_samples]
    padded[:half] = body[1 : half + 1][::-1]
    padded[half + n_samples :] = body[n_samples - half - 1 : n_samples - 1][::-1]
    # n_frames + 1 centred frames; Whisper drops the last one
    frames = np.lib.stride_tricks.as_strided(
        padded, shape=(n_frames, N_FFT), strides=(HOP_LENGTH * 4, 4), writeable=False
    )
    spec = np.fft.rfft(frames * _window(), axis=-1)
    power = spec.real**2 + spec.imag**2
    mel = mel_filters() @ power.T.astype(np.float32)
    log_spec = np.log10(np.maximum(mel, 1e-10))
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    out = ((log_spec + 4.0) / 4.0).astype(np.float32)
    content = min(n_frames, n // HOP_LENGTH)
    out[:, content:] = 0.0
    return out


def log_mel_batch(audios: list[np.ndarray], n_frames: int = N_FRAMES) -> np.ndarray:
    """(B, 80, n_frames) float32."""
    out = np.empty((len(audios), N_MELS, n_frames), dtype=np.float32)
    for i, a in enumerate(audios):
        out[i] = log_mel(a, n_frames)
    return out
