"""How far the word times of a final are from where its words were said: words synthesized one by
one at known times (`streamasr.testdata.spaced_words`), decoded as one final, each word's timed
start and end against its sound's. Then what timing the words costs: the dev set's utterances
decoded as finals by the same model with word times and without, alternating, `--rounds` times.

    python scripts/word_times.py [--model whisper-tiny.en] [--precision fp32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

from config.settings import ModelConfig
from speech.backend import DecodeRequest
from speech.ort_backend import OrtWhisperBackend
from speech.audio import load_audio
from streamasr.testdata import spaced_words, utterances


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="whisper-tiny.en")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    cfg = ModelConfig(name=args.model, precision=args.precision, partial_precision="")
    backend = OrtWhisperBackend(cfg)
    with tempfile.TemporaryDirectory() as folder:
        audio, spans = spaced_words(Path(folder))
    res = backend.transcribe_batch([DecodeRequest(audio=audio)])[0]
    print(f"text: {res.text}")
    print(f"{'word':<12} {'said':>13} {'timed':>13} {'start off':>10} {'end off':>8}")
    errors = []
    for w, (start, end) in zip(res.words, spans):
        errors += [abs(w.start - start), abs(w.end - end)]
        print(f"{w.text.strip():<12} {start:5.2f}-{end:5.2f} s {w.start:5.2f}-{w.end:5.2f} s {w.start - start:+9.2f} s {w.end - end:+7.2f} s")
    if len(res.words) != len(spans):
        print(f"{len(res.words)} words timed for {len(spans)} said")
    print(f"mean |offset| {sum(errors) / len(errors):.3f} s, most {max(errors):.3f} s")

    untimed = OrtWhisperBackend(dataclasses.replace(cfg, word_times=False))
    dev = [load_audio(u.path) for u in utterances()]
    spent: dict[str, list[float]] = {"with words": [], "without": []}
    for _ in range(args.rounds):
        for label, model in (("with words", backend), ("without", untimed)):
            t0 = time.perf_counter()
            for audio in dev:
                model.transcribe_batch([DecodeRequest(audio=audio)])
            spent[label].append(1000 * (time.perf_counter() - t0) / len(dev))
    for label, ms in spent.items():
        print(f"{label:>10}: {', '.join(f'{x:.1f}' for x in ms)} ms per final ({len(dev)} dev-set utterances, per round)")


if __name__ == "__main__":
    main()
