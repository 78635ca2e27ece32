"""The keypad-tone detector the VAD uses, on real speech and on every key as a phone line carries it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ingest.tones import DtmfDetector
from ingest.vad import CHUNK, SAMPLE_RATE
from speech.audio import load_audio
from streamasr import callsounds
from streamasr.testdata import spoken, utterances

detect = DtmfDetector(CHUNK, SAMPLE_RATE)


def chunks(x: np.ndarray) -> np.ndarray:
    return np.stack([x[i : i + CHUNK] for i in range(0, len(x) - CHUNK + 1, CHUNK)]).astype(np.float32)


def key(low: float, high: float, seconds: float = 0.2, twist_db: float = 0.0) -> np.ndarray:
    """A key's two tones at 16 kHz, the high one `twist_db` louder, at -10 dBFS together."""
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    gain = 10 ** (twist_db / 20)
    return 0.3 * (np.sin(2 * np.pi * low * t) + gain * np.sin(2 * np.pi * high * t)) / (1 + gain)


@pytest.mark.parametrize("rate", [8000, 16000])
def test_every_key_is_a_tone_within_the_keypad_s_tolerance(rate: int) -> None:
    """Each of the 16 keys, its frequencies off by up to 1.5 % either way (what a keypad may send)
    and its tones up to 6 dB apart, on a phone line at `rate`: every whole chunk of it is a tone."""
    for low, high in callsounds.DTMF.values():
        for off in (-0.015, 0.0, 0.015):
            for twist in (-6.0, 0.0, 6.0):
                x = callsounds.carried(key(low * (1 + off), high * (1 + off), twist_db=twist), rate)
                whole = chunks(x[CHUNK : -CHUNK])  # clear of the line's and the resampler's edges
                assert detect(whole).all(), (low, high, off, twist, rate)


def test_speech_is_never_a_tone(tmp_path: Path) -> None:
    """The dev set's recordings and espeak-ng voices saying numbers, hums and calls, at 16 kHz and
    on an 8 kHz line: not one chunk is taken for a tone (their highest share is 0.67 of 0.9)."""
    said = ["Press one for sales, two for support, or stay on the line.", "Seven, seven, seven. Nine, nine, nine.",
            "Hmmmmm. Ooooh. Aaaaah, yes. Mmmm hmm.", "Hello? Hello? Can you hear me now?"]
    clips = [load_audio(u.path) for u in utterances()]
    clips += [load_audio(spoken(text, tmp_path / "said.wav", voice))
              for text in said for voice in ("en", "en+f3", "en-us+f2", "en+m3")]
    for x in clips:
        for rate in (8000, 16000):
            assert not detect(chunks(callsounds.carried(x, rate) if rate == 8000 else x)).any(), rate


def test_one_tone_alone_or_speech_over_a_key_is_not_a_key() -> None:
    """A single tone (a whistle, a 697 Hz hum) is not a key, nor is a key a caller talks over."""
    t = np.arange(SAMPLE_RATE) / SAMPLE_RATE
    for hz in (697.0, 1000.0, 1336.0):
        assert not detect(chunks(0.3 * np.sin(2 * np.pi * hz * t))).any(), hz
    sentence = load_audio(next(u.path for u in utterances() if u.name.startswith("librivox/")))
    digit = np.resize(key(852.0, 1477.0, 1.0), len(sentence))
    loud = np.sqrt(np.mean(sentence**2)) / np.sqrt(np.mean(digit**2))
    over = chunks(sentence + digit * loud)  # the key as loud as the speech

    def energy(x: np.ndarray) -> np.ndarray:
        return np.einsum("ij,ij->i", chunks(x), chunks(x))

    assert not detect(over)[energy(sentence) > energy(digit * loud)].any()  # where the caller is the louder
