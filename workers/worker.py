"""A worker process: reads audio straight from the ingests' shm rings, batches the jobs of many
streams and runs the speech model on them.

Two threads. The IO thread owns the DEALER to the broker, so heartbeats keep flowing while a
batch is inside the model (a call may take a second, longer than the broker's patience), and
reconnects Paranoid-Pirate style when the broker falls silent. The main thread loads the model,
then batches and computes. They talk over an inproc PAIR: jobs one way, results the other.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import deque
from typing import Any

import numpy as np
import structlog
import zmq

from broker import jobs as wire
from broker.jobs import EXPIRED, FAILED, Job, JobResult
from broker.signals import StopSignal
from config.settings import Config
from metrics import allocwatch
from metrics.gcwatch import freeze_and_watch
from metrics.registry import ProcessMetrics
from protocol.messages import INTERNAL
from shm.pool import RingPool
from shm.ring import Ring
from speech.backend import Backend, DecodeRequest
from workers.batcher import Batcher

log = structlog.get_logger()

_PIPE = "inproc://worker-io"
STOP = b"STOP"  # compute -> IO thread: send what is left, then close
BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 2.0
FLUSH_S = 1.0  # at shutdown, how long results may wait for the broker


class AudioUnavailable(Exception):
    """The job's samples are no longer (or not) in the ring: the slot was reused or overrun."""


class BrokerLink(threading.Thread):
    """The IO thread: one DEALER to the broker, heartbeats and reconnection.

    Results are handed to the socket only while a connection exists (ZMQ_IMMEDIATE), and kept
    here otherwise, so results finished while the broker was away are sent after reconnecting.
    """

    def __init__(self, ctx: zmq.Context, cfg: Config, identity: bytes, ready: dict[str, Any]) -> None:
        super().__init__(name="broker-io", daemon=True)
        self._ctx = ctx
        self._endpoint = cfg.broker_worker_endpoint
        self._identity = identity
        self._ready = wire.pack(ready)
        self._interval_s = cfg.broker.heartbeat_ms / 1000
        self._patience_s = self._interval_s * cfg.broker.liveness
        self._pipe = ctx.socket(zmq.PAIR)
        self._pipe.connect(_PIPE)
        self._outbox: deque[list[bytes]] = deque()
        self.failed: BaseException | None = None

    def run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # the process must not live on without its link
            self.failed = exc
            log.exception("worker.io_failed")
            os.kill(os.getpid(), signal.SIGTERM)
        finally:
            self._pipe.close(linger=0)

    def _connect(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self._identity)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # no connection: send fails and we keep the message
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._endpoint)
        self._outbox.appendleft([wire.READY, self._ready])
        return sock

    def _serve(self) -> None:
        sock: zmq.Socket | None = self._connect()
        now = time.monotonic()
        heard = sent = now
        tick = reconnect_at = now + self._interval_s
        backoff = BACKOFF_MIN_S
        stop_by: float | None = None  # set by STOP: give up on unsent results at this time
        poller = zmq.Poller()
        poller.register(self._pipe, zmq.POLLIN)
        while True:
            if sock is not None:
                poller.register(sock, zmq.POLLIN | (zmq.POLLOUT if self._outbox else 0))
            wake = tick if sock is not None else reconnect_at
            if stop_by is not None:
                wake = min(wake, stop_by)
            events = dict(poller.poll(max(0.0, wake - time.monotonic()) * 1000))
            now = time.monotonic()

            if self._pipe in events:
                while self._pipe.poll(0):
                    frames = self._pipe.recv_multipart()
                    if frames[0] == STOP:
                        stop_by = now + FLUSH_S
                    else:
                        self._outbox.append(frames)
            if sock is not None and events.get(sock, 0) & zmq.POLLIN:
                heard = now
                backoff = BACKOFF_MIN_S
                while sock.poll(0):
                    frames = sock.recv_multipart()
                    if frames[0] == wire.JOBS and len(frames) == 2:
                        self._pipe.send_multipart(frames)
                    elif frames[0] != wire.HEARTBEAT:
                        log.warning("worker.unknown_message", kind=frames[0][:16])

            if sock is None and now >= reconnect_at:
                sock = self._connect()
                heard = sent = now
                tick = now + self._interval_s
            if sock is not None:
                if self._send_outbox(sock):
                    sent = now
                if now >= tick:
                    tick = now + self._interval_s
                    if now - heard > self._patience_s:
                        log.warning("worker.broker_silent", reconnect_in_s=backoff)
                        poller.unregister(sock)
                        sock.close(linger=0)
                        sock = None
                        reconnect_at = now + backoff
                        backoff = min(backoff * 2, BACKOFF_MAX_S)
                        # The READY of the next connection will lead the outbox.
                        self._outbox = deque(m for m in self._outbox if m[0] != wire.READY)
                    elif now - sent >= self._interval_s / 2 and not self._outbox:
                        if self._send(sock, [wire.HEARTBEAT]):
                            sent = now

            if stop_by is not None and (not self._outbox or now >= stop_by):
                if self._outbox:
                    log.warning("worker.results_unsent", messages=len(self._outbox))
                if sock is not None:
                    sock.close(linger=int(FLUSH_S * 1000))
                return

    def _send_outbox(self, sock: zmq.Socket) -> bool:
        sent = False
        while self._outbox and self._send(sock, self._outbox[0]):
            self._outbox.popleft()
            sent = True
        return sent

    @staticmethod
    def _send(sock: zmq.Socket, frames: list[bytes]) -> bool:
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
            return True
        except zmq.Again:  # not connected yet (or the broker is gone): keep it for later
            return False


