"""A worker's compute side in-process: audio from a real shm pool, the null backend, failures;
its result sockets to the ingests; and the watchdog that ends a worker stuck in its model."""

from __future__ import annotations

import gc
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import IO, Any, Sequence

import msgpack
import numpy as np
import pytest
import zmq
from structlog.testing import capture_logs

from broker import jobs as wire
from broker.jobs import FAILED, OK, REALTIME, Job, JobResult
from config import settings
from metrics.registry import endpoint as metrics_endpoint
from shm import RingPool, reclaim
from shm.ring import Ring
from speech.backend import Backend, DecodeRequest, DecodeResult
from speech.null_backend import NullBackend
from streaming import wait_for
from workers.worker import _PIPE, REGISTER, STOP, STUCK_EXIT_STATUS, Heartbeats, Watchdog, Worker, _ResultLinks

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def segment_name() -> Iterator[str]:
    """An ingest's shm segment name for the test to create (and create again); reclaimed after."""
    instance = f"test{uuid.uuid4().hex[:12]}"
    yield f"streamasr.{instance}.ingest0"
    reclaim(instance)


@pytest.fixture
def pool(segment_name: str) -> Iterator[RingPool]:
    p = RingPool.create(segment_name, slots=2, capacity=16_000)
    yield p
    p.close()


@pytest.fixture
def worker() -> Iterator[Worker]:
    cfg = settings.load(None, {"model": {"name": "null", "backend": "null", "null_text": "hello"}})
    w = Worker(cfg, 0)
    w.backend = NullBackend(cfg.model)
    yield w
    for p in w._pools.values():
        p.close()


def job(p: RingPool, slot: int, generation: int, start: int, end: int, job_id: int = 1) -> Job:
    return Job(job_id=job_id, ingest=0, stream="s", shm=p.name, slot=slot, generation=generation, start=start,
               end=end, final=True, priority=REALTIME, deadline=0.0, seg=0)


class Recording(Backend):
    """Remembers the audio it was given (copied: the views are only valid during the call)."""

    def __init__(self) -> None:
        self.seen: list[np.ndarray] = []

    def transcribe_batch(self, requests: Sequence[DecodeRequest]) -> list[DecodeResult]:
        self.seen += [np.array(r.audio) for r in requests]
        return [DecodeResult(text=f"{len(r.audio)}") for r in requests]


class Broken(Backend):
    def transcribe_batch(self, requests: Sequence[DecodeRequest]) -> list[DecodeResult]:
        raise RuntimeError("device lost")


def test_batch_reads_the_named_samples(pool: RingPool, worker: Worker) -> None:
    ring = pool.acquire()
    samples = np.arange(8000, dtype=np.float32)
    ring.write(samples)
    worker.backend = Recording()
    results = worker.process([job(pool, ring.slot, ring.generation, 100, 900, 1), job(pool, ring.slot, ring.generation, 0, 50, 2)])
    assert [(r.job_id, r.status, r.text, r.batch_size) for r in results] == [(1, OK, "800", 2), (2, OK, "50", 2)]
    assert len(worker.backend.seen) == 2
    np.testing.assert_array_equal(worker.backend.seen[0], samples[100:900])
    np.testing.assert_array_equal(worker.backend.seen[1], samples[0:50])
    assert all(r.worker == worker.identity and r.finished >= r.started > 0 for r in results)


def test_null_backend_result_fields(pool: RingPool, worker: Worker) -> None:
    ring = pool.acquire()
    ring.write(np.zeros(16_000, dtype=np.float32))
    [result] = worker.process([job(pool, ring.slot, ring.generation, 0, 16_000)])
    assert result.status == OK and result.text == "hello"
    assert result.segments == [(0.0, 1.0, "hello")]


def test_a_worker_prices_a_stream_on_speech_it_hears_when_it_starts() -> None:
    """The decodes a starting worker times for admission (sent with READY) are of the clip it
    ships, a spoken sentence, not of silence, which decodes no words and priced a partial at
    half of what speech costs; its log shows ops what the model heard."""
    from streamasr.testdata import wer

    w = Worker(settings.load(None, {"model": {"name": "whisper-tiny.en", "threads": 1}}), 0)
    with capture_logs() as logs:
        w.load()
    [ready] = [e for e in logs if e["event"] == "worker.model_ready"]
    assert wer(["he was not an ill disposed young man"], [ready["heard"]]) <= 0.25, ready
    assert [ready["partial_s"], ready["final_s"]] == [round(c, 4) for c in w.decode_cost] and min(w.decode_cost) > 0


