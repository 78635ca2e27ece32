"""`streamasr bench-model`: our ONNX Runtime Whisper against faster-whisper on the dev set.

Same files, same threads, greedy decoding with timestamps, one process: real-time factor
(processing time / audio duration), WER (streamasr.testdata.normalize), per-utterance
latency and model sizes on disk. For our engines also what a warm decode allocates: the most
tracemalloc sees at once (numpy's arrays and Python's objects) above what was held before it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np


def size_mb(paths: list[Path]) -> float:
    """Megabytes on disk of `paths` together, to a tenth."""
    return round(sum(p.stat().st_size for p in paths) / 1e6, 1)


def _bench_interleaved(engines: dict, items, repeat: int) -> dict[str, dict]:
    """Run every engine on every utterance, interleaved (utterance by utterance, engine by engine),
    so that load from other processes hits all engines alike; the fastest of `repeat` runs counts."""
    for fn in engines.values():
        fn(items[0][1])  # warm-up
    out = {name: {"engine": name, "hyps": [], "latency_s": []} for name in engines}
    for _, audio, _ in items:
        best = {name: float("inf") for name in engines}
        texts = {}
        for _ in range(repeat):
            for name, fn in engines.items():
                t0 = time.perf_counter()
                texts[name] = fn(audio)
                best[name] = min(best[name], time.perf_counter() - t0)
        for name in engines:
            out[name]["hyps"].append(texts[name])
            out[name]["latency_s"].append(round(best[name], 4))
    return out


def _traced_peaks_kib(fn, items) -> list[float]:
    """Per utterance, the most a decode traced at once above what was held before it, in KiB.
    Run after the timed runs (warm, and tracing slows Python). ONNX Runtime's own allocations
    inside a graph run are not Python's and not traced."""
    import tracemalloc

    peaks = []
    tracemalloc.start()
    try:
        for _, audio, _ in items:
            held = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            fn(audio)
            peaks.append((tracemalloc.get_traced_memory()[1] - held) / 1024)
    finally:
        tracemalloc.stop()
    return peaks


