"""A raw-protocol streaming client for the reliability tests, built on protocol.messages alone.

It does what a careful client must: hello at the front door, open on the ingest named in the
welcome, send audio no further than the window, resend what the server refused, and — when
asked to — resume after a lost ingest: keep the audio from the last `durable` on, re-hello,
re-open with `offset`, resend. Kept independent of the client library on purpose: these tests
check the server against the protocol, not against one client's reading of it.
"""

from __future__ import annotations

import threading
import time
import uuid
import wave
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import psutil
import zmq
from zmq.utils.monitor import recv_monitor_message

from protocol import messages as m
from streamasr import service as svc
from streamasr.service import LocalService

LIBRIVOX = Path("/usr/share/pocketsphinx/test/data/librivox")
CARDS = Path("/usr/share/pocketsphinx/test/data/cards")
RATE = 16_000
CHUNK_FRAMES = 1600  # 100 ms per audio message


def read_wav(path: Path) -> bytes:
    """16-bit PCM bytes of a 16 kHz mono wav."""
    with wave.open(str(path)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (RATE, 1, 2), path
        return w.readframes(w.getnframes())


def speech_files() -> list[Path]:
    return sorted(LIBRIVOX.glob("*.wav")) + sorted(CARDS.glob("*.wav"))


class Refused(Exception):
    """The server refused the open: `code` says why."""

    def __init__(self, error: m.ErrorMsg):
        super().__init__(f"{error.code}: {error.message}")
        self.code = error.code
        self.error = error


class ConnectionLost(Exception):
    """The ingest connection dropped, or the ingest no longer knows the stream."""


@dataclass
class StreamResult:
    stream: str
    finals: list[m.Final] = field(default_factory=list)
    partials: int = 0
    errors: list[m.ErrorMsg] = field(default_factory=list)
    closed: m.Closed | None = None
    refused: str | None = None  # error code of a refused open
    refusal: m.ErrorMsg | None = None  # the error it was refused with, as the client got it
    resumes: list[int] = field(default_factory=list)  # offsets the stream was re-opened at
    overloaded: int = 0  # audio messages refused for room (`overloaded`), resent after the next ack
    first_final_at: float | None = None

    @property
    def text(self) -> str:
        return " ".join(f.text.strip() for f in self.finals).strip()


def hello(address: str, timeout: float = 60.0, curve: Callable[[zmq.Socket], None] | None = None) -> m.Welcome:
    """Ask the front door for an ingest endpoint, retrying while the service is not ready."""
    ctx = zmq.Context.instance()
    deadline = time.monotonic() + timeout
    while True:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve(sock)
        sock.connect(address)
        try:
            sock.send_multipart(m.encode(m.Hello()))
            if sock.poll(1000):
                reply = m.decode_server(sock.recv_multipart())
                if isinstance(reply, m.Welcome):
                    return reply
                assert isinstance(reply, m.ErrorMsg) and reply.code == m.NOT_READY, reply
        finally:
            sock.close()
        if time.monotonic() > deadline:
            raise TimeoutError(f"no welcome from {address} within {timeout} s")
        time.sleep(0.2)


class StreamClient:
    """Streams one PCM buffer (16 kHz s16le mono) and collects the events.

    `speed` paces the audio (1.0 = real time, None = as fast as the window allows). With
    `resume`, a lost ingest connection is survived by re-opening at the last durable offset.
    `on_progress(client, frames_sent)` is called after each message (tests use it to inject faults).
    """

    def __init__(self, address: str, pcm: bytes, stream: str | None = None, *, speed: float | None = 1.0,
                 partials: bool = True, priority: str = "realtime", resume: bool = False, timeout: float = 120.0,
                 curve: Callable[[zmq.Socket], None] | None = None,
                 on_progress: Callable[["StreamClient", int], None] | None = None) -> None:
        self.address = address
        self.pcm = pcm
        self.total = len(pcm) // 2
        self.stream = stream or f"s-{uuid.uuid4().hex[:8]}"
        self.speed = speed
        self.partials = partials
        self.priority = priority
        self.resume = resume
        self.timeout = timeout
        self.curve = curve
        self.on_progress = on_progress
        self.result = StreamResult(self.stream)
        self.durable = 0  # input frame: audio before it is never needed again
        self.resume_token: str | None = None  # the last `ready`'s: a resume brings it back, as the reference clients do
        self.started = 0.0
        self.answered = threading.Event()  # the first open was answered: ready, or refused

    # ------------------------------------------------------------------ public

    def run(self) -> StreamResult:
        self.started = time.monotonic()
        deadline = self.started + self.timeout
        while True:
            try:
                self._session(deadline)
                return self.result
            except Refused as exc:
                self.result.refused = exc.code
                self.result.refusal = exc.error
                self.answered.set()
                return self.result
            except ConnectionLost:
                if not self.resume:
                    raise
                self.result.resumes.append(self.durable)
            if time.monotonic() > deadline:
                raise TimeoutError(f"stream {self.stream} did not finish within {self.timeout} s")

    # ------------------------------------------------------------------ one connection

    def _session(self, deadline: float) -> None:
        welcome = hello(self.address, timeout=max(1.0, deadline - time.monotonic()), curve=self.curve)
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.curve is not None:
            self.curve(sock)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(welcome.ingest)
        try:
            self._stream(sock, monitor, deadline)
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)

    def _stream(self, sock: zmq.Socket, monitor: zmq.Socket, deadline: float) -> None:
        start = self.durable  # everything before it is final and delivered: never sent again
        last = next((f for f in reversed(self.result.finals) if f.text), None)  # an empty final prompts nothing
        sock.send_multipart(m.encode(m.Open(stream=self.stream, partials=self.partials, priority=self.priority, offset=start,
                                            resume_text=last and last.text, resume_language=last and last.language,
                                            resume_token=self.resume_token)))
        window = -1
        pos = start
        seq = 0
        sent_at: dict[int, int] = {}  # seq -> input frame it starts at, to rewind on refusal
        ended = False
        began = time.monotonic()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while True:
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"stream {self.stream}: no close within {self.timeout} s")
            # send what the window and the pace allow
            if window >= 0 and not ended:
                due = self.total if self.speed is None else start + int((now - began) * RATE * self.speed)
                while pos < self.total and pos < window and pos < due + CHUNK_FRAMES:
                    n = min(CHUNK_FRAMES, self.total - pos, window - pos)
                    sock.send_multipart(m.encode(m.Audio(stream=self.stream, seq=seq, data=self.pcm[2 * pos: 2 * (pos + n)])))
                    sent_at[seq] = pos
                    seq += 1
                    pos += n
                    if self.on_progress is not None:
                        self.on_progress(self, pos)
                if pos >= self.total:
                    sock.send_multipart(m.encode(m.End(stream=self.stream)))
                    ended = True
            events = dict(poller.poll(20 if window >= 0 and not ended else 200))
            # messages already received come first: a server that exits right after `closed` drops
            # the connection, and that is not a failure
            while sock.poll(0):
                msg = m.decode_server(sock.recv_multipart())
                if isinstance(msg, m.Ready):
                    window = msg.window
                    self.resume_token = msg.resume_token or self.resume_token
                    self.answered.set()
                elif isinstance(msg, m.Ack):
                    window = max(window, msg.window)
                    self.durable = max(self.durable, msg.durable)
                elif isinstance(msg, m.Partial):
                    self.result.partials += 1
                elif isinstance(msg, m.Final):
                    self.durable = max(self.durable, msg.durable)
                    if self.result.first_final_at is None:
                        self.result.first_final_at = time.monotonic() - self.started
                    self.result.finals.append(msg)
                elif isinstance(msg, m.Closed):
                    self.result.closed = msg
                    return
                elif isinstance(msg, m.ErrorMsg):
                    if window < 0:
                        raise Refused(msg)
                    if msg.code == m.UNKNOWN_STREAM:
                        raise ConnectionLost("the ingest no longer knows the stream (it restarted)")
                    if msg.code == m.OVERLOADED and msg.seq is not None and msg.seq in sent_at and msg.seq < seq:
                        self.result.overloaded += 1
                        pos, seq = sent_at[msg.seq], msg.seq  # resend from the refused frame after the next ack
                        window = min(window, pos)
                        ended = False  # an `end` sent after the refused frame is sent again after it
                        continue
                    if msg.code == m.OUT_OF_ORDER and msg.seq is not None and msg.seq >= seq:
                        continue  # frames sent after a refused one: they are resent in order
                    self.result.errors.append(msg)
            if monitor in events:
                event = recv_monitor_message(monitor)
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    raise ConnectionLost("ingest connection dropped")


