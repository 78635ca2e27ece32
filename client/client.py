"""Blocking client: one DEALER to an ingest process, owned by an IO thread, for all of a client's streams.

ZeroMQ sockets are not thread-safe, so only the IO thread touches the socket: callers hand it
work through a queue and wake it through a socketpair registered in its poller; it hands
events back through one queue per stream. Flow control lives in `client.core.StreamCore`.

When the ingest is lost (the connection drops, it forgets a stream, or it stops answering) the
IO thread says `hello` again, connects to the ingest it is given and resumes every open stream
from its last `durable` point; callers see the same Stream objects carry on.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import socket
import threading
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, CancelledError, Future, wait
from typing import Callable, Iterator, Sequence

import numpy as np
import zmq

from zmq.utils.monitor import recv_monitor_message

from client.core import (
    CLOSED,
    LIVENESS_S,
    LOST,
    REOPEN_CODES,
    RESUME_TIMEOUT_S,
    SAMPLE_BYTES,
    Abandoned,
    Entry,
    FrontDoors,
    IngestLost,
    Liveness,
    RoomWait,
    ServerError,
    StreamBase,
    StreamCore,
    StreamError,
    check_open,
    due,
    expire,
    ingest_endpoint,
    limits_from,
    no_credit,
    route,
)
from protocol.auth import Curve, apply_client_curve
from protocol.messages import (
    BAD_MESSAGE,
    INTERNAL,
    NOT_READY,
    End,
    ErrorMsg,
    Hello,
    Open,
    ProtocolError,
    ServerMessage,
    Status,
    StatusReply,
    Welcome,
    decode_server,
    encode,
)

log = logging.getLogger(__name__)

LINGER_MS = 500  # let the last `end`s reach the server when closing right after them
HEARTBEAT_MS = 2000  # ZeroMQ-level pings on the ingest connection: a vanished peer shows as a disconnect
HEARTBEAT_TIMEOUT_MS = 6000
STOP_POLL_MS = 50  # how often a resume waiting on the front door looks whether close() was called
CANCEL_POLL_S = 0.05  # how often an open waiting on the service looks whether its caller withdrew it (`open(cancel=)`)


def _withdrawn(cancel: threading.Event | None, stream: str) -> None:
    """CancelledError once the caller of `open(cancel=)` has set it."""
    if cancel is not None and cancel.is_set():
        raise CancelledError(f"stream {stream}: open withdrawn by its caller")


def client_socket(ctx: zmq.Context, curve: Curve | None) -> zmq.Socket:
    """A DEALER, a CURVE client when `curve` (server public key, client secret key: z85, as
    `protocol.auth` reads them) is given: a service with CURVE on answers nothing else."""
    sock = ctx.socket(zmq.DEALER)
    if curve is not None:
        apply_client_curve(sock, *curve)
    return sock


def ingest_socket(ctx: zmq.Context, endpoint: str, curve: Curve | None = None) -> tuple[zmq.Socket, zmq.Socket]:
    """A DEALER connected to an ingest, with heartbeats on, and the monitor that reports its disconnects.

    If the connect fails (an endpoint ZeroMQ refuses) both are closed: left open, they would
    keep the context's term, and so close(), waiting for ever.
    """
    sock = client_socket(ctx, curve)
    sock.linger = LINGER_MS
    # No send limit: at the default one a send to an ingest that stopped reading (a frozen host)
    # blocks the IO thread, and liveness, resuming and close() with it. What queues is bounded
    # anyway: audio is sent with copy=False, the bytes each stream retains until acked; a batch
    # stream's by its window, a realtime one's by what the caller produces until liveness gives
    # up on the ingest, and a resume closes the socket with whatever it still holds.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        sock.connect(endpoint)
    except BaseException:
        close_ingest_socket(sock, monitor, linger=0)
        raise
    return sock, monitor


def close_ingest_socket(sock: zmq.Socket, monitor: zmq.Socket, linger: int | None = None) -> None:
    """Close the ingest DEALER and its monitor; again does nothing (a failed resume already closed them)."""
    if sock.closed:
        return
    sock.disable_monitor()
    monitor.close(linger=0)
    sock.close(linger)


def request(ctx: zmq.Context, address: str, msg: Hello | Status, timeout: float, curve: Curve | None = None,
            stop: threading.Event | None = None) -> ServerMessage:
    """One request/reply on the front door, on a socket of its own (the front door is stateless).

    `stop`, once set, ends the wait with StreamError('closed'): a client closed while it resumes
    must not wait on a front door that is gone.
    """
    sock = client_socket(ctx, curve)
    sock.linger = 0
    try:
        sock.connect(address)
        sock.send_multipart(encode(msg))
        deadline = time.monotonic() + max(timeout, 0.0)
        while not sock.poll(STOP_POLL_MS if stop is not None else max(timeout, 0.0) * 1000):
            if stop is not None and stop.is_set():
                raise StreamError(CLOSED, "client closed")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no answer from {address} within {timeout:.1f}s")
        return decode_server(sock.recv_multipart())
    finally:
        sock.close()


def handshake(ctx: zmq.Context, address: str, timeout: float, curve: Curve | None = None,
              stop: threading.Event | None = None) -> Welcome:
    """Hello until welcomed; `not_ready` is retried because a starting service answers it. `stop` as in `request`."""
    deadline = time.monotonic() + timeout
    delay = 0.05
    while True:
        reply = request(ctx, address, Hello(), deadline - time.monotonic(), curve, stop)
        if isinstance(reply, Welcome):
            return reply
        if isinstance(reply, ErrorMsg):
            if reply.code == NOT_READY and time.monotonic() + delay < deadline:
                if stop is None:
                    time.sleep(delay)
                elif stop.wait(delay):
                    raise StreamError(CLOSED, "client closed")
                delay = min(delay * 2, 1.0)
                continue
            raise ServerError(reply.code, reply.message)
        raise ServerError(BAD_MESSAGE, f"unexpected {reply.type!r} in answer to hello")


def first_welcome(ctx: zmq.Context, doors: FrontDoors, timeout: float, curve: Curve | None = None,
                  stop: threading.Event | None = None) -> Welcome:
    """The welcome of the first of `doors` to give one, tried in turn from the current one, which
    it becomes; the last one's failure when none does."""
    *others, last = doors.in_turn()
    for address in others:
        try:
            return handshake(ctx, address, doors.try_s(timeout), curve, stop)
        except (TimeoutError, ServerError, ProtocolError):
            doors.passed_over()
    return handshake(ctx, last, doors.try_s(timeout), curve, stop)


