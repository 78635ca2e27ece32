"""What one VAD chunk costs: Silero's graph as it ships, a call per chunk of a stream, against the
graph the ingest runs (ingest/vad_graph.py: convolutions as batch-wide matrix products, and a
stream's waiting chunks in one call as an LSTM sequence), for rounds of S streams with C chunks
each, through `VadBank.process` as the ingest calls it. Both are timed alternately in one process,
so both see the same machine.

    python scripts/vad_cost.py [--rounds-of 1x1,8x1,32x1,200x1,1x3,20x3,67x3] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from ingest.vad import CHUNK, VadBank


def per_chunk_us(bank: VadBank, keys: list[str], chunks: list[np.ndarray]) -> float:
    calls = max(5, 2000 // len(chunks))
    start = time.perf_counter()
    for _ in range(calls):
        bank.process(keys, chunks)
    return (time.perf_counter() - start) / calls / len(chunks) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds-of", default="1x1,8x1,32x1,200x1,1x3,20x3,67x3",
                        help="streams x chunks per stream in one round")
    parser.add_argument("--rounds", type=int, default=5, help="alternations per case; the median is reported")
    args = parser.parse_args()
    banks = {"shipped": VadBank(rewrite=False), "rewritten": VadBank()}  # one thread each, as the ingest runs them
    rng = np.random.default_rng(0)
    print(f"{'round':>7} {'shipped us/chunk':>17} {'rewritten us/chunk':>19} {'ratio':>6}")
    for case in args.rounds_of.split(","):
        streams, each = (int(v) for v in case.split("x"))
        keys = [f"s{i}" for i in range(streams) for _ in range(each)]
        chunks = [(0.1 * rng.standard_normal(CHUNK)).astype(np.float32) for _ in keys]
        for bank in banks.values():
            for i in range(streams):
                if f"s{i}" not in bank:
                    bank.add(f"s{i}")
            per_chunk_us(bank, keys, chunks)  # warm
        times: dict[str, list[float]] = {name: [] for name in banks}
        for _ in range(args.rounds):
            for name, bank in banks.items():
                times[name].append(per_chunk_us(bank, keys, chunks))
        a, b = statistics.median(times["shipped"]), statistics.median(times["rewritten"])
        print(f"{case:>7} {a:>17.1f} {b:>19.1f} {a / b:>6.2f}")


if __name__ == "__main__":
    main()
