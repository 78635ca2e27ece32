"""A worker process: reads audio straight from the ingests' shm rings, batches the jobs of many
streams and runs the speech model on them.

Two threads, two DEALER sockets to the broker. The main thread owns the job socket: jobs arrive
on it, and the thread that computes them sends the results straight to the ingest that owns each
job (a PUSH socket per ingest) and tells the broker which jobs it answered (DONE, on the job
socket), with no hand-off between threads on a job's path and no detour through the broker. The
IO thread owns a second socket, for heartbeats only (its identity is the job socket's plus
`+hb`), so heartbeats keep flowing while a batch is inside the model (a call may take a second,
longer than the broker's patience). When the broker falls silent the IO thread reconnects
Paranoid-Pirate style and tells the main thread to register again. The IO thread is also the
main thread's watchdog: heartbeats that outlive a hung backend call, or a main loop blocked
outside it, would keep its jobs held forever, so past `[workers] stuck_after_s` it ends the
process (see Watchdog).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

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
from metrics.stallwatch import StallWatch
from protocol.messages import INTERNAL
from protocol.socketfiles import socket_file_state
from shm.pool import RingPool
from shm.ring import Ring
from speech.audio import load_audio, resample
from speech.backend import SAMPLE_RATE, Backend, DecodeRequest, DecodeResult
from workers.batcher import Batcher

log = structlog.get_logger()

_PIPE = "inproc://worker-io"
STOP = b"STOP"  # main -> IO thread: close and exit
REGISTER = b"REGISTER"  # IO -> main thread: the broker was silent, or is new or forgot us: send READY again
BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 2.0
# A broker not reached this long after the worker connected (or replaced its sockets) is said in
# the log, and again each UNREACHABLE_REPEAT_S while it lasts: ZeroMQ retries a missing socket
# file for ever without a word. 15 s is several broker starts (its imports take a few seconds on
# a loaded machine, a restart by supervisord a second more), so a cold start says nothing, while
# an operator waiting for a worker to register reads why within the quarter minute.
UNREACHABLE_AFTER_S = 15.0
UNREACHABLE_REPEAT_S = 60.0
FLUSH_S = 1.0  # at shutdown, how long results may wait for the broker and the ingests
POOL_CHECK_S = 1.0  # how often the shm segments a worker maps are checked for an ingest that let go of them
# Exit status of a worker the watchdog ended: not 1 (crashed, or its IO thread failed), so
# supervisord's log tells a hung model call from the other failures.
STUCK_EXIT_STATUS = 3
# The sentence a worker decodes at start-up to price a stream for admission (Worker.calibrate):
# source and licence in calibration.NOTICE beside it.
CALIBRATION_CLIP = Path(__file__).with_name("calibration.flac")


class AudioUnavailable(Exception):
    """The job's samples are no longer (or not) in the ring: the slot was reused or overrun."""