@pytest.mark.parametrize("text", ["", "hello"])
def test_a_worker_whose_model_hears_nothing_when_it_starts_warns(text: str) -> None:
    """A model that decodes no word of the start-up sentence is broken (bad weights, a wrong
    graph) though it loaded: ops are told before streams come, not by empty transcripts."""
    w = Worker(settings.load(None, {"model": {"name": "null", "backend": "null", "null_text": text}}), 0)
    with capture_logs() as logs:
        w.load()
    warnings = [e for e in logs if e["event"] == "worker.model_heard_nothing"]
    assert len(warnings) == (0 if text else 1), logs


def test_a_final_that_loops_is_resampled_counted_and_logged(segment_name: str, tmp_path: Path) -> None:
    """Through the worker's own call: a final whose greedy decode loops comes back with the
    fallback's text, and the worker counts and logs it, so ops see streams that loop."""
    from speech.audio import load_audio
    from speech.ort_backend import OrtWhisperBackend
    from streamasr.testdata import spoken, utterances, wer

    speech = utterances()[0]
    audio = np.concatenate([load_audio(speech.path), load_audio(spoken(" ".join(["no"] * 15), tmp_path / "no.wav"))])
    cfg = settings.load(None, {"model": {"name": "whisper-tiny.en", "partial_precision": "", "threads": 2}})
    w = Worker(cfg, 0)
    w.backend = OrtWhisperBackend(cfg.model, warmup=False)
    p = RingPool.create(segment_name, slots=1, capacity=len(audio))
    try:
        ring = p.acquire()
        ring.write(audio)
        with capture_logs() as logs:
            [result] = w.process([job(p, ring.slot, ring.generation, 0, len(audio))])
        assert result.status == OK
        assert wer([speech.reference + " no" * 15], [result.text]) <= 0.15, result.text
        [(_, labels, count)] = [c for c in w.metrics.snapshot()["counters"] if c[0] == "worker_fallbacks_total"]
        assert labels == {"outcome": "resampled"} and count == 1
        [event] = [e for e in logs if e["event"] == "worker.final_fell_back"]
        assert event["outcome"] == "resampled" and event["temperature"] > 0 and event["stream"] == "s"
    finally:
        for pool in w._pools.values():
            pool.close()
        p.close()


def test_reused_slot_and_overrun_fail_with_reason(pool: RingPool, worker: Worker) -> None:
    ring = pool.acquire()
    ring.write(np.zeros(4000, dtype=np.float32))
    stale = job(pool, ring.slot, ring.generation - 1, 0, 100, 1)
    beyond = job(pool, ring.slot, ring.generation, 0, 5000, 2)
    bad_slot = job(pool, 7, ring.generation, 0, 100, 3)
    good = job(pool, ring.slot, ring.generation, 0, 100, 4)
    results = {r.job_id: r for r in worker.process([stale, beyond, bad_slot, good])}
    assert results[1].status == FAILED and "reused" in (results[1].error or "")
    assert results[2].status == FAILED and "not in ring" in (results[2].error or "")
    assert results[3].status == FAILED and "slot 7" in (results[3].error or "")
    assert results[4].status == OK and results[4].batch_size == 1


def test_missing_segment_fails_the_job(worker: Worker) -> None:
    j = Job(job_id=9, ingest=0, stream="s", shm=f"streamasr.none{uuid.uuid4().hex}.ingest0", slot=0, generation=1,
            start=0, end=10, final=False, priority=REALTIME, deadline=0.0, seg=0)
    [result] = worker.process([j])
    assert result.status == FAILED and "audio unavailable" in (result.error or "")


def test_backend_error_fails_the_batch_and_worker_goes_on(pool: RingPool, worker: Worker) -> None:
    ring = pool.acquire()
    ring.write(np.zeros(1000, dtype=np.float32))
    worker.backend = Broken()
    results = worker.process([job(pool, ring.slot, ring.generation, 0, 100, i) for i in range(3)])
    assert [r.status for r in results] == [FAILED] * 3
    assert "device lost" in (results[0].error or "")
    worker.backend = NullBackend(worker.cfg.model)
    assert worker.process([job(pool, ring.slot, ring.generation, 0, 100)])[0].status == OK


