"""Whisper's log-mel spectrogram in numpy.

Matches openai/whisper `log_mel_spectrogram`: 16 kHz audio, n_fft 400 (25 ms), hop 160 (10 ms),
periodic Hann window, centred STFT with reflect padding, the last frame dropped, power spectrum,
as many Slaney-style mel filters as the model's encoder takes (80, or 128 for large-v3: librosa's
`mel(sr=16000, n_fft=400, n_mels=n_mels)`, htk=False, norm="slaney", which is where Whisper's
stored filterbanks come from), log10 clamped at 1e-10 and to (max - 8), then (x + 4) / 4.
"""

from __future__ import annotations

import functools

import numpy as np

SAMPLE_RATE = 16_000
N_FFT = 400
HOP_LENGTH = 160
N_MELS = 80  # most Whisper models; large-v3 and its distillations take 128
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


class LogMel:
    """Log-mel features of a batch into buffers kept from call to call.

    A worker computes features for every job, in a few dozen window sizes (short partial
    windows of whole seconds, the 30 s window of finals): the scratch buffers are sized once for
    the largest window and each call uses their leading part, so no feature array is allocated
    per job. Only the frames whose 25 ms window reaches the audio are transformed: the rest of
    the window would be the spectrum of zeros, whose log-mel is the floor (-10) that never
    raises the maximum, and Whisper zeroes those frames anyway. A 3 s final computes 302
    frames, not 3000, with the same result.

    The buffers cost ~13 KB a frame, 39 MB once a 30 s window has been asked for (one decoder's
    worth; pages are touched only as far as the audio reaches): what each final used to allocate
    and free. The array returned is a view of the output buffer, valid until the next call.
    """

    def __init__(self, n_mels: int = N_MELS) -> None:
        self.n_mels = n_mels  # the encoder's input channels: the model's, not a constant
        self._frames = 0  # the scratch buffers hold this many frames
        self._padded = self._windowed = self._window_rows = np.empty(0, np.float32)
        self._windowed64 = np.empty(0, np.float64)
        self._spec128 = np.empty(0, np.complex128)
        self._spec = np.empty(0, np.complex64)
        self._power = np.empty(0, np.float32)
        self._out = np.empty(0, np.float32)

    def __call__(self, audios: list[np.ndarray], n_frames: int = N_FRAMES) -> np.ndarray:
        """(len(audios), n_mels, n_frames) float32 log-mel, each audio cut to n_frames * 160 samples.

        As Whisper's transcribe does, the spectrogram is of the audio followed by zeros, only the
        frames covering the audio (len // 160) are kept and the rest of the window is 0 in log-mel
        space (pad_or_trim of the mel, not the mel of silence).
        """
        if n_frames > self._frames:
            self._frames = n_frames
            self._padded = np.empty(n_frames * HOP_LENGTH + N_FFT, np.float32)
            self._windowed = np.empty((n_frames, N_FFT), np.float32)
            self._window_rows = np.tile(_window(), (n_frames, 1))
            self._windowed64 = np.empty((n_frames, N_FFT), np.float64)
            self._spec128 = np.empty((n_frames, N_FFT // 2 + 1), np.complex128)
            self._spec = np.empty((n_frames, N_FFT // 2 + 1), np.complex64)
            self._power = np.empty((n_frames, N_FFT // 2 + 1), np.float32)
        size = len(audios) * self.n_mels * n_frames
        if size > self._out.size:
            self._out = np.empty(size, np.float32)
        out = self._out[:size].reshape(len(audios), self.n_mels, n_frames)
        for row, audio in zip(out, audios):
            self._one(np.asarray(audio, dtype=np.float32).reshape(-1), n_frames, row)
        return out

    def _one(self, audio: np.ndarray, n_frames: int, out: np.ndarray) -> None:
        n_samples = n_frames * HOP_LENGTH
        n = min(len(audio), n_samples)
        half = N_FFT // 2
        # frame f covers samples [160 f - 200, 160 f + 200) of the audio
        frames = min(n_frames, -(-(n + half) // HOP_LENGTH))
        padded = self._padded[: (frames - 1) * HOP_LENGTH + N_FFT if frames < n_frames else n_samples + N_FFT]
        padded[half : half + n] = audio[:n]
        padded[half + n :] = 0.0
        # reflect padding at both ends of the (zero-padded) signal, as torch.stft(center=True) does
        padded[:half] = padded[half + 1 : 2 * half + 1][::-1]
        if frames == n_frames:  # the last frames reach the end of the window, and its reflection
            body = padded[half : half + n_samples]
            padded[half + n_samples :] = body[n_samples - half - 1 : n_samples - 1][::-1]
        # centred frames; Whisper drops the one past the end of the window
        strided = np.lib.stride_tricks.as_strided(padded, shape=(frames, N_FFT), strides=(HOP_LENGTH * 4, 4),
                                                  writeable=False)
        # copied, then windowed by a window repeated for every frame: numpy multiplies an
        # overlapping or broadcast operand through a buffer of its own, allocated every call
        windowed = self._windowed[:frames]
        np.copyto(windowed, strided)
        windowed *= self._window_rows[:frames]
        # numpy transforms float32 in double precision (its loop for a real input is float64), and
        # fed float32 it allocates its cast buffers on every call: the casts are done here instead
        windowed64 = self._windowed64[:frames]
        np.copyto(windowed64, windowed)
        spec = self._spec[:frames]
        np.copyto(spec, np.fft.rfft(windowed64, axis=-1, out=self._spec128[:frames]))
        power = np.square(spec.real, out=self._power[:frames])
        power += np.square(spec.imag, out=windowed.reshape(-1)[: power.size].reshape(power.shape))  # windowed is spent
        # into contiguous memory (windowed is spent again): numpy's matmul would compute into a
        # temporary and copy it for the strided columns of `out`
        mel = np.matmul(mel_filters(self.n_mels), power.T,
                        out=windowed.reshape(-1)[: self.n_mels * frames].reshape(self.n_mels, frames))
        np.maximum(mel, 1e-10, out=mel)
        np.log10(mel, out=mel)
        np.maximum(mel, mel.max() - 8.0, out=mel)
        mel += 4.0
        mel /= 4.0
        out[:, :frames] = mel
        out[:, min(n_frames, n // HOP_LENGTH) :] = 0.0
