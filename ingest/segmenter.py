"""Speech segments from per-chunk VAD probabilities, for one stream. Pure: no I/O, no clock.

Follows Silero's get_speech_timestamps, made incremental: speech switches on at
`threshold` and off below `threshold - 0.15` (hysteresis keeps a wobbling probability from
chopping words), a pause must last `min_silence_ms` to end a segment, and bursts shorter
than `min_speech_ms` never become segments. A "start" is announced only once the speech is
long enough, so a cough costs no decode. Segments longer than `max_segment_s` are cut at the
quietest recent chunk, because Whisper sees at most 30 s.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from config.settings import VadConfig

CUT_WINDOW_S = 2.0  # how far back a forced cut looks for the quietest chunk (at most half of max_segment_s)


@dataclass(slots=True)
class SegmentEvent:
    kind: str  # "start" | "end"
    start: int  # absolute 16 kHz sample
    end: int | None = None  # only for "end"
    forced: bool = False  # cut by max_segment_s, not by a pause


class Segmenter:
    """Turns one stream's VAD probabilities into segment start/end events."""

    def __init__(self, cfg: VadConfig, sample_rate: int = 16000) -> None:
        ms = sample_rate / 1000
        self.threshold = cfg.threshold
        self.neg_threshold = max(cfg.threshold - 0.15, 0.01)
        self.min_silence = int(cfg.min_silence_ms * ms)
        self.min_speech = int(cfg.min_speech_ms * ms)
        self.max_segment = int(cfg.max_segment_s * sample_rate)
        self.pad = int(cfg.pad_ms * ms)
        # At most half the longest segment: a cut must leave the segment it closes its due length,
        # and the one it opens short of the limit, or that one would be due a cut at once.
        self.cut_window = min(int(CUT_WINDOW_S * sample_rate), self.max_segment // 2)
        self.in_speech = False  # a "start" was emitted and its "end" not yet
        self.segment_start: int | None = None
        self._triggered = False  # speech detected, maybe not yet long enough to be a segment
        self._speech_start = 0
        self._silence_from: int | None = None  # start of the pause now running, if any
        self._prev_end = 0  # end of the previous segment: the next one never overlaps it
        self._pos = 0  # end of the last chunk pushed
        # Chunks of the open segment's last CUT_WINDOW_S, as three parallel deques rather than a
        # tuple per chunk: numbers are not tracked by the garbage collector, tuples are, and
        # every stream in speech renews its window 31 times a second.
        self._recent_prob: deque[float] = deque()
        self._recent_start: deque[int] = deque()
        self._recent_end: deque[int] = deque()

    @property
    def earliest_start(self) -> int:
        """Oldest sample an open or future segment can start at: audio before it is no longer needed."""
        if self.in_speech:
            assert self.segment_start is not None
            return self.segment_start
        origin = self._speech_start if self._triggered else self._pos
        return max(origin - self.pad, self._prev_end, 0)

    @property
    def active(self) -> bool:
        """Speech is going on: a segment is open, or the speech that may open one has begun."""
        return self._triggered or self.in_speech

    def may_decide(self, pending: int) -> bool:
        """Whether the probabilities of the next `pending` samples could open or close a segment,
        whatever they are. A start is due a partial and an end its final, so the ingest has such
        chunks classified at once instead of gathering them with other streams' (`push` emits no
        event for chunks of which this said False)."""
        horizon = self._pos + pending
        if self.in_speech:
            assert self.segment_start is not None
            pause_from = self._pos if self._silence_from is None else self._silence_from
            return horizon - pause_from >= self.min_silence or horizon - self.segment_start >= self.max_segment
        return horizon - (self._speech_start if self._triggered else self._pos) >= self.min_speech

    def push(self, prob: float, chunk_end: int) -> list[SegmentEvent]:
        """Feed the probability of the chunk ending at absolute sample `chunk_end`."""
        chunk_start, self._pos = self._pos, chunk_end
        events: list[SegmentEvent] = []
        if prob >= self.threshold:
            self._silence_from = None
            if not self._triggered:
                self._triggered = True
                self._speech_start = chunk_start
        elif prob < self.neg_threshold and self._triggered and self._silence_from is None:
            self._silence_from = chunk_start
        if not self._triggered:
            return events
        if self._silence_from is None:
            if not self.in_speech and chunk_end - self._speech_start >= self.min_speech:
                events.append(self._open(max(self._speech_start - self.pad, self._prev_end, 0)))
        elif chunk_end - self._silence_from >= self.min_silence:
            if self.in_speech:
                events.append(self._close(self._silence_from + self.pad, forced=False))
            self._end_speech()
            return events
        if self.in_speech:
            self._recent_prob.append(prob)
            self._recent_start.append(chunk_start)
            self._recent_end.append(chunk_end)
            while self._recent_end[0] <= chunk_end - self.cut_window:
                self._recent_prob.popleft()
                self._recent_start.popleft()
                self._recent_end.popleft()
            assert self.segment_start is not None
            if chunk_end - self.segment_start < self.max_segment:
                return events
            if self._silence_from is None:
                events.extend(self._force_cut())
            else:  # already in a pause: end there rather than start a segment of silence
                events.append(self._close(self._silence_from + self.pad, forced=True))
                self._end_speech()
        return events

    def flush(self, stream_end: int) -> list[SegmentEvent]:
        """The stream ended at `stream_end`: close the open segment (or one long enough to open)."""
        events: list[SegmentEvent] = []
        if self._triggered:
            # Audio after the last full VAD chunk is taken to continue whatever was going on.
            speech_end = stream_end if self._silence_from is None else self._silence_from
            if not self.in_speech and speech_end - self._speech_start >= self.min_speech:
                events.append(self._open(max(self._speech_start - self.pad, self._prev_end, 0)))
            if self.in_speech:
                assert self.segment_start is not None
                self._pos = max(self._pos, stream_end)
                if self._silence_from is None and self._pos - self.segment_start > self.max_segment:
                    # speech runs past the limit in the audio after the last chunk: cut as push
                    # does, so that audio still gets a segment (a pause gets none, as in push)
                    events.extend(self._force_cut())
                events.append(self._close(speech_end + self.pad, forced=False))
        self._end_speech()
        return events

    def cut(self) -> list[SegmentEvent]:
        """End the open segment now, as at max_segment_s: its stream's buffer is full of it and
        cannot take the audio the VAD would need to find its end (see Session.accept_audio).

        Speech begun but not yet a segment (shorter than `min_speech_ms` so far, or followed by
        a pause shorter than `min_silence_ms`) waits for the same audio: the ring keeps it and
        the pad before it. It is made a segment of its own, ended where the VAD has got, so its
        final frees that room and no accepted audio is left out."""
        if not self.in_speech:
            if not self._triggered:
                return []
            speech_end = self._pos if self._silence_from is None else self._silence_from
            opened = self._open(max(self._speech_start - self.pad, self._prev_end, 0))
            closed = self._close(speech_end + self.pad, forced=True)
            self._end_speech()
            return [opened, closed]
        if self._silence_from is None:
            return self._force_cut()
        event = self._close(self._silence_from + self.pad, forced=True)  # in a pause: end there, as push does
        self._end_speech()
        return [event]

    def _open(self, start: int) -> SegmentEvent:
        self.in_speech = True
        self.segment_start = start
        self._clear_recent()
        return SegmentEvent("start", start)

    def _close(self, end: int, forced: bool) -> SegmentEvent:
        """End the open segment at `end`, capped to the audio seen and to max_segment_s."""
        assert self.segment_start is not None
        end = min(end, self._pos, self.segment_start + self.max_segment)
        event = SegmentEvent("end", self.segment_start, end, forced)
        self._prev_end = end
        self.in_speech = False
        self.segment_start = None
        return event

    def _end_speech(self) -> None:
        self._triggered = False
        self._silence_from = None
        self._clear_recent()

    def _clear_recent(self) -> None:
        self._recent_prob.clear()
        self._recent_start.clear()
        self._recent_end.clear()

    def _force_cut(self) -> list[SegmentEvent]:
        """Split at the quietest chunk of the last CUT_WINDOW_S; speech carries on after it."""
        assert self.segment_start is not None
        if not self._recent_prob:  # opened by `flush`, longer already (min_speech_ms and pad_ms past the limit)
            closed = self._close(self.segment_start + self.max_segment, forced=True)
            return [closed, self._open(closed.end)]
        # the latest of equally quiet chunks keeps the segment longest
        quietest = min(self._recent_prob)
        i = max(i for i, p in enumerate(self._recent_prob) if p == quietest)
        start, end = self._recent_start[i], self._recent_end[i]
        cut = max((start + end) // 2, self.segment_start + 1)
        closed = self._close(cut, forced=True)
        return [closed, self._open(closed.end)]  # the cut capped to max_segment_s: no sample left out
