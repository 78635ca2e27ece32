"""How far speech is from a keypad tone, as the VAD's tone detector (`ingest/tones.py`) sees it:
the share of a chunk's energy in the strongest DTMF frequency of each group (both at least
`tones.LEAST`), over every loud chunk of

- speech: the dev set's recordings, pocketsphinx-testdata's other raw recordings, and espeak-ng
  saying call-centre lines, digits, hums and calls in twelve voices;
- DTMF: 24 s of `streamasr/callsounds.py`'s digits at eight seeds;

each at 16 kHz and on an 8 kHz phone line. A chunk at `tones.SHARE` or more is a tone.

    python scripts/tone_share.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from ingest import tones
from ingest.vad import CHUNK, SAMPLE_RATE
from speech.audio import load_audio
from streamasr import callsounds
from streamasr.testdata import spoken, utterances

RAW = Path("/usr/share/pocketsphinx/test/data")
SAID = ["Press one for sales, two for support, or stay on the line.",
        "My account number is four seven nine two, and my PIN is eight eight one.",
        "Please hold while I transfer your call to the billing department.",
        "Hmmmmm. Ooooh. Aaaaah, yes. Mmmm hmm. Uh huh.",
        "Seven, seven, seven. Nine, nine, nine. Oh, oh, oh.",
        "Hello? Hello? Can you hear me now?"]
VOICES = ["en", "en-us", "en+f3", "en+m3", "en-us+f2", "en+whisper", "de", "fr", "es", "it", "pt", "zh"]


def shares(detect: tones.DtmfDetector, x: np.ndarray) -> np.ndarray:
    """The tone share of each loud chunk of 16 kHz `x` (0 where one group is under LEAST)."""
    chunks = np.stack([x[i : i + CHUNK] for i in range(0, len(x) - CHUNK + 1, CHUNK)]).astype(np.float32)
    loud, low, high = detect.shares(chunks)
    return np.where(np.minimum(low, high) >= tones.LEAST, low + high, 0.0)[loud]


def main() -> None:
    detect = tones.DtmfDetector(CHUNK, SAMPLE_RATE)
    speech = [load_audio(u.path) for u in utterances()]
    speech += [load_audio(RAW / name) for name in ("numbers.raw", "something.raw")]
    with tempfile.TemporaryDirectory() as tmp:
        speech += [load_audio(spoken(text, Path(tmp) / "said.wav", voice)) for voice in VOICES for text in SAID]
    print(f"{'audio':28s} {'rate':>5s} {'loud chunks':>11s} {'highest share':>13s} {'tones':>6s}")
    for rate in (SAMPLE_RATE, 8000):
        found = np.concatenate([shares(detect, callsounds.carried(x, rate) if rate == 8000 else x) for x in speech])
        print(f"{'speech (%d clips)' % len(speech):28s} {rate:5d} {len(found):11d} {found.max():13.2f} {(found >= tones.SHARE).sum():6d}")
    for rate in (SAMPLE_RATE, 8000):
        found = np.concatenate([shares(detect, callsounds.as_ingest(callsounds.signal("dtmf", rate, 24.0, seed), rate))
                                for seed in range(1, 9)])
        print(f"{'DTMF (8 seeds)':28s} {rate:5d} {len(found):11d} {found.max():13.2f} {(found >= tones.SHARE).sum():6d}"
              f"   (the rest: the part-tone chunks at a digit's edges)")


if __name__ == "__main__":
    main()
