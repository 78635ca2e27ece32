"""One client stream inside an ingest process: audio in, jobs out, results back to events.

The session is the authoritative state of a stream: which samples are in its ring, which
segments are open, which jobs are due. The broker and workers hold nothing that cannot be
rebuilt from here, which is what lets a broker restart lose no audio.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog

from broker.jobs import BATCH, FAILED, OK, REALTIME, Job, JobResult
from config.settings import Config
from ingest.audio import S16_SCALE, AudioFormatError, Resampler, buffer_len, decode_pcm
from ingest.segmenter import SegmentEvent, Segmenter
from ingest.stabilizer import LocalAgreement
from ingest.vad import CHUNK as VAD_CHUNK
from metrics.registry import ProcessMetrics
from protocol import messages as m
from shm.pool import Ring
from streamasr.logs import Throttle

SAMPLE_RATE = 16_000
PROMPT_CHARS = 200  # previous final text carried into the next decode as Whisper's prompt
# Whisper's hallucination guard: a result that is probably silence is not a transcript
NO_SPEECH_PROB = 0.6
LOGPROB_FLOOR = -1.0
FINAL_RETRIES = 2
ROOM_MARGIN = 64  # ring samples an accepted frame leaves free beyond its own and the resampler's
WINDOW_HEADROOM = 1024  # ring samples the window keeps in hand: more than ROOM_MARGIN + 3 (see window)
_job_ids = itertools.count(time.time_ns())  # unique per ingest process, across its restarts too


@dataclass(slots=True)
class _Segment:
    index: int
    start: int
    end: int | None = None
    stabilizer: LocalAgreement = field(default_factory=LocalAgreement)
    last_partial_end: int = 0  # end of the last partial job submitted
    partials_submitted: int = 0
    shown_end: int = 0  # end of the last partial sent: an older result arriving late is not shown
    language: str | None = None  # the last partial sent's: a failed final keeps the words it agreed on
    final_job: int | None = None
    result: m.Final | None = None  # held until every earlier segment's final is out
    retries: int = 0


def _segment_row(row: Any) -> bool:
    """A worker's segment as `speech.backend.Segment` gives it: [start, end, text], 0 <= start <= end."""
    return (isinstance(row, (list, tuple)) and len(row) == 3 and all(isinstance(t, (int, float)) and not isinstance(t, bool)
            for t in row[:2]) and 0 <= row[0] <= row[1] < math.inf and isinstance(row[2], str))


