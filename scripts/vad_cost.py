"""What one VAD chunk costs at each batch size: Silero's shipped graph against the graph the
ingest runs (rewritten for batches, ingest/vad_graph.py), timed alternately in one process so
both see the same machine.

    python scripts/vad_cost.py [--batches 1,8,32,200] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort

from ingest.vad import CHUNK, CONTEXT, MODEL_PATH, SAMPLE_RATE, STATE, vad_session
from ingest.vad_graph import batched_graph


def per_chunk_us(run: ort.InferenceSession, feed: dict[str, np.ndarray], batch: int) -> float:
    calls = max(5, 2000 // batch)
    start = time.perf_counter()
    for _ in range(calls):
        run.run(None, feed)
    return (time.perf_counter() - start) / calls / batch * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8,32,200")
    parser.add_argument("--rounds", type=int, default=5, help="alternations per batch size; the median is reported")
    args = parser.parse_args()
    shipped = vad_session(str(MODEL_PATH))  # one thread, as the ingest runs it
    rewritten = vad_session(batched_graph(MODEL_PATH, SAMPLE_RATE, CONTEXT + CHUNK, STATE))
    rng = np.random.default_rng(0)
    print(f"{'batch':>6} {'shipped us/chunk':>17} {'rewritten us/chunk':>19} {'ratio':>6}")
    for batch in (int(b) for b in args.batches.split(",")):
        feed = {"input": (0.1 * rng.standard_normal((batch, CONTEXT + CHUNK))).astype(np.float32),
                "state": np.zeros((2, batch, STATE), np.float32)}
        shipped_feed = {**feed, "sr": np.array(SAMPLE_RATE, np.int64)}
        for run, f in ((shipped, shipped_feed), (rewritten, feed)):
            per_chunk_us(run, f, batch)  # warm
        times: tuple[list[float], list[float]] = ([], [])
        for _ in range(args.rounds):
            times[0].append(per_chunk_us(shipped, shipped_feed, batch))
            times[1].append(per_chunk_us(rewritten, feed, batch))
        a, b = statistics.median(times[0]), statistics.median(times[1])
        print(f"{batch:>6} {a:>17.1f} {b:>19.1f} {a / b:>6.2f}")


if __name__ == "__main__":
    main()
