"""A backend that returns a fixed text at no cost, to measure the pipeline without a model."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from config.settings import ModelConfig
from speech.backend import SAMPLE_RATE, Backend, DecodeRequest, DecodeResult, Segment


class NullBackend(Backend):
    name = "null"

    def __init__(self, cfg: ModelConfig | None = None):
        self.text = (cfg or ModelConfig()).null_text

    def transcribe_batch(self, requests: Sequence[DecodeRequest]) -> list[DecodeResult]:
        out = []
        for r in requests:
            dur = float(np.asarray(r.audio).shape[-1]) / SAMPLE_RATE
            out.append(DecodeResult(text=self.text, segments=[Segment(0.0, dur, self.text)], language=r.language or "en", tokens=0))
        return out
