"""How far the service's partials are from the best decode of the same audio: the dev set's
utterances cut every 0.5 s (1 s to 5.5 s), each prefix decoded as a partial with the configured
partial settings (int8, short window by default) and with fp32 on the full 30 s window; prints the
word error rate of the first against the second. A partial is a prefix of speech, often cut
mid-word, so there is no human reference for it; the full-window fp32 decode is the closest thing.

    python scripts/partial_agreement.py [--model whisper-tiny.en] [--config FILE]
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
from streamasr.testdata import utterances, wer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="whisper-tiny.en")
    ap.add_argument("--config", help="TOML with a [model] table for the partials' settings (default: the defaults)")
    args = ap.parse_args()
    settings = tomllib.loads(Path(args.config).read_text()).get("model", {}) if args.config else {}
    partials = OrtWhisperBackend(ModelConfig(**{**settings, "name": args.model}), warmup=False)
    best = OrtWhisperBackend(ModelConfig(name=args.model, precision="fp32", partial_precision="fp32",
                                         partial_window="full"), warmup=False)
    hyps, refs = [], []
    for utt in utterances():
        audio = load_audio(utt.path)
        for seconds in np.arange(1.0, min(len(audio) / SAMPLE_RATE, 6.0), 0.5):
            request = DecodeRequest(audio=audio[: int(seconds * SAMPLE_RATE)], partial=True, language="en")
            hyps.append(partials.transcribe_batch([request])[0].text)
            refs.append(best.transcribe_batch([request])[0].text)
    print(f"{len(hyps)} prefixes: partials ({partials.name}, {partials.cfg.partial_window} window) against fp32 "
          f"full-window decodes of the same audio: WER {100 * wer(refs, hyps):.1f} %")


if __name__ == "__main__":
    main()
