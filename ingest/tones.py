"""Keypad (DTMF) tones in the VAD's chunks.

A caller's dialled digits are no speech, yet Silero scores runs of them on a phone line as speech
now and then, and the 100 ms gaps between digits above all (its state lags the tone by a chunk or
two): a segment opens, costs decodes, and Whisper may caption it "Beep, beep." A DTMF tone is
one frequency of each of two groups and next to nothing else, which speech never is: its two
frequencies hold SHARE (0.9) or more of the energy of each chunk wholly inside a key's tone,
within the keypad's tolerances, where speech (85 recorded and espeak-ng clips, 8,400 loud
chunks at 16 kHz and as many on an 8 kHz line) held at most 0.67
(`scripts/tone_share.py`; docs/PERFORMANCE.md, "Non-speech on a call").
"""

from __future__ import annotations

import numpy as np

LOW = (697.0, 770.0, 852.0, 941.0)  # Hz, the keypad's rows
HIGH = (1209.0, 1336.0, 1477.0, 1633.0)  # and its columns
SHARE = 0.9  # of a chunk's energy in one frequency of each group, at least
LEAST = 0.1  # in each of the two: a level difference ("twist") of up to 9.5 dB between them
FLOOR = 1e-5  # mean square (-50 dBFS): quieter chunks are not taken for tones
# The probes: each frequency and half a bin either side (the keypad's own tolerance is 1.5 %, up
# to 25 Hz), so a tone anywhere in it falls within a third of a bin of one.
OFFSETS = (-0.5, 0.0, 0.5)


class DtmfDetector:
    """Which chunks (rows of CHUNK samples at `rate`) are DTMF tones: each chunk projected on a
    Hann-windowed cosine and sine per probe, one matrix product for a whole call's chunks."""

    def __init__(self, chunk: int, rate: int) -> None:
        window = np.hanning(chunk + 1)[:-1]
        bin_hz = rate / chunk
        probes = np.array([hz + k * bin_hz for hz in LOW + HIGH for k in OFFSETS])
        phase = 2 * np.pi * probes[None, :] * (np.arange(chunk) / rate)[:, None]
        # the cosines of every probe (the low group's first), then their sines
        self._probes = (window[:, None] * np.concatenate([np.cos(phase), np.sin(phase)], axis=1)).astype(np.float32)
        self._weights = np.stack([np.ones(chunk), window**2], axis=1).astype(np.float32)  # energy: raw, windowed
        self._chunk = chunk

    def __call__(self, chunks: np.ndarray) -> np.ndarray:
        energy = (chunks * chunks) @ self._weights
        loud = energy[:, 0] > FLOOR * self._chunk
        if not loud.any():  # silence, as much of a call is: nothing more to compute
            return loud
        low, high = self._shares(chunks, energy[:, 1])
        return loud & (low + high >= SHARE) & (np.minimum(low, high) >= LEAST)

    def shares(self, chunks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Whether each chunk is loud enough to be a tone, and the share of its energy in the
        strongest probe of each group: what `scripts/tone_share.py` compares."""
        energy = (chunks * chunks) @ self._weights
        return (energy[:, 0] > FLOOR * self._chunk, *self._shares(chunks, energy[:, 1]))

    def _shares(self, chunks: np.ndarray, windowed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        projected = chunks @ self._probes
        half = projected.shape[1] // 2
        # a pure tone at a probe holds a third of N x the windowed energy in its (cos, sin) pair
        scale = 3.0 / (self._chunk * np.maximum(windowed, 1e-20))
        power = (projected[:, :half] ** 2 + projected[:, half:] ** 2) * scale[:, None]
        return power[:, : half // 2].max(axis=1), power[:, half // 2 :].max(axis=1)
