"""One client process of `streamasr bench`: many streams on one DEALER, driven by one loop.

The bench starts these with `python -m streamasr.loadgen`, writes the plan as one msgpack map
to stdin and reads msgpack records from stdout, so raw samples cross the process boundary
without pickle. There is no thread per stream: a heap of due times drives the real-time sends
and one non-blocking receive loop serves every stream, so the generator's own cost grows with
the frame rate, not with a thread per stream.

Latency follows the client's definition (client.core.SendLog): receive time minus the first
send time of the frame holding the last sample a result covers, or of `end` if that was sent
earlier. All times are time.monotonic(), which on Linux is one clock for every process.
"""

from __future__ import annotations

import heapq
import os
import select
import sys
import time
from array import array
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import msgpack
import numpy as np
import zmq

from client.client import handshake
from client.core import StreamCore, float_to_int16, ingest_endpoint, limits_from, to_pcm
from protocol.auth import apply_client_curve
from protocol.messages import (
    SAMPLE_BYTES,
    Ack,
    Audio,
    Closed,
    End,
    ErrorMsg,
    Final,
    Open,
    Partial,
    ProtocolError,
    Ready,
    decode_server,
    encode,
)

OPEN_TIMEOUT_S = 30.0
LEAD_MAX_S = 2.0  # streams begin with up to this much silence so their segments do not end in lockstep
GOLDEN = 0.6180339887498949
SLOT_S = 0.001  # resolution of the send schedule


@dataclass(frozen=True)
class Clip:
    name: str
    path: str
    reference: str


