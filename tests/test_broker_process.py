"""The broker and workers as real processes, driven by a fake ingest over the real sockets.

The fake ingest writes audio into a real shm pool and sends jobs naming slot ranges, exactly as
an ingest process does; workers run the null backend, so the tests time the plumbing only.
"""

from __future__ import annotations

import json
import math
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np
import psutil
import pytest
import zmq
from structlog.testing import capture_logs

from broker import jobs as wire
from broker.broker import SHARE_WINDOW_S, Broker, IngestState, Link
from broker.jobs import FAILED, OK, REALTIME, Job, JobResult
from broker.queue import job_key
from broker.signals import StopSignal
from config import settings
from config.settings import Config
from metrics.registry import endpoint as metrics_endpoint
from protocol import messages as m
from shm import RingPool, reclaim
from streamasr.service import free_ports
from streaming import connections_from

if TYPE_CHECKING:
    from ingest.server import IngestServer

ROOT = Path(__file__).resolve().parents[1]
HEARTBEAT_MS = 100
# 1 s before a silent peer is given up: a process of the test's held up for a few tenths of a
# second on a loaded machine must not count as lost, and a frozen one is found lost soon enough.
LIVENESS = 10
PATIENCE_S = HEARTBEAT_MS * LIVENESS / 1000
MAX_BATCH = 4  # also each worker's capacity: the jobs the broker lets it hold
SAMPLES = 16_000


def wait_for(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class FakeIngest(threading.Thread):
    """Ingest process `index` as the broker and workers see it: READY, heartbeats (with what
    `reported` says), JOBS; collects every RESULTS message, the workers' (on its results
    socket) and the broker's alike, and keeps the broker's last heartbeat figures."""

    def __init__(self, cfg: Config, index: int = 0) -> None:
        super().__init__(daemon=True)
        self.cfg = cfg
        self.index = index
        self.endpoint = cfg.ingest_endpoint(index)
        self.results: list[JobResult] = []
        self.reported: dict[str, int] = {"streams": 0}  # what its heartbeats say
        self.figures: dict[str, Any] = {}  # the broker's, from its last heartbeat
        self.heard = 0  # heartbeats with figures received
        self._out: queue.Queue[list[bytes]] = queue.Queue()
        self._lock = threading.Lock()
        self._stop_event = threading.Event()
        self.register()

    def register(self) -> None:
        self.send([wire.READY, wire.pack({"index": self.index, "endpoint": self.endpoint, "pid": os.getpid(), "streams": 0})])

    def send(self, frames: list[bytes]) -> None:
        self._out.put(frames)

    def submit(self, jobs: list[Job]) -> None:
        self.send([wire.JOBS, wire.pack_jobs(jobs)])

    def answers(self) -> list[JobResult]:
        with self._lock:
            return list(self.results)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(2)

    def run(self) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"ingest-{self.index}".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.cfg.broker_ingest_endpoint)
        results = ctx.socket(zmq.PULL)
        results.setsockopt(zmq.LINGER, 0)
        self.cfg.run_path.mkdir(mode=0o700, parents=True, exist_ok=True)
        results.bind(self.cfg.ingest_results_endpoint(self.index))
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(results, zmq.POLLIN)
        next_hb = 0.0
        try:
            while not self._stop_event.is_set():
                while not self._out.empty():
                    sock.send_multipart(self._out.get())
                if time.monotonic() >= next_hb:
                    sock.send_multipart([wire.HEARTBEAT, wire.pack(self.reported)])
                    next_hb = time.monotonic() + HEARTBEAT_MS / 1000
                for ready in dict(poller.poll(10)):
                    while ready.poll(0):
                        frames = ready.recv_multipart()
                        if frames[0] == wire.RESULTS:
                            with self._lock:
                                self.results += wire.unpack_results(frames[1])
                        elif frames[0] == wire.HEARTBEAT and len(frames) > 1:
                            self.figures = wire.unpack(frames[1])
                            self.heard += 1
        finally:
            sock.close()
            results.close()


@dataclass
class Cluster:
    cfg: Config
    config_file: Path
    dir: Path
    pool: RingPool
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    ingest: FakeIngest | None = None
    _ids: Iterator[int] = field(default_factory=lambda: iter(range(1, 10**9)))

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.dir / f"{name}.log", "ab")
        proc = subprocess.Popen([sys.executable, *args, "--config", str(self.config_file)], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=log)
        log.close()
        self.procs[name] = proc
        return proc

    def start_broker(self) -> subprocess.Popen:
        return self.start("broker", "-m", "broker")

    def configure_broker(self, **fields: Any) -> Config:
        """Change the broker's settings for the processes started after this."""
        self.cfg = replace(self.cfg, broker=replace(self.cfg.broker, **fields))
        self.config_file.write_text(settings.dump(self.cfg))
        return self.cfg

    def start_all(self) -> None:
        """A broker, two workers and the fake ingest, the workers registered."""
        self.start_broker()
        self.start_worker(0)
        self.start_worker(1)
        self.ingest = FakeIngest(self.cfg)
        self.ingest.start()
        self.wait_workers(2)

    def start_worker(self, index: int) -> subprocess.Popen:
        return self.start(f"worker{index}", "-m", "workers", "--index", str(index))

    def log_events(self, name: str) -> list[dict[str, Any]]:
        lines = (self.dir / f"{name}.log").read_text().splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]

    def front(self, payload: bytes, timeout: float = 2.0) -> dict[str, Any]:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.cfg.ingest.address)
        try:
            sock.send(payload)
            assert sock.poll(int(timeout * 1000)), "no answer from the front door"
            return msgpack.unpackb(sock.recv(), raw=False)
        finally:
            sock.close()

    def status(self) -> dict[str, Any]:
        return self.front(msgpack.packb({"type": "status"}))

    def try_front(self, payload: bytes) -> dict[str, Any] | None:
        """The reply, or None while the broker is not (yet) answering."""
        try:
            return self.front(payload, timeout=0.5)
        except AssertionError:
            return None

    def wait_workers(self, n: int, timeout: float = 20) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            status = self.try_front(msgpack.packb({"type": "status"}))
            return status if status and status["ready"] and len(status["workers"]) == n else None

        return wait_for(check, timeout, f"{n} workers registered")

    def jobs(self, n: int, **over: Any) -> list[Job]:
        """`n` finals (never expired, so every one must be run) over one second of audio."""
        now = time.monotonic()
        fields = {"ingest": 0, "shm": self.pool.name, "slot": 0, "generation": self.pool.ring(0).generation,
                  "start": 0, "end": SAMPLES, "final": True, "priority": REALTIME, "deadline": now + 60,
                  "created": now, **over}
        return [Job(job_id=next(self._ids), stream=f"s{i % 5}", seg=i, **fields) for i in range(n)]

    def wait_answers(self, jobs: list[Job], timeout: float = 20) -> dict[int, list[JobResult]]:
        wanted = {j.job_id for j in jobs}
        assert self.ingest is not None
        wait_for(lambda: wanted <= {r.job_id for r in self.ingest.answers()}, timeout, f"answers to {len(jobs)} jobs")
        time.sleep(3 * HEARTBEAT_MS / 1000)  # let duplicates, if any, arrive
        by_job: dict[int, list[JobResult]] = {}
        for r in self.ingest.answers():
            if r.job_id in wanted:
                by_job.setdefault(r.job_id, []).append(r)
        return by_job


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    # A short directory: ipc socket paths are limited to about 100 bytes.
    run = Path(tempfile.mkdtemp(prefix="sasr-"))
    instance = f"t{uuid.uuid4().hex[:8]}"
    base = free_ports(2)  # two ports asked for one at a time may be the same one, freed and handed out again
    cfg = settings.load(None, {
        "instance": instance,
        "run_dir": str(run / "run"),
        "log_level": "info",
        "model": {"name": "null", "backend": "null", "max_batch": MAX_BATCH, "max_wait_ms": 2.0},
        "ingest": {"address": f"tcp://127.0.0.1:{base}", "port_base": base + 1},
        "broker": {"heartbeat_ms": HEARTBEAT_MS, "liveness": LIVENESS},
    })
    config_file = run / "config.toml"
    config_file.write_text(settings.dump(cfg))
    pool = RingPool.create(cfg.shm_name(0), slots=2, capacity=4 * SAMPLES)
    pool.acquire().write(np.zeros(2 * SAMPLES, dtype=np.float32))
    c = Cluster(cfg=cfg, config_file=config_file, dir=run, pool=pool)
    try:
        yield c
    finally:
        if c.ingest is not None:
            c.ingest.stop()
        for proc in c.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        pool.close()
        reclaim(instance)
        shutil.rmtree(run, ignore_errors=True)


