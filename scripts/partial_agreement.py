"""How far the service's partials are from the best decode of the same audio: the dev set's
utterances cut every 0.5 s (1 s to 5.5 s), each prefix decoded as a partial with the configured
partial settings (int8, short window by default) and with fp32 on the full 30 s window; prints the
word error rate of the first against the second. A partial is a prefix of speech, often cut
mid-word, so there is no human reference for it; the full-window fp32 decode is the closest thing.

`--joined` cuts instead the five LibriVox sentences joined with 0.25 s gaps, one 25 s segment to
the VAD (the gaps are shorter than `min_silence_ms`), every 0.5 s from 1 s to 25 s: the partials
of a long segment. Either way it counts the partials that stop at a segment they opened (two
timestamps, or only the first, then the end of text) a second or more before their audio's end
(`--opened-before S` instead of a second).

`--every S` cuts every S seconds instead of 0.5. `--stabilized` decodes each clip's prefixes one
after another as the ingest does a segment's partials: each with the words LocalAgreement has
committed so far as its prefix, its text (nothing, if Whisper's no-speech test calls it
hallucinated) fed to LocalAgreement, and the text the service would show scored. `--vad` also
counts and lists those of the stopped partials with speech after the timestamp: a chunk there
that the ingest's Silero VAD, run over the whole clip, puts at or above the default `[vad]
threshold`; and the most of them in a row.

    python scripts/partial_agreement.py [--model whisper-tiny.en] [--config FILE] [--joined]
        [--every S] [--stabilized] [--opened-before S] [--vad]
"""

from __future__ import annotations

import argparse
import math
import tomllib
from pathlib import Path

import numpy as np

from config.settings import ModelConfig, VadConfig
from ingest.session import Session
from ingest.stabilizer import LocalAgreement
from ingest.vad import CHUNK
from speech.audio import load_audio
from speech.backend import SAMPLE_RATE, DecodeRequest
from speech.ort_backend import OrtWhisperBackend
from speech.tokenizer import TIME_PRECISION
from streamasr.testdata import utterances, wer
from streamasr.vadclips import clip_probs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="whisper-tiny.en")
    ap.add_argument("--config", help="TOML with a [model] table for the partials' settings (default: the defaults)")
    ap.add_argument("--joined", action="store_true", help="prefixes of one 25 s segment of the LibriVox sentences")
    ap.add_argument("--every", type=float, default=0.5, metavar="S", help="seconds between two prefixes")
    ap.add_argument("--stabilized", action="store_true",
                    help="decode each clip's prefixes in turn with LocalAgreement's committed words as the prefix")
    ap.add_argument("--opened-before", type=float, default=1.0, metavar="S",
                    help="count a partial stopped at a segment it opened at least S seconds before its end")
    ap.add_argument("--vad", action="store_true", help="count and list the stopped partials with speech after the timestamp")
    args = ap.parse_args()
    settings = tomllib.loads(Path(args.config).read_text()).get("model", {}) if args.config else {}
    partials = OrtWhisperBackend(ModelConfig(**{**settings, "name": args.model}), warmup=False)
    best = OrtWhisperBackend(ModelConfig(name=args.model, precision="fp32", partial_precision="fp32",
                                         partial_window="full"), warmup=False)
    clips = [(utt.name, load_audio(utt.path)) for utt in utterances()]
    if args.joined:
        gap = np.zeros(SAMPLE_RATE // 4, np.float32)
        libri = [a for name, a in clips if name.startswith("librivox/")]
        clips = [("joined", np.concatenate([x for a in libri for x in (a, gap)])[: 25 * SAMPLE_RATE])]
    tb = partials.tokenizer.timestamp_begin
    threshold = VadConfig().threshold
    hyps, refs, stopped, with_speech = [], [], 0, 0
    longest = (0, 0.0, 0.0, "")  # the most stopped with speech after in a row: how many, first s, last s, text
    for name, audio in clips:
        top = len(audio) / SAMPLE_RATE + args.every / 2 if args.joined else min(len(audio) / SAMPLE_RATE, 6.0)  # 25 s included
        probs = clip_probs(audio) if args.vad else None
        agreement, run = LocalAgreement(), (0, 0.0)  # stopped with speech after, in a row so far: how many, first s
        for k, seconds in enumerate(np.arange(1.0, top, args.every)):
            prefix = (agreement.committed or None) if args.stabilized else None  # as the ingest builds a partial's job
            request = DecodeRequest(audio=audio[: int(seconds * SAMPLE_RATE)], partial=True, language="en",
                                    prefix=prefix, first=args.stabilized and k == 0)
            res, tokens = partials.partial_decoding.decode_tokens([request])[0]  # what transcribe_batch gives a partial
            text = res.text
            if args.stabilized:
                text, _ = agreement.update("" if Session._hallucinated(res) else res.text.strip())
            opened = tokens[-1] if tokens and tokens[-1] >= tb and (len(tokens) == 1 or tokens[-2] >= tb) else None
            at = (opened - tb) * TIME_PRECISION if opened is not None else None
            stop = at is not None and at <= seconds - args.opened_before
            stopped += stop
            if probs is not None and at is not None and stop:  # the chunks wholly after the timestamp
                spoken = bool((probs[math.ceil(at * SAMPLE_RATE / CHUNK) : int(seconds * SAMPLE_RATE) // CHUNK] >= threshold).any())
            else:
                spoken = False
            if spoken:
                with_speech += 1
                print(f"  {name} {seconds:.2f} s: opened at {at:.2f} s: ...{text[-50:]}")
                run = (run[0] + 1, run[1] if run[0] else seconds)
                if run[0] > longest[0]:
                    longest = (*run, seconds, text)
            else:
                run = (0, 0.0)
            hyps.append(text)
            refs.append(best.transcribe_batch([DecodeRequest(audio=request.audio, partial=True, language="en")])[0].text)
    before = "a second" if args.opened_before == 1.0 else f"{args.opened_before:g} s"
    print(f"{len(hyps)} prefixes: partials ({partials.name}, {partials.cfg.partial_window} window) against fp32 "
          f"full-window decodes of the same audio: WER {100 * wer(refs, hyps):.1f} %; {stopped} stopped at a "
          f"segment they opened {before} or more before the end")
    if args.vad:
        print(f"{with_speech} of them with speech after the timestamp (VAD); the most in a row: {longest[0]}"
              + (f", {longest[1]:.2f} s to {longest[2]:.2f} s: ...{longest[3][-50:]}" if longest[0] else ""))


if __name__ == "__main__":
    main()