def _dealer(ctx: zmq.Context, endpoint: str, identity: bytes) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.IMMEDIATE, 1)  # no connection: send fails and the caller keeps the message
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def _exit_now(status: int) -> None:
    """End the process without unwinding: a thread hung in native code cannot be joined, and
    nothing it holds needs cleaning up (the broker re-queues its jobs, the shm is the ingests')."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream must not keep the process alive
            pass
    os._exit(status)


class Watchdog:
    """Ends a worker whose backend call has run longer than `stuck_after_s`, or whose main loop
    has not turned for that long outside a call (0: never).

    A hung native call (a deadlock in the runtime, a GPU hang) cannot be interrupted, and the IO
    thread keeps heartbeating meanwhile: the broker would take the worker for alive and its jobs
    would never be answered, stalling their streams. The main thread stamps each call's start
    (`begin`) and clears it (`end`); the IO thread calls `check` on every tick and, past the
    limit, logs `worker.stuck` and exits. Heartbeats stop with the process, so the broker
    re-queues the jobs, and supervisord starts a new worker.

    A call that hangs holding the GIL stops the IO thread too, so `check` never runs. For that
    the IO thread's ticks also push back a StallWatch (metrics/stallwatch.py) set to the same
    limit: a timer in C that needs no GIL, which then writes every thread's stack to stderr and
    exits with status 1.

    The main loop blocked outside a call (a deadlock, a blocking call that never returns) lets
    the IO thread heartbeat on, and its jobs wait and its credit comes back for jobs that never
    run. The loop stamps each turn (`turned`), and the IO thread pushes that timer back only when
    the loop has turned since the last push, or is inside a call (`turning`): a call is the
    loop's turn, bounded by `check`, so the loop's watch is paused for it. The limit is the
    same: one timer serves both threads, and a turn outside a call (jobs read, audio fetched,
    results sent) is far shorter than any call. A blocked loop thus ends the process as the
    broker's and the ingest's do, with every thread's stack in its log, the main thread's at
    the blocking call.
    """

    def __init__(self, stuck_after_s: float, exit_process: Callable[[int], object] = _exit_now,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stuck_after_s = stuck_after_s
        self._exit = exit_process
        self._clock = clock
        self._jobs: Sequence[Job] = ()
        self._started: float | None = None  # start of the call in progress (None: none)
        self._turned = -math.inf  # the main loop's last turn (time.monotonic())

    def begin(self, started: float, jobs: Sequence[Job]) -> None:
        """Main thread, before a backend call (`started` on the watchdog's clock): two stores,
        all the hot path pays. The jobs go first, so an IO thread that sees this start sees them too."""
        self._jobs = jobs
        self._started = started

    def end(self) -> None:
        """Main thread, after the call, however it ended."""
        self._started = None

    def turned(self, now: float) -> None:
        """Main thread, on every turn of its loop (`now`: time.monotonic()): one store."""
        self._turned = now

    def turning(self, since: float) -> bool:
        """IO thread: whether the main loop has turned since `since` (time.monotonic()) or is
        inside a backend call, which `check` bounds."""
        return self._started is not None or self._turned >= since

    def check(self) -> bool:
        """IO thread: fire if the call in progress has run past the limit. Returns whether it
        fired (the exit function returns only in tests)."""
        started = self._started
        if started is None or self.stuck_after_s <= 0:
            return False
        seconds = self._clock() - started
        if seconds < self.stuck_after_s:
            return False
        jobs = self._jobs
        if self._started is not started:
            return False  # the call returned meanwhile; `jobs` may be the next batch's
        log.error("worker.stuck", seconds=round(seconds, 3), stuck_after_s=self.stuck_after_s, batch=len(jobs),
                  jobs=[job.job_id for job in jobs], streams=[job.stream for job in jobs])
        self._exit(STUCK_EXIT_STATUS)
        return True


class Heartbeats(threading.Thread):
    """The IO thread: heartbeats to and from the broker on a socket of their own, and reconnection.

    A broker that stays silent past its patience is gone: the socket is replaced, with backoff,
    and the main thread told to send READY again on its job socket. A broker that does not know
    this worker (it restarted, or gave the worker up as silent) answers its heartbeats with
    REGISTER instead, and the main thread is told at once. Every tick also runs the main thread's
    watchdog, if given.
    """

    def __init__(self, ctx: zmq.Context, cfg: Config, identity: bytes, watchdog: Watchdog | None = None) -> None:
        super().__init__(name="broker-heartbeats", daemon=True)
        self._ctx = ctx
        self._endpoint = cfg.broker_worker_endpoint
        self._identity = wire.heartbeat_identity(identity)
        self._interval_s = cfg.broker.heartbeat_ms / 1000
        self._patience_s = self._interval_s * cfg.broker.liveness
        self._pipe = ctx.socket(zmq.PAIR)
        self._pipe.connect(_PIPE)
        self._watchdog = watchdog
        # For a call that holds the GIL, which stops this thread and its watch with it, and for a
        # main loop that stops turning (see Watchdog). The timer is pushed back on this thread's
        # ticks after a turn of the main loop, so it allows for the longer of their idle sleeps.
        self._stall = StallWatch(watchdog.stuck_after_s if watchdog else 0,
                                 wakes_every_s=max(self._interval_s / 2, POOL_CHECK_S))
        self.failed: BaseException | None = None

    def run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # the process must not live on without its link
            self.failed = exc
            log.exception("worker.io_failed")
            os.kill(os.getpid(), signal.SIGTERM)
        finally:
            self._stall.stop()  # a worker shutting down has no ticks left to give
            self._pipe.close(linger=0)

    def _serve(self) -> None:
        sock: zmq.Socket | None = _dealer(self._ctx, self._endpoint, self._identity)
        heard = time.monotonic()
        # Patience runs from the first heartbeat the socket could send: a broker that is not up
        # yet is not silent, and replacing the sockets then would only strand what the broker
        # sends in between.
        reached: float | None = None
        connected = time.monotonic()  # when the socket was made: `worker.broker_unreachable` counts from it
        unreachable_told = -math.inf
        sent = reconnect_at = 0.0
        backoff = BACKOFF_MIN_S
        # A broker's heartbeat came since the last READY: a REGISTER now means that broker is
        # gone or forgot us. Before one, the READY may still be on its way (heartbeats and jobs
        # travel on two sockets), and a second one would hand back the jobs sent in between.
        registered = False
        poller = zmq.Poller()
        poller.register(self._pipe, zmq.POLLIN)
        poller.register(sock, zmq.POLLIN)
        while True:
            events = dict(poller.poll(self._interval_s / 2 * 1000))
            now = time.monotonic()
            if self._watchdog is not None:
                self._watchdog.check()  # first: the broker's state does not matter to a hung call
            if self._watchdog is not None and self._watchdog.turning(since=self._stall.pushed):
                self._stall.turned(now)
            if self._pipe in events and self._pipe.recv() == STOP:
                if sock is not None:
                    sock.close(linger=0)
                return
            if sock is None:
                if now >= reconnect_at:
                    sock = _dealer(self._ctx, self._endpoint, self._identity)
                    poller.register(sock, zmq.POLLIN)
                    heard, reached, registered, connected = now, None, False, now
                    self._pipe.send(REGISTER)
                continue
            if sock in events:
                while sock.poll(0):
                    kind = sock.recv_multipart()[0]
                    if kind == wire.REGISTER and not registered:
                        # not hearing: a broker that never answers our READY (it was lost on
                        # the way) must still be taken for silent, and the sockets replaced
                        continue
                    heard = now
                    backoff = BACKOFF_MIN_S
                    if kind == wire.HEARTBEAT:
                        registered = True
                    elif kind == wire.REGISTER:
                        log.info("worker.broker_asks_to_register")
                        registered = False
                        self._pipe.send(REGISTER)
                    else:
                        log.warning("worker.unknown_message", kind=kind[:16])
            if now - sent >= self._interval_s / 2:
                try:
                    sock.send(wire.HEARTBEAT, zmq.NOBLOCK)
                    sent = now
                    reached = reached or now
                except zmq.Again:
                    pass  # not connected (yet, or any more: then the silence below decides)
            if reached is None and now - connected >= UNREACHABLE_AFTER_S and now - unreachable_told >= UNREACHABLE_REPEAT_S:
                unreachable_told = now
                log.warning("worker.broker_unreachable", endpoint=self._endpoint, seconds=round(now - connected, 1),
                            socket_file=socket_file_state(self._endpoint))
            if reached is not None and now - max(heard, reached) > self._patience_s:
                log.warning("worker.broker_silent", reconnect_in_s=backoff)
                poller.unregister(sock)
                sock.close(linger=0)
                sock = None
                reconnect_at = now + backoff
                backoff = min(backoff * 2, BACKOFF_MAX_S)


class _JobLink:
    """The main thread's job socket: READY leads every (re)connection, and messages that cannot
    go out while the broker is away wait here, so it still hears of the jobs answered meanwhile."""

    def __init__(self, ctx: zmq.Context, endpoint: str, identity: bytes, ready: bytes) -> None:
        self._ctx = ctx
        self._endpoint = endpoint
        self._identity = identity
        self._ready = ready
        self.outbox: deque[list[bytes]] = deque()
        self.sock = self._connect()

    def _connect(self) -> zmq.Socket:
        self.outbox = deque(m for m in self.outbox if m[0] != wire.READY)
        self.outbox.appendleft([wire.READY, self._ready])
        return _dealer(self._ctx, self._endpoint, self._identity)

    def reconnect(self) -> None:
        self.sock.close(linger=0)
        self.sock = self._connect()
        self.send_outbox()

    def receive(self) -> list[bytes]:
        """Bodies of the JOBS messages waiting on the socket."""
        out = []
        while self.sock.poll(0):
            frames = self.sock.recv_multipart()
            if frames[0] == wire.JOBS and len(frames) == 2:
                out.append(frames[1])
            else:
                log.warning("worker.unknown_message", kind=frames[0][:16])
        return out

    def send(self, frames: list[bytes]) -> None:
        self.outbox.append(frames)
        self.send_outbox()

    def send_outbox(self) -> None:
        while self.outbox:
            try:
                self.sock.send_multipart(self.outbox[0], zmq.NOBLOCK)
            except zmq.Again:  # not connected yet (or the broker is gone): keep it for later
                return
            self.outbox.popleft()

    def flush(self, seconds: float) -> None:
        """At shutdown: give what is left `seconds` to leave, then close."""
        deadline = time.monotonic() + seconds
        self.send_outbox()
        while self.outbox and time.monotonic() < deadline:
            if self.sock.poll(50, zmq.POLLOUT):
                self.send_outbox()
        if self.outbox:
            log.warning("worker.results_unsent", messages=len(self.outbox))
        self.sock.close(linger=int(seconds * 1000))


class _ResultLinks:
    """Results straight to the ingest that owns each job: one process wake-up fewer on every
    result's way than a detour through the broker, and a broker restart loses none of them.

    One PUSH socket per ingest, made when its first result is due. A socket queues what it
    cannot deliver yet (an ingest restarting binds again within moments); only when its queue is
    full, the ingest gone for good, are results dropped, and logged. Its streams are resumed on
    another ingest, which decodes their audio again.
    """

    def __init__(self, ctx: zmq.Context, cfg: Config) -> None:
        self._ctx = ctx
        self._cfg = cfg
        self._socks: dict[int, zmq.Socket] = {}

    def send(self, results: list[JobResult]) -> None:
        by_ingest: dict[int, list[JobResult]] = {}
        for result in results:
            by_ingest.setdefault(result.ingest, []).append(result)
        for index, answers in by_ingest.items():
            sock = self._socks.get(index)
            if sock is None:
                sock = self._socks[index] = self._ctx.socket(zmq.PUSH)
                sock.connect(self._cfg.ingest_results_endpoint(index))
            try:
                sock.send_multipart([wire.RESULTS, wire.pack_results(answers)], zmq.NOBLOCK)
            except zmq.Again:
                log.warning("worker.results_undeliverable", ingest=index, results=len(answers))

    def close(self, seconds: float) -> None:
        """At shutdown: what is queued gets `seconds` to reach its ingest."""
        for sock in self._socks.values():
            sock.close(linger=int(seconds * 1000))
        self._socks.clear()


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
        self.decode_cost = [0.0, 0.0]  # seconds per partial, per final, measured by load()
        # Created here, published from run(): process() records into it when driven directly too.
        self.metrics = ProcessMetrics(cfg, f"worker-{index}")
        self.watchdog = Watchdog(cfg.workers.stuck_after_s)

    def load(self) -> None:
        """Load and warm the model before announcing READY: the broker never waits on a load."""
        from speech.loader import load_backend  # written separately; imported when needed

        started = time.monotonic()
        self.backend = load_backend(self.cfg.model)
        self.decode_cost, heard = self.calibrate()
        log.info("worker.model_ready", model=self.cfg.model.name, load_s=round(time.monotonic() - started, 3),
                 partial_s=round(self.decode_cost[0], 4), final_s=round(self.decode_cost[1], 4), heard=heard)
        if not heard.strip():  # a clear sentence, and no word of it: the weights or the graphs are broken
            log.warning("worker.model_heard_nothing", model=self.cfg.model.name, clip=CALIBRATION_CLIP.name)

    def calibrate(self) -> tuple[list[float], str]:
        """Seconds one partial and one final decode of a 3 s sentence (CALIBRATION_CLIP) take
        here, timed after a warm-up decode of each (a shape's first run allocates), and the
        final's text. Sent with READY: until the broker has measured what streams cost with the
        workers busy, admission prices a stream at no less than these, so the first burst a
        service sees is cut rather than admitted whole. The clip is speech because a decode's
        price is mostly its tokens: silence, which decodes none, priced a partial at half of
        what speech costs. The workers of a service time theirs at once, sharing the cores as
        streams will; the text shows ops, in the log, that the model they started hears."""
        assert self.backend is not None
        audio = resample(load_audio(CALIBRATION_CLIP), SAMPLE_RATE, self.backend.sample_rate)
        costs, text = [], ""
        for partial in (True, False):
            request = [DecodeRequest(audio=audio, partial=partial)]
            self.backend.transcribe_batch(request)
            started = time.monotonic()
            [result] = self.backend.transcribe_batch(request)
            costs.append(time.monotonic() - started)
            text = result.text
        return costs, text

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
        heartbeats = Heartbeats(ctx, self.cfg, self.identity.encode(), self.watchdog)
        with StopSignal() as stop:
            heartbeats.start()
            log.info("worker.started", worker=self.identity, capacity=self.capacity)
            link = _JobLink(ctx, self.cfg.broker_worker_endpoint, self.identity.encode(), wire.pack({
                "capacity": self.capacity, "pid": os.getpid(), "model": self.cfg.model.name, "cost": self.decode_cost,
            }))
            answers = _ResultLinks(ctx, self.cfg)
            try:
                self._serve(link, answers, pipe, stop)
            finally:
                answers.close(FLUSH_S)
                link.send([wire.LEAVING])  # after the last DONE: the broker requeues what this worker will not answer, at once
                link.flush(FLUSH_S)
                try:
                    pipe.send(STOP, zmq.NOBLOCK)
                except zmq.Again:
                    pass  # the IO thread is gone already
                heartbeats.join(FLUSH_S + 1)
                pipe.close(linger=0)
                ctx.destroy(linger=0)
                for pool in self._pools.values():
                    pool.close()
                assert self.backend is not None
                self.backend.close()
        failed = heartbeats.failed is not None
        log.info("worker.stopped", abandoned=len(self._batcher), io_failed=failed)
        return 1 if failed else 0

    def _serve(self, link: _JobLink, answers: _ResultLinks, pipe: zmq.Socket, stop: StopSignal) -> None:
        """Gather jobs from the broker and run a batch whenever one is due; a batch already
        running when SIGTERM arrives is finished and its results sent, jobs not started are left
        to the broker (see wire.LEAVING). Once a second it lets go of segments their ingests left."""
        poller = zmq.Poller()
        poller.register(pipe, zmq.POLLIN)
        poller.register(stop.fileno(), zmq.POLLIN)
        checked = time.monotonic()
        while not stop.stopping:
            poller.register(link.sock, zmq.POLLIN | (zmq.POLLOUT if link.outbox else 0))
            now = time.monotonic()
            self.watchdog.turned(now)  # wakes at least every POOL_CHECK_S, so an idle loop turns too
            wait = checked + POOL_CHECK_S - now
            if (timeout := self._batcher.timeout(now)) is not None:
                wait = min(wait, timeout)
            events = dict(poller.poll(max(0.0, wait) * 1000))
            stop.drain()
            if stop.stopping:
                break  # jobs not started are handed back with the goodbye: another worker is quicker than this batch
            if (now := time.monotonic()) - checked >= POOL_CHECK_S:
                checked = now
                self.release_stale_pools()
            if pipe in events:
                pipe.recv()  # REGISTER: the broker is new or forgot us
                poller.unregister(link.sock)
                link.reconnect()
                continue
            now = time.monotonic()
            refused: list[JobResult] = []
            for body in link.receive():
                try:
                    jobs, bad = wire.unpack_jobs_checked(body, now)
                except Exception:  # a broker of another version: its jobs are lost, and that is an error
                    self.metrics.inc("errors_total", code=INTERNAL)
                    log.exception("worker.bad_jobs")
                    continue
                refused += self._refuse(bad)
                self._batcher.add(jobs, now)
            batch, late = self._batcher.take(now)
            results = refused + [_answer(job, EXPIRED, self.identity, "deadline passed while queued in the worker") for job in late]
            if batch:
                results += self.process(batch)
            if results:
                answers.send(results)
                link.send([wire.DONE, wire.pack_done(results)])
            else:
                link.send_outbox()

    def _refuse(self, bad: list[wire.BadJob]) -> list[JobResult]:
        """Rows from the broker checked as it checks an ingest's (a broker of another version may
        send what this one cannot order or run: taken, such a row ended the worker, and each it went
        to). Each is logged and, where it names its job and one of the ingests, answered FAILED, so
        the broker returns the credit and the ingest hears of it."""
        answers = []
        for row in bad:
            self.metrics.inc("errors_total", code=INTERNAL)
            log.error("worker.bad_job", job=row.job_id, ingest=row.ingest, field=row.field, error=row.error)
            if row.job_id is not None and row.ingest is not None and 0 <= row.ingest < self.cfg.ingest.processes:
                answers.append(JobResult(job_id=row.job_id, ingest=row.ingest, status=FAILED, worker=self.identity,
                                         error=f"refused by the worker: {row.error}"))
        return answers

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
        return results + self._decode(taken, requests) if requests else results

    def _decode(self, taken: list[tuple[Job, Ring]], requests: list[DecodeRequest]) -> list[JobResult]:
        """One backend call for the requests. A batch the backend raises on is decoded again one
        request at a time: the request at fault must not fail the others with it, or a final
        batched with it again would spend its retries there."""
        assert self.backend is not None
        started = time.monotonic()
        self.watchdog.begin(started, [job for job, _ in taken])
        try:
            decoded = self.backend.transcribe_batch(requests)
            if len(decoded) != len(requests):
                raise RuntimeError(f"backend returned {len(decoded)} results for {len(requests)} requests")
            failure = None
        except Exception as exc:
            failure = exc
        finally:
            self.watchdog.end()
        if failure is not None and len(taken) > 1:
            log.warning("worker.batch_failed", batch=len(taken), error=repr(failure))
            # Dropped once logged: its frames hold the requests' views of shm, and this frame holds
            # `failure`, a cycle only the collector frees (an idle worker may not run it for long),
            # until when an unlinked segment's pages are kept from its restarted ingest.
            failure.__traceback__ = None
            return [result for one, request in zip(taken, requests) for result in self._decode([one], [request])]
        if failure is not None:
            [(job, _)] = taken
            self.metrics.inc("errors_total", code=INTERNAL)
            log.error("worker.decode_failed", job=job.job_id, stream=job.stream, exc_info=failure)
            failure.__traceback__ = None  # logged: dropped, as above
            return [_answer(job, FAILED, self.identity, f"backend error: {failure!r}")]
        finished = time.monotonic()
        self._record(taken, finished - started)
        results: list[JobResult] = []
        for (job, ring), out in zip(taken, decoded):
            if not ring.intact(job.start, job.generation):
                self.metrics.inc("errors_total", code=INTERNAL)
                results.append(_answer(job, FAILED, self.identity, "audio overwritten while it was decoded"))
                continue
            if out.fell_back:
                self._fell_back(job, out, finished - started)
            results.append(JobResult(
                job_id=job.job_id, ingest=job.ingest, text=out.text,
                segments=[(s.start, s.end, s.text) for s in out.segments],
                avg_logprob=out.avg_logprob, no_speech_prob=out.no_speech_prob,
                worker=self.identity, batch_size=len(taken), started=started, finished=finished, language=out.language,
                words=[(w.start, w.end, w.text) for w in out.words],
            ))
        log.debug("worker.batch", size=len(taken), seconds=round(finished - started, 4))
        return results

    def _fell_back(self, job: Job, out: DecodeResult, seconds: float) -> None:
        """A final whose greedy decode looped: counted and logged by whether the temperature
        fallback replaced its text, so a stream that keeps looping, and what it costs, show."""
        outcome = "resampled" if out.temperature > 0 else "kept"
        self.metrics.inc("worker_fallbacks_total", outcome=outcome)
        log.info("worker.final_fell_back", job=job.job_id, stream=job.stream, outcome=outcome,
                 temperature=out.temperature, batch_s=round(seconds, 3))

    def _record(self, taken: list[tuple[Job, Ring]], seconds: float) -> None:
        """Per batch, not per job: the busy ratio and batch sizes are what tell a worker's load."""
        finals = sum(job.final for job, _ in taken)
        self.metrics.observe("batch_size", len(taken))
        self.metrics.inc("busy_seconds_total", seconds)
        if finals:
            self.metrics.inc("worker_jobs_total", finals, kind="final")
        if finals < len(taken):
            self.metrics.inc("worker_jobs_total", len(taken) - finals, kind="partial")

    def release_stale_pools(self) -> None:
        """Unmap the segments whose ingest unlinked or replaced them. tmpfs keeps an unlinked
        segment's pages while any process maps it, and a restarted ingest needs that room for its
        new segment; no job of the old one may come to tell. Runs on the main thread between
        batches, so no view of a pool is in use when it is closed."""
        for name, pool in list(self._pools.items()):
            if not pool.is_current():
                del self._pools[name]
                pool.close()
                log.info("worker.segment_released", segment=name)

    def _audio(self, job: Job) -> tuple[Ring, np.ndarray]:
        """The job's samples from shm: a view, or a copy when the range wraps around the ring
        (attached on first use, re-attached when the ingest recreated its segment)."""
        pool = self._pools.get(job.shm)
        if pool is None or (not _holds(pool, job) and not pool.is_current()):
            if pool is not None:
                # Uncached before the attach: one that fails (the segment is gone or half made)
                # must not leave the closed pool to fail every later job of the segment.
                del self._pools[job.shm]
                pool.close()
            pool = RingPool.attach(job.shm)
            self._pools[job.shm] = pool
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