@pytest.fixture
def running(cluster: Cluster) -> Cluster:
    cluster.start_all()
    return cluster


def assert_exactly_once(by_job: dict[int, list[JobResult]], jobs: list[Job]) -> None:
    assert sorted(by_job) == sorted(j.job_id for j in jobs)
    dupes = {k: len(v) for k, v in by_job.items() if len(v) != 1}
    assert not dupes, f"jobs answered more than once: {dupes}"


def assert_answered_twice_only_by(by_job: dict[int, list[JobResult]], jobs: list[Job], lost: str) -> set[int]:
    """Every job answered; a job answered twice was also answered by worker index `lost`: its
    answer may reach the ingest while its DONE report never reaches the broker, which then runs
    the job again elsewhere (the ingest keeps the first answer). Returns those jobs."""
    assert sorted(by_job) == sorted(j.job_id for j in jobs)
    twice = {k for k, v in by_job.items() if len(v) > 1}
    for k in twice:
        workers = sorted(r.worker.split("-")[1] for r in by_job[k])
        assert len(workers) == 2 and lost in workers and len(set(workers)) == 2, (k, workers)
    assert len(twice) <= 2 * MAX_BATCH  # at most what the lost worker held
    return twice


def test_every_job_answered_spread_over_workers_within_credit(running: Cluster) -> None:
    jobs = running.jobs(400)
    running.ingest.submit(jobs)
    deadline = time.monotonic() + 30
    while (answered := len(running.ingest.answers())) < len(jobs):
        assert time.monotonic() < deadline, f"{len(jobs) - answered} of {len(jobs)} jobs unanswered after 30 s"
        for w in running.status()["workers"]:
            assert w["inflight"] <= w["capacity"] == MAX_BATCH
    by_job = running.wait_answers(jobs)
    assert_exactly_once(by_job, jobs)
    results = [r[0] for r in by_job.values()]
    assert {r.status for r in results} == {OK}
    assert {r.text for r in results} == {"null model"}
    assert all(1 <= r.batch_size <= MAX_BATCH for r in results)
    assert len(Counter(r.worker for r in results)) == 2, "both workers should have served"
    status = running.status()
    assert status["jobs_done"] >= len(jobs) and status["inflight"] == 0
    # A worker that registered again (given up for lost, or its heartbeats unanswered past the
    # test's 1 s patience on a loaded machine) counts afresh; with no such one the counts add up.
    if sum(e["event"] == "broker.worker_ready" for e in running.log_events("broker")) == 2:
        assert sum(w["jobs_done"] for w in status["workers"]) >= len(jobs)


def test_front_door(running: Cluster) -> None:
    welcome = running.front(msgpack.packb({"type": "hello", "version": 1}))
    assert welcome["type"] == "welcome" and welcome["version"] == 1
    assert welcome["ingest"] == running.cfg.ingest_endpoint(0)
    assert welcome["limits"] == {
        "max_frame_bytes": running.cfg.ingest.max_frame_bytes,
        "max_message_bytes": running.cfg.ingest.max_message_bytes,
        "max_streams_per_client": running.cfg.ingest.max_streams_per_client,
    }
    wrong = running.front(msgpack.packb({"type": "hello", "version": 99}))
    assert (wrong["type"], wrong["code"]) == ("error", "unsupported_version")
    for junk in (b"\xc1 not msgpack", msgpack.packb([1, 2]), msgpack.packb({"type": "dance"}),
                 msgpack.packb({"type": "open", "stream": "a"})):
        reply = running.front(junk)
        assert (reply["type"], reply["code"]) == ("error", "bad_message"), junk
    status = running.status()
    assert status["type"] == "status" and status["ready"] is True
    [ingest] = status["ingests"]
    assert ingest["index"] == 0 and ingest["endpoint"] == running.cfg.ingest_endpoint(0) and ingest["pid"] == os.getpid()
    assert {"streams", "alive_s"} <= set(ingest)
    assert {w["model"] for w in status["workers"]} == {"null"}
    assert set(status["queued"]) == {"realtime", "batch"}
    assert {"inflight", "jobs_done", "expired"} <= set(status)
    too_big = running.try_front(b"\x00" * (running.cfg.ingest.max_message_bytes + 1))
    assert too_big is None  # MAXMSGSIZE: the connection is dropped, nothing is parsed
    assert running.status()["ready"] is True
    events = running.log_events("broker")
    bad = [e["code"] for e in events if e["event"] == "broker.bad_client_message"]
    assert sorted(bad) == ["bad_message"] * 4 + ["unsupported_version"]
    assert all(e["process"] == "broker" and e["pid"] == running.procs["broker"].pid and "level" in e for e in events)
    # ISO 8601 in UTC to the microsecond, as log shippers parse it
    stamps = [datetime.fromisoformat(e["timestamp"]) for e in events if re.fullmatch(r"[\d-]{10}T[\d:]{8}\.\d{6}Z", e["timestamp"])]
    assert len(stamps) == len(events) and all(abs(datetime.now(timezone.utc) - at) < timedelta(minutes=10) for at in stamps)
    assert running.procs["broker"].poll() is None


# A client that says hello, reads the answer, and keeps its connection: stopped, it answers nothing.
_WAITING_CLIENT = """
import sys, time, zmq
from protocol import messages as m
sock = zmq.Context().socket(zmq.DEALER)
sock.connect(sys.argv[1])
sock.send_multipart(m.encode(m.Hello()))
sock.recv_multipart()
print("answered", flush=True)
time.sleep(600)
"""


