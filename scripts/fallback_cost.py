"""What the temperature fallback buys finals, and what it costs a worker: segments decoded as
finals on one thread (a worker's setting) with the fallback off, on loops only (the service's
finals), and with Whisper's rule (long-form windows); prints each set's word error rate, decode
seconds, and how many texts a fallback sample replaced.

The sets: the dev set as it is; its librivox utterances with white noise at 0 and -5 dB SNR; segments
where greedy decoding loops (a dev-set utterance before or after a word said over and over,
espeak-ng's voice); words genuinely said several times, where the text compresses well; and one
22 s segment that loops to Whisper's 224 tokens, the longest a final's fallback can be asked to
mend (its number of rounds decides what it costs).

    python scripts/fallback_cost.py [--model whisper-tiny.en]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from config.settings import ModelConfig
from speech.audio import load_audio
from speech.backend import DecodeRequest
from speech.ort_backend import OrtWhisperBackend
from streamasr.testdata import spoken, utterances, wer

Case = tuple[np.ndarray, str]


def said(words: str, times: int, where: Path) -> Case:
    text = " ".join([words] * times)
    return load_audio(spoken(text, where / "said.wav")), text


def sets(where: Path) -> dict[str, list[Case]]:
    dev = [(load_audio(u.path), u.reference) for u in utterances()]
    rng = np.random.default_rng(0)
    noisy: dict[int, list[Case]] = {0: [], -5: []}
    for audio, ref in dev[:5]:  # librivox
        noise = rng.standard_normal(len(audio)).astype(np.float32)
        for snr, cases in noisy.items():
            gain = np.sqrt((audio**2).mean() / (noise**2).mean() / 10 ** (snr / 10))
            cases.append((audio + noise * gain, ref))
    repeated = [said(w, k, where) for w, k in (("no", 15), ("okay", 12), ("yes", 20))]
    loops = [(np.concatenate([dev[i][0], r[0]]), f"{dev[i][1]} {r[1]}") for i, r in enumerate(repeated)]
    loops += [(np.concatenate([r[0], dev[i + 2][0]]), f"{r[1]} {dev[i + 2][1]}") for i, r in enumerate(repeated)]
    genuine = [said(w, k, where) for w, k in (("right", 8), ("thank you", 6), ("hello", 4), ("one two three", 3))]
    longest = said("okay", 70, where)  # 22 s: a loop to Whisper's 224 tokens, the most a final's greedy decode takes
    return {"dev set": dev, "dev set, 0 dB noise": noisy[0], "dev set, -5 dB noise": noisy[-5], "loops": loops,
            "said over and over": genuine, "one long loop": [longest]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="whisper-tiny.en")
    args = ap.parse_args()
    backend = OrtWhisperBackend(ModelConfig(name=args.model, precision="fp32", partial_precision="", threads=1))
    decoder, step = backend.decoding, backend.decoding.opt.temperature_increment
    modes = {"off": (0.0, False), "loops only (finals)": (step, False), "Whisper's rule (long form)": (step, True)}
    with tempfile.TemporaryDirectory() as where:
        cases = sets(Path(where))
    print(f"{backend.name}, one thread; fallback step {step}, best of {decoder.opt.best_of}")
    print("| set | segments | fallback | WER % | decode s | resampled |")
    print("|---|---|---|---|---|---|")
    for name, segs in cases.items():
        for mode, (increment, whisper_rule) in modes.items():
            decoder.opt.temperature_increment = increment
            hyps, resampled, t0 = [], 0, time.perf_counter()
            for audio, _ in segs:
                res, _ = decoder.decode_tokens([DecodeRequest(audio=audio, language="en")], whisper_rule=whisper_rule)[0]
                hyps.append(res.text)
                resampled += res.temperature > 0
            seconds = time.perf_counter() - t0
            print(f"| {name} | {len(segs)} | {mode} | {100 * wer([r for _, r in segs], hyps):.1f} | {seconds:.1f} | {resampled} |",
                  flush=True)


if __name__ == "__main__":
    main()
