"""The interface between worker processes and a speech model.

Workers gather decode requests from many streams and hand them to `transcribe_batch` in one
call, so a backend can batch on its device; the result list is in request order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

SAMPLE_RATE = 16_000
MAX_WINDOW_S = 30.0  # Whisper's receptive field; longer audio goes through speech.longform
MIN_REST_S = 0.05  # audio left after a seek shorter than this is not decoded (long-form windows, decoding on)


@dataclass(slots=True)
class DecodeRequest:
    audio: np.ndarray  # float32 mono 16 kHz, at most 30 s; may be a view into shm, read only during the call
    language: str | None = None  # None: detect (multilingual models) or English (.en models)
    prompt: str | None = None  # previous text or hotwords, given as Whisper's <|startofprev|> context
    prefix: str | None = None  # text the transcript must start with (committed words of a stream)
    partial: bool = False  # a partial decode may trade a little accuracy for latency
    first: bool = False  # a segment's first partial: with quick_first_partial, decoded on a short window
    timestamps: bool = True


@dataclass(slots=True)
class Segment:
    start: float  # seconds from the start of the request's audio
    end: float
    text: str


@dataclass(slots=True)
class DecodeResult:
    text: str
    segments: list[Segment] = field(default_factory=list)
    language: str = "en"
    avg_logprob: float = 0.0
    no_speech_prob: float = 0.0
    tokens: int = 0
    fell_back: bool = False  # the greedy decode needed Whisper's temperature fallback (it looped)
    temperature: float = 0.0  # above 0: this text is the fallback's sample at that temperature
    # a final's words with their times, as `segments` (with the space before each), when the
    # backend times words (`[model] word_times`); empty otherwise
    words: list[Segment] = field(default_factory=list)


class Backend(ABC):
    """A loaded, warmed-up speech model."""

    name: str = "backend"
    sample_rate: int = SAMPLE_RATE

    @abstractmethod
    def transcribe_batch(self, requests: Sequence[DecodeRequest]) -> list[DecodeResult]:
        """Decode every request; one result per request, same order."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release device memory and sessions."""