def test_a_request_the_backend_fails_on_does_not_fail_its_batch_mates(pool: RingPool, worker: Worker) -> None:
    """One request the model raises on, in a batch of three: the worker decodes them again one at a
    time, and only that one is answered FAILED. Failing all three, the ingest would retry each
    final, maybe batched with the same request again, until its retries ran out."""

    class FailsOnOne(Recording):
        def transcribe_batch(self, requests: Sequence[DecodeRequest]) -> list[DecodeResult]:
            if any(r.prompt == "poison" for r in requests):
                raise ValueError("cannot decode this one")
            return super().transcribe_batch(requests)

    ring = pool.acquire()
    ring.write(np.zeros(1000, dtype=np.float32))
    worker.backend = FailsOnOne()
    batch = [replace(job(pool, ring.slot, ring.generation, 0, 100 * (i + 1), i), prompt="poison" if i == 1 else None)
             for i in range(3)]
    results = worker.process(batch)
    assert [(r.job_id, r.status, r.text, r.batch_size) for r in results] == [(0, OK, "100", 1), (1, FAILED, "", 0), (2, OK, "300", 1)]
    assert "cannot decode this one" in (results[1].error or "")


def test_audio_overwritten_during_decode_fails(pool: RingPool, worker: Worker) -> None:
    ring = pool.acquire()
    ring.write(np.zeros(16_000, dtype=np.float32))

    class Slow(Backend):
        def transcribe_batch(self, requests: Sequence[DecodeRequest]) -> list[DecodeResult]:
            ring.protected_from = ring.written
            ring.write(np.ones(8000, dtype=np.float32))  # the writer laps the reader meanwhile
            return [DecodeResult(text="x") for _ in requests]

    worker.backend = Slow()
    [result] = worker.process([job(pool, ring.slot, ring.generation, 0, 8000)])
    assert result.status == FAILED and "overwritten" in (result.error or "")


def segment_with_audio(name: str) -> tuple[RingPool, Ring]:
    """An ingest's segment (new, or recreated after a restart) with 100 samples in its one ring."""
    pool = RingPool.create(name, slots=1, capacity=1000)
    ring = pool.acquire()
    ring.write(np.zeros(100, dtype=np.float32))
    return pool, ring


def test_recreated_segment_is_reattached(worker: Worker, segment_name: str) -> None:
    first, ring = segment_with_audio(segment_name)
    assert worker.process([job(first, 0, ring.generation, 0, 100)])[0].status == OK
    first.close()
    second, ring = segment_with_audio(segment_name)  # the ingest restarted
    assert worker.process([job(second, 0, ring.generation, 0, 100)])[0].status == OK
    second.close()


def test_results_go_to_their_own_ingest_and_a_gone_one_is_reported() -> None:
    """Each ingest's results leave on its own socket, whole and in order; an ingest that is not
    there has them queued until its queue is full, and what cannot be queued is logged."""
    run = Path(tempfile.mkdtemp(prefix="sasr-"))  # short: ipc paths are limited to about 100 bytes
    cfg = settings.load(None, {"run_dir": str(run), "instance": f"t{uuid.uuid4().hex[:8]}"})
    ctx = zmq.Context()
    ingest1 = ctx.socket(zmq.PULL)
    ingest1.bind(cfg.ingest_results_endpoint(1))
    links = _ResultLinks(ctx, cfg)
    try:
        with capture_logs() as logs:
            links.send([JobResult(job_id=i, ingest=i % 2, text=f"r{i}") for i in range(6)])
            assert ingest1.poll(5000)
            kind, body = ingest1.recv_multipart()
            assert kind == wire.RESULTS
            assert [(r.job_id, r.text) for r in wire.unpack_results(body)] == [(1, "r1"), (3, "r3"), (5, "r5")]
            for i in range(2000):  # ingest 0 never binds
                links.send([JobResult(job_id=100 + i, ingest=0)])
        dropped = [e for e in logs if e["event"] == "worker.results_undeliverable"]
        assert dropped and {e["ingest"] for e in dropped} == {0}
        queued = 1 + 2000 - len(dropped)  # the first message (jobs 0, 2, 4) and the rest that fit
        assert queued == links._socks[0].getsockopt(zmq.SNDHWM)  # wait for ingest 0 in its socket's queue
        assert not ingest1.poll(100)  # none of ingest 0's went elsewhere
    finally:
        links.close(0)
        ingest1.close(linger=0)
        ctx.term()
        shutil.rmtree(run, ignore_errors=True)


