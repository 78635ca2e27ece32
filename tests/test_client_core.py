"""Client flow control, resuming, PCM conversion and send-time bookkeeping, without a server."""

from __future__ import annotations

import dataclasses
import queue
import uuid
import warnings
from concurrent.futures import Future

import numpy as np
import pytest

from client.core import (
    COMPACT_AT,
    KEEP_S,
    LOST,
    MAX_REOPEN_S,
    REOPEN_S,
    Entry,
    IngestLost,
    Liveness,
    SendLog,
    StreamCore,
    StreamError,
    check_open,
    expire,
    ingest_endpoint,
    route,
    to_pcm,
)
from config.settings import Config
from ingest.session import Session
from metrics.registry import ProcessMetrics
from protocol.messages import (
    BAD_FORMAT,
    BAD_MESSAGE,
    MAX_PROMPT_CHARS,
    NOT_READY,
    OUT_OF_ORDER,
    OVERLOADED,
    TOO_MANY_STREAMS,
    UNKNOWN_STREAM,
    Ack,
    Audio,
    Closed,
    End,
    ErrorMsg,
    Final,
    Limits,
    Open,
    Partial,
    Ready,
    decode_client,
    encode,
)
from shm import Ring, RingPool


def core(priority: str = "realtime", max_frame_bytes: int = 200, window: int = 1000) -> StreamCore:
    c = StreamCore("s", priority=priority, frame_bytes=2, limits=Limits(max_frame_bytes=max_frame_bytes), rate=100)
    c.on_ready(window)
    return c


def seqs(msgs: list) -> list:
    return [m.seq if isinstance(m, Audio) else "end" for m in msgs]


def test_audio_is_split_into_frames_no_larger_than_the_limit() -> None:
    c = core(max_frame_bytes=201)  # rounds down to whole frames: 100 frames, 200 bytes
    c.push(b"\0" * 500)
    out = c.take(1.0)
    assert [len(m.data) for m in out] == [200, 200, 100]
    assert seqs(out) == [0, 1, 2]
    assert c.log.pairs() == [(100, 1.0), (200, 1.0), (250, 1.0)]


def test_nothing_goes_out_before_ready() -> None:
    c = StreamCore("s", priority="batch", frame_bytes=2, limits=Limits(), rate=100)
    c.push(b"\0" * 10)
    c.end()
    assert c.take(0.0) == []
    c.on_ready(100)
    assert seqs(c.take(0.0)) == [0, "end"]


