"""The broker process: the front door for clients and the load balancer between ingest processes
and workers.

Jobs name audio by slot range in shm, so only a few hundred bytes per job pass through here, and
results not at all: workers send them straight to the owning ingest and tell the broker only
which jobs they answered (DONE). One thread polls three ROUTER sockets (ZeroMQ guide's
load-balancing broker, with credit instead of one-job-at-a-time), heartbeats both ways Paranoid
Pirate style (a worker's on a socket of their own, so they flow while it computes), and
re-queues the jobs of a worker that dies.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog
import zmq

from broker import jobs as wire
from broker.figures import Figures, SavedFigures, prior_share
from broker.jobs import BATCH, EXPIRED, FAILED, OK, REALTIME, BadJob, Job, JobResult
from broker.queue import Dispatcher, JobKey, JobQueue, RealtimeUse, job_key
from broker.signals import StopSignal
from config.settings import Config
from metrics import allocwatch
from metrics.gcwatch import freeze_and_watch
from metrics.registry import ProcessMetrics
from metrics.stallwatch import StallWatch
from protocol import auth
from protocol import messages as m
from protocol.socketfiles import SocketFiles
from streamasr.logs import Throttle

log = structlog.get_logger()

DRAIN_MAX = 512  # messages taken from one socket per loop turn, so heartbeats stay on time
SHARE_WINDOW_S = 5.0  # the per-stream demand is measured over this long, at least
LOADED_BUSY = 0.5  # decodes in a tick the workers were this busy cost what they cost near capacity
# What decodes cost with the workers busy is kept through quiet spells (and across restarts), so
# it is taken only from this many decodes of a kind in a window's busy ticks: one decode that
# stalls (a descheduled core) can be the only "busy" tick of a lightly loaded service.
MIN_LOADED_DECODES = 5
# and no decode counts for more than this many times the median of its kind in the window: a
# partial of a long segment legitimately costs a few times a short one's, a stall tens of times
OUTLIER_RATIO = 4.0
STATUS_NAMES = {OK: "done", EXPIRED: "expired", FAILED: "failed"}  # `status` label of jobs_total


def typical_cost(ticks: list[RealtimeUse], kind: int, least: int) -> float | None:
    """Mean seconds a decode of `kind` (0 partial, 1 final) took in `ticks`, from at least `least`
    decodes (else None), each counted at most OUTLIER_RATIO times their median: decodes that
    stalled (a descheduled core, a batch held up together) say little of what the next will cost,
    as long as they are fewer than half."""
    costs = np.fromiter((c for u in ticks for c in u.costs[kind]), dtype=np.float64)
    if len(costs) < max(least, 1):
        return None
    return float(np.minimum(costs, OUTLIER_RATIO * np.median(costs)).mean())


@dataclass(slots=True)
class Link:
    """Paranoid Pirate bookkeeping for one registered peer."""

    seen: float  # last message from the peer


@dataclass(slots=True)
class IngestState:
    index: int
    endpoint: str  # where clients reach it
    pid: int
    registered: float
    link: Link
    # Its figures, from READY and every heartbeat: a READY carries them too, so the other
    # ingests are not told meanwhile that its streams are gone.
    streams: int = 0  # its load
    realtime: int = 0  # realtime streams among them
    recent: int = 0  # realtime streams it admitted within the figures' window
    rings: int = 0  # shm rings in use: a leak shows here
    draining: bool = False  # shutting down: it refuses new streams, so the front door sends no client there
    # since when (the machine's monotonic clock) its longest-held realtime open has waited for the
    # service's room: a place that frees on another ingest goes to it before their later ones
    held_since: float | None = None

    def take_figures(self, info: Any) -> None:
        """The figures of a READY or heartbeat, all checked before any is taken (ValueError)."""
        counts = {key: wire.peer_int(info, key, getattr(self, key)) for key in ("streams", "realtime", "recent", "rings")}
        draining = info.get("draining", self.draining)
        if type(draining) is not bool:
            raise ValueError(f"draining must be a bool, got {str(draining)[:40]!r} ({type(draining).__name__})")
        held_since = info.get("held_since")
        if held_since is not None and not wire.finite(held_since):
            raise ValueError(f"held_since must be a number or nil, got {str(held_since)[:40]!r}")
        for key, value in counts.items():
            setattr(self, key, value)
        self.draining = draining
        self.held_since = held_since


def ingest_identity(index: int) -> bytes:
    return b"ingest-%d" % index


def ingest_index(identity: bytes) -> int | None:
    prefix = b"ingest-"
    digits = identity[len(prefix):]
    # bounded as a peer's counts are: an index too large to pack would fail the broker's loop
    # when it answers that ingest's jobs or reports it in a status reply
    if identity.startswith(prefix) and digits.isdigit() and len(digits) <= 10 and int(digits) <= wire.MAX_COUNT:
        return int(digits)
    return None


def _decode_cost(value: Any) -> tuple[float, float] | None:
    """A worker's start-up decode times from its READY, if it sent a usable pair: a worker
    without them is served all the same, it just does not price streams."""
    try:
        partial, final = (float(x) for x in value)
    except (TypeError, ValueError):
        return None
    # no more than a day, as a DONE row's decode: finite but absurd, they priced a stream at inf
    return (partial, final) if 0 <= partial <= wire.MAX_CLOCK_GAP_S and 0 <= final <= wire.MAX_CLOCK_GAP_S else None


class Broker:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.metrics = ProcessMetrics(cfg, "broker")
        self._interval_s = cfg.broker.heartbeat_ms / 1000
        self._patience_s = self._interval_s * cfg.broker.liveness
        # off with the workers' watchdog: a model call may then run any length (config.settings)
        self._job_timeout_s = cfg.broker.job_timeout_s if cfg.workers.stuck_after_s else 0.0
        self.dispatcher = Dispatcher(JobQueue(
            partial_deadline_s=cfg.broker.partial_deadline_ms / 1000,
            final_deadline_s=cfg.broker.final_deadline_ms / 1000,
        ))
        self.ingests: dict[int, IngestState] = {}
        self._register_asked: dict[bytes, float] = {}  # peer identity -> when it was last told to register (again)
        # Admission figure sent to every ingest each tick: how long realtime jobs wait for a model,
        # smoothed over ticks. It is the delay queueing adds for admitted streams right now.
        self.load = 0.0
        # With it, the share of the workers' time realtime decodes take, and what one speaking
        # stream asks of them: its partials and finals per second times what each costs to
        # decode. Kept through quiet spells, where there is nothing to measure it by, and across
        # restarts (broker.figures).
        self.busy = 0.0
        # Each part kept when not measured. Decode costs from ticks with the workers at least
        # LOADED_BUSY busy price the share once known: decodes that share the cores with each
        # other and with the ingest take longer, and admission decides near capacity.
        self.figures = Figures(share=[0.0, 0.0], decode_cost=[0.0, 0.0], loaded_cost=[0.0, 0.0])
        # A stream counts as speaking in a span of ticks when it asked for a partial in it: spans
        # of at least two partial intervals (1 s at the defaults), so one that speaks through a
        # span asks in it however short the heartbeat.
        span_s = max(1.0, 2 * cfg.ingest.partial_interval_ms / 1000)
        self._span_ticks = max(1, math.ceil(span_s / self._interval_s - 1e-9))
        spans = max(1, math.ceil(SHARE_WINDOW_S / (self._span_ticks * self._interval_s) - 1e-9))
        self._use_ticks: deque[RealtimeUse] = deque(maxlen=spans * self._span_ticks)
        self._window_spans = spans
        self.figures_window_s = spans * self._span_ticks * self._interval_s  # sent to the ingests with the figures
        self._saved_figures = SavedFigures(cfg)
        self.worker_links: dict[bytes, Link] = {}
        # Workers whose heartbeat socket has been heard: one of these becoming unreachable means
        # the process is gone (before that, its heartbeat socket may just not be connected yet).
        self._heartbeat_heard: set[bytes] = set()
        # Until then a worker's connection found closed is not a lost worker: the broker was not
        # listening for a while, and its workers are replacing the sockets they found silent.
        self._replacing_until = -math.inf
        self._outbox: dict[int, list[JobResult]] = {}  # the broker's own answers per ingest, sent once per loop turn
        self._ctx = zmq.Context()
        self._ingest_sock = self._ctx.socket(zmq.ROUTER)
        self._worker_sock = self._ctx.socket(zmq.ROUTER)
        self._front = self._ctx.socket(zmq.ROUTER)
        self._socket_files = SocketFiles()  # its ipc sockets, bound again if deleted (a peer restarted could not connect)
        self._auth = None
        if auth.curve_settings(cfg.ingest.curve_secret_key, cfg.ingest.curve_authorized_keys):
            self._auth = auth.start_authenticator(self._ctx, cfg.ingest.curve_authorized_keys, "broker", self.metrics)
            auth.apply_server_curve(self._front, cfg.ingest.curve_secret_key)
        for sock in (self._ingest_sock, self._worker_sock):
            # Sending to a peer that is gone raises EHOSTUNREACH instead of vanishing silently:
            # for a worker that means its jobs must be re-queued now, not at the next timeout.
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            # A peer that replaces its socket keeps its identity, and its new connection may come
            # up before this socket has let go of the old one. Without handover the new one is
            # ignored: its READY and DONE are never read and what is sent to it is lost.
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
            sock.setsockopt(zmq.LINGER, 0)
        self._front.setsockopt(zmq.LINGER, 0)
        self._front.setsockopt(zmq.MAXMSGSIZE, cfg.ingest.max_message_bytes)
        self._front.setsockopt(zmq.HEARTBEAT_IVL, m.CLIENT_HEARTBEAT_MS)  # a client gone without a FIN is let go
        self._front.setsockopt(zmq.HEARTBEAT_TIMEOUT, m.CLIENT_HEARTBEAT_TIMEOUT_MS)
        # An answer a client cannot take (it left, or it reads none) is dropped, never waited on:
        # one such client must not stall the loop. Mandatory routing makes libzmq say so, to log it.
        self._front.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._limits = m.Limits(max_frame_bytes=cfg.ingest.max_frame_bytes, max_message_bytes=cfg.ingest.max_message_bytes)
        # the front door's lines, at most one a second per client and code (or reason): see _on_client
        self._bad_message_lines = Throttle("broker.bad_client_message")
        self._undelivered_lines = Throttle("broker.answer_undelivered")

    def run(self) -> None:
        """Serve until SIGTERM/SIGINT."""
        self.cfg.run_path.mkdir(mode=0o700, parents=True, exist_ok=True)
        restored = self._saved_figures.load()
        if restored is not None:
            self.figures = restored
        self.metrics.start()
        try:
            self._socket_files.bind(self._ingest_sock, self.cfg.broker_ingest_endpoint)
            self._socket_files.bind(self._worker_sock, self.cfg.broker_worker_endpoint)
            self._front.bind(self.cfg.ingest.address)
            freeze_and_watch(self.metrics)  # start-up done: what is allocated from here on is the serving path's
            allocwatch.arm(self.metrics.process)
            log.info(
                "broker.started", front=self.cfg.ingest.address, ingests=self.cfg.broker_ingest_endpoint,
                workers=self.cfg.broker_worker_endpoint,
            )
            with StopSignal() as stop:
                self._serve(stop)
        finally:
            self._saved_figures.save(self.figures, time.monotonic(), at_once=True)
            self.close()
            self.metrics.close()
        log.info("broker.stopped", queued=len(self.dispatcher.queue), inflight=self.dispatcher.inflight)

    def close(self) -> None:
        for sock in (self._ingest_sock, self._worker_sock, self._front):
            sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        # what their last second's lines did not say
        self._bad_message_lines.tell_untold(log, lambda key: {"client": key[0].hex(), "code": key[1]})
        self._undelivered_lines.tell_untold(log, lambda key: {"client": key[0].hex(), "why": key[1]})
        self._ctx.term()

    def _serve(self, stop: StopSignal) -> None:
        poller = zmq.Poller()
        handlers = {
            self._worker_sock: self._on_worker,
            self._ingest_sock: self._on_ingest,
            self._front: self._on_client,
        }
        for sock in handlers:
            poller.register(sock, zmq.POLLIN)
        poller.register(stop.fileno(), zmq.POLLIN)
        turned = time.monotonic()
        tick = turned + self._interval_s
        stall = StallWatch(self.cfg.broker.stall_after_s, wakes_every_s=self._interval_s)
        try:
            while not stop.stopping:
                events = dict(poller.poll(max(0.0, tick - time.monotonic()) * 1000))
                now = time.monotonic()
                # An idle loop sleeps until the tick, set an interval after the end of the last
                # turn that checked the peers: a turn that long after the last one's start, plus
                # that turn's work and the poll's overshoot, is the loop listening. Lateness under
                # a quarter interval leaves peers most of their patience; past it, it was blind.
                late_s = now - turned - self._interval_s
                if late_s > self._interval_s / 4:
                    self._excuse_peers(late_s, now, turned)
                turned = now
                stop.drain()
                for sock, handle in handlers.items():
                    if sock in events:
                        self._drain(sock, handle)
                now = time.monotonic()
                # A freeze can land after the poll returned too: the turn's own work then took
                # that long, and its peers' messages wait unread as after a late poll.
                if now - turned > self._interval_s / 4:
                    self._excuse_peers(now - turned, now, turned)
                    turned = now
                if now >= tick:
                    self._check_peers(now)
                    self._check_socket_files()
                    tick = now + self._interval_s
                self._dispatch(now)
                self._flush_results()
                stall.turned(now)
        finally:
            stall.stop()

    def _check_socket_files(self) -> None:
        for lost in self._socket_files.check():
            if lost.restored:
                log.warning("broker.socket_restored", path=lost.path, why=lost.why)
            else:
                log.warning("broker.socket_unrestored", path=lost.path, why=lost.why, error=lost.error)

    @staticmethod
    def _drain(sock: zmq.Socket, handle: Callable[[list[bytes], float], None]) -> None:
        """Handle what `sock` holds, at most DRAIN_MAX messages: one busy peer must not keep the
        loop from the others and from its ticks."""
        for _ in range(DRAIN_MAX):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            handle(frames, time.monotonic())

    # -- workers -----------------------------------------------------------------------------

    def _on_worker(self, frames: list[bytes], now: float) -> None:
        ident, kind, body = frames[0], frames[1] if len(frames) > 1 else b"", frames[2:]
        if ident.endswith(wire.HEARTBEAT_SUFFIX):
            worker = ident[: -len(wire.HEARTBEAT_SUFFIX)]
            link = self.worker_links.get(worker)
            if link is not None:
                link.seen = now
                self._heartbeat_heard.add(worker)
            else:  # a worker this broker does not know (it restarted, or gave it up as silent): jobs wait meanwhile
                self._ask_to_register(self._worker_sock, ident, now)
            if kind != wire.HEARTBEAT:
                self.metrics.inc("errors_total", code=m.INTERNAL)
                log.warning("broker.bad_worker_message", worker=ident.decode(errors="replace"), error=f"{kind[:16]!r} on the heartbeat socket")
            return
        link = self.worker_links.get(ident)
        if link is not None:
            link.seen = now
        try:
            if kind == wire.READY:
                info = wire.unpack(body[0])
                cost = _decode_cost(info.get("cost"))
                self._answer(self.dispatcher.add_worker(
                    ident, wire.peer_int(info, "capacity"), now, pid=wire.peer_int(info, "pid", 0), model=str(info.get("model", "")),
                    cost=cost,
                ))
                self.worker_links[ident] = Link(seen=now)
                self._register_asked.pop(wire.heartbeat_identity(ident), None)
                # at once, not at the next tick: it tells the worker its READY arrived, after which
                # a REGISTER from a broker means that broker is new or forgot it (see workers.worker)
                self._send(self._worker_sock, wire.heartbeat_identity(ident), [wire.HEARTBEAT])
                log.info("broker.worker_ready", worker=ident.decode(errors="replace"), capacity=info["capacity"], model=info.get("model"),
                         decode_cost=cost, stream_share_prior=round(sum(self.share_prior), 4))
                self._figures_changed()
            elif kind == wire.DONE:
                results, unreadable, bad = wire.unpack_done_checked(body[0], now)
                for row in bad:
                    self.metrics.inc("errors_total", code=m.INTERNAL)
                    log.warning("broker.bad_done_row", worker=ident.decode(errors="replace"), job=row.job_id, field=row.field, error=row.error)
                worker = self.dispatcher.workers.get(ident)
                held = worker.inflight if worker is not None else {}
                answered = results + unreadable
                finals = {key for key in map(job_key, answered) if key in held and held[key].final}
                self._count(self.dispatcher.complete(ident, answered), finals, set(map(job_key, unreadable)))
            elif kind == wire.LEAVING:
                if link is not None:
                    # not a loss: what it hands back it never started, so those jobs did not harm it
                    log.info("broker.worker_left", worker=ident.decode(errors="replace"),
                             requeued=self._forget_worker(ident, now, lost=False))
            elif kind != wire.HEARTBEAT:
                raise ValueError(f"unknown kind {kind[:16]!r}")
        except Exception as exc:
            self.metrics.inc("errors_total", code=m.INTERNAL)
            log.warning("broker.bad_worker_message", worker=ident.decode(errors="replace"), error=repr(exc))

    def _closed(self, ident: bytes, now: float) -> None:
        """A send to a worker found its connection closed. A worker that stops says LEAVING, then
        closes both sockets: its goodbye may be waiting unread on the job socket (it came after
        the loop last read the socket), and it has then left, not been lost. What is waiting is
        read first. DRAIN_MAX is enough: the socket takes turns between its peers message by
        message, and a worker's goodbye is behind only its own READY and the DONEs of the jobs
        its credit let it hold."""
        self._drain(self._worker_sock, self._on_worker)
        if ident in self.worker_links:
            self._unreachable(ident, now)

    def _unreachable(self, ident: bytes, now: float) -> None:
        """A worker's connection is closed: it died, or, while the broker is just back from not
        listening, it is replacing the sockets it found silent. Either way it is forgotten (its
        READY on a new socket registers it again), but only the first is a loss for its jobs."""
        if now <= self._replacing_until:
            log.info("broker.worker_reconnecting", worker=ident.decode(errors="replace"),
                     requeued=self._forget_worker(ident, now, lost=False))
        else:
            self._lose_worker(ident, "unreachable", now)

    def _lose_worker(self, ident: bytes, why: str, now: float) -> None:
        log.warning("broker.worker_lost", worker=ident.decode(errors="replace"), why=why, requeued=self._forget_worker(ident, now))

    def _forget_worker(self, ident: bytes, now: float, lost: bool = True) -> int:
        """Drop a worker that died (`lost`) or said goodbye; the jobs it held go back to the queue
        (but see Dispatcher.remove_worker: a job lost workers held too often is answered FAILED).
        Returns how many it held."""
        worker = self.dispatcher.workers.get(ident)
        held = worker.inflight if worker else {}
        finals = {key for key, job in held.items() if job.final}  # those given up on are answered FAILED
        count = len(held)
        self.worker_links.pop(ident, None)
        self._heartbeat_heard.discard(ident)
        self._answer(self.dispatcher.remove_worker(ident, now, lost=lost), finals)
        self._figures_changed()
        return count

    def _dispatch(self, now: float) -> None:
        """Hand out queued jobs, one JOBS message per worker; a worker found gone on the way
        loses its jobs to the queue and the round is repeated without it."""
        while True:
            sent, expired = self.dispatcher.dispatch(now)
            self._answer(expired)
            gone: list[bytes] = []
            for ident, batch in sent.items():
                for job in batch:
                    if job.final and now > job.deadline:
                        log.warning("broker.final_late", job=job.job_id, stream=job.stream, late_s=round(now - job.deadline, 3))
                if not self._send(self._worker_sock, ident, [wire.JOBS, wire.pack_jobs(batch)]):
                    self._answer(self.dispatcher.unsent(ident, batch, now))
                    gone.append(ident)
            for ident in gone:  # once this round's sends are done: what is read may change the workers
                self._closed(ident, now)
            if not gone:
                return

    # -- ingests -----------------------------------------------------------------------------

    def _on_ingest(self, frames: list[bytes], now: float) -> None:
        ident, kind, body = frames[0], frames[1] if len(frames) > 1 else b"", frames[2:]
        index = ingest_index(ident)
        state = self.ingests.get(index) if index is not None else None
        if state is not None:
            state.link.seen = now
        try:
            if index is None:
                raise ValueError("identity is not ingest-<index>")
            if state is None and kind != wire.READY:
                if self._ask_to_register(self._ingest_sock, ingest_identity(index), now):
                    log.info("broker.ingest_unregistered", ingest=index, kind=kind[:16].decode(errors="replace"))
            if kind == wire.READY:
                self._register_ingest(index, wire.unpack(body[0]), now)
            elif kind == wire.JOBS:
                # Accepted from an ingest not (yet) registered too: after a broker restart its
                # jobs arrive before its new READY and would otherwise be lost.
                jobs, bad = wire.unpack_jobs_checked(body[0], now)
                self._reject(index, bad, [job for job in jobs if job.ingest != index])
                self._answer(self.dispatcher.submit([job for job in jobs if job.ingest == index], now))
            elif kind == wire.HEARTBEAT:
                if state is not None and body:
                    before = (state.held_since, state.realtime)
                    state.take_figures(wire.unpack(body[0]))
                    waiting = any(s.held_since is not None for s in self.ingests.values())
                    if state.held_since != before[0] or (waiting and state.realtime != before[1]):
                        # opens wait for room: which takes a place that frees is the others' to hear now
                        self._figures_changed([s for s in self.ingests.values() if s is not state])
            else:
                raise ValueError(f"unknown kind {kind[:16]!r}")
        except Exception as exc:
            self.metrics.inc("errors_total", code=m.INTERNAL)
            log.warning("broker.bad_ingest_message", ingest=ident.decode(errors="replace"), error=repr(exc))

    def _reject(self, index: int, bad: list[BadJob], foreign: list[Job]) -> None:
        """Malformed jobs from ingest `index`, and jobs naming another ingest as their owner (their
        answers would go there, and their ids could clash with its own): never queued, each
        logged and answered FAILED where it names a job id, so the ingest does not wait for them."""
        bad = bad + [BadJob(job.job_id, "ingest", f"ingest-{index} sent a job of ingest {job.ingest}") for job in foreign]
        for job in bad:
            self.metrics.inc("errors_total", code=m.INTERNAL)
            log.warning("broker.bad_job", ingest=index, job=job.job_id, field=job.field, error=job.error)
        self._answer([JobResult(job_id=job.job_id, ingest=index, status=FAILED, error=f"refused by the broker: {job.error}")
                      for job in bad if job.job_id is not None])

    def _ask_to_register(self, sock: zmq.Socket, ident: bytes, now: float) -> bool:
        """Tell a peer this broker has not registered (given up on as silent, or heard first after
        a restart) to register again; True if told now. Its messages (an ingest's heartbeats and
        the answers to its jobs, a worker's heartbeats) keep it taking the broker for alive, so it
        would not reconnect before its patience ran out, if ever. At most once per heartbeat
        interval: what the peer sent before its READY arrives needs no answer of its own."""
        if now - self._register_asked.get(ident, -math.inf) < self._interval_s:
            return False
        self._register_asked[ident] = now
        self._send(sock, ident, [wire.REGISTER])
        return True

    def _register_ingest(self, index: int, info: dict[str, Any], now: float) -> None:
        self._register_asked.pop(ingest_identity(index), None)
        pid = wire.peer_int(info, "pid", 0)
        old = self.ingests.get(index)
        state = IngestState(index=index, endpoint=str(info["endpoint"]), pid=pid,
                            registered=old.registered if old is not None and old.pid == pid else now, link=Link(seen=now))
        state.take_figures(info)  # checked before anything changes: a READY refused leaves the ingest as it was
        if old is not None and old.pid != pid:
            dropped = self.dispatcher.drop_ingest(index)
            log.warning("broker.ingest_replaced", ingest=index, old_pid=old.pid, ingest_pid=pid, dropped=len(dropped))
        self.ingests[index] = state
        log.info("broker.ingest_ready", ingest=index, endpoint=info["endpoint"], ingest_pid=pid)
        self._figures_changed([self.ingests[index]])

    def _answer(self, results: list[JobResult], finals: AbstractSet[JobKey] = frozenset()) -> None:
        """Queue the broker's own answers (partials it expired, jobs it refused or gave up on) for
        their ingests, and count them (`finals` as in `_count`)."""
        for result in results:
            self._outbox.setdefault(result.ingest, []).append(result)
        self._count(results, finals)

    def _count(self, results: list[JobResult], finals: AbstractSet[JobKey] = frozenset(),
               unreported: AbstractSet[JobKey] = frozenset()) -> None:
        """Count answered jobs. `finals` names the final jobs among them (looked up in the
        credit of the worker that held them); every other answer is a partial, since the queue
        never expires a final. Two rare answers count as partials whatever they are, only their
        `kind` label off: a late answer from a worker already declared lost (no longer in its
        credit), and a job row the broker refused (unreadable, so of no known kind).
        `unreported`: jobs whose worker's DONE row was unreadable past the job's ids; the ingest
        has the worker's answer, the broker does not know how it went (status `unreported`).
        """
        for result in results:
            kind = "final" if job_key(result) in finals else "partial"
            status = "unreported" if job_key(result) in unreported else STATUS_NAMES.get(result.status, str(result.status))
            self.metrics.inc("jobs_total", kind=kind, status=status)

    def _flush_results(self) -> None:
        for index, results in self._outbox.items():
            if not self._send(self._ingest_sock, ingest_identity(index), [wire.RESULTS, wire.pack_results(results)]):
                log.warning("broker.results_undeliverable", ingest=index, results=len(results))
        self._outbox.clear()

    # -- liveness ------------------------------------------------------------------------------

    def _excuse_peers(self, blind_s: float, now: float, since: float) -> None:
        """The loop turns at least once a heartbeat interval, and each turn's work is short; a
        turn `blind_s` later or longer than that (the broker was frozen or starved since the turn
        that began at `since`) is time it did not listen, not silence of its peers.
        They found it silent meanwhile and are replacing their sockets, which drops what they
        had queued for it: without this, the first check after the wake would give up every
        peer for lost, re-queue the jobs at the workers as losses and drop the ingests' queued jobs."""
        for link in [*self.worker_links.values(), *(s.link for s in self.ingests.values())]:
            link.seen += blind_s
        self.dispatcher.excuse(blind_s)  # the answers to the jobs the workers hold may be waiting unread
        self._replacing_until = now + self._patience_s
        log.warning("broker.was_not_listening", seconds=round(now - since, 3))

    def _check_peers(self, now: float) -> None:
        """Declare silent peers dead and heartbeat the idle links; ingests get the admission figures every tick."""
        wait = max(0.0, self.dispatcher.realtime_wait(now))
        if wait < self.load and self.dispatcher.queue.oldest_waiting(REALTIME) is None:
            # Smoothed on the way up, so that one slow tick refuses nobody; on the way down it
            # falls at once when no realtime job is queued: the backlog that raised it (a frozen
            # or restarted process, a burst) is worked off, and halving it each tick would go on
            # refusing opens for seconds after.
            self.load = wait
        else:
            self.load = 0.5 * self.load + 0.5 * wait
        use = self.dispatcher.realtime_use(now)
        self.busy = 0.5 * self.busy + 0.5 * use.busy
        self._update_stream_share(use)
        self._saved_figures.save(self.figures, now)
        realtime, recent = self._realtime_totals()
        queued = self.dispatcher.queue.counts()
        self.metrics.set("jobs_queued", queued.get(REALTIME, 0), priority="realtime")
        self.metrics.set("jobs_queued", queued.get(BATCH, 0), priority="batch")
        self.metrics.set("jobs_inflight", self.dispatcher.inflight)
        self.metrics.set("admission_wait_seconds", self.load)
        self.metrics.set("admission_busy_ratio", self.busy)
        self.metrics.set("admission_stream_share", self.stream_share)
        for ident in [p for p, asked in self._register_asked.items() if now - asked > self._patience_s]:
            del self._register_asked[ident]  # not heard from since: gone
        for ident, link in list(self.worker_links.items()):
            if self.worker_links.get(ident) is not link:
                continue  # forgotten, or registered again, by a message read below
            if now - link.seen > self._patience_s:
                self._lose_worker(ident, "silent", now)
            elif not self._send(self._worker_sock, wire.heartbeat_identity(ident), [wire.HEARTBEAT]) \
                    and ident in self._heartbeat_heard:
                self._closed(ident, now)
        self._take_back_overdue(now)
        for index, state in list(self.ingests.items()):
            if now - state.link.seen > self._patience_s:
                self._drop_ingest(state, "silent")
            elif self._send_figures(state, realtime, recent) == zmq.EHOSTUNREACH and now > self._replacing_until:
                self._drop_ingest(state, "unreachable")

    def _take_back_overdue(self, now: float) -> None:
        """Jobs a worker has kept unanswered past `[broker] job_timeout_s` while it heartbeats (a
        JOBS message it could not read, a job its batcher never ran): left there, their credit
        stays used and their ingest waits for them for ever. Each is logged, counted as an error,
        and taken back as from a lost worker (Dispatcher.take_back): re-queued, or answered
        FAILED when it was lost or timed out before."""
        if not self._job_timeout_s:
            return
        overdue: dict[bytes, list[Job]] = {}
        for ident, job, held_s in self.dispatcher.overdue(now, self._job_timeout_s):
            self.metrics.inc("errors_total", code=m.INTERNAL)
            log.warning("broker.job_overdue", worker=ident.decode(errors="replace"), job=job.job_id, ingest=job.ingest,
                        stream=job.stream, final=job.final, held_s=round(held_s, 3), job_timeout_s=self._job_timeout_s)
            overdue.setdefault(ident, []).append(job)
        for ident, jobs in overdue.items():
            self._answer(self.dispatcher.take_back(ident, jobs, now), {job_key(job) for job in jobs if job.final})

    def _drop_ingest(self, state: IngestState, why: str) -> None:
        """Forget an ingest that died or went silent, with the jobs it queued (their answers
        would go nowhere). Its connection closing gives it up at once, not after the patience:
        until then the front door would still send new clients to a dead endpoint, where their
        `open` waits out its timeout. One that was draining has ended as it meant to."""
        del self.ingests[state.index]
        if state.held_since is not None:  # the opens it held are no longer before the others' in line
            self._figures_changed()
        dropped = len(self.dispatcher.drop_ingest(state.index))
        if state.draining:
            log.info("broker.ingest_left", ingest=state.index, ingest_pid=state.pid, dropped=dropped)
        else:
            log.warning("broker.ingest_lost", ingest=state.index, ingest_pid=state.pid, why=why, dropped=dropped)

    def _send_figures(self, state: IngestState, realtime: int, recent: int) -> int:
        """The admission figures, as a heartbeat to one ingest; `realtime` and `recent` are the
        service's totals, of which the ingest is told the other ingests' part. Returns the send's
        errno, 0 once sent."""
        held = [s.held_since for s in self.ingests.values() if s is not state and s.held_since is not None]
        return self._deliver(self._ingest_sock, ingest_identity(state.index), [wire.HEARTBEAT, wire.pack({
            "load": round(self.load, 3), "busy": round(self.busy, 3), "stream_share": round(self.stream_share, 4),
            "realtime_elsewhere": realtime - state.realtime, "recent_elsewhere": recent - state.recent,
            "window_s": self.figures_window_s, "held_since_elsewhere": min(held, default=None),
        })])

    def _realtime_totals(self) -> tuple[int, int]:
        """Realtime streams open over the service, and those admitted within the figures' window."""
        return sum(s.realtime for s in self.ingests.values()), sum(s.recent for s in self.ingests.values())

    def _figures_changed(self, states: Iterable[IngestState] | None = None) -> None:
        """Workers came or went (the start-up price of a stream changed), or an ingest registered:
        the ingests hear the figures now, not at the next tick, or a burst opened meanwhile would
        be admitted at the old ones."""
        realtime, recent = self._realtime_totals()
        for state in list(self.ingests.values() if states is None else states):
            self._send_figures(state, realtime, recent)

    @property
    def share_prior(self) -> list[float]:
        """What one speaking stream is taken to ask for before it is measured: see figures.prior_share."""
        workers = self.dispatcher.workers.values()
        return prior_share([w.cost for w in workers if w.cost], len(workers),
                           self.cfg.ingest.partial_interval_ms / 1000, self.cfg.vad.min_silence_ms / 1000)

    @property
    def stream_share(self) -> float:
        """The admission figure, each part as measured (or restored) with the workers busy. Until
        then it is at least the start-up price: decodes measured with the workers to themselves
        cost less than they will when a burst shares the cores, and the start-up decodes were
        timed with every worker decoding at once."""
        figures = self.figures
        return sum(measured if loaded else max(measured, prior)
                   for measured, loaded, prior in zip(figures.share, figures.loaded_cost, self.share_prior))

    def _update_stream_share(self, use: RealtimeUse) -> None:
        """Share of the workers' time one realtime stream asks for while it speaks, over the last
        ticks: its partials, at what one costs, per worker-second and per stream speaking in it
        (a stream's pauses, and the time before it opened or after it ended, are not its time:
        streams that open together speak together); and its finals, at what one costs per
        second of the speech it covers (a final comes after its speech: counted in the seconds it
        was asked in, it would make one stream look several times dearer than it is). Decodes
        are priced as they cost with the workers busy, once known. The partials' part is
        measured only from windows holding at least half a window of speech."""
        self._use_ticks.append(use)
        ticks = list(self._use_ticks)
        loaded = [u for u in ticks if u.busy >= LOADED_BUSY]
        figures = self.figures
        for final in (0, 1):
            for costs, among, least in ((figures.decode_cost, ticks, 1), (figures.loaded_cost, loaded, MIN_LOADED_DECODES)):
                cost = typical_cost(among, final, least)
                if cost is not None:
                    costs[final] = cost
        cost = [busy or idle for busy, idle in zip(figures.loaded_cost, figures.decode_cost)]
        # Partials asked for in ticks with no worker-seconds (every worker restarting, the
        # broker's first tick) are not part of the share: counted against the seconds of the
        # ticks that had workers, they would price a stream at several times its cost, and
        # admission would refuse streams for a window after the workers are back.
        served = [u for u in ticks if u.seconds * u.workers]
        stream_capacity = 0.0  # worker-seconds times the streams speaking in them
        stream_spans = 0
        for start in range(0, len(served), self._span_ticks):
            span = served[start:start + self._span_ticks]
            speaking = len(set().union(*(u.speaking for u in span)))
            stream_capacity += sum(u.seconds * u.workers for u in span) * speaking
            stream_spans += speaking
        if stream_capacity and 2 * stream_spans >= self._window_spans:
            figures.share[0] = sum(u.asked[0] for u in served) * cost[0] / stream_capacity
        speech_s = sum(u.final_speech_s for u in ticks)
        if speech_s and use.workers:
            figures.share[1] = sum(u.asked[1] for u in ticks) * cost[1] / speech_s / use.workers

    @staticmethod
    def _send(sock: zmq.Socket, ident: bytes, frames: list[bytes]) -> bool:
        return Broker._deliver(sock, ident, frames) == 0

    @staticmethod
    def _deliver(sock: zmq.Socket, ident: bytes, frames: list[bytes]) -> int:
        """0 once sent; else EHOSTUNREACH (not connected) or EAGAIN (connected, not reading)."""
        try:
            sock.send_multipart([ident, *frames], zmq.NOBLOCK)
            return 0
        except zmq.ZMQError as exc:
            if exc.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise
            return exc.errno

    # -- front door ------------------------------------------------------------------------------

    def _on_client(self, frames: list[bytes], now: float) -> None:
        """Answer one client request. REQ clients put an empty delimiter after their identity;
        the envelope is echoed either way so both REQ and DEALER clients work."""
        split = 2 if len(frames) > 2 and frames[1] == b"" else 1
        envelope, body = frames[:split], frames[split:]
        try:
            reply = self._client_reply(m.decode_client(body, self._limits), now)
        except m.ProtocolError as exc:
            # every one answered, at most a line a second per client and code: a client sending
            # thousands must not make this loop, which every job of the service waits on, a log writer
            if (suppressed := self._bad_message_lines((envelope[0], exc.code))) is not None:
                log.warning("broker.bad_client_message", client=envelope[0].hex(), code=exc.code, error=exc.message,
                            suppressed=suppressed)
            reply = exc.reply()
        if errno := self._deliver(self._front, envelope[0], [*envelope[1:], *m.encode(reply)]):
            why = "gone" if errno == zmq.EHOSTUNREACH else "not reading its answers"
            if (suppressed := self._undelivered_lines((envelope[0], why))) is not None:
                log.warning("broker.answer_undelivered", client=envelope[0].hex(), answer=reply.type, why=why,
                            suppressed=suppressed)

    def _client_reply(self, msg: m.ClientMessage, now: float) -> m.ServerMessage:
        if isinstance(msg, m.Status):
            return self.status(now)
        if not isinstance(msg, m.Hello):
            raise m.ProtocolError(m.BAD_MESSAGE, f"{msg.type} goes to the ingest endpoint named in the welcome")
        if not self.ingests or not self.dispatcher.ready:
            missing = "ingest process" if not self.ingests else "worker"
            return m.ErrorMsg(code=m.NOT_READY, message=f"no {missing} is ready yet, retry shortly")
        serving = [s for s in self.ingests.values() if not s.draining]
        if not serving:
            return m.ErrorMsg(code=m.NOT_READY, message="every ingest process is shutting down, retry shortly")
        ingest = min(serving, key=lambda s: (s.streams, s.index))
        ingest.streams += 1  # until its next heartbeat, so a burst of clients spreads out
        limits = self.cfg.ingest
        return m.Welcome(ingest=ingest.endpoint, limits={
            "max_frame_bytes": limits.max_frame_bytes,
            "max_message_bytes": limits.max_message_bytes,
            "max_streams_per_client": limits.max_streams_per_client,
        })

    def status(self, now: float) -> m.StatusReply:
        queued = self.dispatcher.queue.counts()
        return m.StatusReply(
            ready=any(not s.draining for s in self.ingests.values()) and self.dispatcher.ready,
            ingests=[
                {"index": s.index, "endpoint": s.endpoint, "pid": s.pid, "streams": s.streams, "rings": s.rings,
                 "draining": s.draining, "alive_s": round(now - s.registered, 3)}
                for s in sorted(self.ingests.values(), key=lambda s: s.index)
            ],
            workers=[
                {"id": w.ident.decode(errors="replace"), "pid": w.pid, "capacity": w.capacity, "inflight": len(w.inflight), "model": w.model, "jobs_done": w.jobs_done}
                for w in self.dispatcher.workers.values()
            ],
            queued={"realtime": queued.get(REALTIME, 0), "batch": queued.get(BATCH, 0)},
            inflight=self.dispatcher.inflight,
            jobs_done=self.dispatcher.jobs_done,
            expired=self.dispatcher.expired,
            load=round(self.load, 3),
            busy=round(self.busy, 3),
            stream_share=round(self.stream_share, 4),
            stream_share_prior=round(sum(self.share_prior), 4),
            realtime=sum(s.realtime for s in self.ingests.values()),
            realtime_cap=self.cfg.ingest.admit_max_realtime_streams,
        )