def test_failed_reattach_is_retried_on_the_next_job(worker: Worker, segment_name: str) -> None:
    first, ring = segment_with_audio(segment_name)
    assert worker.process([job(first, 0, ring.generation, 0, 100)])[0].status == OK
    gone = ring.generation
    first.close()
    first.unlink()  # the ingest stopped: the re-attach for the next job fails
    [missing] = worker.process([job(first, 0, gone + 5, 0, 100, 2)])
    assert missing.status == FAILED and "audio unavailable" in (missing.error or "")
    second, ring = segment_with_audio(segment_name)  # the ingest is back
    results = worker.process([job(second, 0, ring.generation, 0, 100, 3 + i) for i in range(2)])
    assert [r.status for r in results] == [OK, OK], [r.error for r in results]
    second.close()


def test_a_segment_its_ingest_unlinked_or_replaced_is_released(worker: Worker, segment_name: str) -> None:
    """The serve loop's check keeps a current segment mapped and closes one whose ingest let go."""
    first, ring = segment_with_audio(segment_name)
    assert worker.process([job(first, 0, ring.generation, 0, 100)])[0].status == OK
    worker.release_stale_pools()
    assert list(worker._pools) == [segment_name]  # still the ingest's: kept
    first.close()
    second, ring = segment_with_audio(segment_name)  # the ingest restarted
    with capture_logs() as logs:
        worker.release_stale_pools()
    assert worker._pools == {} and [e["segment"] for e in logs if e["event"] == "worker.segment_released"] == [segment_name]
    assert worker.process([job(second, 0, ring.generation, 0, 100)])[0].status == OK
    second.close()


def _maps(pid: int, name: str) -> bool:
    """Whether process `pid` maps the shm segment `name` (unlinked or not)."""
    return f"/{name}" in Path(f"/proc/{pid}/maps").read_text()


def test_a_segment_read_by_a_batch_the_backend_failed_on_is_unmapped_when_released(worker: Worker, segment_name: str) -> None:
    """A backend error must not pin the audio it was given: a worker that holds an unlinked
    segment's pages keeps the restarted ingest from making its new one. An idle worker allocates
    next to nothing, so no garbage collection comes to free what a reference cycle holds:
    collection is off here as it is, in effect, there."""
    pool, ring = segment_with_audio(segment_name)
    worker.backend = Broken()
    gc.disable()
    try:
        results = worker.process([job(pool, 0, ring.generation, 0, 100, i) for i in range(2)])  # a batch, then each alone
        assert [r.status for r in results] == [FAILED, FAILED]
        del ring
        pool.close()
        pool.unlink()  # the ingest exits
        worker.release_stale_pools()
        assert not _maps(os.getpid(), segment_name), "the worker still maps the unlinked segment"
    finally:
        gc.enable()


class FakeBroker:
    """A real worker process (null model) and the broker's worker socket, played by the test."""

    def __init__(self, overrides: dict[str, Any] | None = None, stderr: IO[bytes] | int = subprocess.DEVNULL) -> None:
        """`overrides`: config sections beside the model's; `stderr`: where the worker's log goes."""
        self.run = Path(tempfile.mkdtemp(prefix="sasr-"))  # short: ipc paths are limited to about 100 bytes
        self.cfg = settings.load(None, {"run_dir": str(self.run), "instance": f"t{uuid.uuid4().hex[:8]}",
                                        "model": {"name": "null", "backend": "null"}, **(overrides or {})})
        config_file = self.run / "config.toml"
        config_file.write_text(settings.dump(self.cfg))
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind(self.cfg.broker_worker_endpoint)
        self.proc = subprocess.Popen([sys.executable, "-m", "workers", "--index", "0", "--config", str(config_file)],
                                     cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr)

    def receive(self, kind: bytes | None, seconds: float) -> list[bytes] | None:
        """The next message of `kind` from the worker within `seconds`, heartbeats answered meanwhile."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self.sock.poll(int(left * 1000) + 1):
                frames = self.sock.recv_multipart()
                if frames[1] == wire.HEARTBEAT:
                    self.sock.send_multipart([frames[0], wire.HEARTBEAT])
                elif frames[1] == kind:
                    return frames
        return None

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(15)
        self.sock.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.run, ignore_errors=True)


def test_a_worker_unmaps_a_segment_its_ingest_unlinked_without_waiting_for_a_job(segment_name: str) -> None:
    """An unlinked segment's pages stay in /dev/shm while any process maps it: a worker holding a
    stopped ingest's segment would leave no room for the restarted ingest's new one, and no job
    of the old segment comes to tell it. A real worker process, a fake broker: the worker reads
    a job's audio from the segment, the ingest unlinks it, the worker unmaps it on its own."""
    pool, ring = segment_with_audio(segment_name)
    broker = FakeBroker()
    try:
        ready = broker.receive(wire.READY, 30)
        assert ready, "the worker never registered"
        broker.sock.send_multipart([ready[0], wire.JOBS, wire.pack_jobs([job(pool, 0, ring.generation, 0, 100)])])
        done = broker.receive(wire.DONE, 30)
        assert done and [row[2] for row in wire.unpack(done[2])] == [OK]
        assert _maps(broker.proc.pid, segment_name)
        del ring
        pool.close()
        pool.unlink()  # the ingest exits
        deadline = time.monotonic() + 10
        while _maps(broker.proc.pid, segment_name) and time.monotonic() < deadline:
            broker.receive(None, 0.1)
        assert not _maps(broker.proc.pid, segment_name), "the worker still maps the unlinked segment"
    finally:
        broker.close()


