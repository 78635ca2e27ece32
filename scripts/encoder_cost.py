"""What the encoder costs at each window length and precision (the 30 s window finals use, the
short one partials use), against CTranslate2's encoder of the same weights where it is installed
(faster-whisper's dependency), and the model's files on disk. The encoder dominates a short
decode, so these say where a partial's time goes.

    python scripts/encoder_cost.py [--model whisper-tiny.en] [--threads 2] [--repeat 5] [--windows 30,7]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Callable

import numpy as np

from config import settings
from speech.loader import ensure_exported, resolve_model
from speech.ort_backend import OrtWhisperBackend
from streamasr.bench_model import size_mb

FRAMES_PER_S = 100  # log-mel frames per second of audio


def best_ms(run: Callable[[], object], repeat: int) -> float:
    """The fastest of `repeat` calls, after one to warm up: what the work costs, not the machine's noise."""
    run()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return 1000 * min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="whisper-tiny.en")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--windows", default="30,7", help="window lengths in seconds, comma-separated")
    args = p.parse_args()
    windows = [float(w) for w in args.windows.split(",")]
    base = dataclasses.replace(settings.load(None).model, name=args.model, threads=args.threads, partial_precision="")
    files = resolve_model(base)
    try:
        import ctranslate2
    except ImportError:
        ctranslate2 = None
    print(f"{args.model}, {args.threads} threads, best of {args.repeat}")
    print(f"{'precision':<10} {'window s':>8} {'ours ms':>8} {'ct2 ms':>8}")
    for precision, ct2_type in (("fp32", "float32"), ("int8", "int8")):
        cfg = dataclasses.replace(base, precision=precision)
        backend = OrtWhisperBackend(cfg, warmup=False)
        [mel_input] = [i.name for i in backend.encoder.get_inputs()]
        n_mels = backend.dims["n_mels"]
        ct2 = (ctranslate2.models.Whisper(str(files.dir), device="cpu", compute_type=ct2_type, intra_threads=args.threads)
               if ctranslate2 else None)
        for window in windows:
            mel = np.zeros((1, n_mels, int(window * FRAMES_PER_S)), np.float32)
            ours = best_ms(lambda: backend.encoder.run(None, {mel_input: mel}), args.repeat)
            theirs = "-"
            if ct2 is not None and window == 30:  # CTranslate2 encodes Whisper's 30 s window only
                features = ctranslate2.StorageView.from_array(mel)
                theirs = f"{best_ms(lambda: ct2.encode(features, to_cpu=True), args.repeat):.0f}"
            print(f"{precision:<10} {window:>8g} {ours:>8.0f} {theirs:>8}")
        backend.close()
    graphs = {prec: ensure_exported(dataclasses.replace(base, precision=prec), quiet=True) for prec in ("fp32", "int8")}
    print(f"\nfiles on disk (MB): CTranslate2 model.bin {size_mb([files.model_bin]):.1f}; ONNX (encoder + decoder) "
          + ", ".join(f"{prec} {size_mb([d / 'encoder.onnx', d / 'decoder.onnx']):.1f}" for prec, d in graphs.items()))


if __name__ == "__main__":
    main()
