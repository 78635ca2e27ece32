"""What resampling a client's stream to 16 kHz costs the ingest, per frame and in delay, for each
rate the protocol accepts and each soxr setting, and how far its output strays from an offline
resampling of the same speech; with --wer, what a setting does to the dev set's word error rate
(the dev set taken to the rate with soxr's best filter, then streamed back in 20 ms frames as the
ingest does, and decoded whole by Whisper tiny.en).

    python scripts/resample_cost.py [--frames-ms 20,100] [--wer]
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import numpy as np
import soxr

from ingest.audio import TARGET_RATE as TARGET
from protocol.messages import RATES

STREAMS = 200
ROUNDS = 20
# label: (quality, variable-rate mode); HQ is the ingest's (ingest/audio.py)
SETTINGS = {"HQ": ("HQ", False), "HQ vr": ("HQ", True), "LQ": ("LQ", False), "QQ": ("QQ", False)}


def stream_through(x: np.ndarray, rate: int, setting: str, frame: int) -> tuple[np.ndarray, float]:
    """`x` resampled frame by frame, and how far the output trailed the input (ms, mean over frames)."""
    quality, vr = SETTINGS[setting]
    s = soxr.ResampleStream(rate, TARGET, 1, dtype="float32", quality=quality, vr=vr)
    parts, lags, taken, given = [], [], 0, 0
    for i in range(0, len(x), frame):
        parts.append(s.resample_chunk(x[i : i + frame]))
        taken += len(x[i : i + frame])
        given += len(parts[-1])
        lags.append(taken * 1000 / rate - given * 1000 / TARGET)
    parts.append(s.resample_chunk(np.zeros(0, np.float32), last=True))
    return np.concatenate(parts), float(np.mean(lags[len(lags) // 4 :]))


def per_stream_us(resample: Callable[[], None]) -> float:
    """What `resample` (one frame of all STREAMS streams) costs per stream, warm."""
    resample()
    start = time.perf_counter()
    for _ in range(ROUNDS):
        resample()
    return (time.perf_counter() - start) / ROUNDS / STREAMS * 1e6


def cost_us(rate: int, setting: str, frame: int) -> float:
    """One frame through one of STREAMS streams' resamplers, as the ingest runs them."""
    x = (0.1 * np.random.default_rng(0).standard_normal(frame)).astype(np.float32)
    quality, vr = SETTINGS[setting]
    streams = [soxr.ResampleStream(rate, TARGET, 1, dtype="float32", quality=quality, vr=vr) for _ in range(STREAMS)]

    def one_frame_each() -> None:
        for s in streams:
            s.resample_chunk(x)

    return per_stream_us(one_frame_each)


def batched_cost_us(rate: int, frame: int) -> float:
    """The same frame of STREAMS streams as the channels of one resampler, per stream: what
    batching would save, were the streams' frames in step."""
    x = np.ascontiguousarray(np.tile((0.1 * np.random.default_rng(0).standard_normal(frame)).astype(np.float32)[:, None], (1, STREAMS)))
    s = soxr.ResampleStream(rate, TARGET, STREAMS, dtype="float32", quality="HQ")

    def one_frame_all() -> None:
        s.resample_chunk(x)

    return per_stream_us(one_frame_all)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames-ms", default="20,100")
    parser.add_argument("--wer", action="store_true", help="also decode the dev set through each setting (about a minute per rate)")
    args = parser.parse_args()
    from speech.audio import load_audio
    from streamasr.testdata import utterances, wer

    utts = utterances()
    speech = load_audio(utts[0].path) if utts else None  # the deviation is measured on it
    noise = (0.1 * np.random.default_rng(1).standard_normal(5 * 48000)).astype(np.float32)
    print(f"{'rate':>6} {'setting':>7} {'frame ms':>8} {'us per frame':>12} {'% of a core, 200 streams':>25} {'delay ms':>8}"
          f" {'us, streams as channels':>24} {'deviation':>9}")
    for rate in (r for r in RATES if r != TARGET):
        source = None if speech is None else soxr.resample(speech, TARGET, rate, quality="VHQ").astype(np.float32)
        offline = None if source is None else soxr.resample(source, rate, TARGET, quality="VHQ")
        for setting in SETTINGS:
            for ms in (int(f) for f in args.frames_ms.split(",")):
                frame = rate * ms // 1000
                us = cost_us(rate, setting, frame)
                _, lag = stream_through(noise[: 5 * rate], rate, setting, frame)
                batched = f"{batched_cost_us(rate, frame):>24.1f}" if setting == "HQ" else " " * 24
                deviation = ""
                if source is not None and offline is not None:  # relative RMS against the offline resampling
                    streamed = stream_through(source, rate, setting, frame)[0][: len(offline)]
                    deviation = f"{np.sqrt(np.mean((streamed - offline[: len(streamed)]) ** 2) / np.mean(offline ** 2)):>9.5f}"
                print(f"{rate:>6} {setting:>7} {ms:>8} {us:>12.1f} {us * STREAMS * 1000 / ms / 1e4:>25.1f} {lag:>8.1f} {batched} {deviation}")
    if args.wer:
        from config.settings import ModelConfig
        from speech.backend import DecodeRequest
        from speech.ort_backend import OrtWhisperBackend

        model = OrtWhisperBackend(ModelConfig(name="whisper-tiny.en"), warmup=False)
        for rate in (8000, 48000):
            sources = [soxr.resample(load_audio(u.path), TARGET, rate, quality="VHQ").astype(np.float32) for u in utts]
            for setting in SETTINGS:
                hyps = [model.transcribe_batch([DecodeRequest(audio=stream_through(x, rate, setting, rate // 50)[0],
                                                              partial=False, language="en")])[0].text for x in sources]
                print(f"dev set at {rate} Hz, streamed back through {setting}: WER {100 * wer([u.reference for u in utts], hyps):.2f} %")


if __name__ == "__main__":
    main()