def test_a_malformed_job_row_from_the_broker_is_refused_alone_and_the_worker_goes_on(pool: RingPool) -> None:
    """A row the worker cannot order or run (a deadline that is no number, from a broker of
    another version, say) is refused and logged, and answered FAILED to the broker (its credit)
    and to the ingest; the rows beside it are run, and the worker lives on: taken, such a row
    ended the worker in its batcher, and every worker it went to."""
    ring = pool.acquire()
    ring.write(np.zeros(1000, dtype=np.float32))
    good = replace(job(pool, ring.slot, ring.generation, 0, 100, 1), final=False, deadline=time.monotonic() + 60)
    bad = list(replace(good, job_id=2).to_wire())
    bad[10] = "soon"  # deadline
    broker = FakeBroker()
    ingest = broker.ctx.socket(zmq.PULL)
    ingest.bind(broker.cfg.ingest_results_endpoint(good.ingest))
    try:
        ready = broker.receive(wire.READY, 30)
        assert ready, "the worker never registered"
        broker.sock.send_multipart([ready[0], wire.JOBS, wire.pack([bad, list(good.to_wire())])])
        done: dict[int, int] = {}
        while len(done) < 2 and (frames := broker.receive(wire.DONE, 10)):
            done.update((row[0], row[2]) for row in wire.unpack(frames[2]))
        assert done == {1: OK, 2: FAILED}
        told: dict[int, JobResult] = {}
        while len(told) < 2 and ingest.poll(10_000):
            told.update((r.job_id, r) for r in wire.unpack_results(ingest.recv_multipart()[1]))
        assert told[2].status == FAILED and "deadline must be a finite number" in told[2].error
        assert told[1].status == OK
        assert broker.proc.poll() is None, "the worker ended"
    finally:
        ingest.close(linger=0)
        broker.close()


def test_a_jobs_message_that_is_no_list_of_rows_counts_as_an_error() -> None:
    """A JOBS body the worker cannot read at all (a broker of another version) loses every job in
    it: the worker drops it and lives on, and says so where an operator alerts, in `errors_total`,
    as it does for a single row it refuses."""
    broker = FakeBroker()
    snapshots = broker.ctx.socket(zmq.SUB)  # the collector's end of the worker's metrics
    snapshots.setsockopt(zmq.SUBSCRIBE, b"")
    snapshots.bind(metrics_endpoint(broker.cfg))
    try:
        ready = broker.receive(wire.READY, 30)
        assert ready, "the worker never registered"
        broker.sock.send_multipart([ready[0], wire.JOBS, wire.pack({"jobs": "soon"})])

        def errors() -> float | None:
            broker.receive(None, 0.1)  # heartbeats answered, or the worker would take the broker for gone
            while snapshots.poll(0):
                counters = msgpack.unpackb(snapshots.recv())["counters"]
                found = [value for name, labels, value in counters if name == "errors_total" and labels == {"code": "internal"}]
                if found:
                    return found[0]
            return None

        assert wait_for(errors, timeout=30, what="the worker's errors_total") == 1
        assert broker.proc.poll() is None, "the worker ended"
    finally:
        snapshots.close(linger=0)
        broker.close()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Exits:
    """Stands in for os._exit: records the statuses the watchdog ends the process with."""

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.at: list[float] = []  # time.monotonic() of each

    def __call__(self, status: int) -> None:
        self.statuses.append(status)
        self.at.append(time.monotonic())


