"""What the service captions when nobody speaks on a call: hold music, ring-back, DTMF, busy
tone, line noise, clicks, breathing (streamasr/callsounds.py), each at 8 and 16 kHz as a phone
line carries it, and a call put on hold (a LibriVox sentence, 20 s of hold music, another
sentence). For each: the segments the ingest's VAD opens (its own bank and segmenter, on the
audio resampled as the ingest does), and the partials and finals a client of a real service
gets, with their text; for the call on hold, the WER of its finals.

    python scripts/nonspeech.py [--server ADDR] [--offline] [--seconds 24] [--only hold_music,on_hold] [--seeds 98,1,2]

Without --server it starts a service of its own (whisper-tiny.en, 2 workers) and stops it after.
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
from pathlib import Path

import numpy as np
import soundfile as sf

from config import settings
from streamasr import callsounds, remote
from streamasr.service import launch
from streamasr.testdata import wer
from streamasr.vadclips import clip_segments

RATES = (8000, 16000)
HOLD_S = 20.0  # the call's time on hold


def vad_segments(audio: np.ndarray, rate: int) -> list[tuple[float, float]]:
    """Segments (seconds) the ingest's VAD opens on 16-bit `audio`, resampled to 16 kHz as the ingest does."""
    return [(round(start, 2), round(end, 2)) for start, end in clip_segments(callsounds.as_ingest(audio, rate), settings.load(None).vad)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", help="a running service's address (default: start one)")
    ap.add_argument("--offline", action="store_true", help="stream as a batch instead of in real time")
    ap.add_argument("--seconds", type=float, default=24.0, help="length of each signal")
    ap.add_argument("--only", help="comma-separated names of callsounds.SIGNALS, and on_hold")
    ap.add_argument("--parallel", type=int, default=6, help="files streamed at once")
    ap.add_argument("--seeds", default="98", help="comma-separated seeds: each signal is made with each (the call on hold with 98)")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else [*callsounds.SIGNALS, "on_hold"]
    with tempfile.TemporaryDirectory() as tmp:
        files: dict[str, tuple[str, int, list[tuple[float, float]], str]] = {}
        for name in names:
            for seed in [98] if name == "on_hold" else [int(v) for v in args.seeds.split(",")]:
                for rate in RATES:
                    if name == "on_hold":
                        call = callsounds.on_hold(rate, HOLD_S, np.random.default_rng(seed))
                        audio, said = call.audio, call.said
                    else:
                        audio, said = callsounds.signal(name, rate, args.seconds, seed), ""
                    label = name if seed == 98 else f"{name} ({seed})"
                    path = str(Path(tmp) / f"{name}-{seed}-{rate}.wav")
                    sf.write(path, audio, rate, subtype="PCM_16")
                    files[path] = (label, rate, vad_segments(audio, rate), said)
        service = None
        if args.server is None:
            service = launch(Path(tmp), {"model": {"name": "whisper-tiny.en"}, "workers": {"processes": 2},
                                         "ingest": {"admit_max_busy": 0}}, 300)
        try:
            out = io.StringIO()
            remote.run(list(files), args.server or service.cfg.ingest.address, args.offline, True, None, out=out,
                       parallel=args.parallel)
        finally:
            if service is not None:
                service.stop()
    rows = [json.loads(line) for line in out.getvalue().splitlines() if line.strip()]
    print(f"{'signal':12} {'rate':>5}  {'VAD segments (s)':24} {'partials (with text)':>20}  finals with text")
    for path, (name, rate, segments, said) in files.items():
        mine = [r for r in rows if r["file"] == path]
        partials = [r["text"] for r in mine if r["type"] == "partial"]
        worded = [t for t in partials if t.strip()]
        finals = [r["text"] for r in mine if r["type"] == "final" and r["text"].strip()]
        shown = ", ".join(f"{a}-{b}" for a, b in segments) or "-"
        print(f"{name:12} {rate:>5}  {shown:24} {len(partials):>10} ({len(worded):>2})       {finals or '-'}")
        if said:
            print(f"{'':19}WER of the finals: {wer([said], [' '.join(finals)]):.3f}")
        for text in dict.fromkeys(worded) if not said else ():
            print(f"{'':19}partial: {text!r}")


if __name__ == "__main__":
    main()
