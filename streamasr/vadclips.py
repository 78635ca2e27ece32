"""The ingest's VAD and segmenter over a whole clip, its chunks handed over as a stream hands
them: what the measuring scripts and the tests compare (a sentence after a call signal, speech
with pauses), without a service."""

from __future__ import annotations

import numpy as np

from config.settings import VadConfig
from ingest.segmenter import Segmenter
from ingest.vad import CHUNK, SAMPLE_RATE, VadBank


def clip_probs(audio: np.ndarray, calls_of: int | None = None) -> np.ndarray:
    """The speech probability of each whole CHUNK of 16 kHz float `audio`, as the ingest's VAD sees
    it streamed: in calls of `calls_of` chunks, as a live stream hands them over, or all at once
    (None), as a stream catching up does."""
    bank = VadBank()
    bank.add("clip")
    chunks = [audio[i : i + CHUNK] for i in range(0, len(audio) - CHUNK + 1, CHUNK)]
    step = calls_of or max(1, len(chunks))
    calls = [chunks[i : i + step] for i in range(0, len(chunks), step)]
    return np.concatenate([bank.process(["clip"] * len(call), call) for call in calls]) if calls else np.zeros(0, np.float32)


def clip_segments(audio: np.ndarray, cfg: VadConfig, calls_of: int | None = None) -> list[tuple[float, float]]:
    """The segments (start, end in seconds) the ingest's VAD and segmenter open on 16 kHz float
    `audio`, its chunks handed over as `clip_probs` says."""
    segmenter = Segmenter(cfg)
    events = []
    for i, prob in enumerate(clip_probs(audio, calls_of)):
        events += segmenter.push(float(prob), (i + 1) * CHUNK)
    events += segmenter.flush(len(audio))
    return [(ev.start / SAMPLE_RATE, ev.end / SAMPLE_RATE) for ev in events if ev.kind == "end"]