def test_watchdog_fires_past_the_limit_for_a_call_that_runs_on(pool: RingPool) -> None:
    clock, exits = Clock(), Exits()
    dog = Watchdog(120.0, exit_process=exits, clock=clock)
    jobs = [job(pool, 0, 1, 0, 100, 7), job(pool, 0, 1, 0, 100, 8)]
    dog.begin(clock.now, jobs)
    clock.now = 119.9
    assert not dog.check() and exits.statuses == []  # long, but not past the limit
    clock.now = 120.0
    with capture_logs() as logs:
        assert dog.check()
    assert exits.statuses == [STUCK_EXIT_STATUS] and STUCK_EXIT_STATUS not in (0, 1)
    assert [(e["event"], e["log_level"], e["seconds"], e["batch"], e["jobs"]) for e in logs] == \
        [("worker.stuck", "error", 120.0, 2, [7, 8])]


def test_watchdog_never_fires_for_calls_that_end_nor_when_off(pool: RingPool) -> None:
    clock, exits = Clock(), Exits()
    dog = Watchdog(120.0, exit_process=exits, clock=clock)
    for _ in range(5):  # many batches, each well within the limit, back to back and apart
        dog.begin(clock.now, [job(pool, 0, 1, 0, 100)])
        clock.now += 100.0
        assert not dog.check()
        dog.end()
        clock.now += 1000.0
        assert not dog.check()
    off = Watchdog(0.0, exit_process=exits, clock=clock)
    off.begin(clock.now, [job(pool, 0, 1, 0, 100)])
    clock.now += 1e9
    assert not off.check()
    assert exits.statuses == []


def test_the_main_loop_counts_as_turning_after_a_turn_and_inside_a_backend_call(pool: RingPool) -> None:
    """What the IO thread asks before it pushes its switch back: has the main loop turned since
    the last push? A call counts as the loop's turn (`check` bounds it); a loop that stopped after
    one does not."""
    dog = Watchdog(120.0)
    assert dog.turning(since=-math.inf)  # the first push, before the loop starts
    assert not dog.turning(since=10.0)
    dog.turned(11.0)
    assert dog.turning(since=10.0) and not dog.turning(since=12.0)
    dog.begin(12.5, [job(pool, 0, 1, 0, 100)])
    assert dog.turning(since=1000.0)
    dog.end()
    assert not dog.turning(since=13.0)


def test_process_is_watched_for_the_length_of_its_backend_call(pool: RingPool, worker: Worker) -> None:
    """Worker.process stamps the call it makes and clears the stamp however the call ends, so the
    watchdog sees the decode and only the decode: one that returns or raises leaves it idle."""
    ring = pool.acquire()
    ring.write(np.zeros(1000, dtype=np.float32))
    clock, exits = Clock(), Exits()  # process() stamps with time.monotonic(): the clock runs ahead of it
    worker.watchdog = Watchdog(120.0, exit_process=exits, clock=clock)
    # what the watchdog said from inside each call: an assert there would only fail the job, which
    # Worker._decode turns into a FAILED result
    seen: list[bool] = []

    class Hangs(Backend):
        def transcribe_batch(self, requests: Sequence[DecodeRequest]) -> list[DecodeResult]:
            clock.now = time.monotonic() + 121.0  # the IO thread ticks while the call is inside
            seen.append(worker.watchdog.check())
            return [DecodeResult(text="late") for _ in requests]

    class Quick(Backend):
        def transcribe_batch(self, requests: Sequence[DecodeRequest]) -> list[DecodeResult]:
            clock.now = time.monotonic() + 1.0
            seen.append(worker.watchdog.check())
            return [DecodeResult(text="x") for _ in requests]

    for backend, status in ((Quick(), OK), (Broken(), FAILED)):
        worker.backend = backend
        [result] = worker.process([job(pool, ring.slot, ring.generation, 0, 100)])
        assert result.status == status, result
        clock.now = time.monotonic() + 1000.0
        assert not worker.watchdog.check()
    assert seen == [False]  # a second into the call, well within the limit
    assert exits.statuses == []
    worker.backend = Hangs()
    with capture_logs() as logs:
        results = worker.process([job(pool, ring.slot, ring.generation, 0, 100, 41), job(pool, ring.slot, ring.generation, 0, 50, 42)])
    assert seen == [False, True] and [r.status for r in results] == [OK, OK]  # fired inside the call; exits only in tests
    assert exits.statuses == [STUCK_EXIT_STATUS]
    assert [(e["batch"], e["jobs"]) for e in logs if e["event"] == "worker.stuck"] == [(2, [41, 42])]