def status(address: str, *, timeout: float = 10.0, curve: Curve | None = None) -> StatusReply:
    """The front door's view of the service (ingests, workers, queues)."""
    reply = request(zmq.Context.instance(), address, Status(), timeout, curve)
    if isinstance(reply, ErrorMsg):
        raise ServerError(reply.code, reply.message)
    if not isinstance(reply, StatusReply):
        raise ServerError(BAD_MESSAGE, f"unexpected {reply.type!r} in answer to status")
    return reply


class Client:
    """A connection to the service; open any number of streams on it.

    `address`: the service's front door, or several services' (a list, or comma-separated), tried
    in turn (`FrontDoors`), so that streams whose service is lost outright resume on another.
    `timeout` bounds the handshake and each `open`. A lost ingest is resumed from, and so is one
    that closes a stream at its shutdown before the stream was complete (a restart, a deploy; a
    stream whose `end` crossed the shutdown, all transcribed, ends with that `closed` "shutdown"):
    `liveness` is how long it may leave an open or audio unanswered before it is taken for dead, and
    `resume_timeout` how long after a loss a stream may go without progress (its resent audio acked,
    or a final) however often it is resumed meanwhile, before it fails with
    StreamError('connection_lost'). `reconnects` counts the resumes so far. `curve`: the
    service's public key and this client's secret key (z85; `protocol.auth.read_public_key` and
    `read_key_pair` read them from certificate files) when the service has CURVE on.
    """

    def __init__(self, address: str | Sequence[str], *, timeout: float = 10.0, liveness: float = LIVENESS_S,
                 resume_timeout: float = RESUME_TIMEOUT_S, curve: Curve | None = None) -> None:
        self._doors = FrontDoors(address)
        self.timeout = timeout
        self.resume_timeout = resume_timeout
        self.reconnects = 0
        self._curve = curve
        self._ctx = zmq.Context()
        try:
            welcome = first_welcome(self._ctx, self._doors, timeout, curve)
            self.limits = limits_from(welcome)
            self.ingest = ingest_endpoint(self.address, welcome.ingest)
            self._sock, self._monitor = ingest_socket(self._ctx, self.ingest, curve)
        except BaseException:
            self._ctx.term()
            raise
        self._liveness = Liveness(liveness)
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self._progress = threading.Condition()  # notified when audio goes out or a stream fails
        self._streams: dict[str, Entry] = {}  # IO thread only
        self._abandoned = Abandoned()  # IO thread only
        self._stopping = False
        self._closed = False
        self._stop = threading.Event()  # close() was called: a resume in progress gives up at once
        self._failure: Exception | None = None
        self._ended: Future[Exception] = Future()  # the IO thread ended; its result: what the streams failed with
        self._thread = threading.Thread(target=self._run, name="streamasr-client-io", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        """The front door that welcomed this client last."""
        return self._doors.current

    def open(
        self,
        stream: str | None = None,
        *,
        rate: int = 16000,
        encoding: str = "pcm_s16le",
        channels: int = 1,
        language: str | None = None,
        model: str | None = None,
        partials: bool = True,
        priority: str = "realtime",
        prompt: str | None = None,
        wait: float = 0.0,
        on_wait: Callable[[StreamError], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> Stream:
        """Open a stream and wait for `ready`; raises StreamError with the server's code if refused.

        `wait`: how long an open the service has no room for (`overloaded`, `too_many_streams`) waits
        for a place before that refusal is raised (see RoomWait: the service holds it, first come
        first served; 0, the default: raised at once); `on_wait` is called once, with why, as the
        waiting begins. `cancel`: set from another thread (its caller hung up, Ctrl-C), the open
        is withdrawn within CANCEL_POLL_S, the service told (`end`), and CancelledError raised.
        Raises ValueError at once for what the protocol does not allow (an id over 64 characters,
        a prompt over 1000, a language code over 16, ...).
        """
        msg = Open(stream=uuid.uuid4().hex if stream is None else stream, rate=rate, encoding=encoding, channels=channels, language=language,
                   model=model, partials=partials, priority=priority, prompt=prompt)
        check_open(msg)
        room = RoomWait(wait)
        while True:
            try:
                return self._open(dataclasses.replace(msg, wait=room.hold_for()), room, on_wait, cancel)
            except StreamError as refused:
                pause = room.pause(refused)
                if refused.code in REOPEN_CODES:
                    room.tell(refused, on_wait)
                if self._paused(pause, cancel, msg.stream):  # closed meanwhile: the refusal stands
                    raise

    def _paused(self, seconds: float, cancel: threading.Event | None, stream: str) -> bool:
        """Wait `seconds` before an open is asked again: True if the client closed meanwhile;
        CancelledError if its caller withdrew it."""
        until = time.monotonic() + seconds
        while (left := until - time.monotonic()) > 0 and not self._stop.wait(min(left, CANCEL_POLL_S) if cancel else left):
            _withdrawn(cancel, stream)
        return self._stop.is_set()

    def _open(self, msg: Open, room: RoomWait, on_wait: Callable[[StreamError], None] | None,
              cancel: threading.Event | None) -> Stream:
        width = SAMPLE_BYTES.get(msg.encoding, 1) * (msg.channels if isinstance(msg.channels, int) and msg.channels > 0 else 1)
        core = StreamCore(msg.stream, priority=msg.priority, frame_bytes=width, limits=self.limits, rate=msg.rate)
        entry = Entry(core, msg, Future(), queue.SimpleQueue(), held=Future())
        self._submit(lambda: self._io_open(entry, msg))
        # a held open is answered when a place frees or its wait is over: `timeout` counts from then
        deadline = time.monotonic() + self.timeout + (msg.wait or 0.0)
        waiting = {entry.opened, entry.held, self._ended}
        while True:
            left = max(deadline - time.monotonic(), 0.0)
            done = wait(waiting, min(left, CANCEL_POLL_S) if cancel else left, return_when=FIRST_COMPLETED).done
            if done == {entry.held}:
                waiting.discard(entry.held)  # held for room: said once, then the answer is waited for
                room.tell(entry.held.result(), on_wait)
            elif done or not left or (cancel is not None and cancel.is_set()):
                break
        if entry.opened.done():
            entry.opened.result()
        elif self._ended.done():  # before it took the open (say, while a resume failed): nothing will answer it
            raise self._ended.result()
        else:  # its `end` withdraws it where the service holds it, and ends it if it was opened meanwhile
            self._submit(lambda: self._io_abandon(entry))
            _withdrawn(cancel, msg.stream)
            raise TimeoutError(f"stream {msg.stream}: no answer to open within {self.timeout:.1f}s")
        return Stream(self, entry, msg)

    def close(self) -> None:
        """Stop the IO thread; open streams fail with StreamError('closed').

        Streams ended before send their `end` first, and it is given LINGER_MS to leave.
        """
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._commands.put(self._io_stop)
        self._wake()
        self._thread.join()
        self._wake_r.close()
        self._wake_w.close()
        self._ctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ caller side

    def _submit(self, fn: Callable[[], None]) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise StreamError(CLOSED, "client is closed")
        self._commands.put(fn)
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already

    def _wait_sent(self, entry: Entry, target: int, frames: int, timeout: float | None) -> None:
        """Block until the audio handed over up to `target` (input frames, counting withdrawn ones) is
        on the wire; `timeout` bounds each wait for credit, and past it what is unsent is withdrawn
        and NoCredit says how many of the send's `frames` went out."""
        core = entry.core
        with self._progress:
            last = core.cut
            deadline = None if timeout is None else time.monotonic() + timeout
            while core.cut + core.withdrawn < target:
                if entry.failure is not None:
                    raise entry.failure
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._progress.wait(remaining)
                if core.cut != last and timeout is not None:
                    last = core.cut
                    deadline = time.monotonic() + timeout
            else:
                return
        assert timeout is not None
        # On the IO thread, before any later send's audio, and waited for: the IO thread may have
        # cut more since the deadline (that stays sent, maybe all of it), so only its count is exact.
        unsent: Future[int | None] = Future()
        self._submit(lambda: unsent.set_result(None if core.cut + core.withdrawn >= target else core.withdraw()))
        wait((unsent, self._ended), return_when=FIRST_COMPLETED)
        if not unsent.done():  # the IO thread ended before it got there: the stream failed with it
            raise entry.failure or self._ended.result()
        if unsent.result() is not None:
            raise no_credit(core, timeout, frames, unsent.result())

    # ------------------------------------------------------------ IO thread

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        wake_fd = self._wake_r.fileno()
        failure: Exception = StreamError(CLOSED, "client closed")
        try:
            while not self._stopping:
                ready = dict(poller.poll(self._poll_ms()))
                if wake_fd in ready:
                    self._wake_r.recv(4096)
                self._run_commands()
                try:
                    if self._sock in ready:  # what arrived counts before a disconnect: `closed`, then exit, is no loss
                        self._receive()
                    if self._monitor in ready and self._disconnected():
                        raise IngestLost("the ingest connection dropped")
                    deadline = self._liveness.deadline(self._streams, time.monotonic())
                    if deadline is not None and time.monotonic() >= deadline:
                        raise IngestLost(f"no answer from the ingest for {self._liveness.interval:.1f}s")
                except IngestLost as exc:
                    poller.unregister(self._sock)
                    poller.unregister(self._monitor)
                    self._reconnect(str(exc))
                    poller.register(self._sock, zmq.POLLIN)
                    poller.register(self._monitor, zmq.POLLIN)
                self._flush()
            self._flush(last=True)
        except StreamError as exc:  # the service could not be reached again
            failure = self._failure = exc
        except Exception as exc:  # the thread must not die silently: every waiter learns why
            log.exception("client IO thread failed")
            failure = self._failure = StreamError(INTERNAL, f"client IO failed: {exc!r}")
        finally:
            for entry in self._streams.values():
                entry.fail(failure, time.monotonic())
            self._streams.clear()
            self._ended.set_result(failure)
            with self._progress:
                self._progress.notify_all()
            close_ingest_socket(self._sock, self._monitor)

    def _poll_ms(self) -> int | None:
        now = time.monotonic()
        times = [t for t in (due(self._streams), self._liveness.deadline(self._streams, now)) if t is not None]
        if not times:
            return None
        return max(int((min(times) - now) * 1000) + 1, 0)

    def _disconnected(self) -> bool:
        """Drain the monitor; True if it reported the ingest connection dropped."""
        dropped = False
        while self._monitor.poll(0):
            dropped = recv_monitor_message(self._monitor)["event"] == zmq.EVENT_DISCONNECTED or dropped
        return dropped

    def _reconnect(self, why: str) -> None:
        """Hello again, connect to the ingest named, and re-open every stream where it is durable,
        cut to the limits of this welcome.

        A stream whose resume made no progress within `resume_timeout` fails with
        StreamError('connection_lost'). Raises that if the front door gives no welcome within
        `resume_timeout`, StreamError('closed') as soon as close() is called meanwhile.
        """
        log.warning("ingest %s lost (%s); resuming %d stream(s)", self.ingest, why, len(self._streams))
        close_ingest_socket(self._sock, self._monitor, linger=0)
        self._abandoned.clear()  # the old connection's answers will not come; held opens go with the resume
        deadline = time.monotonic() + self.resume_timeout
        late = f"no progress resuming the stream within {self.resume_timeout:g}s (last loss: {why})"
        delay = 0.1
        while True:
            self._expire(late)
            try:
                welcome = handshake(self._ctx, self.address, min(self._doors.try_s(self.timeout), max(deadline - time.monotonic(), 0.1)),
                                    self._curve, self._stop)
                break
            except (TimeoutError, ServerError, ProtocolError) as exc:  # the front door may be restarting too
                if self._stop.is_set():
                    raise StreamError(CLOSED, "client closed") from None
                if time.monotonic() + delay >= deadline:
                    raise StreamError(LOST, f"could not resume within {self.resume_timeout:.0f}s: {exc}") from None
                self._doors.passed_over()  # with another service to try: its host may be down
                self._stop.wait(delay)
                delay = min(delay * 2, 1.0)
        self._expire(late)
        self.limits = limits_from(welcome)
        self.ingest = ingest_endpoint(self.address, welcome.ingest)
        self._sock, self._monitor = ingest_socket(self._ctx, self.ingest, self._curve)
        self.reconnects += 1
        for entry in self._streams.values():
            entry.core.set_limits(self.limits)
            self._sock.send_multipart(encode(entry.resume(deadline)))
        self._liveness.heard(time.monotonic())

    def _expire(self, message: str) -> None:
        """Fail the streams whose resume is past its deadline (`client.core.expire`), waking their senders."""
        if expire(self._streams, time.monotonic(), message):
            with self._progress:
                self._progress.notify_all()

    def _run_commands(self) -> None:
        # an open or audio among them may make the ingest owe an answer
        self._liveness.restart_if_owed_nothing(self._streams, time.monotonic())
        while True:
            try:
                fn = self._commands.get_nowait()
            except queue.Empty:
                return
            fn()

    def _io_stop(self) -> None:
        self._stopping = True

    def _io_open(self, entry: Entry, msg: Open) -> None:
        if msg.stream in self._streams:
            entry.opened.set_exception(ValueError(f"stream {msg.stream!r} is already open on this client"))
            return
        self._streams[msg.stream] = entry
        if not self._abandoned.hold(msg.stream):  # else sent once released, in _flush
            self._sock.send_multipart(encode(msg))

    def _io_abandon(self, entry: Entry) -> None:
        """An open the caller gave up on: forget it, and end it in case the server opens it late."""
        if self._abandoned.give_up(self._streams, entry, connected=True):  # the IO thread resumes in one go
            self._sock.send_multipart(encode(End(entry.core.stream)))

    def _receive(self) -> None:
        """Route every message that arrived; a loss one of them reveals is raised once all are routed.

        What arrived behind it (another stream's last final, its `closed`) is delivered, not
        dropped with the socket: that stream would be decoded again, or fail if the resume does.
        """
        lost: IngestLost | None = None
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            now = time.monotonic()
            self._liveness.heard(now)
            try:
                msg = decode_server(frames)
            except ProtocolError as exc:
                log.warning("ignoring a server message: %s", exc.message)  # e.g. a type from a newer server
                continue
            try:
                if not self._abandoned.answered(msg) and route(self._streams, msg, now):
                    with self._progress:
                        self._progress.notify_all()
            except IngestLost as exc:
                lost = lost or exc
        if lost is not None:
            raise lost

    def _flush(self, last: bool = False) -> None:
        """Send what flow control allows now; `last` (closing): every requested `end` too, held or not."""
        now = time.monotonic()
        for entry in self._abandoned.released(self._streams):
            self._sock.send_multipart(encode(entry.request))
        moved = False
        for entry in self._streams.values():
            if entry.core.reopen_at is not None and now >= entry.core.reopen_at:
                self._sock.send_multipart(encode(entry.reopen()))
            cut = entry.core.cut
            for msg in entry.core.take_last(now) if last else entry.core.take(now):
                self._sock.send_multipart(encode(msg), copy=False)
            moved = moved or entry.core.cut != cut
        if moved:
            with self._progress:
                self._progress.notify_all()


class Stream(StreamBase):
    """One audio stream of a Client: send from one thread, read events from one (maybe another).

    `send_times` and `latency_for` tie transcripts back to when their audio left the client.
    """

    def __init__(self, client: Client, entry: Entry, msg: Open) -> None:
        super().__init__(entry, msg)
        self._client = client

    def send(self, pcm: bytes | np.ndarray, timeout: float | None = None) -> None:
        """Queue audio; a batch stream blocks until all of it is within the window and sent.

        `timeout` bounds how long a batch stream waits for the window to move (None: until the
        stream or client closes); past it, `client.core.NoCredit` (a TimeoutError) saying how
        many of its input frames went out, and the part of `pcm` not sent by then is left out of
        the stream: a later `send` continues right after the audio that went out, and `end`
        goes out at once. Raises ValueError for audio the server would refuse
        (see `client.core.to_pcm`): sent, it would stop the stream taking any more.
        """
        data = self._prepare(pcm)
        if not data:
            return
        core = self._entry.core
        self._client._submit(lambda: core.push(data))
        if core.batch:
            self._client._wait_sent(self._entry, self._queued, len(data) // core.frame_bytes, timeout)

    def end(self) -> None:
        """No more audio: the server finishes the last segment and answers `closed`."""
        if not self._ended and self._entry.failure is None:
            self._ended = True
            self._client._submit(self._entry.core.end)

    def events(self, timeout: float | None = None) -> Iterator[ServerMessage]:
        """Partials, finals and errors as they arrive, ending with `closed`.

        Raises TimeoutError when nothing arrives for `timeout` seconds, and StreamError when
        the client is closed or fails first. Called again once it ended, it ends the same way at
        once: nothing more will come.
        """
        while not self._events_over():
            try:
                at, item = self._entry.events.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"stream {self.id}: no event within {timeout:.1f}s") from None
            yield self._event(at, item)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()
