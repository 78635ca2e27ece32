"""Why the VAD runs on digital silence too: what Silero costs on zeros against speech, how long its
recurrent state goes on moving through zeros after speech, and what skipping the model after
0.5 s of zeros would change in the sentence that follows. The ingest's own bank (`VadBank`, one
thread), the dev set's LibriVox utterances.

    python scripts/vad_silence.py [--batch 100] [--gap-s 2.0] [--skip-after-s 0.5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from ingest.vad import CHUNK, SAMPLE_RATE, VadBank
from speech.audio import load_audio
from streamasr.testdata import utterances

THRESHOLD = 0.5  # the default [vad] threshold


def chunks_of(audio: np.ndarray) -> list[np.ndarray]:
    return [audio[i : i + CHUNK] for i in range(0, len(audio) - CHUNK + 1, CHUNK)]


def per_chunk_us(bank: VadBank, chunks: list[np.ndarray]) -> float:
    """Median of 5 calls of one chunk for each of len(chunks) streams."""
    keys = [f"t{i}" for i in range(len(chunks))]
    for key in keys:
        bank.add(key)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        bank.process(keys, chunks)
        times.append((time.perf_counter() - start) / len(chunks) * 1e6)
    for key in keys:
        bank.remove(key)
    return statistics.median(times)


def state_of(bank: VadBank, key: str) -> np.ndarray:
    """A stream's LSTM state as the bank keeps it (the ingest never reads it; this diagnostic does)."""
    return bank._streams.state[bank._streams.rows[key]].copy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=100, help="streams in the timed call")
    ap.add_argument("--gap-s", type=float, default=2.0, help="zeros between two sentences")
    ap.add_argument("--skip-after-s", type=float, default=0.5, help="zeros after which the skipping bank stops calling the model")
    args = ap.parse_args()
    speech = [load_audio(u.path) for u in utterances() if "librivox" in str(u.path)]
    if len(speech) < 2:
        raise SystemExit("needs the dev set's LibriVox utterances (Debian's pocketsphinx-testdata)")
    bank = VadBank()

    spoken = chunks_of(np.concatenate(speech))[: args.batch]
    zeros = [np.zeros(CHUNK, np.float32)] * args.batch
    print(f"cost per chunk, batch of {args.batch}: speech {per_chunk_us(bank, spoken):.0f} us, zeros {per_chunk_us(bank, zeros):.0f} us")

    bank.add("settle")
    bank.process(["settle"] * len(c := chunks_of(speech[0])), c)
    before = state_of(bank, "settle")
    print("state after a sentence, then zeros: largest element's change over the chunk before")
    for n in range(1, 3001):
        bank.process(["settle"], [zeros[0]])
        now = state_of(bank, "settle")
        if n in (1, 10, 30, 100, 300, 1000, 3000):
            print(f"  zero chunk {n:5d} ({n * CHUNK / SAMPLE_RATE:6.1f} s): {np.abs(now - before).max():.4f}")
        before = now

    gap = chunks_of(np.zeros(int(args.gap_s * SAMPLE_RATE), np.float32))
    skip_from = int(args.skip_after_s * SAMPLE_RATE) // CHUNK
    worst, flipped, compared = 0.0, 0, 0
    for first, second in zip(speech, speech[1:]):
        for key in ("every", "skips"):
            bank.add(key)
        for key, silent in (("every", gap), ("skips", gap[:skip_from])):
            bank.process([key] * len(c := chunks_of(first)), c)
            if silent:
                bank.process([key] * len(silent), silent)
        tail = chunks_of(second)
        p_every = bank.process(["every"] * len(tail), tail).copy()
        p_skips = bank.process(["skips"] * len(tail), tail).copy()
        for key in ("every", "skips"):
            bank.remove(key)
        worst = max(worst, float(np.abs(p_every - p_skips).max()))
        flipped += int(((p_every > THRESHOLD) != (p_skips > THRESHOLD)).sum())
        compared += len(tail)
    print(f"next sentence after {args.gap_s:g} s of zeros, the model skipped after {args.skip_after_s:g} s: "
          f"probabilities moved by up to {worst:.3f}; {flipped} of {compared} chunks decided otherwise at {THRESHOLD}")


if __name__ == "__main__":
    main()