@pytest.mark.parametrize("answered", [True, False])
def test_a_broker_that_does_not_know_the_worker_gets_its_ready_again(answered: bool) -> None:
    """A broker answers the heartbeats of a worker it has not registered with REGISTER, as
    broker.py does (at most once a heartbeat interval). Once a heartbeat has answered the
    worker's READY, the IO thread tells the main thread at once to send READY again. Before that
    it waits, since the READY may be on its way; but a READY that never arrives (the broker that
    had it died) must not leave the worker unknown for good: the REGISTERs are not taken for
    hearing the broker, its patience runs out and the sockets are replaced, READY with them."""
    run = Path(tempfile.mkdtemp(prefix="sasr-"))  # short: ipc paths are limited to about 100 bytes
    cfg = settings.load(None, {"run_dir": str(run), "instance": f"t{uuid.uuid4().hex[:8]}",
                               "broker": {"heartbeat_ms": 100, "liveness": 3}})
    interval = cfg.broker.heartbeat_ms / 1000
    ctx = zmq.Context()
    broker = ctx.socket(zmq.ROUTER)
    broker.bind(cfg.broker_worker_endpoint)
    pipe = ctx.socket(zmq.PAIR)
    pipe.bind(_PIPE)
    heartbeats = Heartbeats(ctx, cfg, b"worker-test")
    try:
        with capture_logs() as logs:
            heartbeats.start()
            assert broker.poll(5000)
            ident = broker.recv_multipart()[0]
            if answered:
                broker.send_multipart([ident, wire.HEARTBEAT])  # what answers a READY
            asked = -1.0
            deadline = time.monotonic() + 5.0
            while not pipe.poll(0) and time.monotonic() < deadline:
                if broker.poll(20):
                    broker.recv_multipart()
                if time.monotonic() - asked >= interval:  # the broker no longer knows the worker
                    asked = time.monotonic()
                    broker.send_multipart([ident, wire.REGISTER])
            assert pipe.poll(0) and pipe.recv() == REGISTER, "the main thread was never told to register again"
        events = [e["event"] for e in logs]
        assert events == (["worker.broker_asks_to_register"] if answered else ["worker.broker_silent"]), events
    finally:
        pipe.send(STOP)
        heartbeats.join(5)
        pipe.close(linger=0)
        broker.close(linger=0)
        ctx.term()
        shutil.rmtree(run, ignore_errors=True)


def test_the_io_thread_ends_a_worker_stuck_in_its_model(pool: RingPool, worker: Worker) -> None:
    """The real IO thread runs the watchdog on its ticks while the main thread is inside a call:
    decodes shorter than the limit pass, one that runs past it ends the process."""
    ring = pool.acquire()
    ring.write(np.zeros(1000, dtype=np.float32))
    run = Path(tempfile.mkdtemp(prefix="sasr-"))  # short: ipc paths are limited to about 100 bytes
    cfg = settings.load(None, {"run_dir": str(run), "instance": f"t{uuid.uuid4().hex[:8]}",
                               "broker": {"heartbeat_ms": 40}, "workers": {"stuck_after_s": 0.5}})
    exits = Exits()
    worker.watchdog = Watchdog(cfg.workers.stuck_after_s, exit_process=exits)
    ctx = zmq.Context()
    pipe = ctx.socket(zmq.PAIR)
    pipe.bind(_PIPE)
    heartbeats = Heartbeats(ctx, cfg, b"worker-test", worker.watchdog)

    class Sleeps(Backend):
        def __init__(self, seconds: float) -> None:
            self.seconds = seconds

        def transcribe_batch(self, requests: Sequence[DecodeRequest]) -> list[DecodeResult]:
            time.sleep(self.seconds)  # releases the GIL, as a native call does
            return [DecodeResult(text="x") for _ in requests]

    class Stuck(Backend):
        """A call that stays inside (releasing the GIL, as a hung native call does) until the
        watchdog ends the process; here the stand-in for os._exit only records it, so the call
        then returns, and says when."""

        def __init__(self) -> None:
            self.returned = 0.0

        def transcribe_batch(self, requests: Sequence[DecodeRequest]) -> list[DecodeResult]:
            give_up = time.monotonic() + 60
            while not exits.statuses and time.monotonic() < give_up:
                time.sleep(0.01)
            self.returned = time.monotonic()
            return [DecodeResult(text="x") for _ in requests]

    try:
        heartbeats.start()
        worker.backend = Sleeps(0.05)
        for _ in range(5):
            worker.process([job(pool, ring.slot, ring.generation, 0, 100)])
        time.sleep(0.7)  # idle past the limit: nothing runs, nothing to watch
        assert exits.statuses == []
        worker.backend = stuck = Stuck()
        started = time.monotonic()
        worker.process([job(pool, ring.slot, ring.generation, 0, 100, 99)])
        assert exits.statuses[:1] == [STUCK_EXIT_STATUS], "the IO thread never ended the stuck call"
        # on a tick past the limit, never before it, and while the call was inside
        assert started + 0.5 <= exits.at[0] <= stuck.returned
    finally:
        pipe.send(STOP)
        heartbeats.join(5)
        pipe.close(linger=0)
        ctx.term()
        shutil.rmtree(run, ignore_errors=True)
    assert heartbeats.failed is None


