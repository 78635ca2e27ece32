"""Sounds of a phone call that are not speech, synthesized (numpy, seeded): hold music, ring-back
and busy tones, DTMF digits, line noise, clicks; and a call put on hold (a dev-set sentence, hold
music, another sentence). What a captioning service must not caption, and must caption around.
`scripts/nonspeech.py` streams them through a service; the tests stream a few.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import soxr

from client.core import float_to_int16
from ingest.audio import Resampler
from speech.audio import load_audio
from streamasr.testdata import utterances


def _tone(rate: int, seconds: float, freqs: tuple[float, ...], level_db: float = -12.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return sum(np.sin(2 * np.pi * f * t) for f in freqs) / len(freqs) * 10 ** (level_db / 20)


def _cadence(rate: int, seconds: float, freqs: tuple[float, ...], pattern: list[tuple[float, float]]) -> np.ndarray:
    """A call-progress tone: `freqs` summed, switched on and off by (on, off) seconds, repeated."""
    out = np.zeros(int(seconds * rate))
    at = 0
    while at < len(out):
        for on, off in pattern:
            n = int(on * rate)
            out[at:at + n] = _tone(rate, on, freqs)[: len(out) - at]
            at += n + int(off * rate)
    return out


def ringback_na(rate: int, seconds: float, rng: np.random.Generator) -> np.ndarray:
    return _cadence(rate, seconds, (440, 480), [(2.0, 4.0)])


def ringback_uk(rate: int, seconds: float, rng: np.random.Generator) -> np.ndarray:
    return _cadence(rate, seconds, (400, 450), [(0.4, 0.2), (0.4, 2.0)])


def busy(rate: int, seconds: float, rng: np.random.Generator) -> np.ndarray:
    return _cadence(rate, seconds, (480, 620), [(0.5, 0.5)])


DTMF = {d: (lo, hi) for row, lo in zip(("123A", "456B", "789C", "*0#D"), (697, 770, 852, 941))
        for d, hi in zip(row, (1209, 1336, 1477, 1633))}


def dtmf(rate: int, seconds: float, rng: np.random.Generator) -> np.ndarray:
    """Digits of 100 ms with 100 ms between them, a number of ten, then a pause of 1-3 s."""
    out = np.zeros(int(seconds * rate))
    at = int(0.5 * rate)
    while at < len(out):
        for digit in rng.choice(list("0123456789*#"), 10):
            tone = _tone(rate, 0.1, DTMF[digit], -10)[: max(0, len(out) - at)]
            out[at:at + len(tone)] = tone
            at += int(0.2 * rate)
        at += int(rng.uniform(1, 3) * rate)
    return out


def _envelope(n: int, rate: int, attack: float = 0.02, release: float = 0.3) -> np.ndarray:
    env = np.ones(n)
    a, r = min(int(attack * rate), n), min(int(release * rate), n)
    env[:a] = np.linspace(0, 1, a)
    env[n - r:] *= np.linspace(1, 0, r)
    return env


def _note(rate: int, seconds: float, freq: float) -> np.ndarray:
    """A plucked-ish note: a few harmonics, decaying."""
    t = np.arange(int(seconds * rate)) / rate
    wave = sum(np.sin(2 * np.pi * freq * k * t) / k for k in (1, 2, 3) if freq * k < rate / 2)
    return wave * np.exp(-2.5 * t) * _envelope(len(t), rate)


def hold_music(rate: int, seconds: float, rng: np.random.Generator) -> np.ndarray:
    """I-V-vi-IV chords (a bar each, 2 s), a melody of eighth notes over them, a drum-like noise burst a beat."""
    out = np.zeros(int(seconds * rate))
    chords = [(261.6, 329.6, 392.0), (196.0, 246.9, 293.7), (220.0, 261.6, 329.6), (174.6, 220.0, 261.6)]
    beat = 0.5
    for bar in range(int(seconds / (4 * beat)) + 1):
        at = int(bar * 4 * beat * rate)
        chord = chords[bar % 4]
        for f in chord:
            note = _note(rate, 4 * beat, f) * 0.15
            out[at:at + len(note)] += note[: max(0, len(out) - at)]
        for eighth in range(8):
            f = 2 * chord[rng.integers(3)] * rng.choice([1, 1.122, 1.26])
            start = at + int(eighth * beat / 2 * rate)
            note = _note(rate, beat / 2, f) * 0.12
            out[start:start + len(note)] += note[: max(0, len(out) - start)]
        for b in range(4):
            start = at + int(b * beat * rate)
            hit = rng.standard_normal(int(0.06 * rate)) * np.exp(-np.arange(int(0.06 * rate)) / (0.01 * rate)) * 0.1
            out[start:start + len(hit)] += hit[: max(0, len(out) - start)]
    return out


def _white(level_db: float) -> Callable[[int, float, np.random.Generator], np.ndarray]:
    def make(rate: int, seconds: float, rng: np.random.Generator) -> np.ndarray:
        return rng.standard_normal(int(seconds * rate)) * 10 ** (level_db / 20)
    return make


def _pink(level_db: float) -> Callable[[int, float, np.random.Generator], np.ndarray]:
    def make(rate: int, seconds: float, rng: np.random.Generator) -> np.ndarray:
        n = int(seconds * rate)
        spectrum = np.fft.rfft(rng.standard_normal(n))
        spectrum /= np.sqrt(np.maximum(np.arange(len(spectrum)), 1))
        pink = np.fft.irfft(spectrum, n)
        return pink / pink.std() * 10 ** (level_db / 20)
    return make


def clicks(rate: int, seconds: float, rng: np.random.Generator) -> np.ndarray:
    """A quiet line (-65 dBFS) with single-sample clicks and bursts of key presses (short decaying noise)."""
    out = rng.standard_normal(int(seconds * rate)) * 10 ** (-65 / 20)
    for at in rng.integers(0, len(out), int(seconds * 2)):
        out[at] += rng.choice([-0.5, 0.5])
    at = int(rate)
    while at < len(out) - rate:
        for _ in range(rng.integers(3, 12)):  # a word typed
            n = int(0.008 * rate)
            out[at:at + n] += rng.standard_normal(n) * np.exp(-np.arange(n) / (0.002 * rate)) * 0.2
            at += int(rng.uniform(0.08, 0.2) * rate)
        at += int(rng.uniform(0.5, 2) * rate)
    return out


def breathing(rate: int, seconds: float, rng: np.random.Generator) -> np.ndarray:
    """Breaths close to the microphone: pink noise swelling and fading over a second or so, 1-2.5 s apart."""
    out = np.zeros(int(seconds * rate))
    at = 0
    while at < len(out):
        n = int(rng.uniform(0.8, 1.5) * rate)
        breath = _pink(-20)(rate, n / rate, rng) * np.sin(np.pi * np.arange(n) / n) ** 2
        out[at:at + n] = breath[: len(out) - at]
        at += n + int(rng.uniform(1, 2.5) * rate)
    return out


SIGNALS: dict[str, Callable[[int, float, np.random.Generator], np.ndarray]] = {
    "hold_music": hold_music,
    "ringback_na": ringback_na,
    "ringback_uk": ringback_uk,
    "dtmf": dtmf,
    "busy": busy,
    "white_-50dB": _white(-50),
    "white_-30dB": _white(-30),
    "white_-15dB": _white(-15),
    "pink_-45dB": _pink(-45),
    "pink_-25dB": _pink(-25),
    "clicks": clicks,
    "breathing": breathing,
}


def telephone(audio: np.ndarray, rate: int) -> np.ndarray:
    """At 8 kHz, the 300-3400 Hz band a phone line carries."""
    if rate != 8000:
        return audio
    spectrum = np.fft.rfft(audio)
    freqs = np.fft.rfftfreq(len(audio), 1 / rate)
    spectrum[(freqs < 300) | (freqs > 3400)] = 0
    return np.fft.irfft(spectrum, len(audio))


@dataclass(frozen=True)
class Call:
    """A call put on hold: its 16-bit audio, what was said in it, and when it was on hold (seconds)."""

    audio: np.ndarray
    said: str
    hold: tuple[float, float]


def on_hold(rate: int, seconds: float, rng: np.random.Generator) -> Call:
    """A sentence, `seconds` of hold music, another sentence (the dev set's first two LibriVox
    utterances), as a phone line carries them."""
    spoken = [u for u in utterances() if u.name.startswith("librivox/")][:2]
    if len(spoken) < 2:
        raise FileNotFoundError("needs the dev set's LibriVox utterances (Debian's pocketsphinx-testdata)")
    first, second = (load_audio(u.path) if rate == 16000 else soxr.resample(load_audio(u.path), 16000, rate) for u in spoken)
    call = np.concatenate([first, hold_music(rate, seconds, rng), second])
    start = len(first) / rate
    return Call(pcm(telephone(call, rate)), " ".join(u.reference for u in spoken), (start, start + seconds))


def signal(name: str, rate: int, seconds: float, seed: int = 98) -> np.ndarray:
    """SIGNALS[name], `seconds` long at `rate`, as a phone line carries it."""
    return pcm(telephone(SIGNALS[name](rate, seconds, np.random.default_rng(seed)), rate))


def signal_then(name: str, rate: int, seconds: float, speech: np.ndarray, seed: int = 98) -> np.ndarray:
    """`seconds` of SIGNALS[name], then `speech` (16 kHz float) and a second of silence, at `rate`
    as a phone line carries them: a caller who dialled digits, or heard a tone, and speaks."""
    return np.concatenate([signal(name, rate, seconds, seed), on_line(speech, rate), np.zeros(rate, np.int16)])


def on_line(audio: np.ndarray, rate: int) -> np.ndarray:
    """16 kHz float `audio` as a line at `rate` carries it, in 16-bit PCM."""
    return pcm(telephone(audio if rate == 16000 else soxr.resample(audio, 16000, rate), rate))


def carried(audio: np.ndarray, rate: int) -> np.ndarray:
    """16 kHz float `audio` as a line at `rate` carries it, and back at 16 kHz float as the ingest
    has it."""
    return as_ingest(on_line(audio, rate), rate)


def as_ingest(audio: np.ndarray, rate: int) -> np.ndarray:
    """16-bit `audio` at `rate` as the ingest has it: 16 kHz float, through its resampler."""
    return Resampler(rate).process(audio.astype(np.float32) / 32768, last=True)


def pcm(audio: np.ndarray) -> np.ndarray:
    """Float samples as the 16-bit PCM a line delivers."""
    return float_to_int16(audio)