@dataclass(frozen=True)
class Plan:
    """What one client process does; `first` is the global index of its first stream."""

    address: str
    tag: str  # stream ids are f"{tag}-{index}", unique per run
    first: int
    count: int
    clips: list[Clip]
    duration_s: float
    frame_ms: float
    offline: bool
    gap_s: float
    drain_s: float  # stop waiting for results after this long without any message
    ramp_s: float = 0.0  # stream i of `total` opens at t0 + i * ramp_s / total; 0: all open before t0
    total: int = 1  # streams over all client processes
    rate: int = 16000  # what the streams send: other rates make the ingest resample
    encoding: str = "pcm_s16le"  # how they send it: pcm_mulaw and pcm_alaw make the ingest decode G.711
    curve: list[str] | None = None  # a CURVE service's public key and the client's secret key, z85

    def to_wire(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["clips"] = [[c.name, c.path, c.reference] for c in self.clips]
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Plan:
        d = dict(d)
        d["clips"] = [Clip(*c) for c in d["clips"]]
        return cls(**d)


def playlist(index: int, clips: list[Clip], duration_s: float, gap_s: float, durations: list[float]) -> tuple[float, list[int]]:
    """Lead-in silence and the clips stream `index` plays: whole clips, from a different start
    per stream, until `duration_s` is reached (the last clip is finished, so WER stays exact)."""
    lead = ((index * GOLDEN) % 1.0) * LEAD_MAX_S
    total, order, k = lead, [], index
    while total < duration_s:
        c = k % len(clips)
        order.append(c)
        total += durations[c] + gap_s
        k += 1
    return lead, order


def load_clips(clips: list[Clip], rate: int) -> list[np.ndarray]:
    """Each clip as int16 mono at `rate`."""
    from speech.audio import SAMPLE_RATE, load_audio, resample

    return [float_to_int16(resample(load_audio(c.path), SAMPLE_RATE, rate)) for c in clips]


@dataclass(frozen=True)
class Encoded:
    """The clips and the longest silence a playlist needs, encoded once as the client library
    encodes audio, so every stream's bytes are slices of these."""

    clips: list[bytes]
    silence: bytes  # LEAD_MAX_S or a gap, whichever is longer: silence is not all zero bytes in G.711
    width: int  # bytes per sample


def encode_clips(pcm: list[np.ndarray], rate: int, gap_s: float, encoding: str) -> Encoded:
    silence = np.zeros(int(max(LEAD_MAX_S, gap_s) * rate), dtype="<i2")
    return Encoded([to_pcm(p, encoding, 1) for p in pcm], to_pcm(silence, encoding, 1), SAMPLE_BYTES[encoding])


def stream_audio(lead_s: float, order: list[int], audio: Encoded, gap_s: float, rate: int) -> bytes:
    """One stream's bytes: its lead-in silence, then each clip of its playlist and a gap."""
    gap = audio.silence[: int(gap_s * rate) * audio.width]
    parts = [audio.silence[: int(lead_s * rate) * audio.width]]
    for c in order:
        parts += [audio.clips[c], gap]
    return b"".join(parts)


@dataclass(eq=False)
class Stream:
    sid: str
    core: StreamCore
    pcm: memoryview
    refs: list[str]
    offset: int = 0  # bytes handed to the core so far
    ready: bool = False
    open_error: str | None = None
    closed_at: float | None = None
    closed_reason: str | None = None  # "end" once the service finished it; "shutdown", "idle_timeout" when it cut it
    partials: array = field(default_factory=lambda: array("d"))  # recv, latency, seg, end
    finals: array = field(default_factory=lambda: array("d"))  # recv, latency, seg, end
    acks: array = field(default_factory=lambda: array("d"))  # recv, latency
    texts: list[str] = field(default_factory=list)
    revised: int = 0  # finals that changed words the partials had marked stable
    errors: dict[str, int] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        return {
            "sid": self.sid, "ready": self.ready, "open_error": self.open_error, "closed_at": self.closed_at,
            "closed_reason": self.closed_reason,
            "end_sent": self.core.log.end_sent,
            "audio_s": self.core.cut / self.core.log.rate, "refs": self.refs, "texts": self.texts, "revised": self.revised,
            "errors": self.errors,
            "partials": self.partials.tobytes(), "finals": self.finals.tobytes(), "acks": self.acks.tobytes(),
        }


class LoadClient:
    """The streams of one process and the loop that feeds them."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.ctx = zmq.Context()
        curve = (plan.curve[0].encode(), plan.curve[1].encode()) if plan.curve else None
        welcome = handshake(self.ctx, plan.address, OPEN_TIMEOUT_S, curve)
        limits = limits_from(welcome)
        self.sock = self.ctx.socket(zmq.DEALER)
        if curve is not None:
            apply_client_curve(self.sock, *curve)
        self.sock.linger = 0
        self.sock.sndhwm = 0  # never drop or block on our own queue: lateness must show as send lag
        self.sock.rcvhwm = 0
        self.sock.connect(ingest_endpoint(plan.address, welcome.ingest))
        self.fd = self.sock.getsockopt(zmq.FD)
        self.packer = msgpack.Packer(use_bin_type=True)
        pcm = load_clips(plan.clips, plan.rate)
        durations = [len(p) / plan.rate for p in pcm]
        encoded = encode_clips(pcm, plan.rate, plan.gap_s, plan.encoding)
        self.streams: list[Stream] = []
        for i in range(plan.first, plan.first + plan.count):
            lead, order = playlist(i, plan.clips, plan.duration_s, plan.gap_s, durations)
            core = StreamCore(f"{plan.tag}-{i}", priority="batch" if plan.offline else "realtime",
                              frame_bytes=encoded.width, limits=limits, rate=plan.rate)
            audio = memoryview(stream_audio(lead, order, encoded, plan.gap_s, plan.rate))
            self.streams.append(Stream(core.stream, core, audio, [plan.clips[c].reference for c in order]))
        self.by_id = {s.sid: s for s in self.streams}
        self.frame_bytes = max(1, round(plan.frame_ms * plan.rate / 1000)) * encoded.width
        self.lag = array("d")  # actual minus scheduled send time of every real-time frame
        self.last_message = time.monotonic()

    # ------------------------------------------------------------------ IO

    def flush(self, s: Stream) -> None:
        now = time.monotonic()
        for msg in s.core.take(now):
            if isinstance(msg, Audio):  # the hot path: a literal header costs a third of encode()'s introspection
                frames = [self.packer.pack({"type": "audio", "stream": msg.stream, "seq": msg.seq}), msg.data]
            else:
                frames = encode(msg)
            self.sock.send_multipart(frames, copy=False)

    def receive(self) -> None:
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            now = time.monotonic()
            self.last_message = now
            try:
                msg = decode_server(frames)
            except ProtocolError:
                continue
            s = self.by_id.get(getattr(msg, "stream", None) or "")
            if s is None:
                continue
            if isinstance(msg, Partial):
                s.partials.extend((now, now - s.core.log.sent_at(msg.end), msg.seg, msg.end))
            elif isinstance(msg, Final):
                s.finals.extend((now, now - s.core.log.sent_at(msg.end), msg.seg, msg.end))
                s.texts.append(msg.text)
                s.revised += msg.revised
            elif isinstance(msg, Ack):
                if msg.samples > s.core.accepted:  # news about audio: it left in the loop iteration that took the
                    s.acks.extend((now, now - s.core.log.sent_at(msg.samples / s.core.log.rate)))  # frame (the ingest round trip)
                s.core.on_ack(msg)
                self.flush(s)
            elif isinstance(msg, Ready):
                s.core.on_ready(msg.window)
                s.ready = True
            elif isinstance(msg, ErrorMsg):
                if not s.ready:
                    s.open_error = f"{msg.code}: {msg.message}"
                    continue
                s.errors[msg.code] = s.errors.get(msg.code, 0) + 1  # every refusal counts, echoes too
                s.core.on_error(msg, now)
            elif isinstance(msg, Closed):
                s.closed_at, s.closed_reason = now, msg.reason

    def wait(self, seconds: float) -> None:
        """Sleep until a message may be waiting or `seconds` pass, with microsecond resolution
        (zmq_poll counts whole milliseconds, which would make every send up to 1 ms late).

        ZMQ_FD is edge-triggered: it only signals new activity, so the socket's own EVENTS
        is checked first and every wake-up is followed by draining the socket."""
        if seconds <= 0 or self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            return
        select.select([self.fd], [], [], seconds)

    # ------------------------------------------------------------------ phases

    def open_at(self, t0: float) -> list[tuple[float, Stream]]:
        """When each stream opens under a ramp: spread over the run by global index, so the service
        sees new streams arrive while it measures its load, as admission control expects."""
        step = self.plan.ramp_s / max(self.plan.total, 1)
        return [(t0 + (self.plan.first + j) * step, s) for j, s in enumerate(self.streams)]

    def open(self) -> None:
        if self.plan.ramp_s > 0 and not self.plan.offline:
            return  # opened one by one during the run
        for s in self.streams:
            self.sock.send_multipart(encode(Open(s.sid, rate=self.plan.rate, encoding=self.plan.encoding,
                                                  priority="batch" if self.plan.offline else "realtime")))
        deadline = time.monotonic() + OPEN_TIMEOUT_S
        while time.monotonic() < deadline and any(not s.ready and s.open_error is None for s in self.streams):
            self.wait(0.1)
            self.receive()
        for s in self.streams:
            if not s.ready and s.open_error is None:
                s.open_error = "timeout"

    def run(self, t0: float) -> None:
        live = [s for s in self.streams if s.ready]
        if self.plan.offline:
            while time.monotonic() < t0:
                self.wait(t0 - time.monotonic())
                self.receive()
            for s in live:
                s.core.push(bytes(s.pcm))
                s.core.end()
                self.flush(s)
        else:
            self.realtime(live, t0)
        self.drain(live)  # realtime() appended the streams a ramp opened

    def realtime(self, live: list[Stream], t0: float) -> None:
        """Send every live stream's frames on schedule; under a ramp, also open the others at their
        times (once each: a refused open is the measurement, not something to retry) and append the
        admitted ones to `live`, their schedule starting when `ready` arrives."""
        frame_s = self.plan.frame_ms / 1000
        n = max(len(live), 1)
        # Streams are spread over a frame period in steps of SLOT_S: streams in one slot share a wake-up,
        # which keeps the generator's own cost at one wake-up per slot rather than one per frame.
        slots = max(1, round(frame_s / SLOT_S))
        due = [(t0 + frame_s * (k * slots // n) / slots, k) for k in range(len(live))]
        heapq.heapify(due)
        pending = self.open_at(t0) if self.plan.ramp_s > 0 else []
        opening: list[tuple[float, Stream]] = []  # (deadline, stream) sent `open`, no answer yet
        fb = self.frame_bytes
        lag = self.lag
        while due or pending or opening:
            # Open answers arrive as messages, which wake us; the cap only bounds how late a timeout is seen.
            next_at = min([d[0] for d in due[:1]] + [p[0] for p in pending[:1]] + [time.monotonic() + 0.1] * bool(opening))
            self.wait(next_at - time.monotonic())
            self.receive()
            now = time.monotonic()
            while pending and pending[0][0] <= now:
                _, s = pending.pop(0)
                self.sock.send_multipart(encode(Open(s.sid, rate=self.plan.rate, encoding=self.plan.encoding,
                                                       priority="realtime")))
                opening.append((now + OPEN_TIMEOUT_S, s))
            for deadline, s in list(opening):
                if s.ready:
                    live.append(s)
                    heapq.heappush(due, (now, len(live) - 1))
                elif s.open_error is None and now > deadline:
                    s.open_error = "timeout"
                if s.ready or s.open_error is not None:
                    opening.remove((deadline, s))
            while due and due[0][0] <= now:
                at, k = due[0]
                s = live[k]
                s.core.push(s.pcm[s.offset : s.offset + fb])
                s.offset += fb
                lag.append(now - at)
                if s.offset >= len(s.pcm):
                    s.core.end()
                    heapq.heappop(due)
                else:
                    heapq.heapreplace(due, (at + frame_s, k))
                self.flush(s)
                now = time.monotonic()
            self.retry(live)

    def retry(self, live: list[Stream]) -> None:
        """Resend refused audio whose retry timer ran out (StreamCore keeps the timer)."""
        now = time.monotonic()
        for s in live:
            if s.core.retry_at is not None and s.core.retry_at <= now:
                self.flush(s)

    def drain(self, live: list[Stream]) -> None:
        """Wait for every stream's `closed`, giving up after `drain_s` without any message."""
        self.last_message = time.monotonic()
        while any(s.closed_at is None for s in live):
            if time.monotonic() - self.last_message > self.plan.drain_s:
                return
            self.wait(0.05)
            self.receive()
            self.retry(live)

    def result(self) -> dict[str, Any]:
        return {"kind": "result", "lag": self.lag.tobytes(), "streams": [s.record() for s in self.streams]}

    def close(self) -> None:
        for s in self.streams:
            if s.ready and s.closed_at is None:
                self.sock.send_multipart(encode(End(s.sid)))
        self.sock.close()
        self.ctx.term()


def write_record(out: BinaryIO, obj: dict[str, Any]) -> None:
    out.write(msgpack.packb(obj, use_bin_type=True))
    out.flush()


class RecordReader:
    """msgpack records from a pipe, returned as soon as each is complete (a buffered file's
    read(n) would wait for n bytes)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.unpacker = msgpack.Unpacker(raw=False, max_buffer_size=1 << 30)

    def next(self) -> Any:
        while True:
            try:
                return next(self.unpacker)
            except StopIteration:
                chunk = os.read(self.fd, 1 << 20)
                if not chunk:
                    raise EOFError("the other side closed the pipe") from None
                self.unpacker.feed(chunk)


def main() -> int:
    """Plan on stdin; 'ready' after opening, then wait for 'go' with the start time; 'result' at the end."""
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but records may reach the parent's pipe
    reader = RecordReader(sys.stdin.fileno())
    plan = Plan.from_wire(reader.next())
    client = LoadClient(plan)
    try:
        client.open()
        write_record(out, {"kind": "ready", "opened": sum(s.ready for s in client.streams)})
        go = reader.next()
        client.run(float(go["t0"]))
        write_record(out, client.result())
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