def test_a_stuck_worker_exits_at_once_with_its_own_status() -> None:
    """The default exit: os._exit from the watching thread, whatever the main thread is doing,
    with a status supervisord's log tells apart from a crash; the log line is out first."""
    script = (
        "import threading, time\n"
        "from workers.worker import Watchdog\n"
        "dog = Watchdog(5.0, clock=lambda: 10.0)\n"
        "dog.begin(0.0, [])\n"
        "threading.Thread(target=dog.check).start()\n"
        "time.sleep(60)\n"  # the main thread, 'stuck'
        "raise SystemExit(0)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == STUCK_EXIT_STATUS, done.stderr
    assert "worker.stuck" in done.stdout + done.stderr


def test_a_worker_stuck_holding_the_gil_is_ended_by_the_dead_man_s_switch() -> None:
    """A call that never releases the GIL stops the IO thread and its `check` with it; the switch
    that thread re-arms on its ticks while the main loop turns runs without the GIL and ends the
    process, with every thread's stack on stderr. The call here is libc's sleep through
    ctypes.PyDLL, which keeps the GIL."""
    script = (
        "import ctypes, sys, time, uuid, tempfile, zmq\n"
        "from config import settings\n"
        "from workers.worker import _PIPE, Heartbeats, Watchdog\n"
        "cfg = settings.load(None, {'run_dir': tempfile.mkdtemp(prefix='sasr-'), 'instance': 't' + uuid.uuid4().hex[:8],\n"
        "                           'broker': {'heartbeat_ms': 40}, 'workers': {'stuck_after_s': 0.5}})\n"
        "ctx = zmq.Context()\n"
        "pipe = ctx.socket(zmq.PAIR)\n"
        "pipe.bind(_PIPE)\n"
        "dog = Watchdog(cfg.workers.stuck_after_s)\n"
        "Heartbeats(ctx, cfg, b'worker-test', dog).start()\n"
        "end = time.monotonic() + 5.0\n"  # longer than the switch: ticks keep pushing it back while the loop turns
        "while time.monotonic() < end:\n"
        "    dog.turned(time.monotonic())\n"
        "    time.sleep(0.05)\n"
        "print('holding the GIL', flush=True)\n"
        "ctypes.PyDLL(None).sleep(60)\n"
        "print('the call returned', flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=40,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # the call sleeps 60 s: a timeout is a miss
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "holding the GIL" in done.stdout and "the call returned" not in done.stdout
    # stuck_after_s, the stall watch's push interval and two of the main loop's one-second idle wake-ups
    assert "Timeout (0:00:03.500000)!" in done.stderr
    assert 'File "<string>", line 16 in <module>' in done.stderr  # the main thread's stack, at the stuck call


def test_the_dead_man_s_switch_is_disarmed_when_the_io_thread_stops() -> None:
    """A worker that stops cleanly is not ended afterwards by a switch nobody pushes back."""
    script = (
        "import time, uuid, tempfile, zmq\n"
        "from config import settings\n"
        "from workers.worker import _PIPE, STOP, Heartbeats, Watchdog\n"
        "cfg = settings.load(None, {'run_dir': tempfile.mkdtemp(prefix='sasr-'), 'instance': 't' + uuid.uuid4().hex[:8],\n"
        "                           'broker': {'heartbeat_ms': 40}, 'workers': {'stuck_after_s': 0.2}})\n"
        "ctx = zmq.Context()\n"
        "pipe = ctx.socket(zmq.PAIR)\n"
        "pipe.bind(_PIPE)\n"
        "io = Heartbeats(ctx, cfg, b'worker-test', Watchdog(cfg.workers.stuck_after_s))\n"
        "io.start()\n"
        "time.sleep(0.5)\n"
        "pipe.send(STOP)\n"
        "io.join(5)\n"
        "time.sleep(4.0)\n"  # past the switch's 3.2 s
        "print('still here', flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=40,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert "still here" in done.stdout and "Timeout" not in done.stderr