def test_batch_never_sends_past_the_window() -> None:
    c = core("batch", window=1000)
    c.on_ack(Ack("s", seq=-1, samples=0, window=150))
    c.push(b"\0" * 800)  # 400 frames
    c.end()
    out = c.take(0.0)
    assert [len(m.data) // 2 for m in out] == [100, 50]
    assert c.take(0.0) == []
    c.on_ack(Ack("s", seq=1, samples=150, window=320))
    out = c.take(0.0)
    assert [len(m.data) // 2 for m in out] == [100, 70] and c.cut == 320
    c.on_ack(Ack("s", seq=3, samples=320, window=10_000))
    assert seqs(c.take(0.0)) == [4, "end"]


def test_audio_a_batch_send_gave_up_on_is_withdrawn_and_end_follows_what_was_sent() -> None:
    """A send that timed out waiting for the window told its caller the audio was not sent: it
    is dropped, and `end` goes out at once instead of waiting behind it."""
    c = core("batch", window=400)
    c.push(b"\0" * 1000)  # 500 frames: 400 fit
    assert [len(m.data) // 2 for m in c.take(1.0)] == [100] * 4
    assert c.withdraw() == 100  # what the send's NoCredit tells its caller was left out
    c.end()
    assert seqs(c.take(1.0)) == ["end"]
    assert (c.cut, c.withdrawn) == (400, 100)  # every frame handed over is sent or withdrawn: a waiting send counts both


def test_a_withdrawal_during_a_resume_keeps_the_audio_that_was_sent() -> None:
    """Audio queued again for the new connection was sent before (the server may hold it), so it
    is resent; only what never went out is withdrawn."""
    pcm = bytes(range(250)) * 4  # 500 frames: 400 fit
    c = core("batch", window=400)
    c.push(pcm)
    c.take(1.0)
    c.on_ack(Ack("s", seq=3, samples=400, window=400, durable=150))
    entry(c).resume(until=60.0)  # kept: 150..400, queued again before the 100 frames never sent
    assert c.withdraw() == 100
    c.end()
    c.on_ready(1000)
    out = c.take(2.0)
    assert seqs(out) == [0, 1, 2, "end"] and c.withdrawn == 100
    assert b"".join(bytes(m.data) for m in out[:-1]) == pcm[300:800]


def test_realtime_ignores_the_window_but_sizes_messages_to_fit_it() -> None:
    c = core("realtime", window=100)
    c.push(b"\0" * 400)  # 200 frames, twice the window
    out = c.take(0.0)
    assert [len(m.data) // 2 for m in out] == [25] * 8  # a message larger than the buffer could never be taken


def test_realtime_end_goes_out_with_the_last_audio() -> None:
    """Not after its ack: the server acks about every 100 ms of audio, so waiting for it held a
    stream's last final back by up to the retry time. A refusal crossing the `end` is the next test's."""
    c = core("realtime")
    c.push(b"\0" * 200)
    c.end()
    assert seqs(c.take(1.0)) == [0, "end"] and c.retry_at is None
    assert c.take(2.0) == []


def test_overloaded_frames_are_kept_and_resent_after_the_window_moves() -> None:
    c = core("realtime")
    c.push(b"\0" * 800)  # seqs 0..3, 100 frames each
    sent = c.take(0.0)
    c.on_ack(Ack("s", seq=0, samples=100, window=400))
    assert c.on_error(ErrorMsg(OVERLOADED, "full", "s", 1), 0.1) is True
    # frames after the refused one come back out of order: not news, their resend is planned
    assert c.on_error(ErrorMsg(OUT_OF_ORDER, "expected 1", "s", 2), 0.1) is False
    assert c.on_error(ErrorMsg(OUT_OF_ORDER, "expected 1", "s", 3), 0.1) is False
    c.push(b"\0" * 200)
    c.end()
    assert c.take(0.15) == []  # stalled: no new audio, no end, until the window moves
    c.on_ack(Ack("s", seq=0, samples=100, window=400))
    assert c.take(0.16) == []  # an ack that does not move the window changes nothing
    c.on_ack(Ack("s", seq=0, samples=100, window=500))
    out = c.take(0.2)
    assert seqs(out) == [1, 2, 3, 4, "end"]
    c.on_ack(Ack("s", seq=4, samples=500, window=900))
    assert c.take(0.21) == []
    assert [bytes(m.data) for m in out[:3]] == [bytes(m.data) for m in sent[1:]]
    assert [e for e, _ in c.log.pairs()] == [100, 200, 300, 400, 500]
    assert c.log.pairs()[1][1] == 0.0  # a resent frame keeps its first send time


def test_a_stalled_stream_retries_on_a_timer_when_no_ack_comes() -> None:
    c = core("realtime")
    c.push(b"\0" * 400)
    c.take(0.0)
    c.on_error(ErrorMsg(OVERLOADED, "full", "s", 0), 1.0)
    assert c.retry_at is not None and c.take(c.retry_at - 0.01) == []
    assert seqs(c.take(c.retry_at)) == [0, 1]
    first = c.retry_s
    c.on_error(ErrorMsg(OVERLOADED, "full", "s", 0), 2.0)
    assert c.retry_at == pytest.approx(2.0 + first) and c.retry_s > first  # backs off


def test_acks_release_retained_frames() -> None:
    c = core("realtime")
    c.push(b"\0" * 800)
    c.take(0.0)
    c.on_ack(Ack("s", seq=2, samples=300, window=1000))
    assert [f.seq for f in c.retained] == [3] and c.accepted == 300


def test_a_refusal_after_end_is_resent_and_end_sent_again() -> None:
    """The refusal of the last audio arrives after `end`: the server refuses that `end` too (with
    the refused seq) and keeps the stream open, so the audio is resent, then `end`."""
    c = core("realtime")
    c.push(bytes(range(200)) * 2)
    c.end()
    sent = c.take(0.0)
    assert seqs(sent) == [0, 1, "end"]
    assert c.on_error(ErrorMsg(OVERLOADED, "full", "s", 1), 0.1) is True  # the caller hears of the refusal
    assert c.take(0.2) == []  # stalled until the window moves
    c.on_ack(Ack("s", seq=0, samples=100, window=2000))  # may come before the refusal of the `end`
    out = c.take(0.3)
    assert seqs(out) == [1, "end"] and bytes(out[0].data) == bytes(sent[1].data)  # same seq, same bytes
    # the refusal of the first `end`: neither news for the caller nor a reason to resend again
    assert c.on_error(ErrorMsg(OVERLOADED, "end refused: resend it, then end", "s", 1), 0.35) is False
    c.on_ack(Ack("s", seq=1, samples=200, window=2000))
    assert c.take(10.0) == [] and c.end_out and not c.retained


def test_a_refusal_after_end_against_the_ingest_session_ends_with_all_audio_accepted() -> None:
    """The client against the reference ingest's Session (no sockets), 200 ms each way: the buffer
    refuses the last messages, the refusal comes back after the client's `end`, the workers then
    catch up. The stream must end at the ingest with every sample accepted once, in order."""
    delay, ticks = 0.2, 100  # one-way latency; the loop runs in 10 ms steps
    pcm = (np.arange(12 * 1600) % 3001 - 1500).astype("<i2")  # 1.2 s: twelve 100 ms messages
    # about 1 s of real shm ring: the last messages do not fit until the workers catch up
    pool = RingPool.create(f"streamasr.test{uuid.uuid4().hex[:12]}.ingest0", slots=1, capacity=16000 + 1024)
    try:
        ring = pool.acquire()
        session = Session("k/s", b"k", Open(stream="s"), ring, Config(), 0, pool.name, ProcessMetrics(Config(), "ingest"))
        refused_client_end(session, ring, pcm, delay, ticks)
    finally:
        pool.close()
        pool.unlink()


def refused_client_end(session: Session, ring: Ring, pcm: np.ndarray, delay: float, ticks: int) -> None:
    """Stream `pcm` into `session` over the simulated link; the workers read and release the ring."""
    c = StreamCore("s", priority="realtime", frame_bytes=2, limits=Limits(max_frame_bytes=3200), rate=16000)
    e = entry(c)
    streams = {"s": e}
    route(streams, Ready("s", window=session.window()), 0.0)
    c.push(pcm.tobytes())
    c.end()
    to_ingest: list[tuple[float, object]] = []
    to_client: list[tuple[float, object]] = []
    sent: list[object] = []
    ended_before_refusal: list[bool] = []
    consumed: list[np.ndarray] = []  # what the workers read out of the ring, in order
    for i in range(10 * ticks):
        now = i / ticks
        for at, msg in [x for x in to_client if x[0] <= now]:
            to_client.remove((at, msg))
            if isinstance(msg, ErrorMsg) and msg.code == OVERLOADED:
                ended_before_refusal.append(c.end_out)
            route(streams, msg, now)  # type: ignore[arg-type]
        for msg in c.take(now):
            sent.append(msg)
            to_ingest.append((now + delay, msg))
        for at, msg in [x for x in to_ingest if x[0] <= now]:
            to_ingest.remove((at, msg))
            if isinstance(msg, Audio):
                session.accept_audio(msg)
            else:
                session.client_end()
        read = sum(len(x) for x in consumed)
        consumed.append(np.array(ring.view(read, ring.written)))  # protected until released below
        if now >= 0.5:
            ring.protected_from = ring.written  # the workers catch up: the whole buffer is free again
        replies = list(session.outbox)
        session.outbox.clear()
        ack = session.due_ack()
        replies += [ack] if ack is not None else []
        to_client += [(now + delay, reply) for reply in replies]
        if session.ending and not to_client:
            break
    assert ended_before_refusal[0], "the refusal was meant to come after `end`"
    assert session.ending and session.refused_from is None
    assert session.in_frames == len(pcm) and ring.written == len(pcm)
    assert np.array_equal(np.concatenate(consumed), pcm.astype(np.float32) / 32768)  # once each, in order, scaled
    assert c.end_out and not c.retained
    errors = []
    while not e.events.empty():
        errors.append(e.events.get_nowait()[1])
    assert [(err.code, err.seq) for err in errors] == [(OVERLOADED, 10)]  # once; not the echoes


def test_other_errors_are_always_reported() -> None:
    c = core()
    assert c.on_error(ErrorMsg("bad_format", "odd bytes", "s", 0), 0.0) is True
    assert c.on_error(ErrorMsg("internal", "oops", "s"), 0.0) is True


def test_a_closing_client_sends_a_held_end_at_once() -> None:
    """`take` holds `end` back while refused audio waits for its resend; closing cannot wait for it."""
    stalled = core("realtime")
    stalled.push(b"\0" * 400)
    stalled.end()
    stalled.take(1.0)
    stalled.on_error(ErrorMsg(OVERLOADED, "full", "s", 1), 1.05)
    assert seqs(stalled.take_last(1.06)) == [1, "end"]  # the refused audio gets its last try first


def test_end_is_sent_once() -> None:
    c = core()
    c.end()
    assert isinstance(c.take(0.0)[0], End)
    c.end()
    assert c.take(1.0) == []


def test_send_log_finds_the_frame_holding_a_sample() -> None:
    log = SendLog(rate=100)
    for end, t in [(100, 1.0), (200, 2.0), (300, 3.0)]:
        log.record(end, t)
    assert log.sent_at(0.5) == 1.0
    assert log.sent_at(1.0) == 1.0  # `end` = 1.0 s covers samples 0..99
    assert log.sent_at(1.01) == 2.0
    assert log.sent_at(2.999999) == 3.0  # float noise does not spill into the next frame
    assert log.sent_at(3.2) == 3.0  # past the audio, nothing else known: the last frame
    log.end_sent = 3.5
    assert log.sent_at(3.2) == 3.5  # past the audio: `end` let the server finish the segment
    assert log.sent_at(0.5) == 1.0
    with pytest.raises(LookupError):
        SendLog(rate=100).sent_at(1.0)


def test_send_log_forgets_durable_audio_but_answers_late_readers() -> None:
    """A long stream must not keep a send time per message forever: entries go once their audio
    is durable and KEEP_S old. Recent ones stay (a final's own `durable` passes its `end` before
    its reader asks); an older sample gets the newest forgotten time, never an error."""
    c = core(max_frame_bytes=20)  # 10-frame messages: 0.1 s each at rate 100
    streams = {"s": entry(c)}
    n = 20_000  # 2000 s
    for i in range(n):
        c.push(b"\0" * 20)
        c.take(i * 0.1)
        route(streams, Ack("s", seq=i, samples=(i + 1) * 10, window=10**9, durable=(i + 1) * 10), i * 0.1)
    kept = KEEP_S / 0.1
    assert kept <= len(c.log) <= kept + 2
    assert len(c.log._ends) <= 2 * max(COMPACT_AT, kept + 2)  # dropped from memory too, not only skipped
    end = (n - 5) * 0.1  # held by message n - 6
    route(streams, Final("s", seg=0, text="x", start=end - 1, end=end, durable=n * 10), n * 0.1)
    assert c.log.sent_at(end) == (n - 6) * 0.1
    assert c.log.sent_at(n * 0.1) == (n - 1) * 0.1
    floor = c.log.pairs()[0][1]
    assert c.log.sent_at(1.0) == floor < (n - 1) * 0.1 - KEEP_S


def test_to_pcm_converts_arrays_to_the_opened_encoding() -> None:
    f = np.array([0.0, 0.5, -1.0, 2.0], np.float32)
    assert np.frombuffer(to_pcm(f, "pcm_s16le", 1), "<i2").tolist() == [0, 16384, -32767, 32767]
    assert np.frombuffer(to_pcm(f, "f32le", 1), "<f4").tolist() == f.tolist()
    i = np.array([0, -32768, 16384], np.int16)
    assert np.frombuffer(to_pcm(i, "pcm_s16le", 1), "<i2").tolist() == i.tolist()
    assert np.frombuffer(to_pcm(i, "f32le", 1), "<f4").tolist() == [0.0, -1.0, 0.5]
    stereo = np.array([[1, 2], [3, 4]], np.int16)
    assert np.frombuffer(to_pcm(stereo, "pcm_s16le", 2), "<i2").tolist() == [1, 2, 3, 4]  # interleaved
    raw = b"\1\0\2\0"
    assert to_pcm(raw, "pcm_s16le", 1) is raw  # bytes go out as they are
    assert to_pcm(bytearray(raw), "pcm_s16le", 1) == raw


def test_to_pcm_sends_telephony_bytes_as_they_are_and_encodes_arrays() -> None:
    """G.711 codes from a telephony source go out untouched, any length a whole number of mono
    frames; arrays are made 16-bit, then encoded as G.711 does: their codes decode (by a second
    implementation, the standard library's where it still has one) within G.711's step."""
    codes = bytes(range(256)) + b"\x7f"
    assert to_pcm(codes, "pcm_mulaw", 1) is codes
    assert to_pcm(bytearray(codes), "pcm_alaw", 1) == codes
    s16 = (np.sin(np.linspace(0, 40 * np.pi, 4000)) * np.linspace(0, 32000, 4000)).astype(np.int16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        audioop = pytest.importorskip("audioop")
    for encoding, decode in (("pcm_mulaw", audioop.ulaw2lin), ("pcm_alaw", audioop.alaw2lin)):
        for pcm in (s16, s16.astype(np.float32) / 32767):  # int16, and float at the same levels
            data = to_pcm(pcm, encoding, 1)
            assert len(data) == len(s16)
            back = np.frombuffer(decode(data, 2), "<i2").astype(int)
            np.testing.assert_array_less(np.abs(back - s16), np.abs(s16.astype(int)) / 32 + 9)
        stereo = np.stack([s16, -s16], axis=1)
        assert to_pcm(stereo, encoding, 2) == to_pcm(stereo.reshape(-1), encoding, 2)  # interleaved
        assert to_pcm(stereo, encoding, 2)[:2] == to_pcm(stereo[0], encoding, 2)


@pytest.mark.parametrize("pcm, encoding, channels", [
    (b"\0\0\0", "pcm_s16le", 1),  # not whole frames
    (b"\0\0", "pcm_s16le", 2),
    (b"\0\0\0", "pcm_mulaw", 2),
    (np.zeros((4, 2), np.int16), "pcm_alaw", 1),
    (np.zeros(4, np.int32), "pcm_mulaw", 1),
    (np.zeros((4, 2), np.int16), "pcm_s16le", 1),
    (np.zeros(4, np.int32), "pcm_s16le", 1),
    (np.zeros((2, 2, 2), np.float32), "f32le", 2),
    (np.array([0.0, np.nan], np.float32), "f32le", 1),  # the server refuses NaN, infinity and beyond ±16
    (np.array([0.0, -np.inf], np.float64), "f32le", 1),
    (np.array([16.5], np.float32).tobytes(), "f32le", 1),
])
def test_to_pcm_refuses_what_does_not_fit_the_stream(pcm: object, encoding: str, channels: int) -> None:
    with pytest.raises(ValueError):
        to_pcm(pcm, encoding, channels)  # type: ignore[arg-type]


@pytest.mark.parametrize("front, welcome, expected", [
    ("tcp://127.0.0.1:7700", "tcp://127.0.0.1:7701", "tcp://127.0.0.1:7701"),
    ("tcp://asr.example:7700", "tcp://127.0.0.1:7701", "tcp://asr.example:7701"),
    ("tcp://10.1.2.3:7700", "tcp://0.0.0.0:7702", "tcp://10.1.2.3:7702"),
    ("tcp://asr.example:7700", "tcp://10.0.0.5:7701", "tcp://10.0.0.5:7701"),
    ("ipc:///run/asr.sock", "tcp://127.0.0.1:7701", "tcp://127.0.0.1:7701"),
    # `serve --address tcp://*:7700`: ZeroMQ binds "*" but cannot connect to it, whatever host reached the front door
    ("tcp://127.0.0.1:7700", "tcp://*:7701", "tcp://127.0.0.1:7701"),
    ("tcp://localhost:7700", "tcp://*:7701", "tcp://localhost:7701"),
])
def test_ingest_endpoint_uses_the_front_doors_host_for_a_local_one(front: str, welcome: str, expected: str) -> None:
    assert ingest_endpoint(front, welcome) == expected


# ---------------------------------------------------------------- resuming on a new connection


def entry(c: StreamCore) -> Entry:
    fut: Future = Future()
    fut.set_result(None)
    return Entry(c, Open(stream="s", rate=100, prompt="names"), fut, queue.SimpleQueue())


def test_an_open_not_answered_yet_is_not_failed_by_unknown_stream() -> None:
    """`unknown_stream` never answers an open: one that arrives for an open still waiting is the
    late answer to the `end` of an earlier open of the id (given up on, then closed by the service
    at a shutdown before that `end` came), and must not fail this one."""
    waiting = Entry(core(), Open(stream="s", rate=100), Future(), queue.SimpleQueue())
    streams = {"s": waiting}
    assert route(streams, ErrorMsg(code=UNKNOWN_STREAM, message="no such stream", stream="s", seq=None), 1.0) is False
    assert streams == {"s": waiting} and not waiting.opened.done()
    route(streams, Ready("s", window=1000), 1.1)
    assert waiting.opened.done() and waiting.opened.exception() is None


def test_a_stream_its_ingest_closes_at_shutdown_goes_on_elsewhere_unless_it_was_complete() -> None:
    """An ingest stopping (a restart, a deploy) refuses the audio that comes while it drains and
    closes each stream once the finals of what it took are out. Unless the stream had asked to
    end and had all it sent transcribed, neither is the stream's end: the refused audio is kept
    and the stream resumes on another connection, so the caller hears of neither."""
    c = core("realtime", max_frame_bytes=10_000)  # messages of up to 250 frames
    e = entry(c)
    streams = {"s": e}
    c.push(b"\0" * 400)
    c.take(1.0)  # seq 0: frames 0-200
    route(streams, Final("s", seg=0, text="one", start=0.0, end=1.0, durable=100), 1.1)
    c.push(b"\1" * 200)
    c.take(1.2)  # seq 1: frames 200-300
    assert route(streams, ErrorMsg(code=NOT_READY, message="the service is shutting down", stream="s", seq=1), 1.3) is False
    with pytest.raises(IngestLost):
        route(streams, Closed("s", reason="shutdown", audio_s=2.0, segments=1, durable=200), 1.4)
    assert streams == {"s": e}
    assert [type(e.events.get_nowait()[1]) for _ in range(e.events.qsize())] == [Final]  # no error, no `closed`
    assert e.resume(until=60.0).offset == 200  # all it took was transcribed
    c.on_ready(1200)
    resent = c.take(2.0)
    assert b"".join(bytes(m.data) for m in resent) == b"\1" * 200  # the refused frames 200-300

    c.end()
    c.take(2.1)
    # a final's `durable` stops short of the end (the VAD's chunk grid, its pad of silence): the
    # `closed` that follows the last final says all of it was had
    route(streams, Final("s", seg=0, text="two", start=1.0, end=3.0, durable=256), 2.2)
    assert route(streams, Closed("s", reason="shutdown", audio_s=2.0, segments=1, durable=300), 2.3) is True
    assert streams == {} and isinstance(e.events.get_nowait()[1], Final) and isinstance(e.events.get_nowait()[1], Closed)


def test_an_open_its_ingest_refuses_at_shutdown_goes_where_the_front_door_says() -> None:
    """An open that reaches an ingest while it drains is refused `not_ready`: not the caller's
    failure, since another ingest (or the restarted one) will take it. While the ingest still
    owes the connection's other streams their finals, the open is asked again later rather than
    the connection left, which would lose those."""
    unanswered = StreamCore("s", priority="realtime", frame_bytes=2, limits=Limits(), rate=100)
    waiting = Entry(unanswered, Open(stream="s", rate=100), Future(), queue.SimpleQueue())
    streams = {"s": waiting}
    with pytest.raises(IngestLost):
        route(streams, ErrorMsg(code=NOT_READY, message="the service is shutting down", stream="s"), 1.0)
    assert streams == {"s": waiting} and not waiting.opened.done()
    other = entry(core())  # a stream of the connection the ingest still owes its finals: asked again later
    streams["o"] = other
    assert route(streams, ErrorMsg(code=NOT_READY, message="the service is shutting down", stream="s"), 1.5) is False
    assert unanswered.reopen_at == 1.5 + REOPEN_S and not waiting.opened.done()
    del streams["o"]
    waiting.opened.set_result(None)  # the same for a stream resuming there: retried there, it would be refused until it gave up
    waiting.core.rewind(until=60.0)
    with pytest.raises(IngestLost):
        route(streams, ErrorMsg(code=NOT_READY, message="the service is shutting down", stream="s"), 2.0)
    assert streams == {"s": waiting} and waiting.core.reopen_at is None


def test_only_audio_from_durable_on_is_kept_and_resent_with_fresh_seqs() -> None:
    c = core(max_frame_bytes=200)
    c.push(bytes(range(200)) * 3)  # 300 frames: messages end at 100, 200, 300
    c.take(1.0)
    c.on_ack(Ack("s", seq=2, samples=300, window=1000, durable=150))
    assert [f.end for f in c.kept] == [200, 300] and len(c.kept[0].data) == 100  # 150..200 of the second
    c.push(b"\1" * 20)  # not sent yet when the connection is lost
    c.end()
    c.take(2.0)
    e = entry(c)
    c.on_result(Final("s", seg=0, text="hello there", start=0.1, end=1.2, durable=150))
    opened = e.resume(until=60.0)
    assert (opened.offset, opened.resume_text, opened.prompt) == (150, "hello there", "names")
    assert c.take(3.0) == []  # nothing before the new `ready`
    c.on_ready(1000)
    out = c.take(3.0)
    assert seqs(out) == [0, 1, 2, "end"]  # `end` again, on the new connection
    assert b"".join(bytes(m.data) for m in out[:-1]) == (bytes(range(200)) * 3)[300:] + b"\1" * 20
    assert c.log.pairs() == [(100, 1.0), (200, 1.0), (300, 1.0), (310, 2.0)]  # resends keep their first times


def test_a_resumed_stream_cuts_its_messages_to_the_new_ingests_buffer() -> None:
    """A resumed stream's window counts from its offset: the buffer the new ingest has for it is
    the window less the offset, and a message bigger than that could never be accepted there."""
    c = core("realtime", max_frame_bytes=10_000, window=4000)  # messages of up to 1000 frames
    c.push(b"\0" * 2000)
    c.take(1.0)
    c.on_ack(Ack("s", seq=0, samples=1000, window=5000, durable=800))
    entry(c).resume(until=60.0)
    c.on_ready(800 + 400)  # this ingest keeps 400 frames of the stream
    c.push(b"\0" * 2000)
    assert max(len(m.data) // 2 for m in c.take(2.0)) <= 100


def test_audio_resent_after_a_resume_is_owed_an_ack() -> None:
    """The new connection has acked nothing: `accepted` is back at `durable`, so an ingest that
    takes the re-open but never acks the resent audio is found out."""
    c = core(max_frame_bytes=200)
    streams = {"s": entry(c)}
    c.push(b"\0" * 1000)  # 500 frames, all sent and acked on the old connection; durable at 100
    c.take(1.0)
    route(streams, Ack("s", seq=4, samples=500, window=1000, durable=100), 1.1)
    c.end()
    c.take(1.2)
    streams["s"].resume(until=60.0)
    assert c.accepted == 100
    route(streams, Ready("s", window=1000), 2.0)
    assert seqs(c.take(2.0)) == [0, 1, 2, 3, "end"]
    live = Liveness(5.0)
    live.heard(2.0)
    assert live.deadline(streams, 3.0) == 7.0


def test_an_empty_final_leaves_the_resume_prompt_as_it_was() -> None:
    """The server prompts a segment with the last final that had words; a resumed stream must too."""
    c = core()
    e = entry(c)
    c.on_result(Final("s", seg=0, text="hello there", start=0.1, end=1.2, durable=150))
    c.on_result(Final("s", seg=1, text="", start=1.5, end=2.0, durable=200))  # noise: no words
    assert c.finals == 2
    assert e.resume(until=60.0).resume_text == "hello there"


def test_a_resume_sends_the_language_the_last_final_with_words_was_heard_in() -> None:
    """The new ingest decodes the resumed stream's partials in `resume_language` until a final of
    its own has words: the language of the final `resume_text` comes from. Not sent while none
    was heard (an older service says none: it would refuse the field), nor for a stream opened
    in a language, which decides every decode."""
    c = core()
    e = entry(c)
    assert e.resume(until=60.0).resume_language is None  # no final yet
    c.on_result(Final("s", seg=0, text="Hola, buenos días.", start=0.1, end=1.2, durable=150, language="es"))
    c.on_result(Final("s", seg=1, text="", start=1.5, end=2.0, durable=200, language="en"))  # noise: no words
    resumed = e.resume(until=60.0)
    assert (resumed.resume_text, resumed.resume_language) == ("Hola, buenos días.", "es")
    assert decode_client(encode(dataclasses.replace(resumed, rate=16000))).resume_language == "es"  # the server takes it
    c.on_result(Final("s", seg=2, text="Hello again.", start=3.0, end=4.0, durable=300))  # from a service that says none
    assert e.resume(until=60.0).resume_language is None
    given = Entry(core(), Open(stream="s", rate=100, language="de"), e.opened, queue.SimpleQueue())
    given.core.on_result(Final("s", seg=0, text="Guten Morgen.", start=0.1, end=1.2, durable=150, language="de"))
    assert given.resume(until=60.0).resume_language is None


def test_a_resume_refused_for_its_language_by_an_older_service_is_sent_again_without_it() -> None:
    """A service before `resume_language` refuses it as an unknown field (`bad_message`): the
    re-open goes again at once without it, and so do the stream's later resumes; a second
    refusal is the open's own, and fails the stream as any other would."""
    c = core()
    streams = {"s": entry(c)}
    route(streams, Final("s", seg=0, text="Hola.", start=0.1, end=1.2, durable=150, language="es"), 1.0)
    assert streams["s"].resume(until=60.0).resume_language == "es"
    route(streams, ErrorMsg(BAD_MESSAGE, "open: unknown fields 'resume_language'", stream="s"), 2.0)
    assert "s" in streams and c.reopen_at == 2.0  # sent again by the next pass of the IO loop
    again = streams["s"].reopen()
    assert (again.offset, again.resume_text, again.resume_language) == (150, "Hola.", None)
    assert streams["s"].resume(until=60.0).resume_language is None  # a later loss: resumed without it too
    route(streams, ErrorMsg(BAD_MESSAGE, "open: something else", stream="s"), 3.0)
    assert "s" not in streams


def test_a_resume_refused_for_one_newer_field_keeps_the_other() -> None:
    """A service that knows `resume_language` but not `resume_token` (a release between them)
    names the one it refuses: the re-open goes again without that one only, so the resume keeps
    its language; a refusal that names neither drops both."""
    c = core()
    streams = {"s": entry(c)}
    streams["s"].resume_token = "0123abcd"
    route(streams, Final("s", seg=0, text="Hola.", start=0.1, end=1.2, durable=150, language="es"), 1.0)
    assert streams["s"].resume(until=60.0).resume_token == "0123abcd"
    route(streams, ErrorMsg(BAD_MESSAGE, "open: unknown fields 'resume_token'", stream="s"), 2.0)
    assert "s" in streams and c.reopen_at == 2.0  # sent again by the next pass of the IO loop
    again = streams["s"].reopen()
    assert (again.resume_language, again.resume_token) == ("es", None)
    assert streams["s"].resume(until=60.0).resume_language == "es"  # later resumes too
    route(streams, ErrorMsg(BAD_MESSAGE, "open: unknown fields 'resume_language'", stream="s"), 3.0)
    assert "s" in streams and streams["s"].reopen().resume_language is None

    c = core()
    streams = {"s": entry(c)}
    streams["s"].resume_token = "0123abcd"
    route(streams, Final("s", seg=0, text="Hola.", start=0.1, end=1.2, durable=150, language="es"), 1.0)
    streams["s"].resume(until=60.0)
    route(streams, ErrorMsg(BAD_MESSAGE, "open: a field it does not like", stream="s"), 2.0)
    again = streams["s"].reopen()
    assert (again.resume_language, again.resume_token) == (None, None)


def test_a_resumed_stream_continues_its_segment_numbers_and_totals() -> None:
    c = core()
    streams = {"s": entry(c)}
    route(streams, Final("s", seg=0, text="one", start=0.0, end=1.0, durable=120), 1.0)
    route(streams, Final("s", seg=1, text="two", start=1.5, end=2.0, durable=250), 1.0)
    streams["s"].resume(until=60.0)
    route(streams, Ready("s", window=1000), 2.0)
    after = [Partial("s", seg=0, text="thr", stable="", start=2.6, end=2.8),
             Final("s", seg=0, text="three", start=2.6, end=3.0, durable=320),
             Closed("s", reason="end", audio_s=1.0, segments=1)]
    for msg in after:
        route(streams, msg, 3.0)
    assert [m.seg for m in after[:2]] == [2, 2]
    assert (after[2].segments, after[2].audio_s) == (3, pytest.approx(3.5))
    assert "s" not in streams


def test_unknown_stream_for_an_open_stream_means_the_ingest_was_lost() -> None:
    streams = {"s": entry(core())}
    with pytest.raises(IngestLost):
        route(streams, ErrorMsg(UNKNOWN_STREAM, "no such stream", stream="s", seq=4), 1.0)


def test_a_resume_after_a_long_final_sends_the_end_of_its_text_that_the_protocol_allows() -> None:
    """`resume_text` is capped like a prompt; the server prompts with the end of it, so the start goes, at a word."""
    c = core()
    e = entry(c)
    words = " ".join(f"word{i}" for i in range(300))  # 2389 characters
    c.on_result(Final("s", seg=0, text=words, start=0.0, end=60.0, durable=100))
    opened = e.resume(until=60.0)
    assert decode_client(encode(dataclasses.replace(opened, rate=16000))).resume_text == opened.resume_text  # the server takes it
    text = opened.resume_text
    assert text is not None and MAX_PROMPT_CHARS - len("word299") <= len(text) <= MAX_PROMPT_CHARS
    assert words.endswith(" " + text) and text.startswith("word")
    c.on_result(Final("s", seg=1, text="x" * 1500, start=60.0, end=61.0, durable=200))  # no space to cut at
    assert e.resume(until=60.0).resume_text == "x" * MAX_PROMPT_CHARS


def test_a_busy_refusal_of_a_resume_is_retried_and_a_final_one_fails_the_stream() -> None:
    c = core()
    streams = {"s": entry(c)}
    streams["s"].resume(until=60.0)
    route(streams, ErrorMsg(OVERLOADED, "busy", stream="s"), 1.0)
    assert c.reopen_at is not None and c.reopen_at > 1.0 and "s" in streams
    assert streams["s"].reopen().offset == 0 and c.reopen_at is None
    route(streams, ErrorMsg(BAD_FORMAT, "no", stream="s"), 2.0)
    assert "s" not in streams


def test_busy_refusals_of_a_resume_back_off_until_the_resume_timeout() -> None:
    c = core()
    e = entry(c)
    streams = {"s": e}
    e.resume(until=20.0)
    now, waits = 0.0, []
    while "s" in streams:
        route(streams, ErrorMsg(OVERLOADED, "busy", stream="s"), now)
        if c.reopen_at is not None:
            waits.append(c.reopen_at - now)
            now = c.reopen_at
            e.reopen()
    assert waits == [REOPEN_S, 2 * REOPEN_S, 4 * REOPEN_S, MAX_REOPEN_S]  # 15 s: the next would end past 20
    failure = e.events.get_nowait()[1]
    assert isinstance(failure, StreamError) and failure.code == LOST and failure.stream == "s"


def test_a_resume_has_until_its_deadline_to_make_progress_however_often_it_is_lost() -> None:
    """`ready` is no progress: an ingest may take the re-open, then never ack what is resent (or
    crash on it), and every loss would start a fresh resume. An ack of resent audio or a final is."""
    c = core()
    e = entry(c)
    streams = {"s": e}
    c.push(b"\0" * 100)  # 50 frames, never acked
    c.take(1.0)
    e.resume(until=10.0)
    route(streams, Ready("s", window=1000), 2.0)
    c.take(2.0)
    e.resume(until=20.0)  # lost again: the first deadline stands
    assert c.resume_by == 10.0 and not expire(streams, 9.9, "late")
    route(streams, Ready("s", window=1000), 3.0)
    c.take(3.0)
    route(streams, Ack("s", seq=0, samples=50, window=1000), 3.1)
    assert c.resume_by is None  # the next loss gets a deadline of its own
    e.resume(until=30.0)
    route(streams, Ready("s", window=1000), 4.0)
    route(streams, Final("s", seg=0, text="one", start=0.0, end=0.5, durable=0), 4.1)
    assert c.resume_by is None

    e.resume(until=40.0)
    assert expire(streams, 40.0, "no progress") and streams == {}
    failure = [item for _, item in (e.events.get_nowait() for _ in range(e.events.qsize()))][-1]
    assert isinstance(failure, StreamError) and (failure.code, failure.stream) == (LOST, "s")


def test_a_resume_with_less_to_resend_than_the_ingest_acks_is_done_when_ready() -> None:
    """No ack is owed for it, so none may come: a deadline kept would fail the stream at a later loss."""
    c = core()
    e = entry(c)
    c.push(b"\0" * 10)  # 5 frames: less than the 10 (100 ms) the ingest acks at
    c.take(1.0)
    e.resume(until=10.0)
    route({"s": e}, Ready("s", window=1000), 2.0)
    assert c.resume_by is None


def test_only_a_stream_that_was_ready_counts_its_resumes() -> None:
    """An open unanswered when the connection is lost (or made while resuming) is sent again on
    the new connection: the caller never had the stream, so it is opened, not resumed."""
    c = StreamCore("s", priority="realtime", frame_bytes=2, limits=Limits(), rate=100)
    c.rewind(until=60.0)
    assert c.resumes == []
    c.on_ready(1000)
    c.rewind(until=60.0)
    c.rewind(until=60.0)  # lost again before its new `ready`: resumed all the same
    assert c.resumes == [0, 0]


def test_a_refused_resume_waiting_for_its_retry_is_owed_nothing() -> None:
    """Liveness must not take the ingest for lost while the client itself waits to re-open."""
    c = core()
    streams = {"s": entry(c)}
    live = Liveness(0.5)
    streams["s"].resume(until=60.0)
    live.heard(1.0)
    assert live.deadline(streams, 1.0) == 1.5  # the re-open is owed an answer
    route(streams, ErrorMsg(TOO_MANY_STREAMS, "full", stream="s"), 1.2)
    assert live.deadline(streams, 2.0) is None
    streams["s"].reopen()
    assert live.deadline(streams, 2.1) == 2.5


def test_an_error_naming_no_stream_goes_to_no_stream() -> None:
    """The server could not tie it to a stream; neither can the client, so open streams never see it."""
    opened = entry(core())
    pending = Entry(core(), Open(stream="p"), Future(), queue.SimpleQueue())
    streams = {"s": opened, "p": pending}
    assert route(streams, ErrorMsg(BAD_MESSAGE, "header is not valid msgpack"), 1.0) is False
    assert opened.events.empty() and pending.events.empty() and not pending.opened.done()
    assert set(streams) == {"s", "p"}


@pytest.mark.parametrize("bad", [{"stream": "x" * 65}, {"stream": 7}, {"prompt": "word " * 1000},
                                 {"prompt": "w" * (MAX_PROMPT_CHARS + 1)}, {"language": "x" * 17},
                                 {"priority": "urgent"}, {"rate": np.int64(16000)}])
def test_opens_the_server_would_refuse_as_malformed_are_refused_before_sending(bad: dict) -> None:
    with pytest.raises(ValueError):
        check_open(Open(**{"stream": "s", **bad}))


def test_opens_within_the_limits_pass_and_formats_are_left_to_the_server() -> None:
    check_open(Open(stream="x" * 64, prompt="é" * MAX_PROMPT_CHARS, language="en"))
    check_open(Open(stream="s", rate=11025))  # `bad_format` names the stream: the server's answer says it best


def test_liveness_counts_only_while_an_answer_is_owed() -> None:
    c = core()
    streams = {"s": entry(c)}
    live = Liveness(5.0)
    assert live.deadline(streams, 10.0) is None  # ready, nothing sent
    c.push(b"\0" * 20)  # 10 frames: 100 ms at rate 100
    c.take(10.0)
    assert live.deadline(streams, 11.0) == 15.0  # clock restarted at the last check with nothing owed
    live.heard(12.0)
    assert live.deadline(streams, 13.0) == 17.0
    c.on_ack(Ack("s", seq=0, samples=10, window=1000))
    assert live.deadline(streams, 30.0) is None