ENGINES = ("ours-fp32", "ours-int8", "fw-int8", "fw-fp32")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="streamasr bench-model", description=__doc__)
    ap.add_argument("--model", default="whisper-tiny.en")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1, help="runs per utterance; the fastest counts")
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {', '.join(ENGINES)}")
    ap.add_argument("--cache-dir", default="")
    ap.add_argument("--json", dest="json_path", default=None, help="write the results as one JSON object")
    args = ap.parse_args(argv)
    if args.repeat < 1 or args.threads < 1:
        ap.error("--repeat and --threads must be 1 or more")
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if unknown := [e for e in args.engines if e not in ENGINES]:  # before any engine is loaded
        ap.error(f"--engines: unknown {', '.join(unknown)} (choose from {', '.join(ENGINES)})")
    from speech.loader import ModelError

    try:
        return _run(args)
    except ModelError as exc:  # an unknown model, a cache_dir it cannot write: the operator's to fix
        print(f"streamasr bench-model: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from config.settings import ModelConfig
    from speech import longform
    from speech.audio import load_audio
    from speech.backend import SAMPLE_RATE
    from speech.loader import ensure_exported, resolve_model
    from speech.tokenizer import WhisperTokenizer
    from streamasr.testdata import utterances, wer

    utts = utterances()
    if not utts:
        print("error: no dev-set utterances (install pocketsphinx-testdata)", file=sys.stderr)
        return 1
    items = [(u.name, load_audio(u.path), u.reference) for u in utts]
    audio_s = sum(len(a) for _, a, _ in items) / SAMPLE_RATE
    files = resolve_model(ModelConfig(name=args.model, cache_dir=args.cache_dir))
    english = not WhisperTokenizer(files.dir).multilingual
    language = "en"

    engines: dict = {}
    loads: dict[str, float] = {}
    sizes = {"ctranslate2_model_bin_mb": size_mb([files.model_bin])}
    for engine in args.engines:
        kind, prec = engine.split("-", 1)
        if kind == "ours":
            from speech.ort_backend import OrtWhisperBackend

            cfg = ModelConfig(name=args.model, precision=prec, partial_precision="", threads=args.threads,
                              cache_dir=args.cache_dir)
            gdir = ensure_exported(cfg)
            sizes[f"onnx_{prec}_mb"] = size_mb([gdir / "encoder.onnx", gdir / "decoder.onnx"])
            t0 = time.perf_counter()
            backend = OrtWhisperBackend(cfg)
            loads[engine] = time.perf_counter() - t0

            def fn(audio, backend=backend):
                return longform.transcribe(backend, audio, language=language).text

        else:  # fw: faster-whisper
            try:
                from faster_whisper import WhisperModel
            except ImportError:
                print("faster-whisper is not installed; skipping", engine, file=sys.stderr)
                continue
            compute = {"int8": "int8", "fp32": "float32"}[prec]
            t0 = time.perf_counter()
            fw = WhisperModel(str(files.dir), device="cpu", compute_type=compute, cpu_threads=args.threads, num_workers=1)
            loads[engine] = time.perf_counter() - t0

            def fn(audio, fw=fw):
                segs, _ = fw.transcribe(audio, language=language, beam_size=1, temperature=0.0,
                                        condition_on_previous_text=False, vad_filter=False)  # fmt: skip
                return "".join(s.text for s in segs).strip()

        engines[engine] = fn
    load_before = os.getloadavg()[0]
    results = _bench_interleaved(engines, items, args.repeat)
    runs = []
    for engine, r in results.items():
        r["load_s"] = round(loads[engine], 2)
        r["rtf"] = round(sum(r["latency_s"]) / audio_s, 4)
        r["wer"] = round(wer([u for _, _, u in items], r["hyps"]), 4)
        r["mean_latency_s"] = round(float(np.mean(r["latency_s"])), 4)
        r["p90_latency_s"] = round(float(np.percentile(r["latency_s"], 90)), 4)
        if engine.startswith("ours-"):
            peaks = _traced_peaks_kib(engines[engine], items)
            r["traced_peak_kib"] = {"median": round(float(np.median(peaks)), 1), "max": round(max(peaks), 1)}
        runs.append(r)

    by = {r["engine"]: r for r in runs}
    ratios = {}
    for prec in ("fp32", "int8"):
        if f"ours-{prec}" in by and f"fw-{prec}" in by:
            ratios[prec] = round(by[f"ours-{prec}"]["rtf"] / by[f"fw-{prec}"]["rtf"], 3)
    result = {
        "model": args.model, "threads": args.threads, "utterances": len(items), "audio_s": round(audio_s, 2),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "date": time.strftime("%Y-%m-%d"), "english_only": bool(english), "sizes": sizes, "repeat": args.repeat,
        "loadavg_1min": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
        "rtf_ratio_ours_over_faster_whisper": ratios,
        "runs": runs, "names": [n for n, _, _ in items], "references": [r for _, _, r in items],
    }  # fmt: skip
    print(f"\nmodel {args.model}, {len(items)} utterances, {audio_s:.1f} s of audio, {args.threads} threads, "
          f"best of {args.repeat}, load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(f"{'engine':<10} {'RTF':>7} {'WER %':>7} {'mean ms':>8} {'p90 ms':>7} {'load s':>7}  traced peak KiB (median / max)")
    for r in runs:
        peak = r.get("traced_peak_kib")
        print(f"{r['engine']:<10} {r['rtf']:>7.3f} {100 * r['wer']:>7.1f} {r['mean_latency_s'] * 1000:>8.0f} "
              f"{r['p90_latency_s'] * 1000:>7.0f} {r['load_s']:>7.2f}  "
              + (f"{peak['median']:.1f} / {peak['max']:.1f}" if peak else "not traced"))  # fmt: skip
    for prec, ratio in ratios.items():
        print(f"RTF ours/faster-whisper {prec}: {ratio:.2f}")
    print("sizes (MB): " + ", ".join(f"{k}={v}" for k, v in sizes.items()))
    print("\nper utterance latency (ms):")
    print(f"{'utterance':<48}" + "".join(f"{r['engine']:>11}" for r in runs))
    for i, (name, audio, _) in enumerate(items):
        print(f"{name[-40:] + f' ({len(audio) / SAMPLE_RATE:.1f}s)':<48}" + "".join(f"{r['latency_s'][i] * 1000:>11.0f}" for r in runs))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
