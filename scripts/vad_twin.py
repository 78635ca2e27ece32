"""What each stream's VAD twin (`ingest.vad.TWIN_QUIET`: a second state, started fresh after every
1.5 s of quiet, whose score a chunk takes when it is higher) changes, with it and without it (the
cell-state bound on in both), chunks handed over as 100 ms frames hand them (how they are grouped
into calls changes no score):

- After a call signal: 20 s of each of `streamasr/callsounds.py`'s signals (two seeds, five for
  DTMF), then each LibriVox sentence of the dev set, made at 8 kHz as a phone line carries them,
  and at 16 kHz: sentences with no segment, a segment starting more than 0.75 s late, split in
  two, or a segment inside the signal.
- The call put on hold (five seeds of its music) at 8 kHz: where the sentence after the hold starts.
- Speech: the dev set's utterances joined with pauses of 0.3 to 10 s, at 16 kHz and on an 8 kHz
  phone line: are the segments the same, and how far did their starts and ends move?
- The cost: microseconds per chunk through `VadBank.process` of streams whose twins run (on
  quiet: noise at -20 dBFS), alternating with and without.

    python scripts/vad_twin.py [--twin 125:24]

`--twin Q:W` measures a twin started after Q quiet chunks and counted after W instead of the
shipped one (`TWIN_QUIET`, `TWIN_WARM_UP`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from config import settings
from ingest import vad
from speech.audio import load_audio
from streamasr import callsounds
from streamasr.testdata import utterances
from streamasr.vadclips import clip_segments

RATE = 16000
SIGNAL_S = 20.0
Segments = list[tuple[float, float]]


def segments(x: np.ndarray, twin: bool) -> Segments:
    kept = vad.TWIN_QUIET
    vad.TWIN_QUIET = kept if twin else 0
    try:
        return clip_segments(x, settings.load(None).vad, calls_of=3)
    finally:
        vad.TWIN_QUIET = kept


def after_signals(sentences: list[np.ndarray]) -> None:
    print("after 20 s of        rate  trials   lost (without / with)  late > 0.75 s   split   inside the signal")
    totals = np.zeros((2, 4), dtype=int)
    onsets: list[list[float]] = [[], []]
    for name in callsounds.SIGNALS:
        for rate in (8000, RATE):
            counts = np.zeros((2, 4), dtype=int)
            trials = 0
            for seed in (98, 5, 1, 2, 3) if name == "dtmf" else (98, 5):
                for sentence in sentences:
                    x = callsounds.as_ingest(callsounds.signal_then(name, rate, SIGNAL_S, sentence, seed), rate)
                    trials += 1
                    for i, twin in enumerate((False, True)):
                        found = segments(x, twin)
                        after = [s for s in found if s[1] > SIGNAL_S + 0.5]
                        start = after[0][0] - SIGNAL_S if after else None
                        if start is not None:
                            onsets[i].append(start)
                        counts[i] += [start is None, start is not None and start > 0.75, len(after) > 1,
                                      sum(1 for s in found if s[1] < SIGNAL_S + 0.2)]
            totals += counts
            cells = "   ".join(f"{a:3d} / {b:<3d}" for a, b in zip(*counts))
            print(f"{name:20s} {rate:5d}  {trials:5d}   {cells}")
    cells = "   ".join(f"{a:3d} / {b:<3d}" for a, b in zip(*totals))
    print(f"{'all':20s} {'':5s}  {'':5s}   {cells}")
    for i, label in enumerate(("without", "with")):
        print(f"  onset {label} the twin: mean {np.mean(onsets[i]):+.3f} s, p90 {np.percentile(onsets[i], 90):+.2f} s, "
              f"max {max(onsets[i]):+.2f} s")


def on_hold() -> None:
    print("\ncall on hold at 8 kHz (seeds 98, 1-4): sentence after the hold starts, s")
    for twin in (False, True):
        starts = []
        for seed in (98, 1, 2, 3, 4):
            call = callsounds.on_hold(8000, SIGNAL_S, np.random.default_rng(seed))
            x = callsounds.as_ingest(call.audio, 8000)
            after = [s for s in segments(x, twin) if s[1] > call.hold[1] + 0.5]
            starts.append(f"{after[0][0] - call.hold[1]:+.2f}{'/' * (len(after) - 1)}" if after else "lost")
        print(f"  {'with' if twin else 'without'} the twin: {' '.join(starts)}   ('/': split)")


def speech(clips: list[np.ndarray]) -> None:
    print("\nspeech, pauses of   rate   segments without / with   start moved (earliest, latest)   end moved (earliest, latest)")
    for pause in (0.3, 0.6, 1.0, 2.0, 3.0, 6.0, 10.0):
        joined = np.concatenate([p for c in clips for p in (c, np.zeros(int(pause * RATE), np.float32))])
        for rate in (RATE, 8000):
            x = callsounds.carried(joined, rate)
            alone, twinned = np.array(segments(x, False)), np.array(segments(x, True))
            if len(alone) == len(twinned):
                starts, ends = twinned[:, 0] - alone[:, 0], twinned[:, 1] - alone[:, 1]
                moved = f"{starts.min():+.3f}, {starts.max():+.3f}                    {ends.min():+.3f}, {ends.max():+.3f}"
            else:
                moved = "-"
            print(f"{pause:8g} s          {rate:5d}   {len(alone):4d} / {len(twinned):<4d}                 {moved}")


def cost(rounds: int = 5) -> None:
    print("\nround (streams x chunks)   us per chunk without / with the twin (median of alternations)")
    rng = np.random.default_rng(0)
    kept = vad.TWIN_QUIET
    for streams, each in ((1, 3), (67, 3), (200, 1), (16, 200)):
        keys = [f"s{i}" for i in range(streams) for _ in range(each)]
        chunks = [(0.1 * rng.standard_normal(vad.CHUNK)).astype(np.float32) for _ in keys]
        bank = vad.VadBank()
        for i in range(streams):
            bank.add(f"s{i}")
        calls = max(5, 2000 // len(chunks))
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(-(-(kept + vad.TWIN_WARM_UP) // each)):  # quiet long enough that every twin runs
            bank.process(keys, chunks)
        try:
            for _ in range(rounds + 1):
                for twin in (False, True):
                    vad.TWIN_QUIET = kept if twin else 0
                    start = time.perf_counter()
                    for _ in range(calls):
                        bank.process(keys, chunks)
                    times[twin].append((time.perf_counter() - start) / calls / len(chunks) * 1e6)
        finally:
            vad.TWIN_QUIET = kept
        print(f"{streams:>9d} x {each:<4d}               {statistics.median(times[False][1:]):6.1f} / "
              f"{statistics.median(times[True][1:]):6.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--twin", help="QUIET:WARM_UP, in chunks of 32 ms")
    args = parser.parse_args()
    if args.twin:
        vad.TWIN_QUIET, vad.TWIN_WARM_UP = (int(v) for v in args.twin.split(":"))
    clips = [(u.name, load_audio(u.path)) for u in utterances()]
    after_signals([c for name, c in clips if name.startswith("librivox/")])
    on_hold()
    speech([c for _, c in clips])
    cost()


if __name__ == "__main__":
    main()
