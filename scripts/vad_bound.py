"""What the VAD's cell-state bound (`ingest.vad.CELL_BOUND`) changes: the segments the ingest's VAD
and segmenter open with it and without it, chunks handed over as 100 ms frames hand them. The
stream's twin (`ingest.vad.TWIN_QUIET`, measured by `vad_twin.py`) is off in both, so that what is
measured is the bound's.

- The call put on hold at 8 kHz, with the bound at 20 to 70: where the sentence after the hold
  gets its segment.
- Speech: each dev-set utterance alone, and all of them joined with pauses of 0.3 to 2 s, at
  16 kHz and on an 8 kHz phone line: are the segments the same, and how far did an edge move?
- After a call signal: 20 s of each of `streamasr/callsounds.py`'s signals, then each LibriVox
  sentence of the dev set, at 8 and 16 kHz: how many sentences got a segment, and how far the
  bound moved the start of those found both ways (negative: earlier).

    python scripts/vad_bound.py
"""

from __future__ import annotations

import numpy as np

from config import settings
from ingest import vad
from speech.audio import load_audio
from streamasr import callsounds
from streamasr.testdata import utterances
from streamasr.vadclips import clip_segments

RATE = 16000
FRAME_CHUNKS = 3  # a 100 ms frame
SIGNAL_S = 20.0


def segments(x: np.ndarray, bound: float = vad.CELL_BOUND) -> list[tuple[float, float]]:
    """The segments the ingest opens on 16 kHz `x` with the cell state held to `bound` (inf: none)."""
    kept, vad.CELL_BOUND, twin, vad.TWIN_QUIET = vad.CELL_BOUND, bound, vad.TWIN_QUIET, 0
    try:
        return clip_segments(x, settings.load(None).vad, FRAME_CHUNKS)
    finally:
        vad.CELL_BOUND, vad.TWIN_QUIET = kept, twin


def both(x: np.ndarray) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """Segments without the bound, then with it."""
    return segments(x, float("inf")), segments(x)


def speech(clips: list[np.ndarray]) -> None:
    print("speech                          rate   same segments   largest edge move (s)")
    cases = [("each utterance alone", [np.concatenate([np.zeros(RATE // 2, np.float32), c, np.zeros(RATE, np.float32)])
                                        for c in clips])]
    for pause in (0.3, 0.6, 1.0, 2.0):
        cases.append((f"all joined, {pause:g} s pauses",
                      [np.concatenate([p for c in clips for p in (c, np.zeros(int(pause * RATE), np.float32))])]))
    for name, audios in cases:
        for rate in (RATE, 8000):
            same, moved = 0, 0.0
            for audio in audios:
                alone, bounded = both(callsounds.carried(audio, rate))
                if len(alone) == len(bounded):
                    same += alone == bounded
                    moved = max([moved] + [abs(a - b) for x, y in zip(alone, bounded) for a, b in zip(x, y)])
                else:
                    moved = float("nan")
            print(f"{name:30s} {rate:6d}   {same:3d} of {len(audios):<3d}     {moved:.3f}")


def after_signals(sentences: list[np.ndarray]) -> None:
    print("\nafter 20 s of             rate   sentences heard (alone / bounded)   onset, bounded less alone, s: mean, latest")
    for name in callsounds.SIGNALS:
        for rate in (8000, RATE):
            signal = callsounds.signal(name, RATE, SIGNAL_S).astype(np.float32) / 32768
            heard, moved = [0, 0], []
            for sentence in sentences:
                x = callsounds.carried(np.concatenate([signal, sentence, np.zeros(RATE, np.float32)]), rate)
                starts = [next((s for s, e in segments if e > SIGNAL_S + 0.5), None) for segments in both(x)]
                heard = [n + (s is not None) for n, s in zip(heard, starts)]
                if None not in starts:
                    moved.append(starts[1] - starts[0])
            shown = f"{np.mean(moved):+.2f}, {max(moved):+.2f}" if moved else "-"
            print(f"{name:24s} {rate:6d}   {heard[0]} / {heard[1]} of {len(sentences)}                      {shown}")


def by_bound(bounds: tuple[float, ...] = (20.0, 30.0, 40.0, 50.0, 70.0)) -> None:
    """The call put on hold at 8 kHz (a sentence, 20 s of hold music, a sentence), with the bound at each of `bounds`."""
    call = callsounds.on_hold(8000, SIGNAL_S, np.random.default_rng(98))
    x = callsounds.as_ingest(call.audio, 8000)
    alone = segments(x, float("inf"))
    print(f"call on hold, 8 kHz, hold {call.hold[0]:.1f}-{call.hold[1]:.1f} s; segments without the bound:",
          ", ".join(f"{a:.2f}-{b:.2f}" for a, b in alone))
    for bound in bounds:
        print(f"  bound {bound:g}:", ", ".join(f"{a:.2f}-{b:.2f}" for a, b in segments(x, bound)))
    print()


def main() -> None:
    by_bound()
    clips = [(u.name, load_audio(u.path)) for u in utterances()]
    speech([c for _, c in clips])
    after_signals([c for name, c in clips if name.startswith("librivox/")])


if __name__ == "__main__":
    main()