class Session:
    """State machine of one stream; the ingest server feeds it messages and drains `outbox`."""

    def __init__(self, key: str, client: bytes, opened: m.Open, ring: Ring, cfg: Config, ingest_index: int, shm_name: str,
                 metrics: ProcessMetrics):
        self.key = key
        self.metrics = metrics  # the ingest process's: refusals, internal errors and result latencies happen here
        self.client = client
        self.opened = opened
        self.ring = ring
        self.cfg = cfg
        self.ingest_index = ingest_index
        self.shm_name = shm_name
        self.rate = opened.rate
        self.offset = opened.offset  # input frames before this session: a resumed stream continues its times
        self.offset_s = opened.offset / opened.rate
        self.priority = BATCH if opened.priority == "batch" else REALTIME
        self.resampler = Resampler(opened.rate)
        self.segmenter = Segmenter(cfg.vad, SAMPLE_RATE)
        self.bytes_per_frame = opened.channels * m.SAMPLE_BYTES[opened.encoding]
        # The common case, 16 kHz mono 16-bit, is converted straight into the ring, and mono float
        # is read where it arrived; anything else is converted (mixed down, G.711 looked up) into
        # this buffer, grown to the largest frame (see buffer_len), before the resampler.
        mono = opened.channels == 1
        self.direct_s16 = mono and opened.encoding == "pcm_s16le" and opened.rate == SAMPLE_RATE
        self.pcm: np.ndarray | None = None if self.direct_s16 or (mono and opened.encoding == "f32le") else np.empty(0, np.float32)
        self.log = structlog.get_logger().bind(ingest=ingest_index, stream=opened.stream, key=key)
        self.throttle = Throttle("ingest.audio_refused")  # every frame is refused while its ring is full
        self.next_seq = 0
        self.in_frames = 0  # input frames (per channel) accepted
        self.largest = 0  # input frames of the longest message accepted: what the client waits for room for
        self.vad_pos = 0  # 16 kHz samples already classified by VAD
        self.segments: dict[int, _Segment] = {}
        self.open_segment: _Segment | None = None
        self.next_segment = 0
        self.next_final = 0  # index of the next final to send
        self.previous_text = opened.resume_text or ""  # a resumed stream is prompted as if never interrupted
        # Opened without a language, each final detects its segment's on the whole segment, and the
        # partials after it are decoded in the language the latest one heard: a partial detects on
        # the little audio it has (a second of German is heard as English, Vietnamese, Thai), and
        # partials detecting each for itself flip from one language to another. A resumed stream
        # starts from the language its client last heard (`resume_language`), as if never interrupted.
        self.heard_language: str | None = opened.resume_language or None
        self.ending = False
        self.closed = False
        self.abandoned = False  # its connection is closed: see abandon
        self.close_reason = "end"
        self.refused_at_shutdown = False  # audio refused since a shutdown ended the stream: its client must resume
        self.wind_down_by: float | None = None  # a drain began: end at the next pause, at the latest then (see wind_down)
        self.last_activity = time.monotonic()
        self.opened_at = self.last_activity
        self.acked_frames = 0
        self.acked_window = 0
        self.resent = False  # a resend of accepted audio came in: the next due_ack answers it
        self.stats = {"partials": 0, "finals": 0, "refused": 0, "errors": 0}
        self.refused_from: int | None = None  # seq of the first refused frame the client has not resent yet
        self.outbox: list[m.ServerMessage] = []  # events for the client
        self.jobs_out: list[Job] = []  # jobs for the broker
        self.inflight: dict[int, Job] = {}
        self._update_protection()

    # ------------------------------------------------------------------ audio in

    def _resampled(self, frames: int) -> int:
        """16 kHz samples that `frames` input frames make, rounded up."""
        return -(-frames * SAMPLE_RATE // self.rate)

    def held(self) -> int:
        """16 kHz samples the resampler still owes for audio already accepted.

        The resampler's output never runs ahead of its input, rounded up, so this is never
        negative, and no call (the final flush included) returns more than its own frames'
        share, rounded up, plus this. soxr releases output in blocks (~1660 samples at 8 kHz),
        so a room check that counted only the frame's share would let a block overrun the ring
        after the resampler had consumed the frame.
        """
        return self._resampled(self.in_frames) - self.ring.written

    def _room(self, frames: int) -> int:
        """Ring samples a frame needs free: the most the resampler can return for it, and margin.

        Every accepted frame so leaves room for what the resampler still holds: end()'s flush fits.
        """
        return self._resampled(frames) + self.held() + 1 + ROOM_MARGIN  # 1: slack for the rounding

    def window(self) -> int:
        """Input frame index the client may send up to: what still fits in the ring.

        Frames sent within it, in messages of any size, all pass `_room`: what the messages
        before the last took from the room, plus the last one's check, comes to at most the
        frames' share plus 3 samples of rounding and ROOM_MARGIN, which WINDOW_HEADROOM exceeds.
        """
        free_out = self.ring.free_space() - self.held() - WINDOW_HEADROOM
        return self.offset + self.in_frames + max(0, free_out * self.rate // SAMPLE_RATE)

    def accept_audio(self, msg: m.Audio) -> bool:
        """Take one audio frame; False means it was refused (an error is in the outbox)."""
        self.last_activity = time.monotonic()
        if self.ending:
            # the client may have sent no `end`: the service ends a stream at a shutdown, and one idle too long
            if self.close_reason == "shutdown":
                self.refused_at_shutdown = True
                return self._refuse(m.NOT_READY, "the service is shutting down: the stream was ended at the audio "
                                                 "taken before, which is being transcribed", msg.seq)
            if self.close_reason == "idle_timeout":
                return self._refuse(m.BAD_MESSAGE, f"audio after the stream was ended: none came for "
                                                   f"{self.cfg.ingest.idle_timeout_s:g} s (ingest.idle_timeout_s)", msg.seq)
            return self._refuse(m.BAD_MESSAGE, "audio after end", msg.seq)
        if msg.seq < self.next_seq:
            self.resent = True  # a resend of audio already accepted: acknowledge, do not store twice
            return True
        if msg.seq > self.next_seq:
            return self._refuse(m.OUT_OF_ORDER, f"expected seq {self.next_seq}, got {msg.seq}", msg.seq)
        nbytes = len(msg.data)
        if nbytes % self.bytes_per_frame:
            return self._refuse(m.BAD_FORMAT, f"{nbytes} bytes is not a whole number of {self.bytes_per_frame}-byte frames", msg.seq)
        frames = nbytes // self.bytes_per_frame
        # checked before the resampler sees the frame: once it has, the frame must be accepted
        if self._room(frames) > self.ring.free_space():
            self.stats["refused"] += 1
            self._cut_if_jammed()
            return self._refuse(m.OVERLOADED, "stream buffer full: the service is behind; resend this frame after the next ack", msg.seq)
        if self.direct_s16:
            self.ring.write(np.frombuffer(msg.data, dtype="<i2"), scale=S16_SCALE)
        else:
            if self.pcm is not None and (size := buffer_len(frames, self.opened.channels, self.opened.encoding)) > len(self.pcm):
                self.pcm = np.empty(size, np.float32)
            try:
                pcm = decode_pcm(msg.data, self.opened.encoding, self.opened.channels, out=self.pcm)
            except AudioFormatError as exc:
                return self._refuse(m.BAD_FORMAT, str(exc), msg.seq)
            self.ring.write(self.resampler.process(pcm))
        self.next_seq += 1
        self.refused_from = None
        self.in_frames += frames
        self.largest = max(self.largest, frames)
        return True

    def _cut_if_jammed(self) -> None:
        """A message found no room, the ring holds nothing older than the open segment, and the
        VAD has classified every whole chunk: no room comes until that segment ends, and the VAD
        cannot end it without audio that does not fit (messages a realtime client sends at its
        own pace, larger than what is left beyond `max_segment_s`). Cut it where the VAD has
        got, as at `max_segment_s`: its final frees the room, and the refused message is taken
        when resent. Speech begun but not yet a segment (a burst the VAD has not ruled on: too
        short so far, or a pause too short after it) holds the ring the same way, and is cut
        as a segment of its own."""
        if not self.segmenter.active or self.vad_chunk_due(VAD_CHUNK):
            return
        start = self.segmenter.earliest_start  # the open segment's start, or the burst's less the pad
        if self._needed_from() < start:  # an earlier segment's final frees room first
            return
        seg = self.open_segment
        self.log.info("ingest.segment_cut_for_room", seg=seg.index if seg is not None else self.next_segment,
                      seconds=round((self.vad_pos - start) / SAMPLE_RATE, 3))
        for ev in self.segmenter.cut():
            self._on_segment_event(ev)

    def _refuse(self, code: str, message: str, seq: int) -> bool:
        if code == m.OVERLOADED and self.refused_from is None:
            self.refused_from = seq
        self.stats["errors"] += 1
        self.metrics.inc("refusals_total", code=code)
        if (suppressed := self.throttle(code)) is not None:
            self.log.warning("ingest.audio_refused", code=code, seq=seq, reason=message, suppressed=suppressed)
        self.outbox.append(m.ErrorMsg(code=code, message=message, stream=self.opened.stream, seq=seq))
        return False

    def tell_untold(self) -> None:
        """As the stream goes: the refused frames its `ingest.audio_refused` lines have not told."""
        self.throttle.tell_untold(self.log, lambda code: {"code": code})

    def client_end(self) -> None:
        """The client's `end`: refused while audio it was told to resend is still missing."""
        if self.ending:
            # ended by a shutdown first: with nothing refused since, all the client sent was taken,
            # and its stream ends as it asked (a client resumes one closed "shutdown")
            if self.close_reason == "shutdown" and not self.refused_at_shutdown and self.refused_from is None:
                self.close_reason = "end"
            return
        if self.refused_from is not None:
            self.metrics.inc("refusals_total", code=m.OVERLOADED)
            self.outbox.append(m.ErrorMsg(code=m.OVERLOADED, stream=self.opened.stream, seq=self.refused_from,
                                          message=f"end refused: audio from seq {self.refused_from} was refused and not "
                                                  "resent yet; resend it, then end"))
            return
        self.end()

    def wind_down(self, by: float) -> None:
        """A drain began (a restart, a deploy, a stop): end the stream at its next pause, or at `by`.

        Ended at once, a stream speaking would have its utterance finalised at the cut, and the
        resumed stream would transcribe the rest of it alone: the words either side come out
        worse. So it takes audio as usual until the VAD finds no segment open, or starting, in
        all it took; then it ends there, and its client resumes elsewhere from silence.
        """
        if not self.ending:
            self.wind_down_by = by

    def pause_wait_over(self, now: float) -> bool:
        """A winding-down stream found no pause by its deadline: it ends at the cut (see wind_down)."""
        return self.wind_down_by is not None and not self.ending and now >= self.wind_down_by

    def _wound_down(self) -> bool:
        """Whether a winding-down stream is due to end now (see wind_down)."""
        if self.wind_down_by is None or self.ending:
            return False
        if not self.segmenter.active and not self.vad_chunk_due(VAD_CHUNK):
            return True
        if not self.pause_wait_over(time.monotonic()):
            return False
        if self.segmenter.active:
            self.log.info("ingest.segment_cut_at_shutdown", seconds=round((self.vad_pos - self.segmenter.earliest_start) / SAMPLE_RATE, 3))
        return True

    def end(self, reason: str = "end") -> None:
        """No more audio: flush the resampler and close the open segment."""
        if self.ending:
            return
        self.ending = True
        self.close_reason = reason
        tail = self.resampler.process(np.zeros(0, np.float32), last=True)
        if len(tail) <= self.ring.free_space():
            if len(tail):
                self.ring.write(tail)
            return
        # accept_audio keeps room for the flush, so this should not happen: never drop it silently
        self.stats["errors"] += 1
        self.metrics.inc("errors_total", code=m.INTERNAL)
        self.log.error("ingest.tail_lost", samples=len(tail), free=self.ring.free_space())
        self.outbox.append(m.ErrorMsg(code=m.INTERNAL, stream=self.opened.stream,
                                      message=f"the last {len(tail) / SAMPLE_RATE:.3f} s of audio of stream "
                                              f"{self.opened.stream!r} did not fit its buffer and was lost"))

    # ------------------------------------------------------------------ VAD

    def vad_chunk_due(self, chunk: int) -> bool:
        return self.ring.written - self.vad_pos >= chunk

    def vad_decisive(self, chunk: int) -> bool:
        """The whole chunks waiting for the VAD could start or end a segment (see Segmenter.may_decide)."""
        pending = (self.ring.written - self.vad_pos) // chunk * chunk
        return pending > 0 and self.segmenter.may_decide(pending)

    def on_vad(self, prob: float, chunk: int) -> None:
        if self.abandoned:  # a round already under way: no segment may start or end, nor a final go out
            return
        self.vad_pos += chunk
        for ev in self.segmenter.push(prob, self.vad_pos):
            self._on_segment_event(ev)

    def step(self) -> None:
        """Called once per loop iteration in which this stream changed: due partials, end of stream.

        A partial covers all the audio received, not only what the VAD has classified: the VAD
        decides where segments start and end, and a partial need not wait for it.
        """
        if self.abandoned:
            self._maybe_close()
            return
        if self._wound_down():
            self.end("shutdown")
        seg = self.open_segment
        interval = self.cfg.ingest.partial_interval_ms * SAMPLE_RATE // 1000
        written = self.ring.written
        if seg is not None and self.opened.partials and written - seg.last_partial_end >= interval:
            seg.last_partial_end = written
            self._submit(seg, final=False, end=written)
        if self.ending and not self.vad_chunk_due(VAD_CHUNK):
            for ev in self.segmenter.flush(self.ring.written):
                self._on_segment_event(ev)
            self.vad_pos = self.ring.written
        self._update_protection()
        self._maybe_close()

    def _on_segment_event(self, ev: SegmentEvent) -> None:
        if ev.kind == "start":
            seg = _Segment(index=self.next_segment, start=ev.start, last_partial_end=ev.start)
            self.next_segment += 1
            self.segments[seg.index] = seg
            self.open_segment = seg
        elif ev.kind == "end" and self.open_segment is not None:
            seg = self.open_segment
            seg.end = min(ev.end, self.ring.written)
            self.open_segment = None
            self._submit_due_finals()

    # ------------------------------------------------------------------ jobs

    def _submit(self, seg: _Segment, final: bool, end: int) -> None:
        now = time.monotonic()
        deadline_ms = self.cfg.broker.final_deadline_ms if final else self.cfg.broker.partial_deadline_ms
        prompt = " ".join(p for p in (self.opened.prompt, self.previous_text[-PROMPT_CHARS:]) if p) or None
        job = Job(
            job_id=next(_job_ids),
            ingest=self.ingest_index,
            stream=self.key,
            shm=self.shm_name,
            slot=self.ring.slot,
            generation=self.ring.generation,
            start=seg.start,
            end=end,
            final=final,
            priority=self.priority,
            deadline=now + deadline_ms / 1000,
            seg=seg.index,
            language=self.opened.language if final else self.opened.language or self.heard_language,
            prompt=prompt,
            prefix=None if final else seg.stabilizer.committed or None,  # a final is decoded free: see stabilizer
            created=now,
            first=not final and seg.partials_submitted == 0,
        )
        if final:
            seg.final_job = job.job_id
        else:
            seg.partials_submitted += 1
        self.inflight[job.job_id] = job
        self.jobs_out.append(job)

    def on_result(self, res: JobResult) -> None:
        job = self.inflight.pop(res.job_id, None)
        if job is None:
            return  # a job of an earlier stream under the same key (duplicates stop at the server)
        if self.abandoned:  # nobody to show it to: no retry, no next final
            self._maybe_close()
            return
        now = time.monotonic()
        if job.created and res.status == OK:  # a result: a partial skipped as stale, or a failure, has no latency to show
            self.metrics.observe("final_latency_seconds" if job.final else "partial_latency_seconds", now - job.created)
            if res.started:  # where its latency went
                self.metrics.observe("job_transit_seconds", res.started - job.created, leg="to_worker")
                self.metrics.observe("job_transit_seconds", now - res.finished, leg="to_ingest")
        seg = self.segments.get(job.seg)
        if job.final:
            self._on_final(job, res, seg)
        elif res.status == OK and seg is not None and seg is self.open_segment and job.end > seg.shown_end:
            seg.shown_end = job.end
            seg.language = res.language or None
            text, stable = seg.stabilizer.update("" if self._hallucinated(res) else res.text.strip())
            self.stats["partials"] += 1
            self.outbox.append(m.Partial(stream=self.opened.stream, seg=seg.index, text=text, stable=stable,
                                         start=self._time(seg.start), end=self._time(job.end), language=seg.language))
        elif res.status == FAILED:
            self.metrics.inc("errors_total", code=m.INTERNAL)
            self.log.warning("ingest.partial_failed", job=res.job_id, error=res.error)
        self._update_protection()
        self._maybe_close()

    def _on_final(self, job: Job, res: JobResult, seg: _Segment | None) -> None:
        assert seg is not None
        if res.status != OK:
            # finals are never skipped: retry, then tell the client rather than drop the segment silently
            if res.status == FAILED and seg.retries < FINAL_RETRIES:
                seg.retries += 1
                self.log.warning("ingest.final_retry", job=res.job_id, error=res.error, seg=seg.index)
                self._submit(seg, final=True, end=job.end)
                return
            self.metrics.inc("errors_total", code=m.INTERNAL)
            self.log.error("ingest.final_failed", job=res.job_id, error=res.error, status=res.status, seg=seg.index)
            self.stats["errors"] += 1
            self.outbox.append(m.ErrorMsg(code=m.INTERNAL, stream=self.opened.stream,
                                          message=f"segment {seg.index} could not be transcribed: {res.error}"))
            # what two partial decodes agreed on is the best transcript left: a caption keeps it
            seg.result = m.Final(stream=self.opened.stream, seg=seg.index, text=seg.stabilizer.committed,
                                 start=self._time(seg.start), end=self._time(job.end), language=seg.language)
        else:
            if self._hallucinated(res):  # dropped, and with it what the partials had marked stable
                text, revised = "", bool(seg.stabilizer.committed)
            else:
                text, revised = seg.stabilizer.finalize(res.text.strip())
                if res.text.strip() and res.language:  # words heard: their language is the stream's partials' from now on
                    self.heard_language = res.language
            if revised:
                self.metrics.inc("finals_revised_total")
            seg.result = m.Final(stream=self.opened.stream, seg=seg.index, text=text, start=self._time(seg.start),
                                 end=self._time(job.end), avg_logprob=res.avg_logprob, no_speech_prob=res.no_speech_prob,
                                 revised=revised, language=res.language or None, parts=self._parts(seg, job, res, text),
                                 words=self._words(seg, job, res, text))
        # finals leave in segment order even when workers finish them out of order
        while self.next_final in self.segments and self.segments[self.next_final].result is not None:
            done = self.segments.pop(self.next_final)
            self.next_final += 1
            # one final per segment, even empty (noise, or a failed decode): it voids the segment's partials
            if done.result.text:
                self.previous_text = done.result.text  # an empty final leaves the prompt as it was
            self.stats["finals"] += 1
            done.result.durable = self.durable()  # after the pop: this segment no longer holds it back
            self.outbox.append(done.result)
        self._submit_due_finals()

    def _submit_due_finals(self) -> None:
        """Submit the next segment's final decode once that segment has ended and the one before is out.

        A final is prompted with the previous final's text, so its decode waits until that text
        is out: the prompt — and the transcript — never depends on timing, so a slow or killed
        worker or a broker restart cannot change a final, and a file gives the same finals
        whether it is sent in real time or as a batch. Finals of a realtime stream are seconds
        apart, so this rarely waits at all; a batch stream's finals decode one after another,
        and many batch streams keep the workers busy together.
        """
        seg = self.segments.get(self.next_final)
        if seg is not None and seg.end is not None and seg.final_job is None and seg.result is None:
            self._submit(seg, final=True, end=seg.end)

    def _parts(self, seg: _Segment, job: Job, res: JobResult, text: str) -> list[list[Any]] | None:
        """The decode's own segments, in the stream's seconds within the final's span, when the
        final's text is the decode's (not the partials' committed words it kept instead)."""
        if not text or not res.text.strip():
            return None
        if not all(_segment_row(row) for row in res.segments):  # a worker of another build: the final goes without parts
            self.log.warning("ingest.final_parts_unreadable", job=res.job_id, seg=seg.index, segments=repr(res.segments)[:200])
            return None
        parts = self._on_stream_clock(seg, job, res.segments)
        return [[start, end, text.strip()] for start, end, text in parts if text.strip()] or None

    def _words(self, seg: _Segment, job: Job, res: JobResult, text: str) -> list[list[Any]] | None:
        """The decode's timed words, in the stream's seconds within the final's span, when the
        final's text is the decode's, as its parts."""
        if not text or not res.text.strip() or not res.words:
            return None
        if not all(_segment_row(row) for row in res.words):  # a worker of another build: the final goes without words
            self.log.warning("ingest.final_words_unreadable", job=res.job_id, seg=seg.index, words=repr(res.words)[:200])
            return None
        return self._on_stream_clock(seg, job, res.words)

    def _on_stream_clock(self, seg: _Segment, job: Job, rows: list[Any]) -> list[list[Any]]:
        """A decode's [start, end, text] rows (its segments, its words), timed in the final's
        audio, in the stream's seconds (to the millisecond) within the final's span."""
        start, end = self._time(seg.start), self._time(job.end)
        return [[round(min(start + a, end), 3), round(min(start + b, end), 3), text] for a, b, text in rows]

    @staticmethod
    def _hallucinated(res: JobResult) -> bool:
        """Whisper's own test for text decoded from no speech (noise, breath, music)."""
        return res.no_speech_prob > NO_SPEECH_PROB and res.avg_logprob < LOGPROB_FLOOR

    def _time(self, sample: int) -> float:
        """Seconds from the start of the original stream (a resumed one continues its times)."""
        return self.offset_s + sample / SAMPLE_RATE

    def _needed_from(self) -> int:
        """Oldest 16 kHz sample that an undelivered final or a future segment can still need."""
        starts = [s.start for s in self.segments.values()]
        starts.append(self.segmenter.earliest_start)
        return min(starts)

    def durable(self) -> int:
        """Input frame before which the client's audio is never needed again.

        The same point the ring may overwrite up to: every segment touching earlier audio has
        had its final delivered and the VAD is outside speech there, so a stream resumed at it
        (Open.offset) neither repeats nor loses a final. Rounded down to the VAD's chunk grid so the
        resumed stream's VAD sees the same chunks, and so finds the same segments.
        """
        return self.offset + self._needed_from() // VAD_CHUNK * VAD_CHUNK * self.rate // SAMPLE_RATE

    def _update_protection(self) -> None:
        """The ring may overwrite only audio that no pending job and no future segment can need:
        a partial still decoding when its segment's final came first reads that audio too, and
        would fail as overwritten (a false internal error) if a batch client's audio took it."""
        oldest = self._needed_from()
        for job in self.inflight.values():
            oldest = min(oldest, job.start)
        self.ring.protected_from = oldest

    # ------------------------------------------------------------------ acks and close

    def due_ack(self) -> m.Ack | None:
        """An ack when enough audio arrived or the window moved; few messages, but never a stalled batch client."""
        window = self.window()
        if self.resent or self.in_frames - self.acked_frames >= self.rate // 10 or window - self.acked_window >= self.rate // 2 or (
            self.in_frames > self.acked_frames and window <= self.offset + self.in_frames + self.rate // 10
        ):
            self.resent = False
            self.acked_frames = self.in_frames
            self.acked_window = window
            return m.Ack(stream=self.opened.stream, seq=self.next_seq - 1, samples=self.offset + self.in_frames, window=window,
                         durable=self.durable())
        return None

    def ack_again(self) -> None:
        """Make the next `due_ack` go out though nothing moved, as for a resend: nothing new to a
        client still there, and a send that fails on a closed connection."""
        self.resent = True

    def check_idle(self, now: float) -> bool:
        """Whether the client sent no audio for `ingest.idle_timeout_s` while it had room to: it is gone.

        A batch client whose next message does not fit the window it was told of waits for the
        service, as long as the finals that free its ring wait behind others' (longer than the
        timeout, under load): that time is not the client's, so its clock starts again from `now`
        while it waits, up to 1 s of room. It waits only while the service owes the stream
        something that frees room (a decode, a VAD verdict): owed nothing, the window moves
        only with more audio, a smaller message fits, and a client that sends none is gone.
        """
        # what will move the window: a decode, a segment ended and waiting for its final, a VAD verdict
        owed = self.inflight or any(seg.end is not None for seg in self.segments.values()) or self.vad_chunk_due(VAD_CHUNK)
        if owed and self.acked_window - (self.offset + self.in_frames) < min(self.largest, self.rate):
            self.last_activity = now
            return False
        return now - self.last_activity > self.cfg.ingest.idle_timeout_s

    def abandon(self) -> None:
        """Its connection is closed (the client resumed elsewhere, or died): nothing it decodes can
        reach anyone. No job, message or VAD verdict is made from here on; the stream closes once
        the jobs already out are answered, since until then a worker may be reading its ring,
        which the next stream would otherwise be given at once."""
        self.abandoned = self.ending = True
        self.close_reason = "client_gone"
        self.vad_pos = self.ring.written  # nothing left to classify: its ring takes no more audio
        self._maybe_close()

    def _maybe_close(self) -> None:
        if self.abandoned:
            self.closed = self.closed or not self.inflight
            return
        if self.closed or not self.ending or self.open_segment is not None or self.inflight or self.segments:
            return
        if self.vad_chunk_due(VAD_CHUNK):
            return
        self.closed = True
        figures = self.figures()
        # Ended by a shutdown, the stream resumes elsewhere from `durable`. All it took would skip
        # its last part of a VAD chunk (and, at other rates, what the resampler held): a word begun
        # there lost its onset. From the point a future segment could start at, with its pad, the
        # resumed stream hears it whole.
        durable = self.durable() if self.close_reason == "shutdown" else self.offset + self.in_frames
        self.outbox.append(self.closed_message(self.close_reason, durable=durable))
        self.log.info("ingest.stream_closed", reason=self.close_reason, **figures)

    def closed_message(self, reason: str, durable: int) -> m.Closed:
        """`closed` with what this connection took and sent; `durable`: all of it once every final is out."""
        return m.Closed(stream=self.opened.stream, reason=reason, audio_s=round(self.in_frames / self.rate, 3),
                        segments=self.stats["finals"], durable=durable)

    def figures(self) -> dict[str, object]:
        return {
            "audio_s": round(self.in_frames / self.rate, 3),
            "wall_s": round(time.monotonic() - self.opened_at, 3),
            "segments": self.next_segment,
            "priority": self.opened.priority,
            "rate": self.rate,
            **self.stats,
        }