def stream_many(address: str, buffers: dict[str, bytes], **kwargs: Any) -> dict[str, StreamResult]:
    """Stream several buffers concurrently, one connection each; re-raises a client's failure."""
    results: dict[str, StreamResult] = {}
    failures: list[BaseException] = []

    def one(name: str, pcm: bytes) -> None:
        try:
            results[name] = StreamClient(address, pcm, name, **kwargs).run()
        except BaseException as exc:  # noqa: BLE001 - reported to the test below
            failures.append(exc)

    threads = [threading.Thread(target=one, args=item, daemon=True) for item in buffers.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]
    return results


def send_paced(stream: Any, pcm: np.ndarray, rate: int = RATE, chunk: int = CHUNK_FRAMES, speed: float = 1.0,
               on_sent: Callable[[int], None] | None = None) -> None:
    """Send `pcm` to a reference client's stream `chunk` frames a message at `speed` × real time,
    as a microphone delivers it, then end the stream; `on_sent` gets the frames sent so far."""
    started = time.monotonic()
    for i, at in enumerate(range(0, len(pcm), chunk)):
        time.sleep(max(0.0, started + i * chunk / rate / speed - time.monotonic()))
        stream.send(pcm[at : at + chunk])
        if on_sent is not None:
            on_sent(at + chunk)
    stream.end()


def wait_for(check: Callable[[], Any], timeout: float = 10.0, what: str = "condition", interval: float = 0.1) -> Any:
    """Poll `check` until it is truthy; bounded generously, asserting on the outcome only."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def pid_of(service: LocalService, program: str) -> int:
    """`program`'s pid while supervisord runs it: STARTING (for its `startsecs`, up to a minute) or RUNNING."""
    def check() -> int | None:
        info = next(p for p in svc.processes(service.cfg) if p["name"] == program)
        return int(info["pid"]) if info["statename"] in svc.UP_STATES else None
    return wait_for(check, 30, f"{program} running")


def connections_from(port: int) -> int:
    """Open TCP connections this process holds to a peer's `port` (a client's, seen from the server under test)."""
    return sum(bool(c.raddr) and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
               for c in psutil.Process().net_connections("tcp"))
