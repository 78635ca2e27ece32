"""What a worker's start-up decodes (a 3 s sentence, workers/worker.py `Worker.calibrate`: the
least admission prices a stream at until streams are measured with the workers busy) cost
against decodes of the dev set: every utterance as a final, and its first 3 s as a partial,
timed in the same process.

    python scripts/start_up_price.py [--model whisper-tiny.en] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from broker.figures import PRIOR_SPEECH_PER_FINAL_S
from config import settings
from speech.audio import load_audio
from speech.backend import DecodeRequest
from streamasr.testdata import utterances
from workers.worker import Worker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="whisper-tiny.en")
    parser.add_argument("--rounds", type=int, default=3, help="start-up prices and dev-set passes, alternating")
    args = parser.parse_args()
    worker = Worker(settings.load(None, {"model": {"name": args.model}}), 0)
    worker.load()
    assert worker.backend is not None
    clips = [load_audio(u.path) for u in utterances()]
    if not clips:
        raise SystemExit("no dev set: install pocketsphinx-testdata")
    head = int(PRIOR_SPEECH_PER_FINAL_S * worker.backend.sample_rate)
    price_s: list[list[float]] = [[], []]
    speech: list[list[float]] = [[], []]
    for _ in range(args.rounds):
        for kind, cost in enumerate(worker.calibrate()[0]):
            price_s[kind].append(cost)
        for audio in clips:
            for kind, request in enumerate((DecodeRequest(audio=audio[:head], partial=True), DecodeRequest(audio=audio))):
                started = time.monotonic()
                worker.backend.transcribe_batch([request])
                speech[kind].append(time.monotonic() - started)
    print(f"{args.model}, {len(clips)} dev-set utterances, {args.rounds} rounds; seconds per decode")
    for kind, name in enumerate(("partial (first 3 s)", "final (whole utterance)")):
        low, mid, high = min(speech[kind]), statistics.median(speech[kind]), max(speech[kind])
        price = statistics.median(price_s[kind])
        print(f"{name:<24} start-up price {price:.3f} (rounds {min(price_s[kind]):.3f}-{max(price_s[kind]):.3f}); "
              f"speech median {mid:.3f} (range {low:.3f}-{high:.3f}); price / speech median {price / mid:.2f}")


if __name__ == "__main__":
    main()
