"""asyncio client: the blocking client's shape on `zmq.asyncio`, with no thread of its own.

One reader task owns the receive side; audio is sent from whichever coroutine makes it
sendable (a `send`, an ack, a retry timer). Those sends are issued without awaiting in
between, so pyzmq keeps them in order. Flow control is `client.core.StreamCore`.

The reader also watches the connection; when the ingest is lost it says `hello` again and
resumes every open stream from its last `durable` point, as the blocking client does. Audio
sent meanwhile waits in the streams' queues.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import AsyncIterator, Callable, Sequence

import numpy as np
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from client.client import client_socket, close_ingest_socket, ingest_socket
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
from protocol.auth import Curve
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
    Welcome,
    decode_server,
    encode,
)

log = logging.getLogger(__name__)

LINGER_MS = 500  # let the last `end`s reach the server when closing right after them


async def handshake(ctx: zmq.asyncio.Context, address: str, timeout: float, curve: Curve | None = None) -> Welcome:
    """Hello until welcomed; `not_ready` is retried because a starting service answers it."""
    deadline = time.monotonic() + timeout
    delay = 0.05
    while True:
        sock = client_socket(ctx, curve)
        sock.linger = 0
        try:
            sock.connect(address)
            await sock.send_multipart(encode(Hello()))
            try:  # timeouts here are asyncio.timeout, never wait_for: on Python 3.11 wait_for loses a
                # cancellation that comes as what it waits for completes (the reader, cancelled by
                # close() as a welcome arrived, then ran on for ever, and close() waited for it)
                async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)):
                    frames = await sock.recv_multipart()
            except TimeoutError:
                raise TimeoutError(f"no answer from {address} within {timeout:.1f}s") from None
        finally:
            sock.close()
        reply = decode_server(frames)
        if isinstance(reply, Welcome):
            return reply
        if isinstance(reply, ErrorMsg):
            if reply.code == NOT_READY and time.monotonic() + delay < deadline:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            raise ServerError(reply.code, reply.message)
        raise ServerError(BAD_MESSAGE, f"unexpected {reply.type!r} in answer to hello")


async def first_welcome(ctx: zmq.asyncio.Context, doors: FrontDoors, timeout: float, curve: Curve | None = None) -> Welcome:
    """The welcome of the first of `doors` to give one, as the blocking client's `first_welcome`."""
    *others, last = doors.in_turn()
    for address in others:
        try:
            return await handshake(ctx, address, doors.try_s(timeout), curve)
        except (TimeoutError, ServerError, ProtocolError):
            doors.passed_over()
    return await handshake(ctx, last, doors.try_s(timeout), curve)


