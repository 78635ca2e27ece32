"""Hostile input over real sockets: over 100,000 random and mutated messages against a running
service while a well-behaved stream runs beside them.

Every message gets exactly the reply the protocol promises — an `error` with the code the
reference decoder (protocol.messages) predicts, or a welcome/status where the message is valid —
no process dies, and the good stream's transcript does not change. Hypothesis chooses the
message templates and the mutation seed; each example expands them into a thousand messages and
sends them in bulk, so the volume costs seconds, not minutes.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from typing import Any, Iterator

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import Service, running
from protocol import messages as m
from streamasr import service as svc
from streaming import StreamClient, hello, read_wav, speech_files, wait_for

FIELDS = ["type", "version", "stream", "rate", "encoding", "channels", "language", "model", "partials",
          "priority", "prompt", "offset", "resume_text", "resume_language", "seq", "data", "junk"]
TYPES = ["hello", "open", "audio", "end", "status", "welcome", "bogus", ""]
PER_EXAMPLE = 1000
TOTAL = 100_000
EXAMPLES = TOTAL // PER_EXAMPLE + 5
GAP = np.zeros(8_000, np.int16).tobytes()

values = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1), st.floats(),
    st.text(max_size=80), st.binary(max_size=80), st.lists(st.integers(-5, 5), max_size=4),
    st.sampled_from([1, 16000, 44100, 7, "pcm_s16le", "f32le", "pcm_mulaw", "pcm_alaw", "realtime", "batch", "s1", 2**63]),
)
headers = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), values, max_size=9).flatmap(
    lambda d: st.sampled_from(TYPES).map(lambda t: {**d, "type": t}) | st.just(d))
template = st.tuples(
    st.one_of(headers.map(lambda h: msgpack.packb(h, use_bin_type=True)), st.binary(max_size=64)),
    st.lists(st.binary(max_size=700), max_size=2),  # extra frames: audio payloads or junk
)


def mutate(rng: random.Random, header: bytes, extra: list[bytes]) -> list[bytes]:
    """One hostile variant of a template: truncated, bit-flipped, grown, lying about lengths."""
    kind = rng.randrange(10)
    if kind == 1 and header:
        header = header[: rng.randrange(len(header))]
    elif kind == 2 and header:
        i = rng.randrange(len(header))
        header = header[:i] + bytes([header[i] ^ (1 << rng.randrange(8))]) + header[i + 1:]
    elif kind == 3:
        header = header + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 16)))
    elif kind == 4:  # a str32 / map32 / array32 claiming 4 GiB, then nothing
        header = rng.choice([b"\xdb", b"\xdf", b"\xdd", b"\xc6"]) + b"\xff\xff\xff\xff" + header[:8]
    elif kind == 5:  # deep nesting
        header = b"\x91" * rng.randrange(100, 5000) + b"\xc0"
    elif kind == 6:  # a valid audio header for a stream nobody opened, or with a lying seq
        header = msgpack.packb({"type": "audio", "stream": "s" * rng.randrange(1, 70), "seq": rng.choice([0, -1, 2**64 - 1, 1.5])})
    elif kind == 7 and rng.random() < 0.1:  # an audio frame over the frame limit (rare: 300 kB each)
        header = msgpack.packb({"type": "audio", "stream": "s1", "seq": 0})
        extra = [bytes(300_000)]
    frames = [header, *extra][: rng.randrange(1, 4)] if kind == 8 else [header, *extra]
    return frames


def expect_ingest(frames: list[bytes], limits: m.Limits) -> str | None:
    """The reply the ingest owes `frames`, from a connection with no open stream (None: skip it)."""
    try:
        msg = m.decode_client(frames, limits)
    except m.ProtocolError as exc:
        return exc.code
    if isinstance(msg, m.Open):
        return None  # a valid open opens a stream: not hostile, and it would change the expectations
    if isinstance(msg, (m.Audio, m.End)):
        return m.UNKNOWN_STREAM
    return m.BAD_MESSAGE  # hello and status belong to the front door


def expect_front(frames: list[bytes], limits: m.Limits) -> str:
    """The reply the front door owes `frames` (it strips a REQ-style empty delimiter)."""
    body = frames[1:] if len(frames) > 1 and frames[0] == b"" else frames
    try:
        msg = m.decode_client(body, limits)
    except m.ProtocolError as exc:
        return exc.code
    if isinstance(msg, m.Hello):
        return "welcome"
    if isinstance(msg, m.Status):
        return "status"
    return m.BAD_MESSAGE  # open, audio and end go to an ingest


def reply_kind(frames: list[bytes]) -> str:
    while frames and frames[0] == b"":
        frames = frames[1:]
    msg = m.decode_server(frames)
    return msg.code if isinstance(msg, m.ErrorMsg) else msg.type


def exchange(sock: zmq.Socket, batch: list[list[bytes]], timeout_ms: int = 60_000) -> Counter[str]:
    """Send a batch, then read exactly one reply per message."""
    got: Counter[str] = Counter()
    for i, frames in enumerate(batch):
        sock.send_multipart(frames)
        if i % 200 == 199:  # keep both directions moving so no high-water mark is reached
            while sock.poll(0):
                got[reply_kind(sock.recv_multipart())] += 1
    while sum(got.values()) < len(batch):
        assert sock.poll(timeout_ms), f"{len(batch) - sum(got.values())} of {len(batch)} messages unanswered"
        got[reply_kind(sock.recv_multipart())] += 1
    return got


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with running(tmp_path_factory.mktemp("fuzz"), model="null", workers=2) as service:
        yield service


def connect(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def pids(service: Service) -> dict[str, int]:
    return {p["name"]: p["pid"] for p in svc.processes(service.cfg) if p["group"] != "dashboard"}


def test_fuzz_while_a_good_stream_runs(target: Service) -> None:
    limits = m.Limits(target.cfg.ingest.max_frame_bytes, target.cfg.ingest.max_message_bytes)
    pcm = GAP.join(read_wav(p) for p in speech_files()[:4])
    baseline = StreamClient(target.address, pcm, "good", speed=None).run()
    assert baseline.errors == [] and baseline.finals
    before = pids(target)

    good: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: good.update(r=StreamClient(target.address, pcm, "good", speed=1.0).run()))
    runner.start()

    welcome = hello(target.address)
    ingest, front = connect(welcome.ingest), connect(target.address)
    sent = Counter[str]()

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(templates=st.lists(template, min_size=5, max_size=25), seed=st.integers(0, 2**32))
    def bulk(templates: list[tuple[bytes, list[bytes]]], seed: int) -> None:
        rng = random.Random(seed)
        to_ingest: list[list[bytes]] = []
        to_front: list[list[bytes]] = []
        want_ingest: Counter[str] = Counter()
        want_front: Counter[str] = Counter()
        while len(to_ingest) + len(to_front) < PER_EXAMPLE:
            header, extra = rng.choice(templates)
            frames = mutate(rng, header, extra)
            if rng.random() < 0.7:
                code = expect_ingest(frames, limits)
                if code is not None:
                    to_ingest.append(frames)
                    want_ingest[code] += 1
            else:
                to_front.append(frames)
                want_front[expect_front(frames, limits)] += 1
        assert exchange(ingest, to_ingest) == want_ingest
        assert exchange(front, to_front) == want_front
        sent.update(want_ingest + want_front)

    try:
        bulk()
        stateful = stateful_abuse(welcome.ingest, limits)
    finally:
        ingest.close()
        front.close()
        runner.join(120)
    total = sum(sent.values()) + sum(stateful.values())
    errors = total - sent["welcome"] - sent["status"]
    print(f"fuzz: {total} hostile messages, {errors} error replies: {dict((sent + stateful).most_common())}")
    assert total >= TOTAL

    # the well-behaved stream never noticed
    result = good["r"]
    assert result.errors == [] and result.closed is not None and result.closed.reason == "end"
    assert [(f.start, f.end, f.text) for f in result.finals] == [(f.start, f.end, f.text) for f in baseline.finals]
    assert pids(target) == before, "a process died or restarted"
    assert svc.status(target.cfg).get("ready")


def stateful_abuse(endpoint: str, limits: m.Limits) -> Counter[str]:
    """Valid messages at the wrong moment on an open stream: each refused with its own code."""
    sock = connect(endpoint)
    got: Counter[str] = Counter()
    try:
        sock.send_multipart(m.encode(m.Open(stream="abuse")))
        assert sock.poll(10_000) and isinstance(m.decode_server(sock.recv_multipart()), m.Ready)
        pcm = bytes(3200)
        batch: list[list[bytes]] = []
        want: Counter[str] = Counter()
        for seq in range(1, 1001):  # seq 0 never sent: every one is out of order
            batch.append(m.encode(m.Audio(stream="abuse", seq=seq, data=pcm)))
            want[m.OUT_OF_ORDER] += 1
        for _ in range(500):  # odd byte counts are not whole s16 frames
            batch.append(m.encode(m.Audio(stream="abuse", seq=0, data=b"\x00" * 3)))
            want[m.BAD_FORMAT] += 1
        for _ in range(500):
            batch.append(m.encode(m.Open(stream="abuse")))
            want[m.DUPLICATE_STREAM] += 1
        for bad_open in (m.Open(stream="x", rate=12345), m.Open(stream="x", encoding="mp3"), m.Open(stream="x", channels=0)):
            batch.extend([m.encode(bad_open)] * 300)
            want[m.BAD_FORMAT] += 300
        got.update(exchange(sock, batch))
        assert got == want
        # end the stream, then keep sending to it: unknown once it is closed
        sock.send_multipart(m.encode(m.End(stream="abuse")))
        wait_for(lambda: sock.poll(100) and reply_kind(sock.recv_multipart()) == "closed", 30, "closed")
        late = [m.encode(m.Audio(stream="abuse", seq=s, data=pcm)) for s in range(1000)]
        late += [m.encode(m.End(stream="abuse"))] * 500
        closed = exchange(sock, late)
        assert closed == Counter({m.UNKNOWN_STREAM: 1500})
        got.update(closed)
    finally:
        sock.close()
    return got


def test_oversized_message_drops_only_that_connection(target: Service) -> None:
    """Past max_message_bytes ZeroMQ cuts the sender off before any parsing; the service lives on."""
    before = pids(target)
    welcome = hello(target.address)
    for endpoint in (welcome.ingest, target.address):
        sock = connect(endpoint)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.send_multipart([msgpack.packb({"type": "hello"}), bytes(target.cfg.ingest.max_message_bytes + 1)])
        assert monitor.poll(10_000), "the connection survived an oversized message"
        sock.disable_monitor()
        monitor.close()
        sock.close()
    assert pids(target) == before
    hello(target.address)  # and it still answers
