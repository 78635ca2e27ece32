"""The ingest's loop goes on turning whatever happens around it, and stops in order.

A real ingest server, on the test's main thread (signals go to the main thread), with real
sockets on loopback and real shm, and no broker or workers: their absence is the fault.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import msgpack
import numpy as np
import psutil
import pytest
import zmq
from structlog.testing import capture_logs
from zmq.utils.monitor import recv_monitor_message

from conftest import ROOT

from broker import jobs
from broker.signals import StopSignal
from config import settings
from ingest import server as ingest_server
from ingest.server import IngestServer, _drain
from ingest.session import Session
from protocol import messages as m
from shm import pool
from streamasr.service import free_ports
from streaming import connections_from, read_wav, speech_files, wait_for

FRAME = 1600  # 100 ms at 16 kHz


def client(endpoint: str, streams: list[str], got: dict[str, list[m.ServerMessage]]) -> None:
    """Open the streams, send a tone on each until the ingest closes them, and keep what it says."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)
    tone = (8000 * np.sin(np.arange(FRAME) * 2 * np.pi * 440 / 16000)).astype("<i2").tobytes()
    for sid in streams:
        sock.send_multipart(m.encode(m.Open(stream=sid)))
    seq = dict.fromkeys(streams, 0)
    try:
        while not all(any(isinstance(msg, m.Closed) for msg in got[sid]) for sid in streams):
            if not sock.poll(20_000):
                return
            msg = m.decode_server(sock.recv_multipart())
            got[msg.stream].append(msg)  # type: ignore[union-attr]
            if isinstance(msg, (m.Ready, m.Ack)) and msg.stream in seq:
                sid = msg.stream
                sock.send_multipart(m.encode(m.Audio(stream=sid, seq=seq[sid], data=tone)))
                seq[sid] += 1
    finally:
        sock.close()
        ctx.term()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[IngestServer]:
    """An ingest of an instance of its own; closed by `run`, or here if the test did not run it."""
    yield from _server(tmp_path)


def _server(tmp_path: Path, **ingest: float) -> Iterator[IngestServer]:
    """`ingest`: settings of its [ingest] table beside the ports and the short drain."""
    base = free_ports(2)
    instance = f"test{uuid.uuid4().hex[:8]}"
    cfg = settings.load(None, {
        "instance": instance, "run_dir": str(tmp_path / instance),
        "ingest": {"address": f"tcp://127.0.0.1:{base}", "port_base": base + 1, "drain_timeout_s": 1.0, "drain_pause_s": 0.5,
                   **ingest},
        "shm": {"streams_per_ingest": 4, "ring_seconds": 26.0},  # the smallest rings settings allow
    })
    server = IngestServer(cfg, 0)
    yield server
    if pool.segments(instance):
        server.close()
    assert pool.segments(instance) == []