class Worker:
    """The compute side: model, shm attachments, batching."""

    def __init__(self, cfg: Config, index: int) -> None:
        self.cfg = cfg
        self.index = index
        self.identity = f"worker-{index}-{os.getpid()}"
        # one batch at a time: jobs wait in the broker, where a final can still overtake queued partials
        self.capacity = max(1, cfg.model.max_batch)
        self._batcher = Batcher(cfg.model.max_batch, cfg.model.max_wait_ms / 1000)
        self._pools: dict[str, RingPool] = {}
        self.backend: Backend | None = None
        # Created here, published from run(): process() records into it when driven directly too.
        self.metrics = ProcessMetrics(cfg, f"worker-{index}")

    def load(self) -> None:
        """Load and warm the model before announcing READY: the broker never waits on a load."""
        from speech.loader import load_backend  # written separately; imported when needed

        started = time.monotonic()
        self.backend = load_backend(self.cfg.model)
        silence = np.zeros(self.backend.sample_rate, dtype=np.float32)
        self.backend.transcribe_batch([DecodeRequest(audio=silence)])
        log.info("worker.model_ready", model=self.cfg.model.name, load_s=round(time.monotonic() - started, 3))

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT; returns the process exit status."""
        self.metrics.inc("busy_seconds_total", 0)  # an idle worker reads 0 % busy, not absent
        self.metrics.start()  # published during the load too: the dashboard shows a loading worker as alive
        try:
            return self._run()
        finally:
            self.metrics.close()

    def _run(self) -> int:
        # Loading comes before the signal handlers: SIGTERM during a load (an ONNX export may
        # take minutes) ends the process at once, and exports are atomic, so that is safe.
        self.load()
        freeze_and_watch(self.metrics)  # after the warm-up decode: the model's objects are frozen with the rest
        allocwatch.arm(self.metrics.process)
        ctx = zmq.Context()
        pipe = ctx.socket(zmq.PAIR)
        pipe.bind(_PIPE)
        link = BrokerLink(ctx, self.cfg, self.identity.encode(), {
            "capacity": self.capacity, "pid": os.getpid(), "model": self.cfg.model.name,
        })
        with StopSignal() as stop:
            link.start()
            log.info("worker.started", worker=self.identity, capacity=self.capacity)
            try:
                self._serve(pipe, stop)
            finally:
                try:
                    pipe.send_multipart([STOP], zmq.NOBLOCK)
                except zmq.Again:
                    pass  # the link is gone already
                link.join(FLUSH_S + 1)
                pipe.close(linger=0)
                ctx.destroy(linger=0)
                for pool in self._pools.values():
                    pool.close()
                assert self.backend is not None
                self.backend.close()
        failed = link.failed is not None
        log.info("worker.stopped", abandoned=len(self._batcher), io_failed=failed)
        return 1 if failed else 0

    def _serve(self, pipe: zmq.Socket, stop: StopSignal) -> None:
        """Gather jobs from the IO thread and run a batch whenever one is due; a batch already
        running when SIGTERM arrives is finished and its results sent."""
        poller = zmq.Poller()
        poller.register(pipe, zmq.POLLIN)
        poller.register(stop.fileno(), zmq.POLLIN)
        while not stop.stopping:
            timeout = self._batcher.timeout(time.monotonic())
            poller.poll(None if timeout is None else timeout * 1000)
            stop.drain()
            now = time.monotonic()
            while pipe.poll(0):
                frames = pipe.recv_multipart()
                try:
                    self._batcher.add(wire.unpack_jobs(frames[1]), now)
                except Exception:
                    log.exception("worker.bad_jobs")
            batch, late = self._batcher.take(now)
            results = [_answer(job, EXPIRED, self.identity, "deadline passed while queued in the worker") for job in late]
            if batch:
                results += self.process(batch)
            if results:
                pipe.send_multipart([wire.RESULTS, wire.pack_results(results)])

    def process(self, batch: list[Job]) -> list[JobResult]:
        """Run one batch; never raises: every job gets a result, FAILED ones say why."""
        assert self.backend is not None
        results: list[JobResult] = []
        requests: list[DecodeRequest] = []
        taken: list[tuple[Job, Ring]] = []
        for job in batch:
            try:
                ring, audio = self._audio(job)
            except Exception as exc:  # a vanished segment is as much the job's problem as an overrun
                self.metrics.inc("errors_total", code=INTERNAL)
                log.warning("worker.audio_unavailable", job=job.job_id, stream=job.stream, error=str(exc))
                results.append(_answer(job, FAILED, self.identity, f"audio unavailable: {exc}"))
                continue
            taken.append((job, ring))
            requests.append(DecodeRequest(
                audio=audio, language=job.language, prompt=job.prompt, prefix=job.prefix, partial=not job.final,
                first=job.first,
            ))
        if not requests:
            return results
        started = time.monotonic()
        try:
            decoded = self.backend.transcribe_batch(requests)
            if len(decoded) != len(requests):
                raise RuntimeError(f"backend returned {len(decoded)} results for {len(requests)} requests")
        except Exception as exc:
            self.metrics.inc("errors_total", len(taken), code=INTERNAL)
            log.exception("worker.batch_failed", batch=len(requests))
            return results + [_answer(job, FAILED, self.identity, f"backend error: {exc!r}") for job, _ in taken]
        finished = time.monotonic()
        self._record(taken, finished - started)
        for (job, ring), out in zip(taken, decoded):
            if not ring.intact(job.start, job.generation):
                self.metrics.inc("errors_total", code=INTERNAL)
                results.append(_answer(job, FAILED, self.identity, "audio overwritten while it was decoded"))
                continue
            results.append(JobResult(
                job_id=job.job_id, ingest=job.ingest, text=out.text,
                segments=[(s.start, s.end, s.text) for s in out.segments],
                avg_logprob=out.avg_logprob, no_speech_prob=out.no_speech_prob,
                worker=self.identity, batch_size=len(taken), started=started, finished=finished,
            ))
        log.debug("worker.batch", size=len(taken), seconds=round(finished - started, 4))
        return results

    def _record(self, taken: list[tuple[Job, Ring]], seconds: float) -> None:
        """Per batch, not per job: the busy ratio and batch sizes are what tell a worker's load."""
        finals = sum(job.final for job, _ in taken)
        self.metrics.observe("batch_size", len(taken))
        self.metrics.inc("busy_seconds_total", seconds)
        if finals:
            self.metrics.inc("worker_jobs_total", finals, kind="final")
        if finals < len(taken):
            self.metrics.inc("worker_jobs_total", len(taken) - finals, kind="partial")

    def _audio(self, job: Job) -> tuple[Ring, np.ndarray]:
        """The job's samples as a view into shm (attached on first use, re-attached when the
        ingest recreated its segment)."""
        pool = self._pools.get(job.shm)
        if pool is None or (not _holds(pool, job) and not pool.is_current()):
            if pool is not None:
                pool.close()
            pool = self._pools[job.shm] = RingPool.attach(job.shm)
        if not 0 <= job.slot < pool.slots:
            raise AudioUnavailable(f"slot {job.slot} outside pool {job.shm} of {pool.slots} slots")
        ring = pool.ring(job.slot)
        if ring.generation != job.generation:
            raise AudioUnavailable(f"slot {job.slot} was reused (generation {ring.generation}, job has {job.generation})")
        return ring, ring.view(job.start, job.end)


def _holds(pool: RingPool, job: Job) -> bool:
    return 0 <= job.slot < pool.slots and pool.ring(job.slot).generation == job.generation


def _answer(job: Job, status: int, worker: str, error: str) -> JobResult:
    return JobResult(job_id=job.job_id, ingest=job.ingest, status=status, worker=worker, error=error)

