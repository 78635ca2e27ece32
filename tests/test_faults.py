"""Real processes killed under real streams: no stream loses audio or sees an error.

Each test SIGKILLs (or SIGTERMs) a process that supervisord runs, with pids taken from
supervisord itself, while streams are in flight, and compares every stream's finals with a run
of the same audio without the fault. Streams are opened with partials off, so the finals are the
only decodes and the comparison is exact.
"""

from __future__ import annotations

import configparser
import contextlib
import difflib
import json
import os
import resource
import signal
import socket
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import zmq

from conftest import Service, running, start_service
from shm import pool
from streamasr import service as svc
from streamasr import supervised
from streaming import (CHUNK_FRAMES, RATE, StreamClient, StreamResult, connections_from, pid_of, read_wav, send_paced,
                       speech_files, stream_many, wait_for)

GAP = np.zeros(12_000, np.int16).tobytes()  # 0.75 s of silence: a pause ends a segment
FAULT_SPEED = 3.0  # three times real time: long enough to hit streams mid-flight


def concat(paths: list[Path]) -> bytes:
    return GAP.join(read_wav(p) for p in paths) + GAP


@pytest.fixture(scope="module")
def corpus() -> dict[str, bytes]:
    """Three streams of 12-17 s, several segments each."""
    files = speech_files()
    return {f"stream{i}": concat(files[i::3]) for i in range(3)}


