"""How far the service's partials are from the best decode of the same audio: the dev set's
utterances cut every 0.5 s (1 s to 5.5 s), each prefix decoded as a partial with the configured
partial settings (int8, short window by default) and with fp32 on the full 30 s window; prints the
word error rate of the first against the second. A partial is a prefix of speech, often cut
mid-word, so there is no human reference for it; the full-window fp32 decode is the closest thing.

`--joined` cuts instead the five LibriVox sentences joined with 0.25 s gaps, one 25 s segment to
the VAD (the gaps are shorter than `min_silence_ms`), every 0.5 s from 1 s to 25 s: the partials
of a long segment. Either way it counts the partials that stop at a segment they opened (two
timestamps, or only the first, then the end of text) a second or more before their audio's end.

    python scripts/partial_agreement.py [--model whisper-tiny.en] [--config FILE] [--joined]
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

import numpy as np

from config.settings import ModelConfig
from speech.audio import load_audio
from speech.backend import SAMPLE_RATE, DecodeRequest
from speech.ort_backend import OrtWhisperBackend
from speech.tokenizer import TIME_PRECISION
from streamasr.testdata import utterances, wer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="whisper-tiny.en")
    ap.add_argument("--config", help="TOML with a [model] table for the partials' settings (default: the defaults)")
    ap.add_argument("--joined", action="store_true", help="prefixes of one 25 s segment of the LibriVox sentences")
    args = ap.parse_args()
    settings = tomllib.loads(Path(args.config).read_text()).get("model", {}) if args.config else {}
    partials = OrtWhisperBackend(ModelConfig(**{**settings, "name": args.model}), warmup=False)
    best = OrtWhisperBackend(ModelConfig(name=args.model, precision="fp32", partial_precision="fp32",
                                         partial_window="full"), warmup=False)
    clips = [load_audio(utt.path) for utt in utterances()]
    if args.joined:
        gap = np.zeros(SAMPLE_RATE // 4, np.float32)
        libri = [a for utt, a in zip(utterances(), clips) if utt.name.startswith("librivox/")]
        clips = [np.concatenate([x for a in libri for x in (a, gap)])[: 25 * SAMPLE_RATE]]
    tb = partials.tokenizer.timestamp_begin
    hyps, refs, stopped = [], [], 0
    for audio in clips:
        top = len(audio) / SAMPLE_RATE + 0.25 if args.joined else min(len(audio) / SAMPLE_RATE, 6.0)  # 25 s included
        for seconds in np.arange(1.0, top, 0.5):
            request = DecodeRequest(audio=audio[: int(seconds * SAMPLE_RATE)], partial=True, language="en")
            res, tokens = partials.partial_decoding.decode_tokens([request])[0]  # what transcribe_batch gives a partial
            opened = tokens[-1] if tokens and tokens[-1] >= tb and (len(tokens) == 1 or tokens[-2] >= tb) else None
            stopped += opened is not None and (opened - tb) * TIME_PRECISION <= seconds - 1.0
            hyps.append(res.text)
            refs.append(best.transcribe_batch([request])[0].text)
    print(f"{len(hyps)} prefixes: partials ({partials.name}, {partials.cfg.partial_window} window) against fp32 "
          f"full-window decodes of the same audio: WER {100 * wer(refs, hyps):.1f} %; {stopped} stopped at a "
          f"segment they opened a second or more before the end")


if __name__ == "__main__":
    main()
