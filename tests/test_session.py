"""One stream's Session over a real shm ring, driven by hand: no server, broker or workers."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from structlog.testing import capture_logs

from broker.jobs import EXPIRED, FAILED, OK, JobResult
from config import settings
from ingest.audio import Resampler, decode_pcm
from ingest.session import SAMPLE_RATE, Session
from ingest.vad import CHUNK
from metrics.registry import ProcessMetrics
from protocol import messages as m
from shm import RingPool, reclaim

CAPACITY = SAMPLE_RATE  # a 1 s ring: a few seconds of audio cycle through it


def rings(capacity: int) -> Iterator[RingPool]:
    instance = f"test{uuid.uuid4().hex[:12]}"
    p = RingPool.create(f"streamasr.{instance}.ingest0", slots=2, capacity=capacity)
    p.unlink()  # the mapping stays
    yield p
    p.close()
    reclaim(instance)


@pytest.fixture
def pool() -> Iterator[RingPool]:
    yield from rings(CAPACITY)


@pytest.fixture
def long_pool() -> Iterator[RingPool]:
    """Rings that hold a few segments without a broker to release them."""
    yield from rings(10 * SAMPLE_RATE)


CFG = settings.load(None)
METRICS = ProcessMetrics(CFG, "ingest")


def session(pool: RingPool, **opened: Any) -> Session:
    return Session("c/s", b"c", m.Open(stream="s", **opened), pool.acquire(), CFG, 0, pool.name, METRICS)


def tone(frames: int, rate: int, start: int = 0) -> bytes:
    """16-bit mono audio, continuous from frame to frame when `start` follows on."""
    t = np.arange(start, start + frames) / rate
    return (8000 * np.sin(2 * np.pi * 220 * t) + 2000 * np.sin(2 * np.pi * 1330 * t)).astype("<i2").tobytes()


def errors(s: Session) -> list[m.ErrorMsg]:
    return [msg for msg in s.outbox if isinstance(msg, m.ErrorMsg)]


def owed(s: Session) -> int:
    """16 kHz samples the resampler still holds for the audio accepted (output lags, never leads)."""
    return -(-s.in_frames * SAMPLE_RATE // s.rate) - s.ring.written


def resampled(rate: int, frames: list[bytes]) -> np.ndarray:
    """What the ring must hold for these accepted frames: the same chunks through a fresh resampler."""
    r = Resampler(rate)
    parts = [r.process(decode_pcm(f, "pcm_s16le", 1)) for f in frames]
    parts.append(r.process(np.zeros(0, np.float32), last=True))
    return np.concatenate(parts)


# ------------------------------------------------------------------ resampled audio and the ring


@pytest.mark.parametrize("frame_ms", [10, 20])
@pytest.mark.parametrize("rate", [8000, 44100])
def test_a_realtime_stream_filling_its_ring_is_refused_overloaded_and_loses_nothing(pool: RingPool, rate: int,
                                                                                   frame_ms: int) -> None:
    """soxr releases its output in blocks: the room check counts what it still holds, so a full
    ring refuses the frame (`overloaded`, its seq) before the resampler takes it, never overruns."""
    s = session(pool, rate=rate)
    n = rate * frame_ms // 1000
    accepted: list[bytes] = []
    seq = 0
    while True:
        frame = tone(n, rate, start=seq * n)
        if not s.accept_audio(m.Audio(stream="s", seq=seq, data=frame)):
            break
        accepted.append(frame)
        assert s.ring.free_space() >= owed(s)  # room left for what the resampler owes
        seq += 1
    [err] = errors(s)
    assert (err.code, err.stream, err.seq) == (m.OVERLOADED, "s", seq)
    assert s.next_seq == seq and s.in_frames == seq * n
    assert s.ring.written > CAPACITY // 2  # the ring was filled, not refused early
    s.end()
    assert errors(s) == [err]  # nothing more: the whole remainder fit
    expected = resampled(rate, accepted)
    assert s.ring.written == len(expected)
    np.testing.assert_array_equal(s.ring.view(0, s.ring.written), expected)


@pytest.mark.parametrize("frame_ms", [10, 20])
@pytest.mark.parametrize("rate", [8000, 44100])
def test_a_realtime_stream_resending_after_refusals_keeps_every_sample(pool: RingPool, rate: int, frame_ms: int) -> None:
    """Several seconds through a 1 s ring: each refused frame is resent once room frees up, and
    the ring ends up holding the resampled audio of exactly the frames accepted, once each."""
    s = session(pool, rate=rate)
    n = rate * frame_ms // 1000
    accepted: list[bytes] = []
    seq = refusals = 0
    while seq * n < 4 * rate:
        frame = tone(n, rate, start=seq * n)
        if s.accept_audio(m.Audio(stream="s", seq=seq, data=frame)):
            accepted.append(frame)
            assert s.ring.free_space() >= owed(s)
            seq += 1
            continue
        err = s.outbox.pop()
        assert (err.code, err.stream, err.seq) == (m.OVERLOADED, "s", seq), err
        refusals += 1
        s.ring.protected_from = s.ring.written - CAPACITY // 4  # the service catches up on all but 250 ms
    assert refusals >= 3 and errors(s) == []
    s.end()
    assert errors(s) == []
    expected = resampled(rate, accepted)
    assert s.ring.written == len(expected)
    np.testing.assert_array_equal(s.ring.view(s.ring.written - CAPACITY // 2, s.ring.written), expected[-CAPACITY // 2:])


@pytest.mark.parametrize("frame_ms", [10, 20, 100])
@pytest.mark.parametrize("rate", [8000, 44100])
def test_a_batch_stream_inside_its_window_is_never_refused(pool: RingPool, rate: int, frame_ms: int) -> None:
    """A batch client sends up to the window and no further (shortening the message that would
    cross it), then waits for the window to move: none of its messages may be refused. The
    service frees the ring a few VAD chunks at a time, so the client meets the window at many
    different points of the resampler's blocks."""
    rng = np.random.default_rng(rate + frame_ms)
    s = session(pool, rate=rate, priority="batch")
    n = rate * frame_ms // 1000
    accepted: list[bytes] = []
    window, sent, seq, waits = s.window(), 0, 0, 0
    while sent < 10 * rate:
        k = min(n, window - sent)
        if k <= 0:  # at the window: the service consumes some of the ring, the window moves
            waits += 1
            s.ring.protected_from = min(s.ring.written, s.ring.protected_from + int(rng.integers(1, 16)) * CHUNK)
            window = max(window, s.window())
            continue
        frame = tone(k, rate, start=sent)
        assert s.accept_audio(m.Audio(stream="s", seq=seq, data=frame)), errors(s)
        accepted.append(frame)
        sent, seq = sent + k, seq + 1
    assert waits >= 10 and errors(s) == []
    s.end()
    assert errors(s) == [] and s.ring.written == len(resampled(rate, accepted))