def test_sigterm_in_the_middle_of_a_turn_drains_the_streams(server: IngestServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The signal lands while the loop steps one of two streams, in the middle of iterating the
    streams it must step this turn. Handled there, marking every stream to be ended would change
    that set under the loop and end the process with its streams unanswered. The ingest must
    instead end both streams, tell their client, and stop in order."""
    cfg = server.cfg
    streams = ["a", "b"]
    got: dict[str, list[m.ServerMessage]] = {sid: [] for sid in streams}
    talker = threading.Thread(target=client, args=(cfg.ingest_endpoint(0), streams, got), daemon=True)
    step = Session.step
    signalled: list[bool] = []

    def step_and_signal(session: Session) -> None:
        if (not signalled and len(server.dirty) < len(server.sessions) == len(streams)
                and all(s.in_frames >= 3 * FRAME for s in server.sessions.values())):
            signalled.append(True)
            os.kill(os.getpid(), signal.SIGTERM)  # its handler runs here, before the step goes on
        step(session)

    monkeypatch.setattr(Session, "step", step_and_signal)

    def unhandled(_signum: int, _frame: object) -> None:
        raise AssertionError("SIGTERM reached no handler of the ingest's")  # rather than end the test run

    previous = signal.signal(signal.SIGTERM, unhandled)  # the ingest installs its own while it runs
    try:
        talker.start()
        with StopSignal() as stop:
            server.run(stop)
    finally:
        signal.signal(signal.SIGTERM, previous)
    talker.join(10)
    assert signalled, "the signal was never sent"
    for sid in streams:
        closed = [msg for msg in got[sid] if isinstance(msg, m.Closed)]
        assert len(closed) == 1 and closed[0].reason == "shutdown", got[sid]
        assert closed[0].audio_s >= 0.3
    assert pool.segments(cfg.instance) == []


def test_a_draining_ingest_tells_the_broker_at_once(server: IngestServer) -> None:
    """The front door picks an ingest for each new client from the ingests' heartbeats: one that
    begins to drain says so at once, not up to a heartbeat later, and a broker that asks it to
    register again meanwhile hears it too."""
    broker = zmq.Context.instance().socket(zmq.ROUTER)
    broker.setsockopt(zmq.LINGER, 0)
    broker.bind(server.cfg.broker_ingest_endpoint)
    try:
        server.hb_sent = time.monotonic()  # no heartbeat due
        server.begin_drain()
        server._register()
        got = []
        while len(got) < 3 and broker.poll(10_000):
            got.append(broker.recv_multipart())
    finally:
        broker.close()
    assert [kind for _, kind, _ in got] == [jobs.READY, jobs.HEARTBEAT, jobs.READY]
    assert [jobs.unpack(body)["draining"] for _, _, body in got] == [False, True, True]


def test_a_broker_away_never_blocks_the_loop(server: IngestServer) -> None:
    """What the ingest sends to a broker that is away (dead, or restarting) queues until the link
    is given up for lost; past ZeroMQ's default limit of 1,000 messages, a send would block the
    loop, and every client with it. Here no broker was ever there, and the heartbeats the loop
    sends, 2,000 of them, must all leave at once: queued, not dropped, so a broker that comes up
    gets the registration and every one of them, in order."""

    def blocked(_signum: int, _frame: object) -> None:
        raise TimeoutError("a send to the absent broker blocked")  # interrupts the send

    previous = signal.signal(signal.SIGALRM, blocked)
    signal.setitimer(signal.ITIMER_REAL, 20)
    try:
        for _ in range(2000):
            server.hb_sent = 0.0  # a heartbeat is due
            server.broker_seen = time.monotonic()  # and the broker not yet given up for lost
            server._heartbeat(time.monotonic())
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)

    broker = zmq.Context.instance().socket(zmq.ROUTER)
    broker.setsockopt(zmq.LINGER, 0)
    broker.bind(server.cfg.broker_ingest_endpoint)
    got: list[list[bytes]] = []
    try:
        while len(got) < 2001 and broker.poll(10_000):
            got.append(broker.recv_multipart())
        assert not broker.poll(200), "more than the registration and the heartbeats sent"
    finally:
        broker.close()
    assert len(got) == 2001, f"{len(got)} of the registration and 2,000 heartbeats reached the broker"
    assert {ident for ident, *_ in got} == {b"ingest-0"}
    assert [kind for _, kind, _ in got] == [jobs.READY] + [jobs.HEARTBEAT] * 2000
    assert all(jobs.unpack(body)["streams"] == 0 for _, _, body in got[1:])


def test_a_broker_away_for_long_is_said_once_a_minute(server: IngestServer) -> None:
    """While the broker stays away the ingest reconnects each patience (3 s), and it wrote
    `ingest.broker_lost` each time: a broker down for an hour made some 1,200 warnings of each
    ingest. It says the broker is lost once, then that it is still away at most once a minute,
    with how long and after how many reconnects, and once that it is back. No broker here;
    the loop's clock is stepped through ten minutes rather than waited."""
    patience = server.hb_interval * server.cfg.broker.liveness
    start = time.monotonic()
    with capture_logs() as logs:
        for turn in range(1, 201):  # each a patience on from the last: the broker is given up for lost each time
            server._heartbeat(start + turn * (patience + 0.001))
        server._on_broker([jobs.HEARTBEAT, jobs.pack({})])  # the broker is back
    told = [e for e in logs if e["event"].startswith("ingest.broker_")]
    lost, *still, back = told
    assert lost["event"] == "ingest.broker_lost" and lost["log_level"] == "warning", lost
    assert lost["endpoint"] == server.cfg.broker_ingest_endpoint and lost["socket_file"] == "missing", lost
    assert {e["event"] for e in still} == {"ingest.broker_still_away"} and len(still) >= 9, told
    assert all(e["log_level"] == "warning" and e["socket_file"] == "missing" for e in still), still
    away = [0.0] + [e["away_s"] for e in still]
    assert all(later - earlier >= ingest_server.BROKER_AWAY_REPEAT_S - 1 for earlier, later in zip(away, away[1:])), away
    assert [e["reconnects"] for e in still] == sorted({e["reconnects"] for e in still}), still
    assert back["event"] == "ingest.broker_back" and back["log_level"] == "info" and back["reconnects"] == 200, back


def test_a_broker_stopped_is_said_lost_once_and_back_once(tmp_path: Path) -> None:
    """An ingest process whose broker is not there (stopped, or not started yet) says so once,
    reconnects each patience without a line each, and says once, with how long it was away and
    how many reconnects, when the broker is heard again. The heartbeats are short here (a
    patience of 0.1 s), and the broker is away for ten patiences and its own start."""
    base = free_ports(2)
    instance = f"test{uuid.uuid4().hex[:8]}"
    cfg = settings.load(None, {
        "instance": instance, "run_dir": str(tmp_path / instance),
        "ingest": {"address": f"tcp://127.0.0.1:{base}", "port_base": base + 1},
        "broker": {"heartbeat_ms": 50, "liveness": 2},
    })
    config = tmp_path / "service.toml"
    config.write_text(settings.dump(cfg))
    log = tmp_path / "ingest.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def events(name: str) -> list[dict]:
        return [e for line in log.read_text().splitlines() if line.startswith("{") and (e := json.loads(line))["event"] == name]

    with log.open("w") as err:
        ingest = subprocess.Popen([sys.executable, "-m", "ingest", "--config", str(config)], cwd=ROOT, stderr=err, env=env)
    broker = None
    try:
        wait_for(lambda: events("ingest.broker_lost"), 60, "the ingest to find the broker lost")
        time.sleep(1.0)  # ten patiences with the broker away
        broker = subprocess.Popen([sys.executable, "-m", "broker", "--config", str(config)], cwd=ROOT, stderr=subprocess.DEVNULL,
                                  env=env)
        [back] = wait_for(lambda: events("ingest.broker_back"), 60, "the ingest to hear the broker again")
    finally:
        for proc in (broker, ingest):
            if proc is not None:
                proc.terminate()
                proc.wait(30)
        pool.reclaim(instance)
    [lost] = events("ingest.broker_lost")
    assert lost["level"] == "warning" and lost["endpoint"] == cfg.broker_ingest_endpoint and lost["socket_file"] == "missing", lost
    assert back["level"] == "info" and back["reconnects"] >= 3 and back["away_s"] > 1.0, back
    assert len(events("ingest.broker_still_away")) <= back["away_s"] // ingest_server.BROKER_AWAY_REPEAT_S


@contextmanager
def client_socket(server: IngestServer) -> Iterator[zmq.Socket]:
    """A client's DEALER connected to the ingest."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(server.endpoint)
    try:
        yield sock
    finally:
        sock.close()


def serve_until(server: IngestServer, sock: zmq.Socket, done: Callable[[list[m.ServerMessage]], bool]) -> list[m.ServerMessage]:
    """Turn the clients' part of the ingest's loop until its client has got what `done` waits for."""
    got: list[m.ServerMessage] = []

    def turn() -> bool:
        _drain(server.clients, server._on_client, copy=False)
        server._flush()
        while sock.poll(0):
            got.append(m.decode_server(sock.recv_multipart()))
        return done(got)

    wait_for(turn, what="the ingest's answer", interval=0.01)
    return got


def test_a_batch_stream_waiting_for_its_window_is_not_closed_as_idle(server: IngestServer) -> None:
    """A batch client must not send past its window, and under load the window may not move for
    longer than `idle_timeout_s` (its finals wait behind everyone else's). That wait is the
    service's: the stream must stay open, and only the client's own silence, once the service
    has given it room again, counts towards the idle timeout."""
    with client_socket(server) as sock:
        sock.send_multipart(m.encode(m.Open(stream="b", priority="batch")))
        [ready] = serve_until(server, sock, bool)
        assert isinstance(ready, m.Ready)
        sent = ready.window // FRAME  # 100 ms messages while they fit: the next one waits for room
        for seq in range(sent):
            sock.send_multipart(m.encode(m.Audio(stream="b", seq=seq, data=bytes(2 * FRAME))))
        serve_until(server, sock, lambda got: any(isinstance(a, m.Ack) and a.samples == sent * FRAME for a in got))
        [session] = server.sessions.values()
        assert session.window() == ready.window
        idle = server.cfg.ingest.idle_timeout_s
        waited = time.monotonic() + 2 * idle  # no room for twice the idle timeout: the service is behind
        server._sweep(waited)
        assert not session.ending, "closed as idle while it waited for its window"

        server._run_vad(time.monotonic())  # the service catches up: the silence is classified, the ring freed
        server._flush()
        [ack] = serve_until(server, sock, bool)
        assert isinstance(ack, m.Ack) and ack.window > ready.window
        server._sweep(waited)
        assert not session.ending, "room it was just told of is not idleness"
        server._sweep(waited + idle + 1)  # the client never uses it: it is gone
        assert session.ending and session.close_reason == "idle_timeout"


def test_a_language_the_model_does_not_transcribe_is_refused_at_open(server: IngestServer) -> None:
    """An English-only model decodes every stream as English: a stream opened in French would get
    English words for its French speech, with nothing to say why. Refused at the open, the
    client hears it at once; a code spelled otherwise (capitals, a region) is the same language."""
    with client_socket(server) as sock:
        sock.send_multipart(m.encode(m.Open(stream="fr", language="fr")))
        [refused] = serve_until(server, sock, bool)
        assert isinstance(refused, m.ErrorMsg) and (refused.code, refused.stream) == (m.UNKNOWN_LANGUAGE, "fr")
        assert "'fr'" in refused.message and "whisper-tiny.en" in refused.message and "(en)" in refused.message
        for stream, language in (("en", "EN-us"), ("blank", "")):  # no language ("" as nil): the model's own
            sock.send_multipart(m.encode(m.Open(stream=stream, language=language)))
            [ready] = serve_until(server, sock, bool)
            assert isinstance(ready, m.Ready) and ready.stream == stream
        # a resume's language is held to the same: its partials would be decoded in it
        sock.send_multipart(m.encode(m.Open(stream="es", offset=16_000, resume_text="Hola.", resume_language="es")))
        [refused] = serve_until(server, sock, bool)
        assert isinstance(refused, m.ErrorMsg) and (refused.code, refused.stream) == (m.UNKNOWN_LANGUAGE, "es")
        assert refused.message.startswith("resume_language: language 'es' is not one"), refused.message
        sock.send_multipart(m.encode(m.Open(stream="en-resumed", offset=16_000, resume_language="EN")))
        [ready] = serve_until(server, sock, bool)
        assert isinstance(ready, m.Ready) and ready.stream == "en-resumed"


def test_a_stop_while_the_ingest_starts_leaves_no_shm_behind(tmp_path: Path) -> None:
    """supervisord may stop an ingest at any moment of its start (a `stop` right after a crash
    restarted it). The process must never leave its segment (a ring per stream, ~1 GB by default)
    in /dev/shm: the next `serve` of another instance would find no room for its own."""
    base = free_ports(2)
    instance = f"test{uuid.uuid4().hex[:8]}"
    config = tmp_path / "ingest.toml"
    config.write_text(settings.dump(settings.load(None, {
        "instance": instance, "run_dir": str(tmp_path / instance),
        "ingest": {"address": f"tcp://127.0.0.1:{base}", "port_base": base + 1, "drain_timeout_s": 1.0, "drain_pause_s": 0.5},
        "shm": {"streams_per_ingest": 4, "ring_seconds": 26.0},
    })))
    log = tmp_path / "ingest.log"
    # at once (the default action may still end it: nothing was made yet), at a few moments of
    # the start, and when its segment exists and when it is ready (its handler is in place by
    # then: it must drain, unlink the segment and exit 0)
    for when in (0.0, 0.6, 1.2, 1.8, "segment", "ready"):
        with log.open("w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "ingest", "--config", str(config)], cwd=ROOT,
                                    stdout=out, stderr=subprocess.STDOUT)
        try:
            if when == "segment":
                wait_for(lambda: pool.segments(instance), 60, "the ingest's segment")
            elif when == "ready":
                wait_for(lambda: '"ingest.ready"' in log.read_text(), 60, "the ingest ready")
            else:
                time.sleep(when)
            proc.send_signal(signal.SIGTERM)
            status = proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
            left = pool.segments(instance)
            pool.reclaim(instance)
        assert status in ((0,) if isinstance(when, str) else (0, -signal.SIGTERM)), (when, log.read_text()[-2000:])
        assert left == [], (when, log.read_text()[-2000:])


def test_a_client_that_stops_reading_is_taken_as_gone_and_its_streams_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection still open whose client stopped reading fills the ingest's queue for it. What
    the ingest then has for it (a final perhaps) cannot be queued, nor anything after it in
    order: the connection is taken as gone and its streams dropped, as for a closed one, so that
    the client, finding the ingest silent, resumes them from their `durable` rather than go on
    with answers missing. The queue is shortened here, so that the kernel's buffers and a few
    thousand answers fill it."""
    monkeypatch.setattr(ingest_server, "CLIENT_QUEUE", 5)
    made = _server(tmp_path)
    server = next(made)
    try:
        with client_socket(server) as other:
            other.send_multipart(m.encode(m.Open(stream="other")))
            serve_until(server, other, lambda got: any(isinstance(a, m.Ready) for a in got))
            stuck = zmq.Context.instance().socket(zmq.DEALER)
            stuck.linger = 0
            stuck.setsockopt(zmq.RCVHWM, 1)
            stuck.setsockopt(zmq.RCVBUF, 4096)
            stuck.connect(server.endpoint)
            try:
                stuck.send_multipart(m.encode(m.Open(stream="a", priority="batch")))
                session = wait_for(lambda: (_drain(server.clients, server._on_client, copy=False), server._flush(),
                                            next((s for s in server.sessions.values() if s.opened.stream == "a"), None))[-1],
                                   what="the stream open")
                bad = m.encode(m.Open(stream="b", rate="r" * 4000))  # answered `bad_format`, quoting the rate
                for _ in range(40):  # the client reads none of it
                    for _ in range(100):
                        stuck.send_multipart(bad)
                    _drain(server.clients, server._on_client, copy=False)
                    server._flush()
                    if session.abandoned:
                        break
                assert session.abandoned, "the stream of a client that stopped reading was kept"
                assert stuck in zmq.select([], [stuck], [], 0)[1]  # it can still send: the connection is open
            finally:
                stuck.close()
            other.send_multipart(m.encode(m.Audio(stream="other", seq=0, data=bytes(2 * FRAME))))
            got = serve_until(server, other, lambda got: any(isinstance(a, m.Ack) for a in got))
            assert [type(a) for a in got] == [m.Ack], got  # the other connection is untouched
    finally:
        next(made, None)  # the fixture's end: closed, and its shm checked


# A client that opens a stream, reads its `ready`, and then waits: stopped, it answers nothing.
_WAITING_CLIENT = """
import sys, time, zmq
from protocol import messages as m
sock = zmq.Context().socket(zmq.DEALER)
sock.connect(sys.argv[1])
sock.send_multipart(m.encode(m.Open(stream="a")))
sock.recv_multipart()
print("ready", flush=True)
time.sleep(600)
"""


def test_a_client_that_stops_answering_has_its_connection_closed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client whose host vanished (powered off, its network cut, a NAT that forgot the
    connection) sends no FIN. On a connection the ingest has nothing to send on (its streams
    closed, or the client quiet between them) nothing tells it so: it would hold the connection,
    a file descriptor and ZeroMQ's state for it, for ever, and a service up for weeks, its clients
    coming and going, would gather them until it could accept no more. A client process stopped
    (SIGSTOP) answers nothing either. The ingest pings its clients and closes a connection that
    answers nothing; one that answers keeps its own. The intervals are shortened here."""
    monkeypatch.setattr(m, "CLIENT_HEARTBEAT_MS", 100)
    monkeypatch.setattr(m, "CLIENT_HEARTBEAT_TIMEOUT_MS", 1000)
    made = _server(tmp_path)
    server = next(made)
    frozen = subprocess.Popen([sys.executable, "-c", _WAITING_CLIENT, server.endpoint], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        with client_socket(server) as alive:
            alive.send_multipart(m.encode(m.Open(stream="b")))
            serve_until(server, alive, lambda got: any(isinstance(a, m.Ready) for a in got))
            wait_for(lambda: (_drain(server.clients, server._on_client, copy=False), server._flush(), len(server.sessions) == 2)[-1],
                     what="the waiting client's stream open")
            assert frozen.stdout is not None and frozen.stdout.readline() == "ready\n"
            port = next(c.laddr.port for c in psutil.Process(frozen.pid).net_connections("tcp") if c.raddr)
            assert connections_from(port) == 1
            frozen.send_signal(signal.SIGSTOP)
            wait_for(lambda: connections_from(port) == 0, 10, "the connection of the client that answers nothing closed")
            alive.send_multipart(m.encode(m.Audio(stream="b", seq=0, data=bytes(2 * FRAME))))
            got = serve_until(server, alive, lambda got: any(isinstance(a, m.Ack) for a in got))
            assert [type(a) for a in got] == [m.Ack], got  # the client that answers is still served
    finally:
        frozen.kill()
        frozen.send_signal(signal.SIGCONT)
        frozen.wait()
        next(made, None)  # the fixture's end: closed, and its shm checked


def test_a_closed_connection_s_streams_are_dropped_and_their_rings_kept_until_their_jobs_are_answered(server: IngestServer) -> None:
    """A client that closed its connection (it resumed elsewhere, or died) can be answered no
    more: its streams are dropped as soon as a message for it fails, and make no more jobs. A
    ring goes back to the pool only once the jobs already out are answered: a worker may still
    be reading it, and the next stream would be given that very ring. The other connection's
    stream is untouched. No broker here: the jobs are answered on the ingest's results socket,
    as a worker does."""
    speech = read_wav(speech_files()[0])[: 2 * 3 * 16_000]  # 3 s: a segment, and partials every 0.5 s of it
    results = zmq.Context.instance().socket(zmq.PUSH)
    results.linger = 0
    results.connect(server.cfg.ingest_results_endpoint(0))

    def turn() -> None:
        _drain(server.clients, server._on_client, copy=False)
        _drain(server.results, server._on_worker)
        if server.vad.signal.poll(0):
            server._on_vad()
        server._run_vad(time.monotonic())
        server._flush()

    def answer(job_id: int) -> None:
        now = time.monotonic()
        results.send_multipart([jobs.RESULTS, jobs.pack_results([jobs.JobResult(job_id=job_id, ingest=0, text="words",
                                                                                 started=now, finished=now)])])

    with client_socket(server) as other:
        other.send_multipart(m.encode(m.Open(stream="other")))
        wait_for(lambda: (turn(), len(server.sessions) == 1)[1], what="the other stream open")
        gone = zmq.Context.instance().socket(zmq.DEALER)
        gone.linger = 0
        gone.connect(server.endpoint)
        gone.send_multipart(m.encode(m.Open(stream="a")))
        frames = range(0, len(speech), 2 * FRAME)

        def taken(sent: int, jobs: int) -> Session | None:
            turn()
            found = [s for s in server.sessions.values() if s.opened.stream == "a"]
            return found[0] if found and found[0].in_frames == sent and len(found[0].inflight) >= jobs else None

        for jobs_out, part in enumerate((frames[: len(frames) // 2], frames[len(frames) // 2 :]), start=1):
            for at in part:  # in two parts: a partial is asked at most once a turn
                gone.send_multipart(m.encode(m.Audio(stream="a", seq=at // (2 * FRAME), data=speech[at : at + 2 * FRAME])))
            sent = min(len(speech), part[-1] + 2 * FRAME) // 2
            session = wait_for(lambda: taken(sent, jobs_out), what=f"{sent} frames taken and {jobs_out} decodes out")
        rings = server.pool.in_use
        first, *rest = sorted(session.inflight)
        monitor = server.clients.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            gone.close()
            assert monitor.poll(10_000), "the server never saw the connection end"
            recv_monitor_message(monitor)  # ZeroMQ's I/O thread ended it: a send to it now fails
        finally:
            server.clients.disable_monitor()
            monitor.close(linger=0)
        answer(first)
        wait_for(lambda: (turn(), session.abandoned and first not in session.inflight)[1],
                 what="the stream dropped when its partial could not be sent")
        assert session.key in server.sessions and server.pool.in_use == rings, "the ring went back with decodes out"
        assert sorted(session.inflight) == rest and not session.vad_chunk_due(1)
        for job_id in rest:
            answer(job_id)
        wait_for(lambda: (turn(), session.key not in server.sessions)[1], what="the stream closed once its jobs were answered")
        assert server.pool.in_use == rings - 1
        other.send_multipart(m.encode(m.Audio(stream="other", seq=0, data=bytes(2 * FRAME))))
        got = serve_until(server, other, lambda got: any(isinstance(a, m.Ack) for a in got))
        assert [type(a) for a in got] == [m.Ready, m.Ack] and got[1].samples == FRAME, got
    results.close()


def _answer(sock: zmq.Socket) -> m.ServerMessage:
    assert sock.poll(10_000), "the ingest did not answer"
    return m.decode_server(sock.recv_multipart())


def test_streams_of_a_connection_closed_before_their_audio_give_their_rings_back_at_once(tmp_path: Path) -> None:
    """A client that opens streams and closes its connection before it sends them audio (it died,
    a dialler hung up at once) fails no send: the ingest has nothing to say to it. Its streams
    held their rings until the idle timeout, and rings are an ingest's capacity: a run of such
    short calls turned every new stream away. One stream that took silence, acknowledged, owes
    its client nothing either. They are dropped once the connection is closed, and the next
    client's opens are taken. The idle timeout is an hour here: nothing else frees the rings."""
    made = _server(tmp_path, idle_timeout_s=3600.0)
    server = next(made)
    slots = server.pool.slots
    taken: list[str] = []
    failed: list[BaseException] = []

    def open_stream(sock: zmq.Socket, stream: str) -> bool:
        sock.send_multipart(m.encode(m.Open(stream=stream)))
        answer = _answer(sock)
        if isinstance(answer, m.ErrorMsg) and answer.code == m.TOO_MANY_STREAMS:
            return False  # the rings are still held: asked again, as a client told "try again later" does
        assert isinstance(answer, m.Ready) and answer.stream == stream, answer
        return True

    def clients() -> None:
        try:
            with client_socket(server) as gone:
                for i in range(slots):
                    assert open_stream(gone, f"a{i}")
                gone.send_multipart(m.encode(m.Audio(stream="a0", seq=0, data=bytes(2 * FRAME))))
                ack = _answer(gone)
                assert isinstance(ack, m.Ack) and ack.samples == FRAME, ack
            with client_socket(server) as sock:
                for i in range(slots):
                    wait_for(lambda: open_stream(sock, f"b{i}"), 30, f"a ring for stream b{i}")
                    taken.append(f"b{i}")
        except BaseException as exc:  # told by the test's thread, once the ingest has stopped
            failed.append(exc)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # the ingest drains and stops

    talker = threading.Thread(target=clients, daemon=True)
    try:
        talker.start()
        with StopSignal() as stop:
            server.run(stop)
        talker.join(10)
    finally:
        next(made, None)  # the fixture's end: closed, and its shm checked
    assert not failed, failed
    assert taken == [f"b{i}" for i in range(slots)]


def test_a_connection_still_there_asked_whether_it_is_gone_keeps_its_streams(server: IngestServer) -> None:
    """ZeroMQ reports a closed connection by its file descriptor only, which a new connection may
    have taken by the time the report is read: that one is asked too, sent its last ack again. A
    connection still there takes it as the ack of a resend, and keeps its streams."""
    with client_socket(server) as sock:
        sock.send_multipart(m.encode(m.Open(stream="a")))
        serve_until(server, sock, bool)
        sock.send_multipart(m.encode(m.Audio(stream="a", seq=0, data=bytes(2 * FRAME))))
        [ack] = serve_until(server, sock, bool)
        assert isinstance(ack, m.Ack) and ack.seq == 0, ack
        [session] = server.sessions.values()
        # as a report of its descriptor leaves it, SUSPECT_WAIT_S ago
        server.suspects[session.client] = time.monotonic() - ingest_server.SUSPECT_WAIT_S
        server._sweep(time.monotonic())
        [again] = serve_until(server, sock, bool)
        assert again == ack
        assert not server.gone and not session.abandoned and server.sessions == {session.key: session}
        sock.send_multipart(m.encode(m.Audio(stream="a", seq=1, data=bytes(2 * FRAME))))
        [ack] = serve_until(server, sock, bool)
        assert isinstance(ack, m.Ack) and ack.seq == 1 and ack.samples == 2 * FRAME, ack


def _rss_mb() -> float:
    """This process's resident memory: the ingest under test runs in it. What was freed is given
    back first (malloc_trim), so the test's own messages, sent and gone, do not count."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def test_a_client_that_never_reads_its_refusals_cannot_fill_the_ingest_s_memory(server: IngestServer) -> None:
    """Every refusal waits in the ingest for its client, up to CLIENT_QUEUE of them per
    connection. A refusal quoting in full what it refuses (31 unknown fields of 4096 characters,
    a rate that is a list of 64 such strings) is as large as the message, 130 kB and more: a
    client that sends such messages and never reads would have the ingest hold gigabytes, until
    it and every stream it serves were killed for memory. A refusal quotes a bounded part."""
    fields = {f"{i:02d}" + "k" * 4090: 0 for i in range(31)}
    hostile = [msgpack.packb({"type": "hello", **fields}), msgpack.packb({"type": "open", "stream": "s", "rate": ["r" * 4096] * 64})]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.setsockopt(zmq.RCVHWM, 1)  # it reads nothing: the answers queue in the ingest
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.setsockopt(zmq.SNDHWM, 20)  # the 130 MB sent wait in the ingest, if anywhere, not in the sender's queue
    sock.connect(server.endpoint)
    try:
        before = _rss_mb()
        for i in range(1000):
            while True:
                try:
                    sock.send(hostile[i % 2], zmq.NOBLOCK)
                    break
                except zmq.Again:  # the ingest, in this thread, reads them
                    _drain(server.clients, server._on_client, copy=False)
        wait_for(lambda: (_drain(server.clients, server._on_client, copy=False), not server.clients.poll(100))[1],
                 what="the messages read")
        grown = _rss_mb() - before
        assert not server.gone, "the connection was taken as gone"
        assert grown < 40, f"the ingest holds {grown:.0f} MB for a client's 1000 unread refusals"
        refusal = m.decode_server(sock.recv_multipart())
        assert isinstance(refusal, m.ErrorMsg) and refusal.code == m.BAD_MESSAGE and "unknown fields '00kkk" in refusal.message
        assert "and 27 more" in refusal.message and len(refusal.message) < 400, refusal.message
    finally:
        sock.close()


def _lone_ingest_config(tmp_path: Path) -> tuple[int, str, Path]:
    """A config for one ingest process run by hand: its front door's port (the ingest's is the
    next), its instance name and the config file."""
    base = free_ports(2)
    instance = f"test{uuid.uuid4().hex[:8]}"
    config = tmp_path / "ingest.toml"
    config.write_text(settings.dump(settings.load(None, {
        "instance": instance, "run_dir": str(tmp_path / instance),
        "ingest": {"address": f"tcp://127.0.0.1:{base}", "port_base": base + 1},
    })))
    return base, instance, config


def test_an_ingest_that_crashes_says_so_in_one_json_line_with_its_traceback(tmp_path: Path) -> None:
    """Its log is read as JSON lines (`jq` over the run directory's logs): a crash must be one
    more such line, `ingest.crashed` with the traceback, as the broker's and workers' are, not a
    bare Python traceback that stops `jq` at its first line."""
    base, instance, config = _lone_ingest_config(tmp_path)
    taken = zmq.Context.instance().socket(zmq.ROUTER)  # another program took the ingest's port
    taken.linger = 0
    taken.bind(f"tcp://127.0.0.1:{base + 1}")
    try:
        proc = subprocess.run([sys.executable, "-m", "ingest", "--config", str(config)], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
    finally:
        taken.close()
        pool.reclaim(instance)
    assert proc.returncode == 1, proc.stderr[-2000:]
    events = [json.loads(line) for line in proc.stderr.splitlines()]  # every line is JSON
    [crash] = [e for e in events if e["event"] == "ingest.crashed"]
    assert crash["level"] == "error" and crash["ingest"] == 0
    assert "Traceback" in crash["exception"] and "Address already in use" in crash["exception"]


def test_an_ingest_whose_port_is_held_fails_its_start_before_its_imports(tmp_path: Path) -> None:
    """An ingest whose port another process held spent about 2 s importing ONNX Runtime each
    time before its bind failed: later than the `startsecs` of 1 s it had then, so supervisord
    started it again at once, for ever, a core spent crash-looping. It tries its port first: a
    start fails at once, without the imports, and is backed off."""
    base, instance, config = _lone_ingest_config(tmp_path)
    with socket.socket() as taken:  # another program's listening socket on the ingest's port
        taken.bind(("127.0.0.1", base + 1))
        taken.listen()
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "ingest", "--config", str(config)], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
    pool.reclaim(instance)
    assert proc.returncode == 1, proc.stderr[-2000:]
    imported = [line.rpartition("|")[2].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert "structlog" in imported  # -X importtime reports the imports: this is no vacuous check
    assert not any(name.startswith(("onnxruntime", "ingest.server", "shm")) for name in imported), \
        "the ingest loaded its model runtime before finding its port held"
    [crash] = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{") and '"ingest.crashed"' in line]
    assert f"cannot bind tcp://127.0.0.1:{base + 1}: Address already in use" in crash["exception"]