class AsyncClient:
    """`async with AsyncClient(address) as client:` or `client = await AsyncClient.connect(address)`.

    `address` (one front door or several), `liveness`, `resume_timeout`, `curve` and `reconnects`
    as in the blocking Client.
    """

    def __init__(self, address: str | Sequence[str], *, timeout: float = 10.0, liveness: float = LIVENESS_S,
                 resume_timeout: float = RESUME_TIMEOUT_S, curve: Curve | None = None) -> None:
        self._doors = FrontDoors(address)
        self.timeout = timeout
        self.resume_timeout = resume_timeout
        self.reconnects = 0
        self._curve = curve
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._liveness = Liveness(liveness)
        self._reconnecting = False
        self._reader: asyncio.Task[None] | None = None
        self._streams: dict[str, Entry] = {}
        self._abandoned = Abandoned()
        self._moved = asyncio.Event()  # set (and replaced) whenever audio goes out or a stream ends
        self._retry: asyncio.TimerHandle | None = None
        self._failure: Exception | None = None
        self._closed = False

    @classmethod
    async def connect(cls, address: str | Sequence[str], *, timeout: float = 10.0, liveness: float = LIVENESS_S,
                      resume_timeout: float = RESUME_TIMEOUT_S, curve: Curve | None = None) -> AsyncClient:
        client = cls(address, timeout=timeout, liveness=liveness, resume_timeout=resume_timeout, curve=curve)
        await client.start()
        return client

    @property
    def address(self) -> str:
        """The front door that welcomed this client last."""
        return self._doors.current

    async def start(self) -> None:
        """Handshake with the front door and connect to the ingest it names."""
        try:
            welcome = await first_welcome(self._ctx, self._doors, self.timeout, self._curve)
            self.limits = limits_from(welcome)
            self._connect(welcome)
        except BaseException:
            self._ctx.term()
            self._closed = True
            raise
        self._reader = asyncio.create_task(self._read(), name="streamasr-client-reader")

    async def open(
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
    ) -> AsyncStream:
        """Open a stream and wait for `ready`; raises StreamError with the server's code if refused.

        `wait` and `on_wait`: an open the service has no room for waits for a place as `Client.open`'s does;
        cancelling the call withdraws the open (the service is told, and the place goes to the next).
        Raises ValueError at once for what the protocol does not allow, as `Client.open` does.
        """
        self._check()
        msg = Open(stream=uuid.uuid4().hex if stream is None else stream, rate=rate, encoding=encoding, channels=channels, language=language,
                   model=model, partials=partials, priority=priority, prompt=prompt)
        check_open(msg)
        room = RoomWait(wait)
        while True:
            try:
                return await self._open(dataclasses.replace(msg, wait=room.hold_for()), room, on_wait)
            except StreamError as refused:
                pause = room.pause(refused)
                if refused.code in REOPEN_CODES:
                    room.tell(refused, on_wait)
            await asyncio.sleep(pause)
            self._check()  # closed meanwhile

    async def _open(self, msg: Open, room: RoomWait, on_wait: Callable[[StreamError], None] | None) -> AsyncStream:
        if msg.stream in self._streams:
            raise ValueError(f"stream {msg.stream!r} is already open on this client")
        width = SAMPLE_BYTES.get(msg.encoding, 1) * (msg.channels if isinstance(msg.channels, int) and msg.channels > 0 else 1)
        core = StreamCore(msg.stream, priority=msg.priority, frame_bytes=width, limits=self.limits, rate=msg.rate)
        loop = asyncio.get_running_loop()
        entry = Entry(core, msg, loop.create_future(), asyncio.Queue(), held=loop.create_future())
        self._liveness.restart_if_owed_nothing(self._streams, time.monotonic())  # the open is owed a `ready` from now
        self._streams[msg.stream] = entry
        if not self._reconnecting and not self._abandoned.hold(msg.stream):  # else sent by the reconnect, or once released
            self._send(encode(msg))
        try:
            # a held open is answered when a place frees or its wait is over: `timeout` counts from then
            async with asyncio.timeout(self.timeout + (msg.wait or 0.0)):
                await asyncio.wait((entry.opened, entry.held), return_when=asyncio.FIRST_COMPLETED)
                if not entry.opened.done():  # held for room: said once, then the answer is waited for
                    room.tell(entry.held.result(), on_wait)
                await asyncio.shield(entry.opened)
        except TimeoutError:
            self._abandon(entry)
            raise TimeoutError(f"stream {msg.stream}: no answer to open within {self.timeout:.1f}s") from None
        except asyncio.CancelledError:  # the caller gave up (its own timeout): as if ours ran out
            self._abandon(entry)
            raise
        return AsyncStream(self, entry, msg)

    async def close(self) -> None:
        """Stop reading; open streams fail with StreamError('closed').

        Streams ended before send their `end` first, and it is given LINGER_MS to leave. The
        context is terminated on a thread: against an ingest that is gone with messages queued,
        ZeroMQ waits out that linger, and the event loop's other tasks must not wait with it.
        A cancellation of the task calling it is raised again, once the client is closed all the same.
        """
        if self._closed:
            return
        self._flush(last=True)
        self._closed = True
        if self._retry is not None:
            self._retry.cancel()
        try:
            if self._reader is not None:
                self._reader.cancel()
                await asyncio.wait([self._reader])  # raises a cancellation of the caller's task, not the reader's own
        finally:
            self._fail_all(StreamError(CLOSED, "client closed"))
            self._disconnect(LINGER_MS)
            await asyncio.to_thread(self._ctx.term)

    async def __aenter__(self) -> AsyncClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------ internals

    def _check(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closed or self._sock is None:
            raise StreamError(CLOSED, "client is closed" if self._closed else "client is not started")

    def _send(self, frames: list[bytes | memoryview]) -> None:
        assert self._sock is not None
        self._sock.send_multipart(frames, copy=False).add_done_callback(self._sent)

    def _sent(self, fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            log.error("send failed: %r", fut.exception())

    def _abandon(self, entry: Entry) -> None:
        """An open the caller gave up on: forget it, and end it in case the server opens it late."""
        if self._abandoned.give_up(self._streams, entry, connected=not self._reconnecting):
            self._send(encode(End(entry.core.stream)))

    def _wake_senders(self) -> None:
        self._moved.set()
        self._moved = asyncio.Event()

    def _connect(self, welcome: Welcome) -> None:
        """A DEALER to the welcome's ingest and the monitor for its disconnects (`client.ingest_socket`).

        They are assigned only once connected: a connect that fails closes both, and the old
        ones stay as they were. No send limit here either: pyzmq's asyncio socket never blocks
        the loop, but past the limit it keeps sends in futures of its own, which close()
        cancels, a last `end` with them; without one they all go to ZeroMQ and get the linger.
        """
        ingest = ingest_endpoint(self.address, welcome.ingest)
        self._sock, self._monitor = ingest_socket(self._ctx, ingest, self._curve)
        self.ingest = ingest

    def _disconnect(self, linger: int) -> None:
        """Close the ingest socket and its monitor; again does nothing (a failed resume already closed them).

        They are not set to None: `_check` takes that for a client not started, and one that is
        resuming still takes audio.
        """
        if self._sock is not None and self._monitor is not None:
            close_ingest_socket(self._sock, self._monitor, linger)

    async def _read(self) -> None:
        try:
            while True:
                try:
                    await self._read_until_lost()
                except IngestLost as exc:
                    await self._reconnect(str(exc))
        except asyncio.CancelledError:
            raise
        except StreamError as exc:  # the service could not be reached again
            self._failure = exc
            self._fail_all(exc)
        except Exception as exc:  # every waiter must learn why, not hang
            log.exception("client reader failed")
            self._failure = StreamError(INTERNAL, f"client IO failed: {exc!r}")
            self._fail_all(self._failure)

    async def _read_until_lost(self) -> None:
        """Route the ingest's messages until it is lost: IngestLost says how."""
        assert self._sock is not None and self._monitor is not None
        poller = zmq.asyncio.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            deadline = self._liveness.deadline(self._streams, time.monotonic())
            # owing nothing, look again within the interval anyway: audio sent meanwhile does not
            # wake this task, and the deadline it owes (from `_flush`) must be armed before it passes
            wait = self._liveness.interval if deadline is None else deadline - time.monotonic()
            ready = dict(await poller.poll(max(int(wait * 1000) + 1, 0)))
            if self._sock in ready:  # what arrived counts before a disconnect: `closed`, then exit, is no loss
                lost: IngestLost | None = None
                while True:
                    try:
                        frames = await self._sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        self._receive(frames)
                    except IngestLost as exc:  # raised once all that arrived is routed, as in the blocking client
                        lost = lost or exc
                if lost is not None:
                    raise lost
            if self._monitor in ready:
                dropped = False
                while await self._monitor.poll(0):
                    event = parse_monitor_message(await self._monitor.recv_multipart())
                    dropped = event["event"] == zmq.EVENT_DISCONNECTED or dropped
                if dropped:
                    raise IngestLost("the ingest connection dropped")
            deadline = self._liveness.deadline(self._streams, time.monotonic())
            if deadline is not None and time.monotonic() >= deadline:
                raise IngestLost(f"no answer from the ingest for {self._liveness.interval:.1f}s")

    def _receive(self, frames: list[bytes]) -> None:
        now = time.monotonic()
        self._liveness.heard(now)
        try:
            msg = decode_server(frames)
        except ProtocolError as exc:
            log.warning("ignoring a server message: %s", exc.message)  # e.g. a type from a newer server
            return
        if not self._abandoned.answered(msg) and route(self._streams, msg, now):
            self._wake_senders()
        self._flush()

    async def _reconnect(self, why: str) -> None:
        """Hello again, connect to the ingest named, and re-open every stream where it is durable,
        cut to the limits of this welcome; as the blocking client's, streams that made no progress
        within `resume_timeout` fail."""
        log.warning("ingest %s lost (%s); resuming %d stream(s)", self.ingest, why, len(self._streams))
        self._reconnecting = True
        self._disconnect(0)
        self._abandoned.clear()  # the old connection's answers will not come; held opens go with the resume
        deadline = time.monotonic() + self.resume_timeout
        late = f"no progress resuming the stream within {self.resume_timeout:g}s (last loss: {why})"
        delay = 0.1
        while True:
            self._expire(late)
            try:
                welcome = await handshake(self._ctx, self.address,
                                          min(self._doors.try_s(self.timeout), max(deadline - time.monotonic(), 0.1)), self._curve)
                break
            except (TimeoutError, ServerError, ProtocolError) as exc:  # the front door may be restarting too
                if time.monotonic() + delay >= deadline:
                    raise StreamError(LOST, f"could not resume within {self.resume_timeout:.0f}s: {exc}") from None
                self._doors.passed_over()  # with another service to try: its host may be down
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
        self._expire(late)
        self.limits = limits_from(welcome)
        self._connect(welcome)
        self._reconnecting = False
        self.reconnects += 1
        for entry in self._streams.values():
            entry.core.set_limits(self.limits)
            self._send(encode(entry.resume(deadline)))
        self._liveness.heard(time.monotonic())
        self._flush()

    def _expire(self, message: str) -> None:
        """Fail the streams whose resume is past its deadline (`client.core.expire`), waking their senders."""
        if expire(self._streams, time.monotonic(), message):
            self._wake_senders()

    def _fail_all(self, failure: Exception) -> None:
        now = time.monotonic()
        for entry in self._streams.values():
            entry.fail(failure, now)
        self._streams.clear()
        self._wake_senders()

    def _flush(self, last: bool = False) -> None:
        """Send whatever flow control allows now, and arm the timer of stalled or refused streams.

        `last` (closing): every requested `end` goes out too, held back or not.
        """
        if self._reconnecting or self._closed:
            return
        now = time.monotonic()
        self._liveness.deadline(self._streams, now)  # owing nothing before these sends, the clock starts now
        for entry in self._abandoned.released(self._streams):
            self._send(encode(entry.request))
        moved = False
        for entry in self._streams.values():
            if entry.core.reopen_at is not None and now >= entry.core.reopen_at:
                self._send(encode(entry.reopen()))
            cut = entry.core.cut
            for msg in entry.core.take_last(now) if last else entry.core.take(now):
                self._send(encode(msg))
            moved = moved or entry.core.cut != cut
        if moved:
            self._wake_senders()
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        at = due(self._streams)
        if at is not None:
            self._retry = asyncio.get_running_loop().call_later(max(at - now, 0.0), self._flush)

    async def _wait_sent(self, entry: Entry, target: int, frames: int, timeout: float | None) -> None:
        """Wait until the audio handed over up to `target` (input frames, counting withdrawn ones) is
        on the wire; `timeout` bounds each wait for this stream's credit.

        Any stream's progress wakes the wait, so only this stream's restarts the clock. Past the
        timeout, or cancelled (the caller's own timeout), what is unsent is withdrawn, as in the
        blocking client: left queued, it would hold the stream's `end` back. The timeout's
        NoCredit says how many of the send's `frames` went out.
        """
        core = entry.core
        last = core.cut
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while core.cut + core.withdrawn < target:
                if entry.failure is not None:
                    raise entry.failure
                if core.cut != last and timeout is not None:
                    last = core.cut
                    deadline = time.monotonic() + timeout
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    assert timeout is not None
                    raise no_credit(core, timeout, frames, self._withdraw(core))
                try:
                    async with asyncio.timeout(remaining):
                        await self._moved.wait()
                except TimeoutError:
                    pass  # the loop checks this stream's progress and the deadline
        except asyncio.CancelledError:
            self._withdraw(core)
            raise

    def _withdraw(self, core: StreamCore) -> int:
        """Leave the audio a send gave up on out of the stream (returns its input frames); an `end`
        asked for already goes out now."""
        unsent = core.withdraw()
        self._flush()
        return unsent


class AsyncStream(StreamBase):
    """One audio stream of an AsyncClient; the blocking Stream's methods, awaited."""

    def __init__(self, client: AsyncClient, entry: Entry, msg: Open) -> None:
        super().__init__(entry, msg)
        self._client = client

    async def send(self, pcm: bytes | np.ndarray, timeout: float | None = None) -> None:
        """Queue audio; a batch stream waits until all of it is within the window and sent (as `Stream.send`).

        Past `timeout` (NoCredit, saying how much went out), or cancelled, the part of `pcm` not
        sent by then is left out of the stream.
        """
        self._client._check()
        data = self._prepare(pcm)
        if not data:
            return
        core = self._entry.core
        core.push(data)
        self._client._flush()
        if core.batch:
            await self._client._wait_sent(self._entry, self._queued, len(data) // core.frame_bytes, timeout)

    async def end(self) -> None:
        """No more audio: the server finishes the last segment and answers `closed`."""
        if not self._ended and self._entry.failure is None:
            self._ended = True
            self._entry.core.end()
            self._client._flush()

    async def events(self, timeout: float | None = None) -> AsyncIterator[ServerMessage]:
        """Partials, finals and errors as they arrive, ending with `closed` (as `Stream.events`)."""
        while not self._events_over():
            try:
                async with asyncio.timeout(timeout):
                    at, item = await self._entry.events.get()
            except TimeoutError:
                raise TimeoutError(f"stream {self.id}: no event within {timeout:.1f}s") from None
            yield self._event(at, item)

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.end()