@pytest.mark.parametrize(("reason", "code", "says"), [
    ("end", m.BAD_MESSAGE, "audio after end"),
    ("shutdown", m.NOT_READY, "the service is shutting down"),
    ("idle_timeout", m.BAD_MESSAGE, "none came for 30 s (ingest.idle_timeout_s)"),
])
def test_audio_after_the_stream_ended_is_refused_saying_who_ended_it(pool: RingPool, reason: str, code: str, says: str) -> None:
    """Only the first is the client's own doing: a shutdown or the idle timeout ended the others,
    and the refusal must not read as if the client had sent `end` before its audio."""
    s = session(pool)
    assert s.accept_audio(m.Audio(stream="s", seq=0, data=tone(1600, 16000)))
    s.end(reason)
    assert not s.accept_audio(m.Audio(stream="s", seq=1, data=tone(1600, 16000, 1600)))
    [err] = errors(s)
    assert (err.code, err.stream, err.seq) == (code, "s", 1) and says in err.message, err


class Talker:
    """A client sending 32 ms frames of 16 kHz audio, each classified by the VAD as it arrives."""

    def __init__(self, s: Session) -> None:
        self.s = s
        self.seq = 0

    def say(self, prob: float, chunks: int) -> None:
        for _ in range(chunks):
            self.send()
            self.s.on_vad(prob, CHUNK)
            self.s.step()

    def send(self) -> bool:
        taken = self.s.accept_audio(m.Audio(stream="s", seq=self.seq, data=tone(CHUNK, 16000, start=self.seq * CHUNK)))
        self.seq += taken
        return taken


def test_a_drain_ends_a_speaking_stream_at_its_next_pause(long_pool: RingPool) -> None:
    """Ended at the drain, the utterance under way would be finalised at the cut and the rest of it
    transcribed alone where the stream resumes. It takes audio on until the pause instead."""
    s = session(long_pool)
    talk = Talker(s)
    talk.say(0.9, 20)
    assert s.open_segment is not None
    s.wind_down(time.monotonic() + 60)
    talk.say(0.9, 20)  # still speaking: every frame taken
    talk.say(0.05, 15)  # 0.48 s of pause, under min_silence_ms
    assert not s.ending and errors(s) == []
    talk.say(0.05, 1)  # the pause ends the segment, and the stream with it
    assert s.ending and s.close_reason == "shutdown"
    [final] = [j for j in s.jobs_out if j.final]
    assert (final.start, final.end) == (0, 40 * CHUNK + CFG.vad.pad_ms * 16)  # whole, its pad after it
    assert not talk.send()
    [err] = errors(s)
    assert err.code == m.NOT_READY and err.seq == 56


def test_a_drain_ends_a_silent_stream_at_once_and_a_speaking_one_when_its_wait_runs_out(long_pool: RingPool) -> None:
    quiet, speaking = session(long_pool), session(long_pool)
    Talker(quiet).say(0.05, 10)
    Talker(speaking).say(0.9, 20)
    for s in (quiet, speaking):
        s.wind_down(time.monotonic() + 60)
        s.step()
    assert quiet.ending and quiet.close_reason == "shutdown" and not speaking.ending
    speaking.wind_down(time.monotonic())  # its wait for a pause runs out
    with capture_logs() as logs:
        speaking.step()
    assert speaking.ending and speaking.close_reason == "shutdown"
    assert [e["seconds"] for e in logs if e["event"] == "ingest.segment_cut_at_shutdown"] == [0.64]
    [final] = [j for j in speaking.jobs_out if j.final]
    assert (final.start, final.end) == (0, 20 * CHUNK)  # cut where the audio stops