def test_the_front_door_closes_the_connection_of_a_client_that_stops_answering(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client whose host vanished sends no FIN, and the front door has nothing more to send on
    a connection it answered: held for ever, such connections would gather over weeks of clients
    coming and going, a file descriptor each, until the broker could accept none. The broker
    (here in this process, its front door answered by hand) pings its clients and closes a
    connection that answers nothing, as a stopped (SIGSTOP) client does. Intervals shortened."""
    monkeypatch.setattr(m, "CLIENT_HEARTBEAT_MS", 100)
    monkeypatch.setattr(m, "CLIENT_HEARTBEAT_TIMEOUT_MS", 1000)
    cfg = settings.load(None, {"run_dir": str(tmp_path / "run"), "ingest": {"address": f"tcp://127.0.0.1:{free_ports(1)}"}})
    broker = Broker(cfg)
    broker._front.bind(cfg.ingest.address)
    frozen = subprocess.Popen([sys.executable, "-c", _WAITING_CLIENT, cfg.ingest.address], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})

    def answered() -> bool:
        if not broker._front.poll(100):
            return False
        broker._on_client(broker._front.recv_multipart(), time.monotonic())
        return True

    try:
        wait_for(answered, 10, "the client's hello")
        assert frozen.stdout is not None and frozen.stdout.readline() == "answered\n"
        port = next(c.laddr.port for c in psutil.Process(frozen.pid).net_connections("tcp") if c.raddr)
        assert connections_from(port) == 1
        frozen.send_signal(signal.SIGSTOP)
        wait_for(lambda: connections_from(port) == 0, 10, "the connection of the client that answers nothing closed")
    finally:
        frozen.kill()
        frozen.send_signal(signal.SIGCONT)
        frozen.wait()
        broker.close()


def test_an_answer_the_front_door_cannot_deliver_is_logged_not_dropped_silently(tmp_path: Path) -> None:
    """The front door never waits on a client: an answer to one whose connection closed, or to
    one that reads none of its answers, is dropped. Dropped, but said: the operator sees which
    client and why. The broker here is in this process, its front door served by hand."""
    cfg = settings.load(None, {"run_dir": str(tmp_path / "run"), "ingest": {"address": f"tcp://127.0.0.1:{free_ports(1)}"}})
    broker = Broker(cfg)
    broker._front.bind(cfg.ingest.address)
    ctx = zmq.Context.instance()
    gone, deaf = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    deaf.setsockopt(zmq.RCVBUF, 4096)  # the kernel holds few of the answers it never reads
    deaf.setsockopt(zmq.RCVHWM, 1)
    try:
        with capture_logs() as logs:
            gone.connect(cfg.ingest.address)
            gone.send_multipart(m.encode(m.Hello()))
            assert broker._front.poll(10_000)
            request = broker._front.recv_multipart()
            port = next(c.laddr.port for c in psutil.Process().net_connections("tcp")
                        if c.raddr and c.raddr.port == int(cfg.ingest.address.rsplit(":", 1)[1]))
            gone.close(linger=0)
            wait_for(lambda: connections_from(port) == 0, 10, "the client's connection closed")
            broker._on_client(request, time.monotonic())

            deaf.connect(cfg.ingest.address)
            hello = m.encode(m.Hello())
            for _ in range(400):  # until the answers waiting fill the kernel's buffers and libzmq's queue
                for _ in range(500):
                    deaf.send_multipart(hello)
                while broker._front.poll(50):
                    broker._on_client(broker._front.recv_multipart(), time.monotonic())
                if sum(e["event"] == "broker.answer_undelivered" for e in logs) > 1:
                    break
        said = [(e["answer"], e["why"]) for e in logs if e["event"] == "broker.answer_undelivered"]
        assert said == [("error", "gone"), ("error", "not reading its answers")], said  # not_ready: no ingest here
    finally:
        gone.close(linger=0)
        deaf.close(linger=0)
        broker.close()


def test_not_ready_without_ingest_or_worker(cluster: Cluster) -> None:
    cluster.start_broker()
    hello = msgpack.packb({"type": "hello", "version": 1})
    reply = wait_for(lambda: cluster.try_front(hello), 10, "the front door")
    assert (reply["type"], reply["code"]) == ("error", "not_ready")
    cluster.ingest = FakeIngest(cluster.cfg)
    cluster.ingest.start()
    wait_for(lambda: cluster.status()["ingests"], 5, "the ingest registered")
    assert cluster.front(hello)["code"] == "not_ready"  # still no worker
    assert cluster.status()["ready"] is False


def test_killed_worker_jobs_are_redispatched(running: Cluster) -> None:
    victim = running.procs["worker0"]
    first = running.jobs(100)
    running.ingest.submit(first)
    wait_for(lambda: len(running.ingest.answers()) >= 50, 10, "some answers")
    victim.send_signal(signal.SIGSTOP)  # it holds its in-flight jobs, unanswered
    second = running.jobs(100)
    running.ingest.submit(second)
    time.sleep(0.05)
    victim.kill()
    by_job = running.wait_answers(first + second)
    assert_answered_twice_only_by(by_job, first + second, lost="0")
    lost = [e for e in running.log_events("broker") if e["event"] == "broker.worker_lost" and e["worker"].split("-")[1] == "0"]
    assert lost and lost[0]["requeued"] > 0
    assert [w["id"].split("-")[1] for w in running.status()["workers"]] == ["1"]


def test_stopping_worker_hands_back_what_it_holds(cluster: Cluster) -> None:
    """A worker stopped with jobs in hand says goodbye: the broker requeues them at once, logs
    a clean leave (not a lost worker), and every job is answered exactly once. The broker's
    patience is 10 s: the worker is frozen for a while below, and is not to be lost meanwhile."""
    cluster.configure_broker(liveness=100)
    cluster.start_all()
    leaving = cluster.procs["worker0"]
    first = cluster.jobs(20)
    cluster.ingest.submit(first)
    cluster.wait_answers(first)
    leaving.send_signal(signal.SIGSTOP)  # idle, so what it is sent now it holds unread
    second = cluster.jobs(100)
    cluster.ingest.submit(second)
    wait_for(lambda: any(w["id"].split("-")[1] == "0" and w["inflight"] == MAX_BATCH for w in cluster.status()["workers"]),
             5, "a full credit dispatched to the stopped worker")
    leaving.send_signal(signal.SIGTERM)
    leaving.send_signal(signal.SIGCONT)
    assert leaving.wait(5) == 0
    assert_exactly_once(cluster.wait_answers(first + second), first + second)
    events = cluster.log_events("broker")
    [left] = [e for e in events if e["event"] == "broker.worker_left"]
    assert left["level"] == "info" and left["worker"].split("-")[1] == "0" and left["requeued"] == MAX_BATCH
    assert not [e for e in events if e["event"] == "broker.worker_lost"]
    assert [w["id"].split("-")[1] for w in cluster.status()["workers"]] == ["1"]


def test_each_ingest_hears_of_the_realtime_streams_open_and_just_admitted_elsewhere(running: Cluster) -> None:
    """Admission on one ingest counts the streams of the others: the broker sums what each
    reports and tells every ingest the rest, with the window its figures cover."""
    other = FakeIngest(running.cfg, index=1)
    other.start()
    try:
        running.ingest.reported = {"streams": 5, "realtime": 4, "recent": 3}
        other.reported = {"streams": 2, "realtime": 2, "recent": 1}
        for ingest, (open_elsewhere, recent_elsewhere) in ((running.ingest, (2, 1)), (other, (4, 3))):
            wait_for(lambda: ingest.figures.get("realtime_elsewhere") == open_elsewhere
                     and ingest.figures.get("recent_elsewhere") == recent_elsewhere, 5, f"ingest {ingest.index}'s figures")
            assert ingest.figures["window_s"] == pytest.approx(SHARE_WINDOW_S)  # whole spans of 1 s, 10 heartbeats each
    finally:
        other.stop()


def test_a_registering_ingest_s_streams_count_for_the_others_from_its_ready(running: Cluster) -> None:
    """An ingest registering anew (a restarted broker, or one that gave it up as silent) still
    has its streams: until its next heartbeat, the others must not be told they are gone, or a
    cap on realtime streams would let a burst through. This one sends READY and nothing after."""
    running.ingest.reported = {"streams": 1, "realtime": 1, "recent": 0}
    wait_for(lambda: [i["streams"] for i in running.status()["ingests"]] == [1], 5, "ingest 0's heartbeat")
    info = {"index": 1, "endpoint": running.cfg.ingest_endpoint(1), "pid": 1, "streams": 5, "realtime": 4, "recent": 3}
    other = _replaced(running.cfg.broker_ingest_endpoint, b"ingest-1", info)
    try:
        assert other.poll(5000), "no figures when the ingest registered"
        kind, body = other.recv_multipart()
        assert kind == wire.HEARTBEAT and wire.unpack(body)["realtime_elsewhere"] == 1
        wait_for(lambda: (running.ingest.figures.get("realtime_elsewhere"), running.ingest.figures.get("recent_elsewhere")) == (4, 3),
                 5, "ingest 0 told of ingest 1's streams")
    finally:
        other.close(linger=0)


@pytest.mark.parametrize(("peer", "message"), [
    ("ingest", {"streams": 1, "realtime": 1e20}),  # a float
    ("ingest", {"realtime": 2**64 - 1}),  # the others' share of the total would not pack
    ("ingest", {"draining": "yes"}),
    ("worker", {"capacity": 1e20, "pid": 1, "model": "null"}),
    ("worker", {"capacity": 1, "pid": -1, "model": "null"}),
])
def test_a_peer_s_figures_that_are_no_counts_are_refused_and_the_broker_keeps_serving(
        running: Cluster, peer: str, message: dict[str, Any]) -> None:
    """A heartbeat or READY with a count the broker cannot use (what a peer of another version,
    or a bug, might send) is refused and logged, and the peer keeps what it had. Stored, it broke
    the broker later, far from the peer, when packing the figures for another ingest or a
    status reply: the broker died, and again after every restart, as the peer repeated it."""
    other = FakeIngest(running.cfg, index=1)
    other.start()
    try:
        other.reported = {"streams": 2, "realtime": 2, "recent": 0}
        wait_for(lambda: running.ingest.figures.get("realtime_elsewhere") == 2, 5, "ingest 1's streams counted")
        if peer == "ingest":
            other.send([wire.HEARTBEAT, wire.pack(message)])
        else:
            worker = _replaced(running.cfg.broker_worker_endpoint, b"worker-9-1", message)
        event = f"broker.bad_{peer}_message"
        wait_for(lambda: any(e["event"] == event for e in running.log_events("broker")), 5, f"{event} logged")
        before = running.ingest.heard
        wait_for(lambda: running.ingest.heard > before + 1, 10, "two more ticks of figures")
        assert running.ingest.figures["realtime_elsewhere"] == 2
        status = running.status()
        assert [i["streams"] for i in status["ingests"]] == [0, 2] and len(status["workers"]) == 2
        assert running.procs["broker"].poll() is None
        jobs = running.jobs(2)
        running.ingest.submit(jobs)
        assert_exactly_once(running.wait_answers(jobs), jobs)
    finally:
        other.stop()
        if peer == "worker":
            worker.close(linger=0)


def test_the_front_door_sends_no_client_to_an_ingest_that_is_shutting_down(running: Cluster) -> None:
    """An ingest draining (a restart, a deploy) refuses every open, and its streams leave as it
    drains, so it soon has the fewest: picked by streams alone, it would get every new client,
    each refused `not_ready` until it is gone. The other ingest must get them; with none left
    serving, the front door itself says so."""
    hello = msgpack.packb({"type": "hello", "version": 1})
    other = FakeIngest(running.cfg, index=1)
    other.start()
    try:
        running.ingest.reported = {"streams": 0}
        other.reported = {"streams": 50}
        wait_for(lambda: [i["streams"] for i in running.status()["ingests"]] == [0, 50], 5, "both ingests' figures")
        assert running.front(hello)["ingest"] == running.cfg.ingest_endpoint(0)
        running.ingest.reported = {"streams": 0, "draining": True}
        wait_for(lambda: running.status()["ingests"][0]["draining"], 5, "ingest 0 seen draining")
        assert {running.front(hello)["ingest"] for _ in range(3)} == {running.cfg.ingest_endpoint(1)}
        assert running.status()["ready"] is True
        other.reported = {"streams": 50, "draining": True}
        wait_for(lambda: running.status()["ingests"][1]["draining"], 5, "ingest 1 seen draining")
        reply = running.front(hello)
        assert (reply["type"], reply["code"]) == ("error", "not_ready") and "shutting down" in reply["message"]
        assert running.status()["ready"] is False
    finally:
        other.stop()


def test_worker_back_from_the_dead_is_counted_once(running: Cluster) -> None:
    """Frozen longer than the broker's patience, its jobs went to the other worker; when it
    wakes up it answers them too, straight to the ingest (which keeps the first answer of a
    job: tests/test_service_e2e.py), while the broker counts each job once."""
    frozen = running.procs["worker0"]
    frozen.send_signal(signal.SIGSTOP)
    jobs = running.jobs(60)
    running.ingest.submit(jobs)
    wait_for(lambda: any(e["event"] == "broker.worker_lost" for e in running.log_events("broker")), 5, "worker declared dead")
    frozen.send_signal(signal.SIGCONT)
    assert_answered_twice_only_by(running.wait_answers(jobs), jobs, lost="0")
    status = running.wait_workers(2)  # it re-registered
    assert status["jobs_done"] == len(jobs)


def test_a_broker_frozen_past_its_peers_patience_gives_none_of_them_up(running: Cluster) -> None:
    """The broker's own freeze (a stalled host, say) is time it did not listen, not its peers'
    silence. They found it silent meanwhile and replaced their sockets, dropping what they had
    queued for it; given up for lost at its first look after the wake, the workers' jobs would
    count a loss (two fail a job) and the ingest's queued jobs would be dropped."""
    broker = running.procs["broker"]
    broker.send_signal(signal.SIGSTOP)
    try:
        jobs = running.jobs(40)
        running.ingest.submit(jobs)  # they wait for the frozen broker
        time.sleep(3 * PATIENCE_S)  # the workers replace their sockets again and again
    finally:
        broker.send_signal(signal.SIGCONT)
    # Each answered OK. A worker that registers again has what it held re-queued (what was sent
    # to its old socket may be lost), so some may be answered twice: the ingest keeps the first.
    by_job = running.wait_answers(jobs)
    assert sorted(by_job) == sorted(j.job_id for j in jobs)
    assert {r.status for answers in by_job.values() for r in answers} == {OK}
    events = running.log_events("broker")
    assert not [e for e in events if e["event"] in ("broker.worker_lost", "broker.ingest_lost")], events
    assert any(e["event"] == "broker.was_not_listening" and e["seconds"] >= 3 * PATIENCE_S - 0.1 for e in events)
    running.wait_workers(2)  # both registered again


def broker_serving_workers(tmp_path: Path, **overrides: Any) -> Broker:
    """A broker in this process, its worker socket bound: a test drives its loop, or its handlers
    by hand, to put a fault exactly where it wants."""
    cfg = settings.load(None, {"run_dir": str(tmp_path / "run"), **overrides})
    cfg.run_path.mkdir(parents=True)
    broker = Broker(cfg)
    broker._worker_sock.bind(cfg.broker_worker_endpoint)
    return broker


def worker_socket(broker: Broker, identity: bytes) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(broker.cfg.broker_worker_endpoint)
    return sock


def test_a_broker_frozen_while_it_handles_a_message_gives_no_peer_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A freeze can land after the loop's poll returned, while the turn handles what it read: the
    poll was on time, but the turn itself took as long as the freeze, and what its peers sent
    meanwhile waits unread. The peer check that ends that turn found every peer silent and gave
    them all up. The broker runs in this process and its freeze is a sleep in its handler: a
    SIGSTOP cannot be made to land there."""
    broker = broker_serving_workers(tmp_path, broker={"heartbeat_ms": HEARTBEAT_MS, "liveness": 3})
    frozen_s = 3 * HEARTBEAT_MS * 3 / 1000  # three times the peers' patience
    ident = b"worker-3-1"
    sock = worker_socket(broker, ident)
    handle = broker._on_worker
    try:
        with StopSignal() as stop, capture_logs() as logs:
            def freezing(frames: list[bytes], now: float) -> None:
                handle(frames, now)
                if frames[1] == wire.READY:  # registered: the host stalls now
                    time.sleep(frozen_s)
                    stop.stopping = True  # the loop ends after this turn

            monkeypatch.setattr(broker, "_on_worker", freezing)
            sock.send_multipart([wire.READY, wire.pack({"capacity": 1, "pid": 1, "model": "null"})])
            broker._serve(stop)
        assert ident in broker.worker_links
        assert not [e for e in logs if e["event"] == "broker.worker_lost"], logs
        excused = [e for e in logs if e["event"] == "broker.was_not_listening"]
        assert len(excused) == 1 and excused[0]["seconds"] >= frozen_s, excused
    finally:
        sock.close(linger=0)
        broker.close()


def test_an_idle_broker_is_listening_and_a_frozen_one_is_not(cluster: Cluster) -> None:
    """With no peer talking (workers still loading the model, or all restarting) the broker
    sleeps until each heartbeat tick: that is listening. Taken for a freeze, every idle tick
    warned `broker.was_not_listening` and kept peers excused as "replacing their sockets", so a
    worker killed meanwhile counted no loss and a job that crashes every worker was never given
    up on. A real freeze is still told apart (the default heartbeat: 1 s ticks, 3 s patience)."""
    cluster.configure_broker(heartbeat_ms=1000, liveness=3)
    broker = cluster.start_broker()
    wait_for(lambda: cluster.try_front(msgpack.packb({"type": "status"})), 20, "the broker answering")
    time.sleep(4.5)  # four idle ticks
    assert not [e for e in cluster.log_events("broker") if e["event"] == "broker.was_not_listening"]
    broker.send_signal(signal.SIGSTOP)
    time.sleep(4)
    broker.send_signal(signal.SIGCONT)
    excused = wait_for(lambda: [e for e in cluster.log_events("broker") if e["event"] == "broker.was_not_listening"],
                       10, "the freeze told")
    assert len(excused) == 1 and excused[0]["seconds"] >= 3.9, excused


def test_broker_restart_workers_reregister(running: Cluster) -> None:
    before = {w["id"] for w in running.status()["workers"]}
    running.procs["broker"].kill()
    running.procs["broker"].wait()
    running.start_broker()
    running.ingest.register()
    status = running.wait_workers(2)
    assert {w["id"] for w in status["workers"]} == before
    jobs = running.jobs(20)
    running.ingest.submit(jobs)
    assert_exactly_once(running.wait_answers(jobs), jobs)


def test_a_restarted_broker_asks_its_workers_to_register_at_once(cluster: Cluster) -> None:
    """A broker restarted within the workers' patience (supervisord restarts one within a second)
    does not know them, and would send them nothing until that patience ran out: the jobs of every
    stream would wait. It answers their first heartbeats with REGISTER instead."""
    cfg = cluster.configure_broker(heartbeat_ms=500, liveness=40)  # patience 20 s
    cluster.start_broker()
    for index in (0, 1):
        cluster.start_worker(index)
    cluster.ingest = FakeIngest(cfg)
    cluster.ingest.start()
    cluster.wait_workers(2)
    time.sleep(0.5)  # the heartbeat answering each READY reaches its worker
    cluster.procs["broker"].kill()
    cluster.procs["broker"].wait()
    cluster.start_broker()
    cluster.ingest.register()
    cluster.wait_workers(2, timeout=15)  # before the patience could have run out
    jobs = cluster.jobs(20)
    cluster.ingest.submit(jobs)
    assert_exactly_once(cluster.wait_answers(jobs), jobs)
    for name in ("worker0", "worker1"):
        events = [e["event"] for e in cluster.log_events(name)]
        assert "worker.broker_silent" not in events
        assert events.count("worker.broker_asks_to_register") == 1, events
    assert sum(e["event"] == "broker.worker_ready" for e in cluster.log_events("broker")) == 4  # two per broker


def test_workers_up_before_the_broker_wait_for_it(cluster: Cluster) -> None:
    """Workers started before the broker keep their first connection: a broker that is not up
    yet is not a silent one, and a needless reconnect could strand jobs sent meanwhile."""
    for index in (0, 1):
        cluster.start_worker(index)
    for name in ("worker0", "worker1"):
        wait_for(lambda: (cluster.dir / f"{name}.log").exists() and any(e["event"] == "worker.started" for e in cluster.log_events(name)),
                 20, f"{name} started")
    time.sleep(3 * PATIENCE_S + 0.1)  # over three times the patience
    cluster.start_broker()
    cluster.ingest = FakeIngest(cluster.cfg)
    cluster.ingest.start()
    cluster.wait_workers(2)
    jobs = cluster.jobs(100)
    cluster.ingest.submit(jobs)
    assert_exactly_once(cluster.wait_answers(jobs), jobs)
    silent = [e for name in ("worker0", "worker1") for e in cluster.log_events(name) if e["event"] == "worker.broker_silent"]
    assert not silent
    assert sum(e["event"] == "broker.worker_ready" for e in cluster.log_events("broker")) == 2


def _replaced(endpoint: str, identity: bytes, ready: dict[str, Any]) -> zmq.Socket:
    """A peer's socket after it gave up on the broker: same identity, a new connection, READY
    first, made while the broker may still hold the old connection."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send_multipart([wire.READY, wire.pack(ready)])
    return sock


def _patient_broker(cluster: Cluster) -> None:
    """The broker with 1 s heartbeats: the hand-made peers below send none of their own, and
    must not be given up for silent while a round runs on a loaded machine."""
    cluster.configure_broker(heartbeat_ms=1000, liveness=3)
    cluster.start_broker()


def test_a_worker_that_replaces_its_socket_is_served_on_the_new_one(cluster: Cluster) -> None:
    """Each round the worker's new connection must be the one the broker hears and sends to:
    its READY hands back what the old socket held, and jobs and DONE flow on the new one."""
    _patient_broker(cluster)
    cluster.ingest = FakeIngest(cluster.cfg)
    cluster.ingest.start()
    identity = b"worker-9-1"
    ready = {"capacity": 1, "pid": 1, "model": "null"}
    sock = _replaced(cluster.cfg.broker_worker_endpoint, identity, ready)
    cluster.wait_workers(1)
    for round_ in range(10):
        sock.close(linger=0)
        sock = _replaced(cluster.cfg.broker_worker_endpoint, identity, ready)
        [job] = cluster.jobs(1)
        cluster.ingest.submit([job])
        assert sock.poll(5000), f"round {round_}: the job never reached the worker's new socket"
        kind, body = sock.recv_multipart()
        assert kind == wire.JOBS and [j.job_id for j in wire.unpack_jobs(body)] == [job.job_id]
        sock.send_multipart([wire.DONE, wire.pack_done([JobResult(job_id=job.job_id, ingest=0, worker=identity.decode())])])
        wait_for(lambda: cluster.status()["jobs_done"] == round_ + 1, 5, f"round {round_}: DONE counted")
    sock.close(linger=0)



def _worker_connections(cluster: Cluster) -> int:
    """Unix sockets the broker process holds on its worker endpoint (its listener and each
    connection it accepted): one goes when the broker has seen that peer go."""
    path = cluster.cfg.broker_worker_endpoint.removeprefix("ipc://")
    return sum(c.laddr == path for c in psutil.Process(cluster.procs["broker"].pid).net_connections(kind="unix"))


def test_a_job_sent_to_workers_already_gone_is_not_given_up_on(cluster: Cluster) -> None:
    """Two workers vanish before the broker hears they are gone; a final then comes. Each send
    to them fails (unreachable), so neither ever held the job: it waits for a worker that is
    there and is decoded, instead of being answered FAILED as if two workers died decoding it."""
    _patient_broker(cluster)
    cluster.ingest = FakeIngest(cluster.cfg)
    cluster.ingest.start()
    ready = {"capacity": 1, "pid": 1, "model": "null"}
    gone = [_replaced(cluster.cfg.broker_worker_endpoint, b"worker-%d-1" % i, ready) for i in (7, 8)]
    cluster.wait_workers(2)
    connected = _worker_connections(cluster)
    for sock in gone:
        sock.close(linger=0)
    # the broker's socket sees both connections end (it closes them); its patience (3 s) runs on
    wait_for(lambda: _worker_connections(cluster) == connected - 2, 5, "the broker to close both connections")
    [final] = cluster.jobs(1)
    cluster.ingest.submit([final])

    def lost() -> list[dict[str, Any]]:
        return [e for e in cluster.log_events("broker") if e["event"] == "broker.worker_lost"]

    wait_for(lambda: len(lost()) == 2, 5, "both workers found gone")
    # found gone by the send that failed, holding nothing: no loss counted against the job
    assert sorted((e["worker"], e["why"], e["requeued"]) for e in lost()) == [
        ("worker-7-1", "unreachable", 0), ("worker-8-1", "unreachable", 0)], lost()
    worker = _replaced(cluster.cfg.broker_worker_endpoint, b"worker-9-1", ready)
    try:
        assert worker.poll(5000), f"the final never reached a live worker; the ingest got {cluster.ingest.answers()}"
        kind, body = worker.recv_multipart()
        assert kind == wire.JOBS and [j.job_id for j in wire.unpack_jobs(body)] == [final.job_id]
        assert not cluster.ingest.answers()
        assert not [e for e in cluster.log_events("broker") if e["event"] == "broker.job_given_up"]
    finally:
        worker.close(linger=0)


class SilentWorker(threading.Thread):
    """A worker that registers, heartbeats and takes jobs, and never answers them: what a worker
    is to the broker when it cannot read the JOBS messages it is sent (a broker of another version)."""

    def __init__(self, cfg: Config, identity: bytes, capacity: int) -> None:
        super().__init__(daemon=True)
        self.cfg = cfg
        self.identity = identity
        self.capacity = capacity
        self.received: list[int] = []  # the ids of the jobs it was sent, each time it was sent one
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(2)

    def run(self) -> None:
        endpoint = self.cfg.broker_worker_endpoint
        jobs = _replaced(endpoint, self.identity, {"capacity": self.capacity, "pid": 1, "model": "null"})
        heartbeats = zmq.Context.instance().socket(zmq.DEALER)
        heartbeats.setsockopt(zmq.IDENTITY, wire.heartbeat_identity(self.identity))
        heartbeats.setsockopt(zmq.LINGER, 0)
        heartbeats.connect(endpoint)
        try:
            while not self._stop_event.is_set():
                heartbeats.send(wire.HEARTBEAT)
                while heartbeats.poll(0):
                    heartbeats.recv_multipart()
                if jobs.poll(HEARTBEAT_MS):
                    kind, body = jobs.recv_multipart()
                    if kind == wire.JOBS:
                        self.received += [job.job_id for job in wire.unpack_jobs(body)]
        finally:
            jobs.close(linger=0)
            heartbeats.close(linger=0)


def test_jobs_a_heartbeating_worker_never_answers_are_taken_back_then_failed(cluster: Cluster) -> None:
    """A worker that keeps heartbeating but never answers the jobs it holds (it could not read
    their JOBS message) would hold them, and its credit, for ever, and their ingest would wait for
    the finals for ever. Past `[broker] job_timeout_s` the broker takes each back, logging it
    (naming worker and job) and counting it as an error, and re-queues it once: the only worker
    there, its credit returned, is sent it again, and the second time the job is answered FAILED."""
    cluster.cfg = replace(cluster.cfg, workers=replace(cluster.cfg.workers, stuck_after_s=0.2))
    cluster.configure_broker(job_timeout_s=2.0)  # more than twice stuck_after_s
    snapshots = zmq.Context.instance().socket(zmq.SUB)  # the collector's end of the broker's metrics
    snapshots.setsockopt(zmq.SUBSCRIBE, b"")
    snapshots.setsockopt(zmq.LINGER, 0)
    cluster.cfg.run_path.mkdir(mode=0o700, parents=True, exist_ok=True)
    snapshots.bind(metrics_endpoint(cluster.cfg))
    cluster.start_broker()
    cluster.ingest = FakeIngest(cluster.cfg)
    cluster.ingest.start()
    identity = b"worker-7-1"
    worker = SilentWorker(cluster.cfg, identity, capacity=2)
    worker.start()
    try:
        cluster.wait_workers(1)
        jobs = cluster.jobs(2)
        cluster.ingest.submit(jobs)
        wait_for(lambda: len(cluster.ingest.answers()) >= 2, 30, "both jobs answered")
        answers = cluster.ingest.answers()
        assert sorted((r.job_id, r.status) for r in answers) == [(j.job_id, FAILED) for j in jobs]
        assert all("never answered it" in (r.error or "") for r in answers), answers
        assert sorted(worker.received) == sorted(2 * [j.job_id for j in jobs])  # sent again once, not for ever
        status = cluster.status()
        # the worker is still served, its credit back
        assert [(w["id"], w["inflight"]) for w in status["workers"]] == [(identity.decode(), 0)]
        events = cluster.log_events("broker")
        overdue = [e for e in events if e["event"] == "broker.job_overdue"]
        assert sorted((e["job"], e["worker"], e["level"]) for e in overdue) == \
            sorted(2 * [(j.job_id, identity.decode(), "warning") for j in jobs])
        assert sorted(e["job"] for e in events if e["event"] == "broker.job_given_up") == [j.job_id for j in jobs]

        def counted() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
            while snapshots.poll(100):
                counters = {(name, tuple(sorted(labels.items()))): value
                            for name, labels, value in msgpack.unpackb(snapshots.recv())["counters"]}
                if ("errors_total", (("code", "internal"),)) in counters:
                    return counters
            return None

        counters = wait_for(counted, 10, "the broker's errors_total")
        assert counters[("errors_total", (("code", "internal"),))] == 4  # each job taken back twice
        assert counters[("jobs_total", (("kind", "final"), ("status", "failed")))] == 2
    finally:
        worker.stop()
        snapshots.close(linger=0)


@pytest.mark.parametrize(("name", "value"), [("started", "soon"), ("finished", math.inf), ("finished", 1e300), ("status", 9),
                                           ("row", "more"), ("row", "fewer")])
def test_a_malformed_done_row_returns_its_credit_and_spoils_no_figure(cluster: Cluster, name: str, value: Any) -> None:
    """A worker's DONE row whose times are wrongly typed, infinite or absurd, whose status is
    none the broker knows, or that has a field too many or too few (a worker of another
    version), still frees the worker's credit for its job
    and lets the rows after it be counted; its times are not measured (an infinite decode would
    price every stream at infinity for good, an absurd one for a long time), and it is logged
    naming the worker, the job and the field."""
    _patient_broker(cluster)
    cluster.ingest = FakeIngest(cluster.cfg)
    cluster.ingest.start()
    identity = b"worker-9-1"
    sock = _replaced(cluster.cfg.broker_worker_endpoint, identity, {"capacity": 2, "pid": 1, "model": "null"})
    try:
        cluster.wait_workers(1)
        for round_ in range(2):  # the second round needs the credit the first one returned
            jobs = cluster.jobs(2)
            cluster.ingest.submit(jobs)
            got: list[Job] = []
            while len(got) < 2:
                assert sock.poll(5000), f"round {round_}: the worker was sent {len(got)} of 2 jobs"
                kind, body = sock.recv_multipart()
                assert kind == wire.JOBS
                got += wire.unpack_jobs(body)
            now = time.monotonic()
            bad = [jobs[0].job_id, 0, OK, 1, now - 0.2, now]
            if name == "row":
                bad = bad + [value] if value == "more" else bad[:-1]
            else:
                bad[{"status": 2, "started": 4, "finished": 5}[name]] = value
            good = [jobs[1].job_id, 0, OK, 1, now - 0.1, now]
            sock.send_multipart([wire.DONE, wire.pack([bad, good])])
            wait_for(lambda: cluster.status()["jobs_done"] == 2 * (round_ + 1), 5, f"round {round_}: both rows counted")
        heard = cluster.ingest.heard
        # two of the broker's ticks, which take the decode times into the figures and send them
        wait_for(lambda: cluster.ingest.heard >= heard + 2, 10, "two heartbeats of figures")
        numbers = {k: v for k, v in cluster.ingest.figures.items() if isinstance(v, (int, float))}
        assert "stream_share" in numbers and all(math.isfinite(v) for v in numbers.values()), numbers
        logged = [e for e in cluster.log_events("broker") if e["event"] == "broker.bad_done_row"]
        assert len(logged) == 2 and {(e["worker"], e["field"]) for e in logged} == {(identity.decode(), name)}
    finally:
        sock.close(linger=0)

def test_an_ingest_that_replaces_its_socket_is_heard_on_the_new_one(cluster: Cluster) -> None:
    """The ingest registers again on a new connection, as a new process would (another pid):
    the broker must take that READY and send its heartbeats to the new socket."""
    _patient_broker(cluster)
    info = {"index": 0, "endpoint": cluster.cfg.ingest_endpoint(0), "streams": 0}
    sock = _replaced(cluster.cfg.broker_ingest_endpoint, b"ingest-0", {**info, "pid": 1})
    wait_for(lambda: (status := cluster.try_front(msgpack.packb({"type": "status"}))) and status["ingests"], 10, "the ingest registered")
    for pid in range(2, 12):
        sock.close(linger=0)
        sock = _replaced(cluster.cfg.broker_ingest_endpoint, b"ingest-0", {**info, "pid": pid})
        wait_for(lambda: [i["pid"] for i in cluster.status()["ingests"]] == [pid], 5, f"READY of pid {pid} heard")
        assert sock.poll(2000), f"pid {pid}: no heartbeat on the new socket"
        assert sock.recv_multipart()[0] == wire.HEARTBEAT
    sock.close(linger=0)


def test_ingests_hear_the_figures_when_a_peer_registers_not_at_the_next_tick(cluster: Cluster) -> None:
    """An ingest gets the admission figures as soon as it registers, and again when a worker's
    READY changes the start-up price of a stream: a burst opened before the broker's next tick
    would otherwise be admitted at the old figures. The broker ticks every 30 s here, so no
    heartbeat of its tick comes during the test."""
    cfg = cluster.configure_broker(heartbeat_ms=30_000)
    cluster.start_broker()
    info = {"index": 0, "endpoint": cfg.ingest_endpoint(0), "streams": 0}
    ingest = _replaced(cfg.broker_ingest_endpoint, b"ingest-0", {**info, "pid": 1})
    worker = None
    try:
        assert ingest.poll(10_000), "no figures when the ingest registered"
        kind, body = ingest.recv_multipart()
        assert kind == wire.HEARTBEAT and wire.unpack(body)["stream_share"] == 0  # no worker: nothing to price
        worker = _replaced(cfg.broker_worker_endpoint, b"worker-9-1", {"capacity": 1, "pid": 1, "model": "null", "cost": [0.05, 0.6]})
        assert ingest.poll(5000), "no figures when the worker registered"
        kind, body = ingest.recv_multipart()
        # one worker: 7 partials of 0.05 s and a final of 0.6 s per 3 s segment
        assert kind == wire.HEARTBEAT and wire.unpack(body)["stream_share"] == pytest.approx(7 / 3 * 0.05 + 0.6 / 3, abs=1e-4)
    finally:
        ingest.close(linger=0)
        if worker is not None:
            worker.close(linger=0)


def test_failed_job_for_reused_slot(running: Cluster) -> None:
    [stale] = running.jobs(1, generation=running.pool.ring(0).generation - 1)
    [beyond] = running.jobs(1, end=10 * SAMPLES)
    running.ingest.submit([stale, beyond])
    by_job = running.wait_answers([stale, beyond])
    assert [r.status for r in by_job[stale.job_id]] == [wire.FAILED]
    assert "reused" in by_job[stale.job_id][0].error
    assert by_job[beyond.job_id][0].status == wire.FAILED


def test_sigterm_stops_cleanly(running: Cluster) -> None:
    for name in ("worker0", "broker"):
        proc = running.procs[name]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(5) == 0  # a stop that hangs (a socket lingering, a thread not joined) fails here
    assert any(e["event"] == "broker.stopped" for e in running.log_events("broker"))
    assert any(e["event"] == "worker.stopped" for e in running.log_events("worker0"))


@pytest.mark.parametrize(("name", "value"), [("priority", "0"), ("created", -math.inf), ("deadline", math.inf),
                                           ("created", -1e300), ("deadline", 1e300), ("ingest", 1)])
def test_a_malformed_job_is_refused_and_the_broker_keeps_serving(running: Cluster, name: str, value: Any) -> None:
    """A job with a wrongly typed field (a priority sent as a string), a time that is no time
    (infinite, or absurdly far from the broker's clock: a job created at -inf would have waited
    forever, and the admission load would read infinite for good; at -1e300, for a thousand
    ticks) or another ingest's index (its answer would go there, its id could clash with that
    ingest's own) is refused on its own, logged naming the ingest and the field and answered
    FAILED to the ingest that sent it; the jobs around it and after it are served as ever, and
    the broker lives on."""
    [bad] = running.jobs(1, **{name: value})
    first = running.jobs(3)
    running.ingest.submit([*first, bad])
    later = running.jobs(3)
    for j in later:  # one message each, as ingest loop turns would send them
        running.ingest.submit([j])
    by_job = running.wait_answers([*first, bad, *later])
    assert [r.status for r in by_job.pop(bad.job_id)] == [wire.FAILED]
    assert_exactly_once(by_job, first + later)
    assert {r[0].status for r in by_job.values()} == {OK}
    [refused] = [e for e in running.log_events("broker") if e["event"] == "broker.bad_job"]
    assert (refused["ingest"], refused["job"], refused["field"]) == (0, bad.job_id, name)
    assert running.procs["broker"].poll() is None and running.status()["queued"] == {"realtime": 0, "batch": 0}


class _Session:
    """What the ingest's broker link reads of a session: the jobs it still waits for."""

    def __init__(self, jobs: list[Job]) -> None:
        self.inflight = {j.job_id: j for j in jobs}
        self.priority = REALTIME
        self.abandoned = False
        self.answers: list[JobResult] = []

    def on_result(self, result: JobResult) -> None:
        if self.inflight.pop(result.job_id, None) is not None:
            self.answers.append(result)


@contextmanager
def _ingest_link(cfg: Config) -> Iterator[IngestServer]:
    """The real ingest (IngestServer as its process makes it: registered with the broker, its
    shm segment made), its loop not run: its broker link and result handling are driven by hand.
    Closed at the end as at its stop."""
    from ingest.server import IngestServer  # ONNX Runtime, for its VAD: only the tests that need it wait for it

    ingest = IngestServer(cfg, 0)
    try:
        yield ingest
    finally:
        ingest.sessions.clear()  # stand-ins with no client to tell `shutdown`
        ingest.close()


def _waiting(ingest: IngestServer, key: str, jobs: list[Job]) -> _Session:
    """A stream `key` of `ingest` that waits for `jobs`, sent to the broker as the loop sends a
    session's jobs (`_flush`)."""
    session = ingest.sessions[key] = _Session(jobs)  # type: ignore[assignment]
    ingest.owner.update({job.job_id: key for job in jobs})
    ingest.broker.send_multipart([wire.JOBS, wire.pack_jobs(jobs)])
    return session


def test_an_ingest_drops_a_broker_message_it_cannot_read(cluster: Cluster) -> None:
    """What a broker of another version might send: figures that are not msgpack, results that
    are not result rows, a kind the ingest does not know. Each is logged and dropped, and the
    next heartbeat is read as usual."""
    with _ingest_link(cluster.cfg) as ingest:
        with capture_logs() as logs:
            ingest._on_broker([wire.HEARTBEAT, b"\xc1"])
            ingest._on_broker([wire.RESULTS, msgpack.packb([[7]])])  # a row too short
            ingest._on_broker([b"NEWKIND", b""])
            ingest._on_broker([wire.HEARTBEAT, wire.pack({"load": 0.25, "busy": 0.5})])
        bad = [e for e in logs if e["event"] == "ingest.bad_broker_message"]
        assert [(e["kind"], e["log_level"]) for e in bad] == [(wire.HEARTBEAT, "warning"), (wire.RESULTS, "warning"),
                                                             (b"NEWKIND", "warning")]
        assert (ingest.load, ingest.busy) == (0.25, 0.5)


def test_an_ingest_whose_connection_closes_gets_no_new_clients(cluster: Cluster) -> None:
    """An ingest that dies (killed, crashed) closes its connection to the broker. Until the broker
    gives it up the front door sends new clients to its dead endpoint, where their `open` waits
    out its timeout: so it is given up as soon as a heartbeat finds its connection gone, not at
    the end of the broker's patience (10 s here). One that was draining has left, not been lost."""
    cluster.configure_broker(liveness=100)
    cluster.start_broker()
    cluster.start_worker(0)
    hello = msgpack.packb({"type": "hello", "version": 1})
    for draining in (False, True):
        ingest = FakeIngest(cluster.cfg)
        ingest.reported = {"streams": 0, "draining": draining}
        ingest.start()
        wait_for(lambda: [i["index"] for i in cluster.status()["ingests"]] == [0], 10, "the ingest registered")
        if not draining:
            cluster.wait_workers(1)
            assert cluster.front(hello)["type"] == "welcome"
        ingest.stop()  # its socket closes, as a dead process's does
        wait_for(lambda: not cluster.status()["ingests"], 3, "the ingest given up")
        reply = cluster.front(hello)
        assert reply["type"] == "error" and reply["code"] == "not_ready", reply
    events = [e for e in cluster.log_events("broker") if e["event"] in ("broker.ingest_lost", "broker.ingest_left")]
    assert [(e["event"], e["level"], e.get("why")) for e in events] == [
        ("broker.ingest_lost", "warning", "unreachable"), ("broker.ingest_left", "info", None)], events


def test_an_ingest_given_up_on_registers_again_and_gets_its_final(cluster: Cluster) -> None:
    """An ingest whose loop stalled past the broker's patience is dropped with its queued jobs
    (a final among them). The broker still answers it (expired partials of another stream), so
    it never falls silent for the ingest; but it tells it to register, and the ingest does:
    READY and every job it waits for, once, and the final is decoded after all."""
    cluster.start_broker()
    wait_for(lambda: cluster.try_front(msgpack.packb({"type": "status"})), 10, "the broker")
    with _ingest_link(cluster.cfg) as ingest:
        ring = ingest.pool.acquire()  # the stream's audio, in the ingest's own segment
        ring.write(np.zeros(2 * SAMPLES, dtype=np.float32))
        audio = {"shm": ingest.pool.name, "slot": ring.slot, "generation": ring.generation}
        [final] = cluster.jobs(1, **audio)
        session = _waiting(ingest, "a", [final])

        def serve(seconds: float, partials: bool = False, until: Callable[[], bool] = lambda: False) -> None:
            """The ingest's loop, as far as the broker sees it; with `partials`, another stream's,
            each superseding the last one queued (no worker yet takes them)."""
            end = time.monotonic() + seconds
            next_partial = time.monotonic()
            while time.monotonic() < end and not until():
                while ingest.broker.poll(0):
                    ingest._on_broker(ingest.broker.recv_multipart())
                while ingest.results.poll(0):
                    ingest._on_worker(ingest.results.recv_multipart())
                if partials and time.monotonic() >= next_partial:
                    partial = replace(cluster.jobs(1, final=False, **audio)[0], stream="b")
                    ingest.broker.send_multipart([wire.JOBS, wire.pack_jobs([partial])])
                    next_partial = time.monotonic() + 2 * HEARTBEAT_MS / 1000
                ingest._heartbeat(time.monotonic())
                time.sleep(0.01)

        serve(0.5)
        assert [i["index"] for i in cluster.status()["ingests"]] == [0] and cluster.status()["queued"]["realtime"] == 1
        time.sleep(2 * PATIENCE_S)  # the loop stalls: the broker gives up on it and drops the final
        wait_for(lambda: not cluster.status()["ingests"] and not cluster.status()["queued"]["realtime"], 5, "the ingest dropped")
        serve(1.0, partials=True)
        status = cluster.status()
        assert [i["index"] for i in status["ingests"]] == [0], "the ingest never registered again"
        assert status["queued"]["realtime"] == 2 and status["expired"] > 0  # the final again, and the last partial
        cluster.start_worker(0)
        serve(20, until=lambda: bool(session.answers))
        assert [(r.job_id, r.status) for r in session.answers] == [(final.job_id, OK)]
        events = cluster.log_events("broker")  # before the link closes, which the broker may see as a loss too
    assert [e["why"] for e in events if e["event"] == "broker.ingest_lost"] == ["silent"]
    asked = sum(e["event"] == "broker.ingest_unregistered" for e in events)
    assert asked >= 1 and sum(e["event"] == "broker.ingest_ready" for e in events) == 1 + asked


def test_an_ingest_s_figures_with_a_held_since_that_is_no_time_are_refused_whole() -> None:
    """A heartbeat's `held_since` (since when the ingest's longest-held open has waited for room)
    must be a time or nil: a string would fail the broker's comparisons, and NaN would order it
    before or after every other ingest's for good. Such figures are refused whole, the last good
    ones kept; an ingest of an earlier release, which does not send it, holds none."""
    state = IngestState(index=0, endpoint="tcp://127.0.0.1:7701", pid=1, registered=0.0, link=Link(seen=0.0))
    state.take_figures({"streams": 2, "realtime": 1, "held_since": 12.5})
    for bad in ("soon", float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="held_since"):
            state.take_figures({"streams": 3, "realtime": 2, "held_since": bad})
    assert (state.streams, state.realtime, state.held_since) == (2, 1, 12.5)
    state.take_figures({"streams": 2, "realtime": 1})
    assert state.held_since is None


def test_an_ingest_identity_whose_index_packs_in_no_message_does_not_end_the_broker(running: Cluster) -> None:
    """A peer on the ingest socket named `ingest-<index>` with an index beyond what msgpack can
    carry (a 25-digit one): its job, another ingest's, is refused and answered FAILED to that
    index, as any foreign job is. Packing that answer raised in the broker's loop and the broker
    died, and every stream with it; such an identity must be refused like any other malformed
    one, and the broker must keep serving."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"ingest-" + b"1" * 25)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(running.cfg.broker_ingest_endpoint)
    try:
        sock.send_multipart([wire.JOBS, wire.pack_jobs(running.jobs(1))])
        wait_for(lambda: any(e["event"] in ("broker.bad_ingest_message", "broker.bad_job")
                             for e in running.log_events("broker")), 5, "the peer's message refused")
        time.sleep(3 * HEARTBEAT_MS / 1000)
        assert running.procs["broker"].poll() is None, "the broker died"
        jobs = running.jobs(2)
        running.ingest.submit(jobs)
        assert_exactly_once(running.wait_answers(jobs), jobs)
    finally:
        sock.close(linger=0)


def test_a_worker_that_said_goodbye_before_its_connection_closed_has_left_not_been_lost(tmp_path: Path) -> None:
    """A worker that stops sends LEAVING on its job socket, then closes both sockets. When the
    broker's heartbeat finds the closed heartbeat socket before its loop has read the goodbye
    (still queued on the job socket), the worker has left all the same: logging it lost would
    count a loss against every job it handed back, and put a worker stop in the operators' alerts.
    The broker runs in this process, so the check comes exactly between the two."""
    broker = broker_serving_workers(tmp_path)
    ident = b"worker-3-1"
    job_sock, hb_sock = (worker_socket(broker, identity) for identity in (ident, wire.heartbeat_identity(ident)))

    def read(count: int) -> None:
        for _ in range(count):
            assert broker._worker_sock.poll(5000), "the broker heard nothing"
            broker._on_worker(broker._worker_sock.recv_multipart(), time.monotonic())

    try:
        job_sock.send_multipart([wire.READY, wire.pack({"capacity": 1, "pid": 1, "model": "null"})])
        read(1)
        hb_sock.send_multipart([wire.HEARTBEAT])
        read(1)
        assert ident in broker.worker_links
        with capture_logs() as logs:
            job_sock.send_multipart([wire.LEAVING])
            job_sock.close(linger=1000)
            hb_sock.close(linger=1000)

            def checked() -> bool:  # until a heartbeat finds the connection closed, the broker's checks see nothing
                broker._check_peers(time.monotonic())
                return ident not in broker.worker_links

            wait_for(checked, 10, "the broker to find the worker's connection closed")
        events = [e["event"] for e in logs if e["event"].startswith("broker.worker_")]
        assert events == ["broker.worker_left"], events
    finally:
        broker.close()


def test_a_worker_message_the_broker_cannot_read_is_logged_and_counted_on_either_socket(tmp_path: Path) -> None:
    """A worker of another version may send a kind this broker does not know, on its job socket
    or its heartbeat socket. Either is an error an operator must see in `errors_total` as well as
    in the log (an alert watches the counter), and neither costs the worker its place."""
    broker = broker_serving_workers(tmp_path)
    ident = b"worker-3-1"
    job_sock, hb_sock = (worker_socket(broker, identity) for identity in (ident, wire.heartbeat_identity(ident)))

    def read() -> None:
        assert broker._worker_sock.poll(5000), "the broker heard nothing"
        broker._on_worker(broker._worker_sock.recv_multipart(), time.monotonic())

    def errors() -> float:
        return sum(c[2] for c in broker.metrics.snapshot()["counters"] if c[0] == "errors_total")

    try:
        job_sock.send_multipart([wire.READY, wire.pack({"capacity": 1, "pid": 1, "model": "null"})])
        read()
        with capture_logs() as logs:
            for sock in (job_sock, hb_sock):
                sock.send_multipart([b"NEWKIND", b""])
                read()
        bad = [(e["worker"], e["log_level"]) for e in logs if e["event"] == "broker.bad_worker_message"]
        assert bad == [(ident.decode(), "warning"), (wire.heartbeat_identity(ident).decode(), "warning")], logs
        assert errors() == 2
        assert ident in broker.worker_links
    finally:
        for sock in (job_sock, hb_sock):
            sock.close(linger=0)
        broker.close()


def test_a_worker_whose_goodbye_comes_while_the_broker_dispatches_to_it_has_left_not_been_lost(tmp_path: Path) -> None:
    """The worker says LEAVING and closes its sockets after the broker's loop last read them; the
    loop then sends it a job, which finds the connection closed. The goodbye is waiting unread:
    the worker has left, and the job it handed back (never started) counts no loss, which would
    bring it nearer to being given up. The broker runs in this process, so the send comes
    exactly between the two."""
    broker = broker_serving_workers(tmp_path)
    ident = b"worker-3-1"
    sock = worker_socket(broker, ident)
    now = time.monotonic()
    held, sent_later = (Job(job_id=i, ingest=0, stream="s", shm="shm", slot=0, generation=1, start=0, end=SAMPLES,
                            final=True, priority=REALTIME, deadline=now + 60, seg=i, created=now) for i in (1, 2))
    try:
        sock.send_multipart([wire.READY, wire.pack({"capacity": 2, "pid": 1, "model": "null"})])
        assert broker._worker_sock.poll(5000), "the broker heard nothing"
        broker._on_worker(broker._worker_sock.recv_multipart(), time.monotonic())
        broker.dispatcher.submit([held], now)
        broker._dispatch(now)
        assert sock.poll(5000) and wire.unpack_jobs(sock.recv_multipart()[1]) == [held]
        sock.send_multipart([wire.LEAVING])
        sock.close(linger=1000)
        # until the broker's socket has seen the connection close, what it sends goes out as ever
        wait_for(lambda: not broker._send(broker._worker_sock, ident, [wire.HEARTBEAT]), 10, "the connection closed")
        broker.dispatcher.submit([sent_later], now)
        with capture_logs() as logs:
            broker._dispatch(time.monotonic())
        events = [e["event"] for e in logs if e["event"].startswith("broker.worker_")]
        assert events == ["broker.worker_left"], events
        assert broker.dispatcher._losses == {}
        assert job_key(held) in broker.dispatcher.queue and job_key(sent_later) in broker.dispatcher.queue
    finally:
        broker.close()