@pytest.fixture(scope="module")
def asr(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    # One request per decode: a batched decode's text can depend on which other requests share
    # the batch, and a fault changes the batches, so only unbatched finals compare exactly.
    # Admission off: the baseline sends every stream at once, and the backlog it leaves must not
    # turn the next test's streams away; nor may streams sent at three times real time, each
    # costing three live ones (test_overload covers admission).
    tmp = tmp_path_factory.mktemp("faults")
    with running(tmp, model="whisper-tiny.en", workers=2, model_options={"max_batch": 1},
                 ingest={"admit_max_load_s": 0, "admit_max_busy": 0}) as service:
        yield service


@pytest.fixture(scope="module")
def baseline(asr: Service, corpus: dict[str, bytes]) -> dict[str, list[tuple[float, float, str]]]:
    results = stream_many(asr.address, corpus, speed=None, partials=False)
    for r in results.values():
        assert r.errors == [] and r.closed is not None and r.closed.reason == "end", r
        assert r.finals, r
    return {name: finals(r) for name, r in results.items()}


def finals(result: StreamResult) -> list[tuple[float, float, str]]:
    """(start, end, text) of each final: times too, so a resumed stream must continue them."""
    return [(round(f.start, 2), round(f.end, 2), f.text) for f in result.finals]


def restarted(service: Service, program: str, old_pid: int) -> int:
    """Wait until supervisord runs `program` again under a new pid; returns it."""
    def check() -> int | None:
        info = next(p for p in svc.processes(service.cfg) if p["name"] == program)
        return info["pid"] if info["statename"] in svc.UP_STATES and info["pid"] != old_pid else None
    return wait_for(check, 120, f"supervisord to restart {program}")


def busy_worker(service: Service) -> dict[str, Any] | None:
    report = svc.status(service.cfg)
    return next((w for w in report.get("workers", []) if w["inflight"] > 0), None)


def words(segments: list[tuple[float, float, str]]) -> list[str]:
    return " ".join(text for _, _, text in segments).lower().replace(".", "").replace(",", "").split()


def assert_unchanged(results: dict[str, StreamResult], baseline: dict[str, list[tuple[float, float, str]]]) -> None:
    for name, result in results.items():
        assert result.refused is None and result.errors == [], (name, result.refused, result.errors)
        assert result.closed is not None and result.closed.reason == "end", (name, result.closed)
        assert finals(result) == baseline[name], (name, result.resumes)


def holds_a_job(service: Service, worker_id: str) -> bool:
    return any(w["id"] == worker_id and w["inflight"] > 0 for w in svc.status(service.cfg).get("workers", []))


def test_worker_killed_mid_job(asr: Service, corpus: dict[str, bytes], baseline: dict[str, list[tuple[float, float, str]]]) -> None:
    killed: dict[str, Any] = {}
    stop = threading.Event()  # the streams are done: a killer still looking must not outlive the test

    def kill_busy_worker() -> None:
        # A worker seen busy may have answered by the time a signal lands: it is stopped first, so
        # that it cannot answer, and killed only if the broker still counts a job on it (asked
        # twice: an answer sent just before the stop has reached the broker by the second reply).
        while not stop.is_set():
            worker = wait_for(lambda: stop.is_set() or busy_worker(asr), 120, "a worker holding a job", interval=0.02)
            if stop.is_set():
                return
            logged = len(asr.events("broker"))  # a worker held stopped too long is lost (and back) before it is killed
            os.kill(worker["pid"], signal.SIGSTOP)
            try:
                if holds_a_job(asr, worker["id"]) and holds_a_job(asr, worker["id"]):
                    os.kill(worker["pid"], signal.SIGKILL)
                    killed.update(worker, logged=logged)
                    return
            finally:
                if not killed:
                    os.kill(worker["pid"], signal.SIGCONT)

    killer = threading.Thread(target=kill_busy_worker, daemon=True)
    killer.start()
    try:
        results = stream_many(asr.address, corpus, speed=FAULT_SPEED, partials=False)
    finally:
        stop.set()
        killer.join(60)
    assert not killer.is_alive(), "the killer thread did not stop"
    assert killed, "no worker was ever seen holding a job"
    assert_unchanged(results, baseline)
    name = "worker-" + killed["id"].split("-")[1]
    restarted(asr, name, killed["pid"])
    # the broker gave the killed worker up and queued its job again for the other
    lost = [e for e in asr.events("broker")[killed["logged"]:] if e["event"] == "broker.worker_lost" and e["worker"] == killed["id"]]
    assert len(lost) == 1 and lost[0]["requeued"] >= 1, lost
    # and the worker supervisord started in its place registered with the broker (a new pid, the same index)
    index = killed["id"].split("-")[1]
    wait_for(lambda: any(e["event"] == "broker.worker_ready" and e["worker"].split("-")[1] == index and e["worker"] != killed["id"]
                         for e in asr.events("broker")[killed["logged"]:]), 60, "the restarted worker's READY")


def test_broker_killed(asr: Service, corpus: dict[str, bytes], baseline: dict[str, list[tuple[float, float, str]]]) -> None:
    broker_pid = pid_of(asr, "broker")
    fired = threading.Event()
    logged: dict[str, int] = {}  # log lines per program before the kill: this module's service logged earlier tests too

    def kill_broker(client: StreamClient, pos: int) -> None:
        if pos > client.total // 3 and not fired.is_set():
            fired.set()
            logged.update({program: len(asr.events(program)) for program in ("broker", "ingest-0")})
            os.kill(broker_pid, signal.SIGKILL)

    results = stream_many(asr.address, corpus, speed=FAULT_SPEED, partials=False, on_progress=kill_broker)
    assert fired.is_set()
    assert_unchanged(results, baseline)
    restarted(asr, "broker", broker_pid)
    # the ingest re-registered: the new broker asked it to, or it noticed the silence first ...
    since = [e["event"] for e in asr.events("ingest-0")[logged["ingest-0"]:]]
    assert {"ingest.broker_asks_to_register", "ingest.broker_lost"} & set(since), since
    # ... and the restarted broker took it on
    wait_for(lambda: any(e["event"] == "broker.ingest_ready" and e["ingest"] == 0
                         for e in asr.events("broker")[logged["broker"]:]), 60, "the new broker to register ingest 0")


def test_ingest_killed_client_resumes(asr: Service, corpus: dict[str, bytes], baseline: dict[str, list[tuple[float, float, str]]]) -> None:
    ingest_pid = pid_of(asr, "ingest-0")
    (segment,) = pool.segments(asr.cfg.instance)
    inode = (pool.SHM_DIR / segment).stat().st_ino
    fired = threading.Event()

    def kill_ingest(client: StreamClient, pos: int) -> None:
        # mid-stream, once a final is out: the resume must keep it and resend only what follows
        if client.stream == "stream0" and client.durable > 0 and not fired.is_set():
            fired.set()
            os.kill(ingest_pid, signal.SIGKILL)

    results = stream_many(asr.address, corpus, speed=2.0, partials=False, resume=True, on_progress=kill_ingest)
    assert fired.is_set(), "stream0 sent all its audio before its first final: nothing was killed"
    # it saw the connection fail and resent only the audio after its delivered finals
    assert results["stream0"].resumes and results["stream0"].resumes[0] > 0
    for name, result in results.items():
        assert result.refused is None and result.errors == [], (name, result.refused, result.errors)
        assert result.closed is not None and result.closed.reason == "end", (name, result.closed)
        got, want = finals(result), baseline[name]
        # Nothing lost, nothing repeated: the same segments, times continued from the offset.
        # The restarted VAD starts without the dead one's recurrent state, so the boundary of
        # the first segment after the resume may move by a few 32 ms chunks, and its text vary
        # as any decode of slightly different audio may.
        assert len(got) == len(want), (name, got, want)
        for (start, end, text), (start0, end0, text0) in zip(got, want):
            assert abs(start - start0) <= 0.25 and abs(end - end0) <= 0.25, (name, got, want)
            if not result.resumes or end0 <= result.resumes[0] / 16_000:
                assert text == text0, (name, got, want)  # before the resume point: untouched
        similarity = difflib.SequenceMatcher(None, words(got), words(want)).ratio()
        assert similarity >= 0.8, (name, got, want)
    restarted(asr, "ingest-0", ingest_pid)
    # the restart replaced the dead process's segment: same name, a new file, nothing left over
    assert pool.segments(asr.cfg.instance) == [segment]
    assert (pool.SHM_DIR / segment).stat().st_ino != inode
    # and said so, on a line an operator finds by the ingest's index as all of that process's lines
    lines = asr.events("ingest-0")
    assert any(e["event"] == "shm.leftover_unlinked" for e in lines)
    assert all(e.get("ingest") == 0 for e in lines), [e for e in lines if e.get("ingest") != 0][:3]


def test_sigterm_drains_open_streams(service_factory: Any) -> None:
    # a worker may be held up for a second here and not be given up for lost
    service = service_factory(model="null", workers=2, broker={"heartbeat_ms": 1000, "liveness": 10})
    workers = [p["pid"] for p in svc.processes(service.cfg) if p["name"].startswith("worker-")]
    assert len(workers) == 2
    files = speech_files()
    buffers = {f"drain{i}": concat(files[i::3]) for i in range(3)}
    # the same audio streamed whole, with no stop: the segments the drained streams must match
    whole = {name.removeprefix("whole-"): finals(r) for name, r in
             stream_many(service.address, {f"whole-{n}": pcm for n, pcm in buffers.items()}, speed=None, partials=False).items()}
    stopping = threading.Event()
    draining = threading.Event()

    def resume_workers() -> None:
        try:
            wait_for(lambda: "ingest.draining" in service.logs("ingest-0"), 30, "the drain to begin")
            draining.set()
            time.sleep(1.0)  # the drain waits on the finals while the clients send 2 s of audio more
        finally:
            for pid in workers:
                os.kill(pid, signal.SIGCONT)

    def stop_midway(client: StreamClient, pos: int) -> None:
        # SIGTERM to supervisord, as `streamasr stop` sends it. (The CLI itself polls the pid,
        # which stays a zombie here until this test, its parent, reaps it.) The workers are held
        # up for a while, so that audio arrives after the drain began and before it ends. The
        # clients send nothing more until the drain has begun (supervisord may take a second to
        # act on the signal): what the service takes ends near a third of each stream.
        if pos > client.total // 3:
            if not stopping.is_set():
                stopping.set()
                for pid in workers:
                    os.kill(pid, signal.SIGSTOP)
                service.proc.send_signal(signal.SIGTERM)
                threading.Thread(target=resume_workers, daemon=True).start()
            draining.wait(30)

    pids = [p["pid"] for p in svc.processes(service.cfg) if p["pid"]]
    results = stream_many(service.address, buffers, speed=2.0, partials=False, on_progress=stop_midway)
    spoke_on = 0
    for name, result in results.items():
        closed = result.closed
        assert closed is not None and closed.reason == "shutdown", (name, closed)
        taken = round(closed.audio_s * RATE)  # input frames the service accepted before the stop
        third = len(buffers[name]) // 2 // 3  # where the clients held off until the drain began
        assert 0 < taken < len(buffers[name]) // 2, (name, closed)
        # what the service accepted was transcribed and delivered, each segment whole, as in the
        # run without a stop: a stream speaking when the drain began took audio up to its next
        # pause, so no utterance was finalised at the cut and none is left for the resumed stream
        # to finish alone (a segment opens pad_ms, 0.4 s, before its speech)
        got, want = finals(result), whole[name]
        assert got == [f for f in want if f[0] + 0.4 < closed.audio_s], (name, closed.audio_s, got, want)
        assert all(end <= closed.audio_s + 0.01 for _, end, _ in got), (name, closed.audio_s, got)
        spoke_on += any(start + 0.4 < third / RATE < end for start, end, _ in got)
        assert closed.segments == len(result.finals), (name, result)
        # audio the client kept sending after the stream ended is refused, never dropped silently:
        # each message the service read before `closed` was taken or refused by its seq, the
        # refusals starting at the first message not taken
        assert all(e.code == "not_ready" and "shutting down" in e.message for e in result.errors), result.errors
        first = -(-taken // CHUNK_FRAMES)
        assert [e.seq for e in result.errors] == list(range(first, first + len(result.errors))), (name, taken, result.errors)
    assert spoke_on, "no stream was speaking when the drain began: the test shows nothing"
    assert "ingest.segment_cut_at_shutdown" not in service.logs("ingest-0")
    # the workers held up, the drain outlasts the frames sent behind the stop for streams mid-segment
    assert any(result.errors for result in results.values()), results
    # within supervisord's stop timeouts (ingest drains first, then workers, then the broker)
    assert service.proc.wait(60) == 0
    for pid in pids:
        assert not _alive(pid), f"pid {pid} outlived the stop"
    assert pool.segments(service.cfg.instance) == []
    assert "ingest.stream_abandoned_at_shutdown" not in service.logs("ingest-0")
    # a clean stop: each worker says goodbye, none is given up for lost
    broker = service.logs("broker")
    assert broker.count("broker.worker_left") == 2 and "broker.worker_lost" not in broker


def test_a_rolling_restart_of_the_ingests_ends_no_stream(service_factory: Any) -> None:
    """A deploy restarts the ingest processes one at a time (SIGTERM, as `supervisorctl restart`
    sends). The reference clients' streams on the one stopping must go on elsewhere: every
    second of their audio taken and transcribed, each ended by its own `end`, no error shown."""
    from client import Client
    from protocol.messages import Closed, ErrorMsg, Final

    service = service_factory(model="null", workers=1, ingests=2)
    pcm = np.frombuffer(b"".join(read_wav(f) for f in speech_files()[:3]), np.int16)  # ~12 s of speech
    clients = [Client(service.address) for _ in range(2)]  # one per ingest: the front door spreads them
    events: dict[str, list[Any]] = {}
    failures: list[BaseException] = []

    def stream(client: Client, name: str) -> None:
        try:
            s = client.open(partials=False)
            send_paced(s, pcm)
            events[name] = list(s.events(timeout=60))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failures.append(exc)

    try:
        threads = [threading.Thread(target=stream, args=(c, f"{i}-{j}")) for i, c in enumerate(clients) for j in range(2)]
        for t in threads:
            t.start()
        for program in ("ingest-0", "ingest-1"):
            time.sleep(1.0)
            old = pid_of(service, program)
            os.kill(old, signal.SIGTERM)
            restarted(service, program, old)
        for t in threads:
            t.join(90)
    finally:
        for c in clients:
            c.close()
    assert not failures, failures
    assert len(events) == 4
    for name, got in events.items():
        assert not [e for e in got if isinstance(e, ErrorMsg)], (name, got)
        assert any(isinstance(e, Final) for e in got), name
        closed = got[-1]
        assert isinstance(closed, Closed) and closed.reason == "end", (name, closed)
        assert closed.audio_s == pytest.approx(len(pcm) / RATE, abs=0.01), (name, closed)
    assert all(c.reconnects >= 1 for c in clients), [c.reconnects for c in clients]


def test_a_stream_abandoned_at_shutdown_is_told_so(service_factory: Any) -> None:
    """A stop whose drain runs out (the only worker hangs on the stream's final) ends the ingest
    with that stream still open: its client must get `closed` "shutdown", sent in the ingest's
    last moments, rather than wait for an answer that will never come. (The reference clients
    then try to resume it elsewhere: `test_client_resume.py`.)"""
    service = service_factory(model="null", workers=1, ingest={"drain_timeout_s": 1.0, "drain_pause_s": 0.5})
    [worker] = [p["pid"] for p in svc.processes(service.cfg) if p["name"].startswith("worker") and p["pid"]]

    def hang_the_worker(client: StreamClient, pos: int) -> None:
        if pos == CHUNK_FRAMES:  # from the first message on, no final is decoded
            os.kill(worker, signal.SIGSTOP)

    def final_owed() -> bool:  # the stream's final made, never to be answered: at the worker, or queued again
        report = svc.status(service.cfg)
        return report.get("inflight", 0) > 0 or report.get("queued", {}).get("realtime", 0) > 0

    def stop_once_the_final_is_owed() -> None:
        wait_for(final_owed, 30, "the stream's final at the hung worker")
        service.proc.send_signal(signal.SIGTERM)

    stopper = threading.Thread(target=stop_once_the_final_is_owed, daemon=True)
    stopper.start()
    try:
        result = StreamClient(service.address, read_wav(speech_files()[0]), speed=None, partials=False,
                              timeout=30, on_progress=hang_the_worker).run()
    finally:
        os.kill(worker, signal.SIGCONT)
        stopper.join(5)
    assert result.closed is not None and result.closed.reason == "shutdown", result
    assert service.proc.wait(60) == 0  # supervisord gone: every line its programs wrote is in their logs
    assert "ingest.stream_abandoned_at_shutdown" in service.logs("ingest-0")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


CONNECTIONS = 1_100  # past the soft limit most systems give a login (1024), and supervisord's floor (minfds)


def test_more_client_connections_than_the_usual_open_files_limit_are_all_served(tmp_path: Path) -> None:
    """Every client connection is a descriptor of the ingest's (and, for a hello, of the broker's).
    At the limit libzmq cannot accept, and retries at once for ever: the process spins a core
    while a new client hangs unanswered. `serve` started from a shell with the usual soft limit
    (1024; supervisord raises a lower one to that) must run its programs at the hard limit, so
    that connections past 1024 are served."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 5 * CONNECTIONS:
        pytest.skip(f"the hard limit on open files here ({hard}) is below what the test opens")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # a login shell's soft limit, or lower
    try:
        service = start_service(tmp_path, model="null", workers=1)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    ctx = zmq.Context()
    ctx.max_sockets = 2 * CONNECTIONS + 16
    idle: list[zmq.Socket] = []
    try:
        pids = {name: pid_of(service, name) for name in ("broker", "ingest-0")}
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # this process holds them all, and a socket each
        for port in (int(service.address.rsplit(":", 1)[1]), service.cfg.ingest.port_base):
            for _ in range(CONNECTIONS):
                sock = ctx.socket(zmq.DEALER)
                sock.linger = 0
                sock.connect(f"tcp://127.0.0.1:{port}")  # ZMTP answered on its own: the connection stays up, idle
                idle.append(sock)
            # connect() returns at once: wait for more than a process at 1024 could hold
            wait_for(lambda: connections_from(port) > 1024, 60, f"{CONNECTIONS} connections to port {port}")
        result = StreamClient(service.address, read_wav(speech_files()[0]), speed=None, timeout=60).run()
        assert result.errors == [] and result.closed is not None and result.closed.reason == "end", result
        assert result.text
        assert {name: pid_of(service, name) for name in pids} == pids
    finally:
        for sock in idle:
            sock.close()
        ctx.term()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        service.stop()
    assert pool.segments(service.cfg.instance) == []


def test_a_sighup_to_a_program_stops_it_cleanly_and_supervisord_starts_it_again(service_factory: Any) -> None:
    """`kill -HUP` to a program (a reload, to many daemons) ended it on the spot, its default
    action: an ingest's streams were cut undrained and its shm segment left for the next start to
    reclaim, the dashboard's carried totals unsaved. It is a stop: each program stops as on
    SIGTERM (the ingest drains and unlinks its segment), and supervisord starts it again."""
    service = service_factory(model="null", workers=1)
    for program, role in (("ingest-0", "ingest"), ("broker", "broker"), ("dashboard", "dashboard")):
        old = pid_of(service, program)
        os.kill(old, signal.SIGHUP)
        restarted(service, program, old)
        events = service.events(program)
        assert any(e["event"] == f"{role}.stopped" and e["pid"] == old for e in events), (program, events)
    assert not any(e["event"] == "shm.leftover_unlinked" for e in service.events("ingest-0"))
    wait_for(lambda: svc.status(service.cfg).get("ready"), 60, "the service ready again")
    result = StreamClient(service.address, read_wav(speech_files()[0]), speed=None, timeout=60).run()
    assert result.errors == [] and result.closed is not None and result.closed.reason == "end" and result.text, result


# ---------------------------------------------------------------- programs supervisord gave up on

GIVE_UP_WAIT_S = 300  # a first start and supervisord's ten retries, a second more apart each (55 s of waits), on a busy machine
RETRY_S = 20.0  # [supervisor] fatal_retry_s here: long enough to look at the FATAL program before it is started again


@contextlib.contextmanager
def port_held_from(service: Service, program: str, port: int) -> Iterator[None]:
    """Kill `program` and listen on its TCP port before supervisord's next start of it can bind it
    (another process holding it for a while: a scanner, a container restarting); let it go after."""
    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ's listeners: the kernel still refuses them the port
    try:
        while True:  # the program started again in time and bound it first: once more
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid_of(service, program), signal.SIGKILL)
            with contextlib.suppress(AssertionError):
                wait_for(lambda: _bound(held, port), 5, f"{program}'s port", interval=0.01)
                break
        held.listen()
        yield
    finally:
        held.close()


def _bound(sock: socket.socket, port: int) -> bool:
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        return False
    return True


def given_up_report(service: Service, program: str) -> dict[str, Any]:
    """`status` once supervisord has given `program` up (FATAL): run as an operator would."""
    wait_for(lambda: program in svc.given_up(svc.status(service.cfg)), GIVE_UP_WAIT_S, f"supervisord to give {program} up", interval=0.5)
    return json.loads(service.cli("status", "--json").stdout)


def test_a_program_given_up_on_is_shown_and_started_again_once_its_port_is_free(service_factory: Any) -> None:
    """Another process held the broker's port for longer than supervisord's ten retries (about a
    minute, the broker failing within a second each time): supervisord put it in FATAL and never
    started it again, the instance down for good. `status` and the dashboard name it FATAL with
    its last words, and `revive` starts it again, logged, once the port is free."""
    service = service_factory(model="null", workers=1, supervisor={"fatal_retry_s": RETRY_S})
    with port_held_from(service, "broker", int(service.cfg.ingest.address.rpartition(":")[2])):
        report = given_up_report(service, "broker")
        broker = next(p for p in report["processes"] if p["name"] == "broker")
        assert broker["state"] == "FATAL" and "Address already in use" in broker["why"], broker
        text = service.cli("status")
        assert text.returncode == 1 and "supervisord gave up starting broker (FATAL)" in text.stdout, text.stdout
        url = f"http://127.0.0.1:{service.cfg.metrics.dashboard_port}/api/snapshot"

        def shown() -> dict[str, Any] | None:
            with urllib.request.urlopen(url, timeout=5) as reply:
                rows = json.loads(reply.read())["processes"]
            return next((p for p in rows if p["name"] == "broker" and p["state"] == "FATAL"), None)

        assert "Address already in use" in wait_for(shown, 30, "the dashboard to show the broker FATAL")["why"]
    report = svc.wait_ready(service.cfg, GIVE_UP_WAIT_S + RETRY_S)
    assert report["ready"] and svc.complete(report) and not svc.given_up(report), report
    restarts = [e for e in service.events("revive") if e["event"] == "revive.restart"]
    assert restarts and restarts[0]["program"] == "broker" and restarts[0]["fatal_s"] >= RETRY_S, restarts
    assert "Address already in use" in restarts[0]["why"], restarts



def graphs_linked_into(cache: Path) -> list[Path]:
    """A model cache (`[model] cache_dir`) of links to the graphs whisper-tiny.en has exported, one
    directory each, in the order a worker loads them: one of its files can be damaged without
    touching the cache every other test shares."""
    from config.settings import ModelConfig
    from speech.loader import ensure_all_exported

    linked = []
    for exported in ensure_all_exported(ModelConfig(name="whisper-tiny.en")):
        graphs = cache / "onnx" / exported.name
        graphs.mkdir(parents=True)
        for file in exported.iterdir():
            (graphs / file.name).symlink_to(file)
        linked.append(graphs)
    return linked


def test_a_worker_whose_model_fails_to_load_late_in_its_start_is_given_up_not_started_again_at_once(
        service_factory: Any, tmp_path: Path) -> None:
    """A worker found its model's graph cut short seconds into its start (a disk fault, a copy
    interrupted), after importing ONNX Runtime and loading the graphs before it: later than a
    `startsecs` of 1 s, so supervisord counted each try a start and started it again at once, for
    ever, a core spent loading, never FATAL and never named in `status`. Its failed starts are
    backed off, given up after `startretries`, named FATAL with the model's error, and `revive`
    starts it again once the file is whole."""
    conf = configparser.RawConfigParser()
    conf.read(svc.SUPERVISORD_CONF)
    tries = 1 + conf.getint("program:worker", "startretries")  # the first start and its retries
    cache = tmp_path / "model-cache"
    broken = graphs_linked_into(cache)[-1] / "decoder.onnx"  # the last graph a worker loads
    service = service_factory(model="whisper-tiny.en", workers=1, model_options={"cache_dir": str(cache)},
                              supervisor={"fatal_retry_s": RETRY_S})
    whole = broken.resolve()
    broken.unlink()
    with open(whole, "rb") as graph:
        broken.write_bytes(graph.read(1 << 20))  # its first MiB
    with supervised.rpc(service.cfg.run_path / "supervisor.sock") as rpc:  # restarted: it finds the file so from now on
        rpc.stopProcess("worker:worker-0")
        rpc.startProcess("worker:worker-0", False)

    def failed_starts() -> int:
        return len({e["pid"] for e in service.events("worker-0") if e["event"] == "worker.crashed"})

    backing_off: list[dict[str, Any]] = []

    def given_up() -> bool:
        assert failed_starts() <= tries, f"worker-0 failed to load its model {failed_starts()} times, started again at once each time"
        report = svc.status(service.cfg)
        backing_off.extend(p for p in report["processes"] if p["name"] == "worker-0" and p["state"] == "BACKOFF")
        return "worker-0" in svc.given_up(report)

    wait_for(given_up, GIVE_UP_WAIT_S, "supervisord to give worker-0 up", interval=0.5)
    assert failed_starts() == tries
    # while supervisord waits to try again, a minute before it gives up, `status` says why already
    assert backing_off and all("decoder.onnx" in p.get("why", "") for p in backing_off), backing_off
    report = json.loads(service.cli("status", "--json").stdout)
    worker = next(p for p in report["processes"] if p["name"] == "worker-0")
    assert worker["state"] == "FATAL", worker
    assert "Exited too quickly" in worker["why"] and "INVALID_PROTOBUF" in worker["why"] and "decoder.onnx" in worker["why"], worker
    text = service.cli("status")
    assert text.returncode == 1 and "supervisord gave up starting worker-0 (FATAL)" in text.stdout, text.stdout

    broken.unlink()
    broken.symlink_to(whole)  # the file mended: `revive` starts the worker again, which loads it
    report = svc.wait_ready(service.cfg, RETRY_S + GIVE_UP_WAIT_S)
    assert report["ready"] and svc.complete(report) and not svc.given_up(report), report
    restarts = [e for e in service.events("revive") if e["event"] == "revive.restart"]
    assert restarts and restarts[0]["program"] == "worker-0" and "INVALID_PROTOBUF" in restarts[0]["why"], restarts