def test_a_stream_a_drain_ends_resumes_from_before_the_audio_its_vad_never_heard(long_pool: RingPool) -> None:
    """The VAD takes whole 32 ms chunks, so a drain ends a quiet stream with the last part of one
    never classified. `closed` said all the audio was durable, so the stream resumed after it: a
    word begun there had its onset heard nowhere. A resume from `durable` hears it again, with the
    pad a segment opens with before it."""
    s = session(long_pool)
    talk = Talker(s)
    talk.say(0.05, 30)
    assert s.accept_audio(m.Audio(stream="s", seq=talk.seq, data=tone(CHUNK // 2, 16000, start=talk.seq * CHUNK)))
    s.wind_down(time.monotonic() + 60)
    s.step()
    s.step()
    [closed] = [msg for msg in s.outbox if isinstance(msg, m.Closed)]
    classified = 30 * CHUNK  # the rest, half a chunk, was taken to go on as the stream did: quiet
    assert closed.reason == "shutdown" and s.in_frames == classified + CHUNK // 2
    assert closed.durable <= classified - CFG.vad.pad_ms * 16


def test_a_client_s_end_while_its_stream_winds_down_ends_it_as_asked(long_pool: RingPool) -> None:
    s = session(long_pool)
    Talker(s).say(0.9, 20)
    s.wind_down(time.monotonic() + 60)
    s.client_end()
    assert s.ending and s.close_reason == "end"


def test_end_writes_the_whole_remainder_of_a_full_ring(pool: RingPool) -> None:
    """A ring filled to refusal with 100 ms frames, then with smaller ones: the resampler still
    holds a block, and end() writes all of it."""
    rate = 8000
    s = session(pool, rate=rate)
    accepted: list[bytes] = []
    seq = 0
    for n in (800, 160, 40):
        while s.accept_audio(m.Audio(stream="s", seq=seq, data=(frame := tone(n, rate, start=s.in_frames)))):
            accepted.append(frame)
            seq += 1
        s.outbox.clear()
        s.refused_from = None  # the client gives up on that message and sends smaller ones
    assert owed(s) > 0
    s.end()
    assert errors(s) == []
    expected = resampled(rate, accepted)
    assert s.ring.written == len(expected) == -(-s.in_frames * SAMPLE_RATE // rate)
    np.testing.assert_array_equal(s.ring.view(0, s.ring.written), expected)


def test_a_remainder_that_cannot_fit_is_reported_not_dropped(pool: RingPool) -> None:
    """accept_audio keeps room for the resampler's remainder; should the ring ever lack it
    anyway, end() says so to the client and in the log."""
    s = session(pool, rate=8000)
    for seq in range(3):
        assert s.accept_audio(m.Audio(stream="s", seq=seq, data=tone(160, 8000, start=160 * seq)))
    held = owed(s)
    assert held > 0
    s.ring.protected_from = s.ring.written - s.ring.capacity + held // 2  # room for half of it
    with capture_logs() as logs:
        s.end()
    [err] = errors(s)
    assert (err.code, err.stream) == (m.INTERNAL, "s") and "'s'" in err.message
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["ingest.tail_lost"]


def test_a_frame_refused_for_room_is_not_fed_to_the_resampler(pool: RingPool) -> None:
    """The refused frame, resent, goes through the resampler once: its audio appears once."""
    s = session(pool, rate=8000)
    frames = [tone(160, 8000, start=160 * i) for i in range(100)]
    seq = 0
    while s.accept_audio(m.Audio(stream="s", seq=seq, data=frames[seq])):
        seq += 1
    s.outbox.clear()
    s.ring.protected_from = s.ring.written  # all consumed
    assert s.accept_audio(m.Audio(stream="s", seq=seq, data=frames[seq]))
    s.end()
    assert s.ring.written == len(resampled(8000, frames[: seq + 1]))


# ------------------------------------------------------------------ f32le bounds


def test_stereo_f32_that_would_mix_down_to_infinity_is_refused(pool: RingPool) -> None:
    s = session(pool, encoding="f32le", channels=2)
    for value in (3e38, -3e38):
        assert not s.accept_audio(m.Audio(stream="s", seq=0, data=np.full((CHUNK, 2), value, "<f4").tobytes()))
        [err] = errors(s)
        assert (err.code, err.seq) == (m.BAD_FORMAT, 0) and f"{m.MAX_F32_SAMPLE:g}" in err.message
        s.outbox.clear()
    assert s.ring.written == 0 and s.in_frames == 0


def test_huge_f32_at_44k_is_refused_before_the_resampler(pool: RingPool) -> None:
    s = session(pool, encoding="f32le", rate=44100)
    x = np.full(4410, 3e38, "<f4")
    x[::2] *= -1
    assert not s.accept_audio(m.Audio(stream="s", seq=0, data=x.tobytes()))
    [err] = errors(s)
    assert (err.code, err.seq) == (m.BAD_FORMAT, 0)
    s.outbox.clear()
    # overshoot past full scale is audio all the same
    loud = np.full(4410, 2.5, "<f4")
    loud[::2] *= -1
    for seq in range(4):
        assert s.accept_audio(m.Audio(stream="s", seq=seq, data=loud.tobytes()))
    s.end()
    audio = s.ring.view(0, s.ring.written)
    assert errors(s) == [] and np.isfinite(audio).all() and np.abs(audio).max() < 2 * m.MAX_F32_SAMPLE


# ------------------------------------------------------------------ finals


def feed(s: Session, probs: list[float]) -> None:
    """16 kHz silence, with the VAD verdicts given for its chunks."""
    for p in probs:
        assert s.accept_audio(m.Audio(stream="s", seq=s.next_seq, data=bytes(2 * CHUNK)))
        s.on_vad(p, CHUNK)
        s.step()


def answer(s: Session, final: bool, status: int = OK, text: str = "", **fields: Any) -> None:
    job = next(j for j in s.jobs_out if j.final == final and j.job_id in s.inflight)
    s.jobs_out.remove(job)
    s.on_result(JobResult(job_id=job.job_id, ingest=0, status=status, text=text, **fields))


def finals(s: Session) -> list[m.Final]:
    return [msg for msg in s.outbox if isinstance(msg, m.Final)]


def stream_half_seconds(s: Session, messages: int, probability: Callable[[int], float]) -> int:
    """A realtime client: `messages` messages of 0.5 s, each resent while refused (at most 20
    refusals in all), the VAD giving `probability(chunk start)`, every final answered as soon
    as it is asked for; then `end`, answered. Returns how many sends were refused."""
    message = SAMPLE_RATE // 2
    refusals = 0
    while s.next_seq < messages:
        if not s.accept_audio(m.Audio(stream="s", seq=s.next_seq, data=tone(message, SAMPLE_RATE, s.next_seq * message))):
            refusals += 1
            assert refusals < 20, f"refused for good at {s.ring.written} samples written"
        while s.vad_chunk_due(CHUNK):
            s.on_vad(probability(s.vad_pos), CHUNK)
        s.step()
        while any(j.final for j in s.jobs_out if j.job_id in s.inflight):
            answer(s, final=True, text="words")
            s.step()
    s.outbox = [msg for msg in s.outbox if not isinstance(msg, m.ErrorMsg)]
    s.client_end()
    s.step()
    while s.inflight:
        answer(s, final=True, text="words")
        s.step()
    return refusals


def test_a_ring_full_of_one_segment_cuts_it_rather_than_refuse_the_stream_for_ever() -> None:
    """The smallest ring settings allow (`max_segment_s` + 0.5 s) and a realtime client sending
    0.5 s messages of steady speech: the ring fills before the VAD has seen enough to cut at
    `max_segment_s`, and no message fits. The segment is cut where the VAD got, so its final
    frees the room: every message is taken on a resend, and the finals cover all the audio."""
    cfg = settings.load(None, {"vad": {"max_segment_s": 3.0}, "shm": {"ring_seconds": 3.5}})
    for pool in rings(int(3.5 * SAMPLE_RATE)):
        s = Session("c/s", b"c", m.Open(stream="s", partials=False), pool.acquire(), cfg, 0, pool.name, METRICS)
        refusals = stream_half_seconds(s, 20, lambda pos: 0.9)  # 10 s
        assert refusals > 0 and errors(s) == []
        spans = [(f.start, f.end) for f in finals(s)]
        assert spans[0][0] == 0 and spans[-1][1] == pytest.approx(10.0, abs=0.001), spans
        assert all(b[0] == a[1] for a, b in zip(spans, spans[1:])), spans  # continuous: nothing left out
        assert all(e - st <= 3.0 for st, e in spans), spans
        assert isinstance(s.outbox[-1], m.Closed) and s.outbox[-1].reason == "end"


def test_a_ring_full_while_a_short_burst_waits_for_its_verdict_is_not_refused_for_ever() -> None:
    """The smallest ring settings allow and a realtime client sending 0.5 s messages, as above;
    but here a click (four chunks of speech, shorter than `min_speech_ms`) comes just before a
    message boundary. The VAD keeps the pad before it and waits for `min_silence_ms` of pause
    to drop it, which it cannot see without the next message, and that message does not fit:
    no segment was open, so there was nothing to cut, and every resend (and the `end`) was
    refused for good. The click is cut as a segment of its own, so its audio is transcribed,
    and every message is taken on a resend."""
    cfg = settings.load(None, {"vad": {"max_segment_s": 1.0}, "shm": {"ring_seconds": 1.5}})
    for pool in rings(int(1.5 * SAMPLE_RATE)):
        s = Session("c/s", b"c", m.Open(stream="s", partials=False), pool.acquire(), cfg, 0, pool.name, METRICS)
        click = range(12 * CHUNK, 16 * CHUNK)  # 128 ms of speech, from 0.384 s
        refusals = stream_half_seconds(s, 10, lambda pos: 0.9 if pos in click else 0.0)  # 5 s
        assert refusals > 0 and errors(s) == [] and s.in_frames == 5 * SAMPLE_RATE
        assert [(f.start, f.end) for f in finals(s) if f.start <= click.start / SAMPLE_RATE < click.stop / SAMPLE_RATE <= f.end]
        assert isinstance(s.outbox[-1], m.Closed) and s.outbox[-1].reason == "end"


def test_a_partial_still_decoding_after_its_segment_s_final_keeps_its_audio(long_pool: RingPool) -> None:
    """Two workers: a segment's partial is still decoding when its final, decoded by the other,
    comes back. A batch client's audio must not take the partial's samples meanwhile: the
    worker would find them overwritten and fail the job, an internal error for nothing."""
    s = session(long_pool, priority="batch")
    feed(s, [0.0] * 5 + [0.9] * 40 + [0.0] * 20)
    partials = [j for j in s.jobs_out if not j.final]
    partial = partials[0]
    answer(s, final=True, text="hello")
    assert [f.seg for f in finals(s)] == [0] and all(j.job_id in s.inflight for j in partials)
    taken = 0
    while taken < 2 * long_pool.ring(0).capacity // CHUNK and s.accept_audio(m.Audio(stream="s", seq=s.next_seq, data=bytes(2 * CHUNK))):
        s.on_vad(0.0, CHUNK)
        s.step()
        taken += 1
    assert s.ring.intact(partial.start, partial.generation)
    assert s.window() <= s.in_frames + CHUNK  # the client is told to wait, not refused inside its window
    s.outbox.clear()
    for job in partials:
        s.on_result(JobResult(job_id=job.job_id, ingest=0, status=OK, text="hel"))
    s.step()
    assert s.window() > s.in_frames + 9 * SAMPLE_RATE and s.accept_audio(m.Audio(stream="s", seq=s.next_seq, data=bytes(2 * CHUNK)))
    assert taken > 0 and not errors(s)


def test_a_final_judged_a_hallucination_drops_the_words_its_partials_agreed_on(long_pool: RingPool) -> None:
    """Whisper hallucinates the same words on noise decode after decode, so its partials may
    agree on them; the final, decoded on the whole segment, is the judge: judged no speech, it
    is empty, and `revised` tells the client to take back what it printed as stable. A final
    that merely found no words keeps them (the stabilizer's tests)."""
    s = session(long_pool)
    feed(s, [0.0] * 5 + [0.9] * 20)
    answer(s, final=False, text="Thank you.")
    feed(s, [0.9] * 16)
    answer(s, final=False, text="Thank you.")
    assert [p.stable for p in s.outbox if isinstance(p, m.Partial)][-1] == "Thank"  # never the last word heard
    feed(s, [0.0] * 20)
    answer(s, final=True, text="Thank you.", no_speech_prob=0.9, avg_logprob=-1.5)
    [final] = finals(s)
    assert (final.text, final.revised) == ("", True)


def test_a_final_s_parts_and_words_are_its_decode_s_on_the_stream_s_clock(long_pool: RingPool) -> None:
    """A final carries the decode's own segments and timed words moved onto the stream's clock
    and kept within the final's span; a final whose text is not its decode's (the committed words
    kept when the decode heard none, noise dropped) has neither; segments or words a worker of
    another build sends that are not [start, end, text] rows leave the final without them, said
    in the log, and the final goes out all the same."""
    s = session(long_pool, offset=32_000)  # a resumed stream: its times go on from 2 s
    feed(s, [0.0] * 5 + [0.9] * 20 + [0.0] * 20)
    [job] = [j for j in s.jobs_out if j.final]
    start, end = 2 + job.start / 16_000, 2 + job.end / 16_000
    answer(s, final=True, text=" Turn left. Then stop.", segments=[[0.0, 0.52, " Turn left."], [0.52, 99.0, " Then stop."]],
           words=[[0.0, 0.2, " Turn"], [0.2, 0.52, " left."], [0.52, 0.8, " Then"], [0.8, 99.0, " stop."]])
    [final] = finals(s)
    assert final.parts == [[round(start, 3), round(start + 0.52, 3), "Turn left."], [round(start + 0.52, 3), round(end, 3), "Then stop."]]
    assert final.words == [[round(start, 3), round(start + 0.2, 3), " Turn"], [round(start + 0.2, 3), round(start + 0.52, 3), " left."],
                           [round(start + 0.52, 3), round(start + 0.8, 3), " Then"], [round(start + 0.8, 3), round(end, 3), " stop."]]
    long_pool.release(s.ring)

    for rows in ([[0.0, "0.5", "Turn left."]], [[0.3, 0.1, "Turn left."]], [[0.0, float("nan"), "x"]], [["Turn left."]], "x"):
        for field, event in (("segments", "ingest.final_parts_unreadable"), ("words", "ingest.final_words_unreadable")):
            s = session(long_pool)
            feed(s, [0.0] * 5 + [0.9] * 20 + [0.0] * 20)
            with capture_logs() as logs:
                answer(s, final=True, text="Turn left.", **{field: rows})
            [final] = finals(s)
            assert (final.text, final.parts if field == "segments" else final.words) == ("Turn left.", None), rows
            assert [e["event"] for e in logs if e["log_level"] == "warning"] == [event], rows
            long_pool.release(s.ring)

    s = session(long_pool)
    feed(s, [0.0] * 5 + [0.9] * 20)
    answer(s, final=False, text="turn left now")
    feed(s, [0.9] * 16)
    answer(s, final=False, text="turn left now")
    feed(s, [0.0] * 20)
    answer(s, final=True, text="", segments=[], words=[])
    [final] = finals(s)
    assert final.text == "turn left" and final.parts is None and final.words is None  # the partials' committed words, no decode's times


@pytest.mark.parametrize("priority", ["realtime", "batch"])
def test_a_final_waits_for_the_one_before_and_is_prompted_with_its_text(long_pool: RingPool, priority: str) -> None:
    """Three segments ended before any final came back (a batch client sends faster than its
    finals decode; a slow worker does it to a realtime one): the second and third finals wait
    for the text of the one before, so the transcript is the same however fast the workers
    were, and the same for a file sent in real time or as a batch."""
    s = session(long_pool, priority=priority, partials=False)
    feed(s, ([0.0] * 5 + [0.9] * 20 + [0.0] * 20) * 3)
    asked = [j for j in s.jobs_out if j.final]
    assert [(j.seg, j.prompt) for j in asked] == [(0, None)]
    for seg, text in enumerate(["turn left", "go forward", "stop"]):
        answer(s, final=True, text=text)
        asked = [j for j in s.jobs_out if j.final and j.job_id in s.inflight]
        assert [(j.seg, j.prompt) for j in asked] == ([(seg + 1, text)] if seg < 2 else [])
    assert [(f.seg, f.text) for f in finals(s)] == [(0, "turn left"), (1, "go forward"), (2, "stop")]


def test_a_segment_of_noise_gets_an_empty_final_in_order(long_pool: RingPool) -> None:
    """Noise the cleaning blanks still ends its segment with a final, so the client knows its
    partials are void; the next segment is prompted with the last final that had words."""
    s = session(long_pool, resume_text="earlier words")
    feed(s, [0.0] * 5 + [0.9] * 20)
    answer(s, final=False, text="turn left")
    feed(s, [0.0] * 20)
    answer(s, final=True, text="turn left", no_speech_prob=0.9, avg_logprob=-1.5)  # probably silence
    feed(s, [0.9] * 20 + [0.0] * 20)
    assert [j.prompt for j in s.jobs_out if j.final and j.job_id in s.inflight] == ["earlier words"]
    answer(s, final=True, text="go forward ten meters")
    assert [(f.seg, f.text) for f in finals(s)] == [(0, ""), (1, "go forward ten meters")]
    assert finals(s)[0].durable > 0  # it counts as delivered
    assert s.previous_text == "go forward ten meters"
    while any(j.job_id in s.inflight for j in s.jobs_out):  # partials still out: late now
        answer(s, final=False)
    s.end()
    s.step()
    closed = [msg for msg in s.outbox if isinstance(msg, m.Closed)]
    assert len(closed) == 1 and closed[0].segments == 2
    assert closed[0].durable == s.in_frames  # every final out: a client resuming now would resend nothing


@pytest.mark.parametrize("opened", [None, "de"])
def test_partials_take_the_language_the_last_final_was_heard_in(long_pool: RingPool, opened: str | None) -> None:
    """Opened without a language, a segment's partials are decoded in the language the latest
    final with words was heard in (a partial detecting on its second of audio may hear German as
    Vietnamese); each final still detects its own. A final judged no speech tells nothing. A
    language the client gave is every job's."""
    s = session(long_pool, language=opened)

    def asked(seg: int, final: bool) -> set[str | None]:
        return {j.language for j in s.jobs_out if j.seg == seg and j.final == final}

    feed(s, [0.0] * 5 + [0.9] * 20)
    answer(s, final=False, text="Guten Morgen", language="de")
    feed(s, [0.0] * 20)
    assert asked(0, final=False) == asked(0, final=True) == {opened}
    answer(s, final=True, text="Guten Morgen, wie geht es?", language="de")
    feed(s, [0.9] * 20 + [0.0] * 20)
    assert (asked(1, final=False), asked(1, final=True)) == ({"de"}, {opened})
    answer(s, final=True, text="Danke.", no_speech_prob=0.9, avg_logprob=-1.5, language="en")  # probably noise
    feed(s, [0.9] * 20)
    assert asked(2, final=False) == {"de"}
    # the client is told what each was decoded in: the noise's final too (it is what the model decoded)
    assert [p.language for p in s.outbox if isinstance(p, m.Partial)] == ["de"]
    assert [f.language for f in finals(s)] == ["de", "en"]


@pytest.mark.parametrize("opened", [None, "fr"])
def test_a_resumed_stream_s_partials_take_the_language_its_client_last_heard(long_pool: RingPool, opened: str | None) -> None:
    """A stream resumed on a new ingest decodes its partials in `resume_language`, the language of
    the last final its client had, until a final of its own has words; its finals detect as ever.
    A language the client gave is every job's, `resume_language` or not."""
    s = session(long_pool, language=opened, offset=48_000, resume_text="Hoy vamos a la playa.", resume_language="es")

    def asked(seg: int, final: bool) -> set[str | None]:
        return {j.language for j in s.jobs_out if j.seg == seg and j.final == final}

    feed(s, [0.0] * 5 + [0.9] * 20)
    answer(s, final=False, text="Mañana compramos", language=opened or "es")
    feed(s, [0.0] * 20)
    assert (asked(0, final=False), asked(0, final=True)) == ({opened or "es"}, {opened})
    answer(s, final=True, text="Mañana compramos pan.", language=opened or "pt")  # heard otherwise on the whole segment
    feed(s, [0.9] * 20)
    assert asked(1, final=False) == {opened or "pt"}
    assert [p.language for p in s.outbox if isinstance(p, m.Partial)][:1] == [opened or "es"]
    assert [f.language for f in finals(s)] == [opened or "pt"]


@pytest.mark.parametrize("heard", [[], ["turn left now", "turn left now please"]], ids=["no partials", "partials"])
def test_a_final_that_failed_for_good_is_sent_after_its_error(long_pool: RingPool, heard: list[str]) -> None:
    """A segment whose final cannot be decoded still gets its final, after an error naming it,
    holding the words its partials had marked stable (none, if none were)."""
    s = session(long_pool)
    feed(s, [0.0] * 5 + [0.9] * 20)
    for text in heard:
        answer(s, final=False, text=text, language="en")
        feed(s, [0.9] * 10)
    stable = [msg.stable for msg in s.outbox if isinstance(msg, m.Partial)][-1] if heard else ""
    assert bool(stable) == bool(heard)
    feed(s, [0.0] * 20)
    s.jobs_out[:] = [j for j in s.jobs_out if j.final]
    for _ in range(3):  # the first try and its retries
        answer(s, final=True, status=FAILED, error="worker lost")
    [err] = errors(s)
    assert err.code == m.INTERNAL and "segment 0" in err.message
    assert [(f.seg, f.text, f.revised, f.language) for f in finals(s)] == [(0, stable, False, "en" if heard else None)]
    assert s.outbox.index(err) < s.outbox.index(finals(s)[0])
    assert s.previous_text == stable and s.stats["finals"] == 1


# ------------------------------------------------------------------ acks


def test_a_resend_of_accepted_audio_is_acked(pool: RingPool) -> None:
    s = session(pool)
    assert s.accept_audio(m.Audio(stream="s", seq=0, data=bytes(3200)))  # 100 ms: acked
    assert s.due_ack() is not None
    assert s.accept_audio(m.Audio(stream="s", seq=1, data=bytes(640)))  # 20 ms: below the ack step
    assert s.due_ack() is None
    for _ in range(3):
        assert s.accept_audio(m.Audio(stream="s", seq=1, data=bytes(640)))  # resends: dropped
    ack = s.due_ack()
    assert ack is not None and (ack.seq, ack.samples) == (1, 1920)
    assert s.due_ack() is None  # once
    assert s.in_frames == 1920 and s.ring.written == 1920


# ------------------------------------------------------------------ G.711


@pytest.mark.parametrize("encoding", ["pcm_mulaw", "pcm_alaw"])
def test_telephony_audio_counts_one_byte_a_sample(pool: RingPool, encoding: str) -> None:
    """8 kHz G.711 in messages of any length (an RTP packet is 160 bytes, a jittery one less):
    every byte is a sample, in acks and the window, and the ring holds the decoded audio."""
    s = session(pool, rate=8000, encoding=encoding, offset=8000)  # resumed 1 s in
    codes = np.random.default_rng(95).integers(0, 256, 4001, np.uint8)
    sizes = [160, 159, 1, 961, 720, 2000]
    parts = np.split(codes, np.cumsum(sizes)[:-1])
    for seq, part in enumerate(parts):
        assert s.accept_audio(m.Audio(stream="s", seq=seq, data=part.tobytes())), errors(s)
    assert s.in_frames == 4001
    ack = s.due_ack()
    assert ack is not None and (ack.seq, ack.samples) == (5, 8000 + 4001)
    assert ack.window == s.window() > ack.samples
    s.end()
    r = Resampler(8000)
    expected = np.concatenate([r.process(decode_pcm(p.tobytes(), encoding, 1)) for p in parts]
                              + [r.process(np.zeros(0, np.float32), last=True)])
    assert s.ring.written == len(expected) == 2 * 4001  # at 16 kHz
    np.testing.assert_array_equal(s.ring.view(0, s.ring.written), expected)


def test_telephony_audio_in_two_channels_must_be_whole_frames(pool: RingPool) -> None:
    s = session(pool, rate=8000, encoding="pcm_mulaw", channels=2)
    assert s.accept_audio(m.Audio(stream="s", seq=0, data=bytes(320)))
    assert not s.accept_audio(m.Audio(stream="s", seq=1, data=bytes(161)))
    [err] = errors(s)
    assert (err.code, err.seq) == (m.BAD_FORMAT, 1) and "161 bytes is not a whole number of 2-byte frames" in err.message
    assert s.in_frames == 160


# ------------------------------------------------------------------ idle


@pytest.fixture
def small_pool() -> Iterator[RingPool]:
    """Rings of 2 s, with room for a 1 s message however much of them stays protected."""
    yield from rings(2 * SAMPLE_RATE)


def test_a_client_gone_after_a_message_bigger_than_its_ring_frees_again_is_closed_as_idle(small_pool: RingPool) -> None:
    """The idle clock waits while the client's next message does not fit its window, since it
    waits for the service; but a ring never frees what it keeps protected behind the audio (the
    pad before speech, the window's headroom), so a client that once sent a message nearly the
    ring's size would wait forever. Up to 1 s of room is the most it is taken to wait for: once
    gone, it counts as idle, and its stream is closed and its ring freed."""
    s = session(small_pool)
    frames = 2 * SAMPLE_RATE - 3000  # 1.8 s: it fits the empty ring
    assert s.accept_audio(m.Audio(stream="s", seq=0, data=bytes(2 * frames)))
    while s.vad_chunk_due(CHUNK):  # the service catches up: silence, nothing pending
        s.on_vad(0.0, CHUNK)
    s.step()
    ack = s.due_ack()
    assert ack is not None and SAMPLE_RATE <= ack.window - frames < frames  # room, if not for another such message
    assert s.check_idle(time.monotonic() + CFG.ingest.idle_timeout_s + 1)


def test_a_client_gone_mid_segment_with_under_a_second_of_room_is_closed_as_idle() -> None:
    """The smallest rings settings allow hold a whole segment and under a second more: a batch
    client that sent 1 s messages and vanished in a long segment leaves less room than its
    next message, with nothing owed to the stream (every chunk classified, every decode back)
    that could free any. It is not waiting for the service then, and must be closed as idle
    rather than keep its ring and its client's stream slot for good."""
    from config.settings import RING_ROOM

    for p in rings(int(CFG.vad.max_segment_s * SAMPLE_RATE) + RING_ROOM):
        s = session(p, priority="batch")
        while s.window() - (s.offset + s.in_frames) >= SAMPLE_RATE:  # continuous speech, 1 s messages
            assert s.accept_audio(m.Audio(stream="s", seq=s.next_seq, data=bytes(2 * SAMPLE_RATE)))
            while s.vad_chunk_due(CHUNK):
                s.on_vad(0.9, CHUNK)
            s.step()
            while any(j.job_id in s.inflight for j in s.jobs_out):
                answer(s, final=False, text="go on")
            s.due_ack()
        assert s.open_segment is not None and not s.inflight and list(s.segments.values()) == [s.open_segment]
        assert s.check_idle(time.monotonic() + CFG.ingest.idle_timeout_s + 1)


def test_only_results_count_in_the_latency_figures(long_pool: RingPool) -> None:
    """The dashboard's partial latency is how long a stream waits for text: a partial the broker
    skipped as stale (answered `expired` past its 2 s deadline) never became text, and counted,
    it would read as seconds of latency exactly when the service sheds load to keep it low."""
    metrics = ProcessMetrics(CFG, "ingest")
    s = Session("c/s", b"c", m.Open(stream="s"), long_pool.acquire(), CFG, 0, long_pool.name, metrics)
    feed(s, [0.0] * 5 + [0.9] * 20)
    answer(s, final=False, status=EXPIRED)
    feed(s, [0.9] * 16)
    answer(s, final=False, text="go forward", started=1.0, finished=1.0)

    def count(name: str) -> int:
        return sum(sum(h[3]) for h in metrics.snapshot()["histograms"] if h[0] == name)

    assert count("partial_latency_seconds") == 1


@pytest.mark.parametrize("refused", [False, True], ids=["all taken", "audio refused since"])
def test_an_end_that_comes_after_a_shutdown_ended_the_stream_closes_it_as_asked(long_pool: RingPool, refused: bool) -> None:
    """A shutdown ends every stream at the audio taken so far and says `closed` "shutdown", which
    a client resumes elsewhere. A client whose own `end` came in meanwhile, with nothing of its
    audio refused since, had all it sent taken: its stream ends "end", or `transcribe` and the
    bench would count a stream served whole as cut."""
    s = session(long_pool)
    feed(s, [0.0] * 5 + [0.9] * 20)
    s.end("shutdown")
    if refused:
        assert not s.accept_audio(m.Audio(stream="s", seq=s.next_seq, data=bytes(2 * CHUNK)))
    s.client_end()
    s.step()
    while any(j.job_id in s.inflight for j in s.jobs_out):
        answer(s, final=any(j.final and j.job_id in s.inflight for j in s.jobs_out), text="go on")
    s.step()
    [closed] = [msg for msg in s.outbox if isinstance(msg, m.Closed)]
    assert (closed.reason, closed.durable) == ("shutdown" if refused else "end", s.in_frames)
