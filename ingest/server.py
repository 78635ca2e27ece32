"""The ingest process: one ROUTER for all clients, sessions writing into shm, jobs to the broker,
results from the workers straight back (a PULL socket every worker pushes to).

One poll loop. Each iteration drains what arrived, then sends one JOBS message and the
clients' events: under load many frames share one wake-up, which is what keeps the per-frame
cost low. The Silero VAD runs beside it on a thread of its own (ingest/vad.py, VadRunner), one
batched round at a time over every stream with a full chunk; its results come back through
the same poll and only move segment boundaries, so a frame's partial never waits for it. The
few chunks that could open or close a segment the loop classifies itself, at once.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import structlog
import zmq
from zmq.utils.monitor import parse_monitor_message

from broker import jobs as j
from broker.jobs import REALTIME
from broker.signals import StopSignal
from config.settings import Config
from ingest.resume import ResumeTokens
from ingest.session import Session
from ingest.vad import CHUNK, VadRunner
from metrics import allocwatch
from metrics.gcwatch import freeze_and_watch
from metrics.registry import ProcessMetrics
from metrics.stallwatch import StallWatch
from protocol import auth
from protocol import messages as m
from protocol.socketfiles import SocketFiles, socket_file_state
from shm.pool import PoolExhausted, RingPool, make_room, ring_capacity, segment_size
from speech.loader import language_refusal, served_languages
from streamasr.logs import Throttle

DRAIN_BATCH = 512  # messages taken from one socket per loop iteration
# At exit, the clients' last messages (a drained stream's final and `closed`, sent in the loop's
# last turn) may still wait for ZeroMQ's I/O thread: this long is given for them to leave,
# within the ingest's time to exit (streamasr.service.DRAIN_EXIT_S).
CLOSE_LINGER_MS = 1000
# A VAD round starts at most this often. A call costs ~0.1 ms however few chunks it holds, so
# rounds started on every frame (2,000 a second at 200 streams) were mostly that fixed cost;
# gathered over 10 ms they are ~60 chunks each. A chunk that could start or end a segment does
# not wait for the gathering: a segment's first partial, or its final, is due on its verdict.
VAD_ROUND_S = 0.010
# Restarted (after a crash, or by a restart that drained it), the ingest makes its segment while
# the workers still map its predecessor's (they let go within a second of its name going, or of
# their batch): /dev/shm sized for one segment per ingest, as `streamasr serve` checks, has its
# room back by then.
SHM_WAIT_S = 5.0
GONE_KEEP_S = 60.0  # how long messages of a closed connection, still queued, are dropped unread
# A connection ZeroMQ reports closed is asked whether it is gone (`_sweep`) this long after the
# report at the soonest: the report can come before the ROUTER has let go of the connection,
# while a send to it still passes.
SUSPECT_WAIT_S = 0.5
# Messages queued for one client connection: a client that leaves this many unread has stopped
# reading, and its connection is taken as gone (`_send`). A client streaming live is sent some 13
# messages a second a stream (an ack per 100 ms of audio, a partial per 500 ms of speech, its
# finals): at `max_streams_per_client` (64) streams, 10,000 is over 10 s of its answers unread,
# beside what its own socket and the kernel's buffers hold. A connection that never reads, but
# sends what is refused as fast as it can, has the ingest hold this many answers for it until it
# closes: 2 MB of the usual refusals (~200 bytes each, with ZeroMQ's share), 5 MB of the largest;
# 100,000 were 20-50 MB a connection, and a few hundred such clients took gigabytes.
CLIENT_QUEUE = 10_000
# A realtime stream resuming at an offset with its resume token (ingest/resume.py) was admitted
# before its ingest died: it is not new load, but the figures may count it where it was until the
# broker hears that ingest is gone (at most once more, as a service held to its limits holds at
# most them). Past twice the limits it is refused as a new stream is, and retried by its client.
RESUME_HEADROOM = 2.0
# An open held for room (`open.wait`) is told so at once and then this often, so that its client,
# owed a `ready`, keeps hearing the ingest (the reference clients take 10 s of silence for death).
WAIT_NOTICE_S = 2.0
# How often the held opens are tried against the room at most: each try counts the open streams.
HELD_CHECK_S = 0.05
HELD_PER_RING = 4  # opens held for room at most, per audio ring of the ingest
# While the broker stays away the ingest reconnects each patience (3 s by default), and says it is
# still away at most this often: a line each patience was some 1,200 lines an hour from each ingest.
BROKER_AWAY_REPEAT_S = 60.0


@dataclass(slots=True)
class _BrokerAway:
    """The broker found lost: when it was last heard, when the ingest last said it is away, and
    how often it has reconnected since it found it lost."""

    since: float
    told: float
    reconnects: int = 0


@dataclass(slots=True)
class _Held:
    """An open held for room (`open.wait`): admitted in the order they came, each priority on its
    own, as streams end or the figures fall; refused when its wait is over."""

    ident: bytes
    msg: m.Open
    fd: int
    resuming: bool
    since: float
    until: float
    code: str  # what it would be refused with now, and why
    message: str
    told: float = 0.0  # when it was last sent `waiting`


class IngestServer:
    def __init__(self, cfg: Config, index: int):
        self.cfg = cfg
        self.languages = served_languages(cfg.model)  # before anything that needs undoing; None: any (the null model)
        self.index = index
        self.log = structlog.get_logger().bind(ingest=index)
        self.metrics = ProcessMetrics(cfg, f"ingest-{index}")
        self.limits = m.Limits(cfg.ingest.max_frame_bytes, cfg.ingest.max_message_bytes)
        self.endpoint = cfg.ingest_endpoint(index)
        share = math.ceil(cfg.ingest.max_streams / cfg.ingest.processes) if cfg.ingest.max_streams else cfg.shm.streams_per_ingest
        self.max_streams = min(cfg.shm.streams_per_ingest, share)
        # Opens held for room at most (`_hold`): a few bytes each, but a line of thousands is a
        # wait of many minutes, better refused at once (its clients ask again later).
        self.max_held = HELD_PER_RING * cfg.shm.streams_per_ingest
        self.resume_tokens = ResumeTokens()
        self.ctx = zmq.Context()
        self.vad = VadRunner(self.ctx, threads=1, on_failure=lambda: self.metrics.inc("errors_total", code=m.INTERNAL))
        self.auth = None
        if auth.curve_settings(cfg.ingest.curve_secret_key, cfg.ingest.curve_authorized_keys):
            self.auth = auth.start_authenticator(self.ctx, cfg.ingest.curve_authorized_keys, f"ingest-{index}",
                                                 self.metrics)
        self.clients = self.ctx.socket(zmq.ROUTER)
        if self.auth is not None:
            auth.apply_server_curve(self.clients, cfg.ingest.curve_secret_key)
        self.clients.setsockopt(zmq.MAXMSGSIZE, cfg.ingest.max_message_bytes)
        self.clients.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished client is an error we log, not a silent drop
        self.clients.setsockopt(zmq.SNDHWM, CLIENT_QUEUE)
        self.clients.setsockopt(zmq.LINGER, 0)
        self.clients.setsockopt(zmq.HEARTBEAT_IVL, m.CLIENT_HEARTBEAT_MS)  # a client gone without a FIN is let go
        self.clients.setsockopt(zmq.HEARTBEAT_TIMEOUT, m.CLIENT_HEARTBEAT_TIMEOUT_MS)
        # A connection closed while the ingest has nothing to send on it (a client that opened and
        # died, a dialler that hung up before its audio) fails no send: ZeroMQ tells it only here.
        self.disconnects = self.clients.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        cfg.run_path.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.results = self.ctx.socket(zmq.PULL)
        self.results.setsockopt(zmq.LINGER, 0)
        self.socket_files = SocketFiles()  # its results socket, bound again if deleted (a worker restarted could not send)
        self.socket_files.bind(self.results, cfg.ingest_results_endpoint(index))
        self.clients.bind(self.endpoint)
        self.broker: zmq.Socket | None = None
        self.sessions: dict[str, Session] = {}
        self.per_client: dict[bytes, int] = {}
        self.held: dict[tuple[bytes, str], _Held] = {}  # opens waiting for room, by client and stream, first first
        self.held_due = 0.0  # when they are next tried: see _serve_held
        self.fds: dict[bytes, int] = {}  # the file descriptor of each connection with open streams: see _on_disconnects
        self.gone: dict[bytes, float] = {}  # connections a send found closed, and when: see _drop_gone
        # the refusal lines, at most one a second per client and code; as the process stops each
        # says what its lines did not (see close)
        self.bad_message_lines = Throttle("ingest.bad_message")
        self.unknown_stream_lines = Throttle("ingest.unknown_stream")
        self.open_refused_lines = Throttle("ingest.open_refused")
        self.newly_gone = False  # one was found since the last _drop_gone
        self.suspects: dict[bytes, float] = {}  # connections that may be closed, and since when: see _on_disconnects
        self.owner: dict[int, str] = {}  # job id -> session key
        self.scratch: dict[str, np.ndarray] = {}  # per-session VAD chunk buffer for ring wrap-around
        self.dirty: set[str] = set()  # streams to step this iteration
        self.vad_due: set[str] = set()  # streams that may have a full chunk the VAD has not seen
        self.vad_round_at = 0.0  # when the last VAD round started
        self.vad_urgent: set[str] = set()  # those of vad_due whose chunks could start or end a segment
        self.hb_interval = cfg.broker.heartbeat_ms / 1000
        self.broker_seen = time.monotonic()
        self.broker_away: _BrokerAway | None = None  # set from `ingest.broker_lost` until the broker is heard again
        self.hb_sent = 0.0
        self.load = 0.0  # the broker's admission figures, from its heartbeats: see _open
        self.busy = 0.0
        self.stream_share = 0.0
        self.realtime_elsewhere = 0  # realtime streams open on the other ingest processes
        self.figures_window_s = 0.0  # what the busy figure and the share are measured over
        self.admitted: deque[float] = deque()  # when realtime streams were admitted here, within that window
        self.recent_elsewhere = 0  # realtime streams admitted on the other ingests within it
        # since when the longest-held realtime open on another ingest has waited for room (the
        # broker's figures): it comes before the opens held here that came after it
        self.held_elsewhere: float | None = None
        self.reported: tuple[float | None, int] = (None, 0)  # what the last heartbeat said of that here
        self.moved_due = 0.0  # when _figures_moved next looks
        self.draining = False
        self.stop_at: float | None = None
        capacity = ring_capacity(cfg.shm.ring_seconds)
        # before READY: the front door must not send clients here while this waits
        make_room(cfg.shm_name(index), segment_size(cfg.shm.streams_per_ingest, capacity), SHM_WAIT_S)
        self._connect_broker()
        # Last: from here on only close() unlinks the segment, so nothing that can fail comes after it.
        self.pool = RingPool.create(cfg.shm_name(index), cfg.shm.streams_per_ingest, capacity)

    # ------------------------------------------------------------------ broker link

    def _connect_broker(self) -> None:
        """(Re)connect and re-register; every job still in flight is re-sent from session state."""
        if self.broker is not None:
            self.broker.close(linger=0)
        self.broker = self.ctx.socket(zmq.DEALER)
        self.broker.setsockopt(zmq.IDENTITY, f"ingest-{self.index}".encode())
        self.broker.setsockopt(zmq.LINGER, 0)
        # While the broker is away what is sent to it queues here; at the default limit of 1,000
        # messages a send would block the loop, and with it every client, until it is back. The
        # queue goes when the link is given up for lost (`_heartbeat`): a few seconds of jobs,
        # which `_register` sends again from the sessions.
        self.broker.setsockopt(zmq.SNDHWM, 0)
        self.broker.connect(self.cfg.broker_ingest_endpoint)
        self._register()

    def _register(self) -> None:
        """READY, then every job still in flight: the broker is new, or gave up on this ingest
        and dropped what it had queued."""
        self.broker.send_multipart([j.READY, j.pack({"index": self.index, "endpoint": self.endpoint, "pid": os.getpid(),
                                                     **self._figures(time.monotonic())})])
        pending = [job for s in self.sessions.values() for job in s.inflight.values()]
        if pending:
            self.log.info("ingest.jobs_resent", jobs=len(pending))
            self.broker.send_multipart([j.JOBS, j.pack_jobs(pending)])
        self.broker_seen = time.monotonic()

    def _on_broker(self, frames: list[bytes]) -> None:
        """One broker message; one the ingest cannot read (a broker of another version, say) is
        logged and dropped, never the process's end."""
        self.broker_seen = time.monotonic()
        if (away := self.broker_away) is not None:
            self.broker_away = None
            self.log.info("ingest.broker_back", away_s=round(self.broker_seen - away.since, 1), reconnects=away.reconnects)
        try:
            self._handle_broker(frames)
        except Exception as exc:
            self.metrics.inc("errors_total", code=m.INTERNAL)
            self.log.warning("ingest.bad_broker_message", kind=frames[0][:16], error=repr(exc))

    def _handle_broker(self, frames: list[bytes]) -> None:
        kind = frames[0]
        if kind == j.HEARTBEAT:
            figures = j.unpack(frames[1])
            self.load = float(figures.get("load", 0.0))
            self.busy = float(figures.get("busy", 0.0))
            self.stream_share = float(figures.get("stream_share", 0.0))
            self.realtime_elsewhere = int(figures.get("realtime_elsewhere", 0))
            self.recent_elsewhere = int(figures.get("recent_elsewhere", 0))
            elsewhere = figures.get("held_since_elsewhere")
            self.held_elsewhere = None if elsewhere is None else float(elsewhere)
            self.figures_window_s = float(figures.get("window_s", 0.0))
        elif kind == j.RESULTS:
            self._on_results(frames[1])
        elif kind == j.REGISTER:
            # The broker does not know this ingest (it found it silent, or restarted) though it
            # answers: register on this socket, which keeps what the broker already sent on it.
            self.log.warning("ingest.broker_asks_to_register")
            self._register()
        else:
            raise ValueError(f"unknown kind {kind[:16]!r} of {len(frames)} frames")

    def _on_results(self, body: bytes) -> None:
        """Results of this ingest's jobs, from the workers (or the broker: partials it expired).
        The first result of a job counts: a job re-queued after its worker was given up for dead
        may be answered twice, and a job id is never reused."""
        for res in j.unpack_results(body):
            key = self.owner.pop(res.job_id, None)
            if key is None:
                self.log.info("ingest.result_unknown_job", job=res.job_id, worker=res.worker, status=res.status)
                continue
            session = self.sessions.get(key)
            if session is not None:
                session.on_result(res)
                self.dirty.add(key)

    def _on_worker(self, frames: list[bytes]) -> None:
        try:
            if frames[0] != j.RESULTS or len(frames) != 2:
                raise ValueError(f"unknown kind {frames[0][:16]!r}")
            self._on_results(frames[1])
        except Exception as exc:
            self.metrics.inc("errors_total", code=m.INTERNAL)
            self.log.warning("ingest.bad_worker_message", error=repr(exc))

    def _heartbeat(self, now: float) -> None:
        if now - self.hb_sent >= self.hb_interval or self._figures_moved(now):
            self._beat(now)
        if now - self.broker_seen > self.hb_interval * self.cfg.broker.liveness:
            # whether the broker's socket file is there tells a broker down from one whose file was deleted
            endpoint = self.cfg.broker_ingest_endpoint
            if (away := self.broker_away) is None:
                self.log.warning("ingest.broker_lost", silent_s=round(now - self.broker_seen, 2), endpoint=endpoint,
                                 socket_file=socket_file_state(endpoint))
                away = self.broker_away = _BrokerAway(since=self.broker_seen, told=now)
            elif now - away.told >= BROKER_AWAY_REPEAT_S:
                away.told = now
                self.log.warning("ingest.broker_still_away", away_s=round(now - away.since, 1), reconnects=away.reconnects,
                                 endpoint=endpoint, socket_file=socket_file_state(endpoint))
            self._connect_broker()
            away.reconnects += 1

    def _check_socket_files(self) -> None:
        for lost in self.socket_files.check():
            if lost.restored:
                self.log.warning("ingest.socket_restored", path=lost.path, why=lost.why)
            else:
                self.log.warning("ingest.socket_unrestored", path=lost.path, why=lost.why, error=lost.error)

    def _beat(self, now: float) -> None:
        self.hb_sent = now
        self.broker.send_multipart([j.HEARTBEAT, j.pack({**self._figures(now), "rings": self.pool.in_use})])

    def _figures(self, now: float) -> dict[str, int | bool | float | None]:
        """What the broker admits streams and picks an ingest for new clients by: in every
        heartbeat, and in READY, so that a broker that takes this ingest anew (it restarted, or
        gave it up as silent) does not count its streams as none meanwhile."""
        self.reported = (self._held_since(), self._realtime_open())
        return {"streams": len(self.sessions), "realtime": self.reported[1], "recent": self._recent_admissions(now),
                "draining": self.draining, "held_since": self.reported[0]}

    def _in_line(self) -> bool:
        """Opens wait for room, here or on another ingest, or did at the last heartbeat."""
        return bool(self.held) or self.held_elsewhere is not None or self.reported[0] is not None

    def _held_since(self) -> float | None:
        """Since when the longest-held realtime open here has waited for the service's room (held
        for its admission limits, which are the service's, not for this ingest's own)."""
        return min((h.since for h in self.held.values() if h.msg.priority == "realtime" and h.code == m.OVERLOADED),
                   default=None)

    def _figures_moved(self, now: float) -> bool:
        """While opens wait for room, here or on another ingest, what decides which takes a place
        that frees (the longest-held open, the realtime streams open) goes to the broker, and from
        it to the other ingests, within HELD_CHECK_S rather than at the next heartbeat: the place
        would stay empty meanwhile, or go to an open that came later."""
        if now < self.moved_due or not self._in_line():
            return False
        self.moved_due = now + HELD_CHECK_S
        return (self._held_since(), self._realtime_open()) != self.reported

    # ------------------------------------------------------------------ clients

    def _on_client(self, frames: list[zmq.Frame]) -> None:
        """One client message; a bug in handling it fails that message, never the process."""
        ident = frames[0].bytes
        if ident in self.gone:  # sent before its connection closed, read after: its streams were dropped
            return
        try:
            self._handle_client(ident, frames)
        except Exception as exc:
            self.metrics.inc("errors_total", code=m.INTERNAL)
            self.log.exception("ingest.internal_error", client=ident.hex())
            self._send(ident, m.ErrorMsg(code=m.INTERNAL, message=f"the server failed on this message: {type(exc).__name__}"))

    def _handle_client(self, ident: bytes, frames: list[zmq.Frame]) -> None:
        try:
            msg = m.decode_client([f.buffer for f in frames[1:]], self.limits)
        except m.ProtocolError as exc:
            self.metrics.inc("refusals_total", code=exc.code)
            if (suppressed := self.bad_message_lines((ident, exc.code))) is not None:
                self.log.warning("ingest.bad_message", client=ident.hex(), code=exc.code, reason=exc.message, stream=exc.stream,
                                 suppressed=suppressed)
            self._send(ident, exc.reply())
            return
        if isinstance(msg, m.Audio):
            session = self._session(ident, msg.stream, msg.seq)
            if session is not None:
                session.accept_audio(msg)
                self._changed(session.key)
        elif isinstance(msg, m.Open):
            self._open(ident, msg, frames[1].get(zmq.SRCFD))
        elif isinstance(msg, m.End):
            if (held := self.held.pop((ident, msg.stream), None)) is not None:
                # its client stopped waiting: the open is answered first, then the `end` (unknown_stream)
                self._refuse(ident, msg.stream, held.code, f"{held.message} (ended while it waited for room)")
            session = self._session(ident, msg.stream, None)
            if session is not None:
                session.client_end()
                self._changed(session.key)  # the resampler's tail may complete a chunk
        else:  # hello and status: the front door names the ingest and its limits, for the whole service
            self.metrics.inc("refusals_total", code=m.BAD_MESSAGE)
            self._send(ident, m.ErrorMsg(code=m.BAD_MESSAGE, message=f"{msg.type} is answered by the front door only"))

    def _session(self, ident: bytes, stream: str, seq: int | None) -> Session | None:
        session = self.sessions.get(f"{ident.hex()}/{stream}")
        if session is None or session.closed:
            self.metrics.inc("refusals_total", code=m.UNKNOWN_STREAM)
            if (suppressed := self.unknown_stream_lines((ident, m.UNKNOWN_STREAM))) is not None:
                self.log.warning("ingest.unknown_stream", client=ident.hex(), stream=stream, suppressed=suppressed)
            self._send(ident, m.ErrorMsg(code=m.UNKNOWN_STREAM, message=f"no open stream {stream!r}", stream=stream, seq=seq))
            return None
        return session

    def _refuse(self, ident: bytes, stream: str, code: str, message: str) -> None:
        """Refuse an open: answered, counted, and logged (at most a line a second per client and code)."""
        self.metrics.inc("refusals_total", code=code)
        if (suppressed := self.open_refused_lines((ident, code))) is not None:
            self.log.warning("ingest.open_refused", client=ident.hex(), stream=stream, code=code, reason=message,
                             suppressed=suppressed)
        self._send(ident, m.ErrorMsg(code=code, message=message, stream=stream))

    def _open(self, ident: bytes, msg: m.Open, fd: int) -> None:
        def refuse(code: str, message: str) -> None:
            self._refuse(ident, msg.stream, code, message)

        if self.draining:
            return refuse(m.NOT_READY, "the service is shutting down")
        if f"{ident.hex()}/{msg.stream}" in self.sessions or (ident, msg.stream) in self.held:
            return refuse(m.DUPLICATE_STREAM, f"stream {msg.stream!r} is already open on this connection")
        if msg.model is not None and msg.model != self.cfg.model.name:
            return refuse(m.UNKNOWN_MODEL, f"model {msg.model!r} is not served here; this service runs {self.cfg.model.name!r}")
        if why := language_refusal(self.cfg.model.name, self.languages, msg.language):
            return refuse(m.UNKNOWN_LANGUAGE, why)
        if why := language_refusal(self.cfg.model.name, self.languages, msg.resume_language):
            return refuse(m.UNKNOWN_LANGUAGE, f"resume_language: {why}")
        if self.per_client.get(ident, 0) + self._held_by(ident) >= self.cfg.ingest.max_streams_per_client:
            return refuse(m.TOO_MANY_STREAMS, f"at most {self.cfg.ingest.max_streams_per_client} open streams per client")
        # a resume with the token that shows it was admitted before
        resuming = msg.offset > 0 and self.resume_tokens.valid(msg.stream, msg.resume_token)
        # A new open does not pass those held for room before it (a resume, admitted before, does),
        # here or on another ingest.
        ahead = [h for h in self.held.values() if h.msg.priority == msg.priority] if not resuming else []
        if ahead:
            room: tuple[str, str] | None = (ahead[0].code, f"{ahead[0].message} ({len(ahead)} "
                                                           f"{'opens wait' if len(ahead) > 1 else 'open waits'} for room before it)")
        elif msg.priority == "realtime" and not resuming and self.held_elsewhere is not None:
            room = (m.OVERLOADED, "realtime opens held for room on another ingest process come before it; "
                                  "try again later or open with priority batch")
        else:
            room = self._no_room(msg, resuming)
        if room is None:
            self._admit(ident, msg, fd, resuming)
        elif msg.wait and len(self.held) < self.max_held:
            self._hold(ident, msg, fd, resuming, room)
        else:
            refuse(*room)

    def _no_room(self, msg: m.Open, resuming: bool) -> tuple[str, str] | None:
        """Why the service has no room for the stream now (code, message), if it has none."""
        if len(self.sessions) >= self.max_streams:
            return m.TOO_MANY_STREAMS, "the service is at its stream limit; try again later"
        if msg.priority == "realtime":
            # Admitting another realtime stream would delay every admitted one; batch streams
            # are still taken, credits slow them down instead. One resuming is held to twice the limits.
            headroom = RESUME_HEADROOM if resuming else 1.0
            cfg = self.cfg.ingest
            max_load, max_busy = cfg.admit_max_load_s * headroom, cfg.admit_max_busy * headroom
            realtime = self._realtime_open() + self.realtime_elsewhere  # open over the service, as last heard
            cap = cfg.admit_max_realtime_streams * headroom
            if cap and realtime >= cap:
                return (m.OVERLOADED, f"the service admits {cfg.admit_max_realtime_streams} realtime streams at a time "
                                      f"(ingest.admit_max_realtime_streams{', twice that resuming' if resuming else ''}); "
                                      "try again later or open with priority batch")
            if max_load and self.load > max_load:
                return (m.OVERLOADED, f"the service is past its capacity (realtime streams wait {self.load:.1f} s for a model); "
                                      "try again later or open with priority batch")
            # Extrapolated only while the workers are at least half busy, counting the streams
            # admitted too recently to show in the figures (a burst): a share measured on other
            # streams (sent faster than real time, say) must not turn streams away from idle workers.
            busy = self.stream_share * (realtime + 1)
            unseen = self._recent_admissions(time.monotonic()) + self.recent_elsewhere
            if max_busy and self.busy + self.stream_share * unseen >= max_busy / 2 and busy > max_busy:
                return (m.OVERLOADED, f"the service is at its capacity (with another realtime stream the models would be "
                                      f"{100 * busy:.0f} % busy); try again later or open with priority batch")
        return None

    def _admit(self, ident: bytes, msg: m.Open, fd: int, resuming: bool, waited_s: float | None = None) -> None:
        key = f"{ident.hex()}/{msg.stream}"
        try:
            ring = self.pool.acquire()
        except PoolExhausted:
            return self._refuse(ident, msg.stream, m.TOO_MANY_STREAMS, "no free audio buffer; try again later")
        session = Session(key, ident, msg, ring, self.cfg, self.index, self.pool.name, self.metrics)
        self.sessions[key] = session
        self.scratch[key] = np.empty(CHUNK, np.float32)
        self.per_client[ident] = self.per_client.get(ident, 0) + 1
        self.fds[ident] = fd
        self.vad.add(key)
        session.log.info("ingest.stream_opened", rate=msg.rate, encoding=msg.encoding, channels=msg.channels,
                         priority=msg.priority, language=msg.language, partials=msg.partials, offset=msg.offset,
                         resume_language=msg.resume_language, resuming=resuming,
                         **({} if waited_s is None else {"waited_s": round(waited_s, 3)}))
        token = self.resume_tokens.issue(msg.stream) if msg.priority == "realtime" else None
        told = self._send(ident, m.Ready(stream=msg.stream, window=session.window(), resume_token=token))
        session.acked_window = session.window()
        # A resuming one too: its demand here is not in the figures yet. One whose client is gone
        # (it went while its open was held) is dropped with the connection: no demand to come.
        if msg.priority == "realtime" and told:
            self.admitted.append(time.monotonic())

    def _hold(self, ident: bytes, msg: m.Open, fd: int, resuming: bool, room: tuple[str, str]) -> None:
        """Keep an open the service has no room for, as its `wait` asks: a stream that ends, or
        figures that fall, let in the one that came first, not whichever client asks again first."""
        now = time.monotonic()
        held = _Held(ident, msg, fd, resuming, now, now + float(msg.wait or 0), *room)
        self.held[(ident, msg.stream)] = held
        position = sum(h.msg.priority == msg.priority for h in self.held.values())
        self.log.info("ingest.open_waiting", client=ident.hex(), stream=msg.stream, code=room[0], reason=room[1],
                      position=position, wait_s=msg.wait)
        self._tell_held(held, position, now)

    def _held_by(self, ident: bytes) -> int:
        """The opens a client has held for room: they count among its streams."""
        return sum(h.ident == ident for h in self.held.values()) if self.held else 0

    def _tell_held(self, held: _Held, position: int, now: float) -> None:
        held.told = now
        self._send(held.ident, m.Waiting(stream=held.msg.stream, position=position, code=held.code, message=held.message))

    def _serve_held(self, now: float) -> None:
        """Admit the held opens in the order they came, each priority on its own, while there is
        room; refuse those whose wait is over as they would have been at once; tell the others."""
        self.held_due = now + HELD_CHECK_S
        positions: dict[str, int] = {}  # of the opens kept waiting, per priority: an earlier one blocks the rest
        for key, held in list(self.held.items()):
            priority = held.msg.priority
            if priority not in positions:
                room = self._no_room(held.msg, held.resuming)
                if room is None and priority == "realtime" and self.held_elsewhere is not None and self.held_elsewhere < held.since:
                    room = held.code, held.message  # the place goes first to an open held longer on another ingest
                if room is None:
                    del self.held[key]
                    self._admit(held.ident, held.msg, held.fd, held.resuming, waited_s=now - held.since)
                    continue
                held.code, held.message = room
            if now >= held.until:
                del self.held[key]
                self._refuse(held.ident, held.msg.stream, held.code, held.message)
                continue
            positions[priority] = positions.get(priority, 0) + 1
            if now - held.told >= WAIT_NOTICE_S:
                self._tell_held(held, positions[priority], now)

    def _recent_admissions(self, now: float) -> int:
        """Realtime streams admitted here within the broker's figures' window: their demand is not in them yet."""
        while self.admitted and now - self.admitted[0] > self.figures_window_s:
            self.admitted.popleft()
        return len(self.admitted)

    def _realtime_open(self) -> int:
        """Realtime streams open here: counted when needed (an open, a heartbeat), not kept in step."""
        return sum(s.priority == REALTIME and not s.abandoned for s in self.sessions.values())

    def _send(self, ident: bytes, msg: m.ServerMessage) -> bool:
        try:
            self.clients.send_multipart([ident, *m.encode(msg)], flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:
            # EHOSTUNREACH: the connection is closed. EAGAIN: it is open, but the client stopped
            # reading and CLIENT_QUEUE messages wait for it. Either way this message, a final perhaps,
            # cannot reach it, nor can the rest in order: its streams are dropped, and a client
            # still alive finds this ingest silent and resumes them from their `durable`.
            if ident not in self.gone:
                self.gone[ident] = time.monotonic()
                self.newly_gone = True
                self.log.warning("ingest.client_gone", client=ident.hex(), streams=self.per_client.get(ident, 0),
                                 waiting=self._held_by(ident), event_type=msg.type,
                                 reason="closed" if exc.errno == zmq.EHOSTUNREACH else "not_reading", error=exc.strerror)
            return False

    def _drop_gone(self) -> None:
        """Drop the streams of connections that are closed: nothing they decode can reach anyone.

        A reference client's connection is a routing id of the ROUTER, new on every connect, so a
        closed one never comes back: its client, if alive, has resumed the streams elsewhere from
        their `durable` (it gave up on this ingest as silent, say, while the ingest was only slow).
        Left to the idle timeout they would hold their rings and be decoded, for nobody, for 30 s.
        """
        self.newly_gone = False
        for key in [key for key, held in self.held.items() if held.ident in self.gone]:
            del self.held[key]  # nobody to admit: its client resumes elsewhere, or died
        for s in [s for s in self.sessions.values() if s.client in self.gone and not s.abandoned]:
            s.log.warning("ingest.stream_dropped", reason="client_gone", pending_jobs=len(s.inflight), **s.figures())
            s.abandon()
            self.vad_due.discard(s.key)
            self.vad_urgent.discard(s.key)
            if s.closed:
                self.dirty.discard(s.key)
                self._release(s)

    def _on_disconnects(self) -> None:
        """Connections ZeroMQ closed: the client closed it or died, or it answered no ping. An
        event names only the connection's file descriptor, which a new connection may have taken
        since: the connections with open streams that came on that descriptor are suspects, asked
        by a sweep whether they are gone (`_sweep`). Read before the clients' messages, so that a
        new connection on the descriptor is seldom among them."""
        fds: set[int] = set()
        _drain(self.disconnects, lambda frames: fds.add(int(parse_monitor_message(frames)["value"])))
        now = time.monotonic()
        for ident, fd in self.fds.items():
            if fd in fds and ident not in self.gone:
                self.suspects.setdefault(ident, now)

    # ------------------------------------------------------------------ per-iteration work

    def _changed(self, key: str) -> None:
        """The stream took audio, ended or moved its VAD: step it this iteration, and look for chunks to classify."""
        self.dirty.add(key)
        self.vad_due.add(key)
        if self.sessions[key].vad_decisive(CHUNK):
            self.vad_urgent.add(key)

    def _on_vad(self) -> None:
        """The VAD thread's round finished."""
        self._apply_vad(*self.vad.take())

    def _apply_vad(self, keys: list[str], probs: np.ndarray) -> None:
        """Classified chunks move their streams' segments; each stream is marked changed once,
        after all its chunks (before that, those still to come would look due)."""
        for key, prob in zip(keys, probs.tolist()):
            session = self.sessions.get(key)
            if session is not None:
                session.on_vad(prob, CHUNK)
        for key in set(keys):
            if key in self.sessions:
                self._changed(key)

    def _vad_wait(self, now: float) -> float | None:
        """Seconds until the VAD thread's next round may start, if audio waits for one."""
        if not self.vad_due or self.vad.busy:
            return None
        return max(0.0, self.vad_round_at + VAD_ROUND_S - now)

    def _waiting_chunks(self, key: str, keys: list[str], chunks: list[np.ndarray]) -> None:
        """Append every full chunk of the stream the VAD has not seen, in order. Only between the
        stream's rounds, so its `vad_pos` is current: no chunk is sent twice. At most one chunk
        of a stream wraps around its ring (a ring holds far more than one round), and only that
        one is copied, into the stream's scratch buffer."""
        s = self.sessions[key]
        for pos in range(s.vad_pos, s.ring.written - CHUNK + 1, CHUNK):
            keys.append(key)
            chunks.append(s.ring.view(pos, pos + CHUNK, out=self.scratch[key]))

    def _run_vad(self, now: float) -> None:
        """Classify at once, on this thread, the chunks that could start or end a segment (see
        VadRunner.classify_now); hand the VAD thread every other full chunk not yet classified,
        of every stream, in one round once VAD_ROUND_S has gathered them. A stream's chunks
        always go in one call together, in order."""
        if self.vad_urgent:
            keys: list[str] = []
            chunks: list[np.ndarray] = []
            for key in [k for k in self.vad_urgent if self.vad.ready_now(k)]:  # the others are in the thread's round
                self.vad_urgent.discard(key)
                self.vad_due.discard(key)
                self._waiting_chunks(key, keys, chunks)
            if keys:
                self._apply_vad(keys, self.vad.classify_now(keys, chunks))
        if self._vad_wait(now) != 0.0:
            return
        keys, chunks = [], []
        for key in self.vad_due:
            self._waiting_chunks(key, keys, chunks)
        self.vad_due.clear()
        self.vad_urgent.clear()
        if keys:
            self.vad.submit(keys, chunks)
            self.vad_round_at = now

    def _flush(self) -> None:
        jobs_out: list[j.Job] = []
        for key in self.dirty:
            s = self.sessions[key]
            s.step()
            for job in s.jobs_out:
                self.owner[job.job_id] = key
            jobs_out.extend(s.jobs_out)
            s.jobs_out.clear()
            for msg in s.outbox:
                self._send(s.client, msg)
            s.outbox.clear()
            ack = None if s.closed or s.abandoned else s.due_ack()
            if ack is not None:
                self._send(s.client, ack)
            if s.closed:
                self._release(s)
        if jobs_out:
            self.broker.send_multipart([j.JOBS, j.pack_jobs(jobs_out)])
        self.dirty.clear()
        if self.newly_gone:  # before the loop takes more of their audio, or steps them again
            self._drop_gone()

    def _release(self, s: Session) -> None:
        s.tell_untold()
        del self.sessions[s.key]
        del self.scratch[s.key]
        self.vad_due.discard(s.key)
        self.vad_urgent.discard(s.key)
        self.vad.remove(s.key)
        self.pool.release(s.ring)
        left = self.per_client.get(s.client, 1) - 1
        if left:
            self.per_client[s.client] = left
        else:
            self.per_client.pop(s.client, None)
            self.fds.pop(s.client, None)

    def _sweep(self, now: float) -> None:
        """Close streams whose client went quiet: their accepted audio is still transcribed. Forget
        closed connections after GONE_KEEP_S: what they sent before closing is read by then.

        Each suspect connection (`_on_disconnects`) is sent its last ack again, SUSPECT_WAIT_S
        after it was reported at the soonest: a closed one fails that send, and its streams are
        dropped as the flush ends (`_send`, `_drop_gone`); one alive takes it as the ack of a resend."""
        for ident in [i for i, at in self.gone.items() if now - at > GONE_KEEP_S]:
            del self.gone[ident]
        for ident in [i for i, at in self.suspects.items() if now - at >= SUSPECT_WAIT_S]:
            del self.suspects[ident]
            asked = next((s for s in self.sessions.values() if s.client == ident and not s.abandoned), None)
            if asked is not None:
                asked.ack_again()
                self.dirty.add(asked.key)
        for key, s in self.sessions.items():
            if not s.ending and s.check_idle(now):
                s.log.warning("ingest.stream_idle", idle_s=round(now - s.last_activity, 1))
                s.end("idle_timeout")
                self._changed(key)

    def _publish_gauges(self) -> None:
        """Stream and ring gauges, set once a second from the loop rather than on every open and close."""
        active = {"realtime": 0, "batch": 0}
        for s in self.sessions.values():
            active[s.opened.priority] = active.get(s.opened.priority, 0) + 1
        for priority, count in active.items():
            self.metrics.set("streams_active", count, priority=priority)
        self.metrics.set("shm_rings_used", self.pool.in_use)
        self.metrics.set("opens_waiting", len(self.held))

    # ------------------------------------------------------------------ main loop

    def begin_drain(self) -> None:
        """On SIGTERM or SIGINT: refuse new streams, end every open one at its next pause (see
        Session.wind_down), finish them, then exit. Called by the loop between turns, never from
        the signal handler: a handler runs between any two bytecodes of the loop, which may be
        iterating the very sets this adds to."""
        now = time.monotonic()
        self.draining = True
        self.stop_at = now + self.cfg.ingest.drain_timeout_s
        self.log.info("ingest.draining", streams=len(self.sessions))
        self._beat(now)  # at once: the front door must stop sending new clients here
        for held in self.held.values():
            self._refuse(held.ident, held.msg.stream, m.NOT_READY, "the service is shutting down")
        self.held.clear()
        for key, s in self.sessions.items():
            s.wind_down(now + self.cfg.ingest.drain_pause_s)
            self._changed(key)

    def _wind_down(self, now: float) -> None:
        """Step the streams still speaking when their pause wait runs out: they end at the cut."""
        for key, s in self.sessions.items():
            if s.pause_wait_over(now):
                self._changed(key)

    def run(self, stop: StopSignal) -> None:
        """Serve until `stop` says (entered before this server was made: see `main`), then close."""
        poller = zmq.Poller()
        poller.register(self.clients, zmq.POLLIN)
        poller.register(self.broker, zmq.POLLIN)
        poller.register(self.vad.signal, zmq.POLLIN)
        poller.register(self.results, zmq.POLLIN)
        poller.register(self.disconnects, zmq.POLLIN)
        self.metrics.set("shm_rings_total", self.pool.slots)
        self._publish_gauges()
        self.metrics.start()
        freeze_and_watch(self.metrics)  # start-up done: what is allocated from here on is the serving path's
        allocwatch.arm(self.metrics.process)
        self.log.info("ingest.ready", endpoint=self.endpoint, shm=self.pool.name, slots=self.pool.slots)
        stall = StallWatch(self.cfg.ingest.stall_after_s, wakes_every_s=self.hb_interval / 2)
        poller.register(stop.fileno(), zmq.POLLIN)
        try:
            self._serve(poller, stall, stop)
        finally:
            stall.stop()
        self.close()

    def _serve(self, poller: zmq.Poller, stall: StallWatch, stop: StopSignal) -> None:
        """The loop, until a drain ends (see the module's docstring)."""
        registered = self.broker
        last_sweep = time.monotonic()
        while True:
            if self.broker is not registered:
                poller.unregister(registered)
                registered = self.broker
                poller.register(registered, zmq.POLLIN)
            timeout = self.hb_interval / 2
            if (vad_wait := self._vad_wait(time.monotonic())) is not None:
                timeout = min(timeout, vad_wait)
            if self.held:  # a place that frees goes to the first held open at once, not at the next wake
                timeout = min(timeout, max(0.0, self.held_due - time.monotonic()))
            if self._in_line():  # or to one held on another ingest
                timeout = min(timeout, max(0.0, self.moved_due - time.monotonic()))
            events = dict(poller.poll(timeout=math.ceil(timeout * 1000)))
            if stop.fileno() in events:
                stop.drain()
            if stop.stopping and not self.draining:
                self.begin_drain()
            if self.results in events:
                _drain(self.results, self._on_worker)
            if self.broker in events:
                _drain(self.broker, self._on_broker)
            if self.dirty:  # results go out before the clients' frames are taken: they waited longest
                self._flush()
            if self.disconnects in events:
                self._on_disconnects()
            if self.clients in events:
                _drain(self.clients, self._on_client, copy=False)
            if self.vad.signal in events:
                self._on_vad()
            now = time.monotonic()
            if now - last_sweep >= 1.0:
                last_sweep = now
                self._sweep(now)
                self._publish_gauges()
                self._check_socket_files()
            if self.draining:
                self._wind_down(now)
            elif self.held and now >= self.held_due:
                self._serve_held(now)
            if self.dirty:
                self._flush()
            self._run_vad(now)
            if self.dirty:  # segments the deciding chunks just opened or closed
                self._flush()
            if self.newly_gone:  # found by a send outside a flush (a refused open, say)
                self._drop_gone()
            self._heartbeat(now)
            stall.turned(now)
            # streams dropped with their connection wait only for answers nobody will receive
            if self.draining and (all(s.abandoned for s in self.sessions.values()) or now >= self.stop_at):
                break

    def close(self) -> None:
        for s in self.sessions.values():
            s.tell_untold()
            if s.abandoned:  # dropped already, its client gone: only its jobs' answers were awaited
                continue
            self._send(s.client, s.closed_message("shutdown", durable=s.durable()))  # from where its finals are owed
            s.log.error("ingest.stream_abandoned_at_shutdown", pending_jobs=len(s.inflight), **s.figures())
        for lines in (self.bad_message_lines, self.unknown_stream_lines, self.open_refused_lines):
            lines.tell_untold(self.log, lambda key: {"client": key[0].hex(), "code": key[1]})
        self.vad.close()
        self.clients.disable_monitor()
        self.disconnects.close(linger=0)
        self.clients.close(linger=CLOSE_LINGER_MS)
        self.results.close(linger=0)
        self.broker.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()
        self.pool.close()
        self.pool.unlink()
        self.metrics.close()
        self.log.info("ingest.stopped")


def _drain(sock: zmq.Socket, handle: Callable[[list], None], copy: bool = True) -> None:
    """Hand up to DRAIN_BATCH waiting messages to `handle`: a bound per turn keeps one busy
    socket from starving the others and the heartbeats."""
    for _ in range(DRAIN_BATCH):
        try:
            frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            return
        handle(frames)


def main(cfg: Config, index: int) -> None:
    # The VAD thread needs the GIL between its batched calls; when the loop is busy it would wait
    # up to the default 5 ms switch interval for each, and fall behind the audio.
    sys.setswitchinterval(0.0005)
    # Signals are taken before the shm segment exists: a stop while the process starts is a
    # drain of no stream, and the segment is unlinked, not left behind in /dev/shm.
    with StopSignal() as stop:
        IngestServer(cfg, index).run(stop)
