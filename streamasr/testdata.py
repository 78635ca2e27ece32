"""The development set: pocketsphinx-testdata utterances with reference transcripts.

Debian's ``pocketsphinx-testdata`` ships LibriVox sentences (librivox/*.wav + transcription),
spoken card names (cards/*.wav + cards.transcription) and goforward.raw (16 kHz s16le mono,
"go forward ten meters"). Used by the tests, `streamasr bench-model` and the service benchmark.
What it lacks (other languages, a word said over and over) espeak-ng speaks (`spoken`).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

DATA_ENV = "STREAMASR_TESTDATA"
DEFAULT_DATA = Path("/usr/share/pocketsphinx/test/data")


@dataclass(frozen=True)
class Utterance:
    name: str
    path: str
    reference: str


def data_dir() -> Path:
    return Path(os.environ.get(DATA_ENV) or DEFAULT_DATA)


def spoken(text: str, wav: Path, voice: str | None = None) -> Path:
    """`text` synthesized by espeak-ng into `wav`, in `voice` (a language code) or its default one."""
    subprocess.run(["espeak-ng", *(["-v", voice] if voice else []), "-w", str(wav), text], check=True, capture_output=True)
    return wav


# words said one by one a fifth to half a second apart, and where each starts: known word times
SPACED_WORDS = (("please", 0.25), ("open", 0.9), ("the", 1.5), ("window", 2.0), ("before", 2.7), ("lunch", 3.4))


def spaced_words(folder: Path, words: tuple[tuple[str, float], ...] = SPACED_WORDS,
                 seconds: float = 4.0) -> tuple[np.ndarray, list[tuple[float, float]]]:
    """`words` synthesized one by one, each trimmed to its sound and put at its start in 16 kHz
    float audio of `seconds`, and where each was said (start, end): speech whose word times are
    known, to measure word timing by."""
    import numpy as np

    from speech.audio import load_audio

    audio = np.zeros(round(seconds * 16_000), np.float32)
    spans = []
    for word, start in words:
        clip = load_audio(str(spoken(word, folder / f"{word}.wav")))
        loud = np.flatnonzero(np.abs(clip) > 0.02)
        clip = clip[loud[0] : loud[-1]]
        at = round(start * 16_000)
        audio[at : at + len(clip)] = clip
        spans.append((start, start + len(clip) / 16_000))
    return audio, spans


def _read_transcription(path: Path) -> dict[str, str]:
    refs: dict[str, str] = {}
    for line in path.read_text().splitlines():
        m = re.match(r"\s*(?:<s>)?(.*?)(?:</s>)?\s*\(([^)]+)\)\s*$", line)
        if m:
            refs[m.group(2).strip()] = " ".join(m.group(1).split())
    return refs


def utterances() -> list[Utterance]:
    """Every dev-set utterance with its reference (empty list if the package is not installed)."""
    root = data_dir()
    out: list[Utterance] = []
    for folder, listing in (("librivox", "transcription"), ("cards", "cards.transcription")):
        if (root / folder / listing).exists():
            for key, ref in sorted(_read_transcription(root / folder / listing).items()):
                wav = root / folder / f"{key}.wav"
                if wav.exists():
                    out.append(Utterance(f"{folder}/{key}", str(wav), ref))
    raw = root / "goforward.raw"
    if raw.exists():
        out.append(Utterance("goforward", str(raw), "go forward ten meters"))
    return out


_ONES = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen".split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
_ABBREV = {"mr": "mister", "mrs": "missus", "dr": "doctor", "st": "saint", "metres": "meters", "metre": "meter"}


def number_to_words(n: int) -> str:
    if n < 0:
        return "minus " + number_to_words(-n)
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + ("" if n % 10 == 0 else " " + _ONES[n % 10])
    if n < 1000:
        rest = n % 100
        return _ONES[n // 100] + " hundred" + ("" if rest == 0 else " " + number_to_words(rest))
    for size, word in ((10**9, "billion"), (10**6, "million"), (1000, "thousand")):
        if n >= size:
            rest = n % size
            return number_to_words(n // size) + " " + word + ("" if rest == 0 else " " + number_to_words(rest))
    return str(n)


def normalize(text: str) -> str:
    """Lower case, no punctuation, integers as words, a few abbreviations expanded."""
    text = text.lower().replace("’", "'")
    text = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text)  # every group separator: 1,000,000 is one number
    # "1st", "22nd", "10th" before the numbers: else "st" is left to be read as "saint"
    text = re.sub(r"(\d+)(?:st|nd|rd|th)\b", lambda m: " " + _ordinal(number_to_words(int(m.group(1)))) + " ", text)
    text = re.sub(r"\d+", lambda m: " " + number_to_words(int(m.group())) + " ", text)
    text = re.sub(r"[-‐–—/]", " ", text)
    text = re.sub(r"[^\w\s']", " ", text)
    text = text.replace("'", "")
    words = [_ABBREV.get(w, w) for w in text.split()]
    return " ".join(words)


_ORDINALS = {"one": "first", "two": "second", "three": "third", "five": "fifth", "eight": "eighth", "nine": "ninth",
             "twelve": "twelfth"}


def _ordinal(words: str) -> str:
    """"twenty one" -> "twenty first", "ten" -> "tenth", "forty" -> "fortieth"."""
    *head, last = words.split()
    last = _ORDINALS.get(last) or (last[:-1] + "ieth" if last.endswith("y") else last + "th")
    return " ".join([*head, last])


def wer(refs: list[str], hyps: list[str]) -> float:
    """Word error rate (0..1+) over the whole set, after `normalize`: errors over reference words.

    Words against an empty reference are insertions and count (older jiwer refuses an empty
    reference, so they are counted here); with no reference words at all, any word is an infinite rate."""
    import jiwer

    if len(refs) != len(hyps):  # a missing hypothesis must not drop its reference from the count
        raise ValueError(f"{len(refs)} references against {len(hyps)} hypotheses")
    r = [normalize(x) for x in refs]
    h = [normalize(x) for x in hyps]
    inserted = sum(len(b.split()) for a, b in zip(r, h) if not a)
    pairs = [(a, b) for a, b in zip(r, h) if a]
    if not pairs:
        return math.inf if inserted else 0.0
    out = jiwer.process_words([a for a, _ in pairs], [b if b else "<empty>" for _, b in pairs])
    errors = out.substitutions + out.deletions + out.insertions + inserted
    return errors / (out.hits + out.substitutions + out.deletions)
