"""What the blocking and the asyncio clients share: flow control, resuming, PCM conversion, send times.

Everything here is free of IO so both clients drive the same state machine and it can be
tested without a server. A `StreamCore` belongs to whichever thread or event loop owns the
socket; only `SendLog` is read from other threads.
"""

from __future__ import annotations

import bisect
import dataclasses
import io
import logging
import random
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import soundfile

from protocol.messages import (
    BAD_FORMAT,
    BAD_MESSAGE,
    G711_SUBTYPES,
    MAX_F32_SAMPLE,
    MAX_OPEN_WAIT_S,
    MAX_PROMPT_CHARS,
    NOT_READY,
    OUT_OF_ORDER,
    OVERLOADED,
    SAMPLE_BYTES,
    TOO_MANY_STREAMS,
    UNKNOWN_STREAM,
    Ack,
    Audio,
    ClientMessage,
    Closed,
    End,
    ErrorMsg,
    Final,
    Limits,
    Open,
    Partial,
    ProtocolError,
    Ready,
    ServerMessage,
    Waiting,
    Welcome,
    decode_client,
    encode,
)

log = logging.getLogger(__name__)

LOCAL_HOSTS = ("127.0.0.1", "0.0.0.0", "localhost", "*")
CLOSED = "closed"  # StreamError code for a stream that ended or a client that was closed
LOST = "connection_lost"  # StreamError code when the service could not be reached again to resume
LIVENESS_S = 10.0  # an ingest silent this long while it owes an answer (ready, ack) is taken for dead
RESUME_TIMEOUT_S = 60.0  # how long to keep trying to reach the service again before failing the streams
FAILOVER_TRY_S = 3.0  # a front door that has not welcomed within this is passed over, when there are others
REOPEN_CODES = (OVERLOADED, TOO_MANY_STREAMS)  # a refused resume worth retrying: the service is busy
REOPEN_S = 1.0  # a re-open (or `streamasr transcribe`'s open) refused for being busy is sent again after this long...
MAX_REOPEN_S = 8.0  # ...doubling up to this, until the resume's deadline
RETRY_S = 0.25  # resend refused audio after this long even if no ack moves the window...
MAX_RETRY_S = 2.0  # ...doubling up to this, so a server that acks only on receipt cannot stall us
KEEP_S = 60.0  # send times of durable audio are kept this long, for results still waiting to be read
COMPACT_AT = 1024  # forgotten send times are dropped from memory in batches of at least this many


class ServerError(Exception):
    """The service refused something; `code` is one of the protocol error codes."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class StreamError(ServerError):
    """A stream could not be opened, or can no longer be used (closed, client gone)."""

    def __init__(self, code: str, message: str, stream: str | None = None) -> None:
        super().__init__(code, message)
        self.stream = stream


@dataclass
class RoomWait:
    """An `open` the service has no room for (`overloaded`: past its admission limits;
    `too_many_streams`: at its stream limit) waited on for up to `seconds`: a place frees as
    other streams end, and a call or a file that came a moment too soon need not fail. The open
    asks the service to hold it for what is left of the wait (`open.wait`): the ingest admits
    the opens it holds in the order they came, as places free. Refused all the same (its client
    at its own stream limit, the ingest's held opens at theirs), or by a service older than that
    field, it is asked again after a wait growing as a resume's does, jittered so that opens
    waiting together do not ask together. Any other refusal is final at once."""

    seconds: float
    deadline: float = 0.0
    delay: float = REOPEN_S
    held: bool = True  # whether the service holds opens: until one refuses `wait` as an unknown field
    told: bool = False  # whether the caller was told the open waits

    def __post_init__(self) -> None:
        self.deadline = time.monotonic() + self.seconds

    def hold_for(self) -> float | None:
        """The `wait` to open with: what is left of the wait, while the service holds opens."""
        left = self.deadline - time.monotonic()
        return min(left, MAX_OPEN_WAIT_S) if self.held and left > 0 else None

    def pause(self, refused: StreamError) -> float:
        """How long to wait before asking again; raises the refusal when it is not for room, or
        when the wait is over (then saying how long it waited)."""
        if self.held and refused.code == BAD_MESSAGE and "'wait'" in refused.message:
            self.held = False  # a service older than the field: asked again at once, without it
            return 0.0
        if refused.code not in REOPEN_CODES:
            raise refused
        left = self.deadline - time.monotonic()
        if left <= 0:
            if not self.seconds:  # no wait asked for
                raise refused
            raise StreamError(refused.code, f"{refused.message} (still refused after waiting {self.seconds:g} s)",
                              refused.stream) from None
        pause = min(random.uniform(self.delay / 2, self.delay), left)
        self.delay = min(self.delay * 2, MAX_REOPEN_S)
        return pause

    def tell(self, why: StreamError, on_wait: Callable[[StreamError], None] | None) -> None:
        """Tell the caller, once, that the open waits for room, and why."""
        if not self.told and on_wait is not None:
            on_wait(why)
        self.told = True


class IngestLost(Exception):
    """The ingest no longer knows a stream it had opened: it restarted, so the client must resume."""


class NoCredit(TimeoutError):
    """A batch send gave up: the window did not move for its timeout. Of the input frames it was
    given, `sent` went out (the first ones: they are in the stream) and the `unsent` rest was
    withdrawn, left out of the stream; a caller that still has that audio knows where to go on."""

    def __init__(self, message: str, sent: int, unsent: int) -> None:
        super().__init__(message)
        self.sent = sent
        self.unsent = unsent


def no_credit(core: StreamCore, timeout: float, frames: int, unsent: int) -> NoCredit:
    """What a batch send of `frames` input frames raises when the window did not move for
    `timeout`, once `core.withdraw` took its `unsent` ones back."""
    return NoCredit(f"stream {core.stream}: no send credit for {timeout:.1f}s (window {core.window}); {frames - unsent} "
                    f"of the send's {frames} input frames went out, the rest is left out of the stream", frames - unsent, unsent)


def limits_from(welcome: Welcome) -> Limits:
    """The welcome's limits, ignoring keys a newer server may add."""
    known = {f.name for f in fields(Limits)}
    return Limits(**{k: v for k, v in welcome.limits.items() if k in known})


class FrontDoors:
    """The front doors a client may use, tried in turn: one service's, or several services' on
    other hosts, so that the streams of a service lost outright (its host down) resume on another
    (which gives them the headroom of resumed streams when the services share a resume key,
    `[ingest] resume_key_file`). The one that welcomed last is tried first again: streams whose
    ingest restarted stay on their service."""

    def __init__(self, address: str | Sequence[str]) -> None:
        given = address.split(",") if isinstance(address, str) else list(address)
        self.addresses = [a.strip() for a in given if a.strip()]
        if not self.addresses:
            raise ValueError(f"no front door address in {address!r}")
        self.current = self.addresses[0]

    def in_turn(self) -> list[str]:
        """Every address, the current one first."""
        i = self.addresses.index(self.current)
        return self.addresses[i:] + self.addresses[:i]

    def passed_over(self) -> None:
        """The current one did not welcome: the next is tried first from now on."""
        self.current = self.in_turn()[1 % len(self.addresses)]

    def try_s(self, timeout: float) -> float:
        """How long one hello may wait: `timeout` for a lone front door; with others to try, a
        silent one (a host that is down) is passed over after FAILOVER_TRY_S."""
        return timeout if len(self.addresses) == 1 else min(timeout, FAILOVER_TRY_S)


def ingest_endpoint(front_door: str, ingest: str) -> str:
    """Where to stream: the welcome's endpoint, with a loopback/wildcard host replaced by the front door's.

    An ingest process only knows the interface it bound; a client that reached the front door
    through another host name must use that name for the ingest too. ZeroMQ's wildcard `*` can
    be bound but never connected to: it takes the front door's host even when that is a local one.
    """
    front_host = _host(front_door)
    host = _host(ingest)
    if host in LOCAL_HOSTS and front_host is not None and (front_host not in LOCAL_HOSTS or host == "*"):
        scheme, _, rest = ingest.partition("://")
        port = rest.rpartition(":")[2]
        return f"{scheme}://{front_host}:{port}"
    return ingest


def _host(endpoint: str) -> str | None:
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp" or ":" not in rest:
        return None
    return rest.rpartition(":")[0]


def float_to_int16(audio: np.ndarray) -> np.ndarray:
    """Float samples (full scale ±1, beyond it clipped) as little-endian 16-bit PCM, rounded."""
    return (np.clip(audio, -1.0, 1.0) * 32767.0).round().astype("<i2")


def to_pcm(pcm: bytes | bytearray | memoryview | np.ndarray, encoding: str, channels: int) -> bytes:
    """`pcm` as interleaved bytes in `encoding`; the caller may reuse its buffer afterwards.

    bytes are taken as already encoded (and not copied): G.711 codes from a telephony source go
    out as they came. Arrays may be float (-1..1) or int16, shaped (frames,) interleaved or
    (frames, channels); for pcm_mulaw and pcm_alaw they are made 16-bit, then encoded by
    libsndfile. Raises ValueError for audio the server would refuse: not whole frames, or f32le
    samples that are NaN, infinite or beyond ±MAX_F32_SAMPLE.
    """
    width = SAMPLE_BYTES[encoding]
    if isinstance(pcm, np.ndarray):
        if pcm.ndim == 2 and pcm.shape[1] != channels:
            raise ValueError(f"array has {pcm.shape[1]} channels, stream has {channels}")
        if pcm.ndim not in (1, 2):
            raise ValueError("audio arrays must be (frames,) or (frames, channels)")
        if pcm.dtype.kind == "f":
            if encoding == "f32le":
                out = pcm.astype("<f4")
            else:
                out = float_to_int16(pcm)
        elif pcm.dtype == np.int16:
            out = (pcm / np.float32(32768.0)).astype("<f4") if encoding == "f32le" else pcm.astype("<i2")
        else:
            raise ValueError(f"audio arrays must be float or int16, not {pcm.dtype}")
        data = g711_encode(out, encoding) if encoding in G711_SUBTYPES else out.tobytes()
    elif isinstance(pcm, bytes):
        data = pcm
    else:
        data = bytes(pcm)
    if len(data) % (width * channels):
        raise ValueError(f"{len(data)} bytes is not a whole number of {channels}-channel {encoding} frames")
    if encoding == "f32le" and data:
        # the server refuses such a message bad_format and every later one out_of_order (it can
        # never be resent as it is): the stream would take no more audio. min and max carry a NaN.
        samples = np.frombuffer(data, "<f4")
        if not (samples.min() >= -MAX_F32_SAMPLE and samples.max() <= MAX_F32_SAMPLE):
            raise ValueError(f"f32le samples must be finite and within ±{MAX_F32_SAMPLE:g} (full scale is ±1)")
    return data


def g711_encode(s16: np.ndarray, encoding: str) -> bytes:
    """16-bit samples (any shape, interleaved in row order) as the G.711 codes of `encoding`, by libsndfile."""
    buf = io.BytesIO()
    # each sample is encoded alone: one channel of them all is the same bytes, and the rate is not stored
    soundfile.write(buf, s16.reshape(-1), 8000, format="RAW", subtype=G711_SUBTYPES[encoding])
    return buf.getvalue()


def check_open(msg: Open) -> None:
    """Raise ValueError for an `open` the server would refuse as malformed, before it is sent.

    The server cannot name the stream in some such refusals (a bad id, a header it cannot
    decode), so the client could not tell which open they answer; the protocol's own validator
    finds them all here. An unsupported format is left to the server: its `bad_format` names the stream.
    """
    # checked first: past the header's string limit the validator would only say "not valid msgpack"
    if isinstance(msg.prompt, str) and len(msg.prompt) > MAX_PROMPT_CHARS:
        raise ValueError(f"open {msg.stream!r}: a prompt of {len(msg.prompt)} characters; at most {MAX_PROMPT_CHARS} are allowed")
    try:
        frames = encode(msg)
    except (TypeError, ValueError) as exc:  # a value msgpack cannot carry: a numpy integer for `rate`, say
        raise ValueError(f"open {msg.stream!r}: {exc} (give plain str, int and bool values)") from None
    try:
        decode_client(frames)
    except ProtocolError as exc:
        if exc.code != BAD_FORMAT:
            raise ValueError(f"open {msg.stream!r} would be refused: {exc.message}") from None


def prompt_tail(text: str | None) -> str | None:
    """`text` cut to the protocol's MAX_PROMPT_CHARS from its start, at a word boundary where there is one.

    A resume sends the last final's text as `resume_text`; the server prompts with only its end,
    so a long final loses what the prompt would not have used.
    """
    if text is None or len(text) <= MAX_PROMPT_CHARS:
        return text
    tail = text[-MAX_PROMPT_CHARS:]
    if text[-MAX_PROMPT_CHARS - 1].isspace():
        return tail
    _, space, rest = tail.partition(" ")
    return rest if space and rest else tail  # a script written without spaces is cut anywhere


@dataclass(slots=True)
class OutFrame:
    """One audio message, kept until acked so a refused one can be resent unchanged."""

    seq: int
    end: int  # input frame index just past its last sample
    data: memoryview


class SendLog:
    """When each sample left the client, for latency: appended by the IO side, read by anyone.

    Entry i holds the input frame index just past a message and its first send time
    (time.monotonic()); a resent message keeps its first time, so stalls count as latency.
    Entries are forgotten once their audio is durable and they are KEEP_S old, so a long stream
    keeps a bounded log while a result read late from a stream's queue (a final's own `durable`
    is applied before its reader asks) still finds its send time.
    """

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self.end_sent: float | None = None  # when `end` was first sent
        self._ends = array("q")
        self._times = array("d")
        self._head = 0  # entries before it are forgotten; dropped from the arrays once they are half of them
        self._lock = threading.Lock()  # forgetting moves the entries a reader may be searching

    def __len__(self) -> int:
        return len(self._ends) - self._head

    def record(self, end: int, now: float) -> None:
        """A message ending at input frame `end` went out; audio re-cut after a resume keeps its first time."""
        with self._lock:
            if not self._ends or end > self._ends[-1]:
                self._times.append(now)
                self._ends.append(end)

    def forget(self, durable: int) -> None:
        """Drop entries for audio before `durable` sent over KEEP_S before the newest one.

        The newest of those stays: it answers, as the latest time it can have been, for any
        earlier sample still asked about.
        """
        with self._lock:
            n = len(self._ends)
            if n - self._head < 2:
                return
            old = bisect.bisect_left(self._times, self._times[n - 1] - KEEP_S, self._head, n)
            done = bisect.bisect_right(self._ends, durable, self._head, n)
            head = min(old, done) - 1
            if head <= self._head:
                return
            self._head = head
            if head >= COMPACT_AT and head * 2 >= n:  # amortised: each entry is moved at most once on average
                del self._ends[:head]
                del self._times[:head]
                self._head = 0

    def sent_at(self, seconds: float) -> float:
        """When the sample at `seconds` (a partial's or final's `end`) was sent, or `end` if earlier.

        A segment's `end` may lie past the last sample (padding); then `end` is what let the
        server finish it. A sample forgotten long ago (see `forget`) gets the newest forgotten time.
        """
        sample = max(round(seconds * self.rate), 1)
        with self._lock:
            n = len(self._ends)
            i = bisect.bisect_left(self._ends, sample, self._head, n)
            frame = self._times[i] if i < n else float("inf")
            end = self.end_sent if self.end_sent is not None else float("inf")
            at = min(frame, end)
            if at == float("inf"):
                if n == self._head:
                    raise LookupError("nothing sent yet")
                return self._times[n - 1]
            return at

    def pairs(self) -> list[tuple[int, float]]:
        """(end, first send time) of every entry not forgotten, in send order."""
        with self._lock:
            return list(zip(self._ends[self._head :], self._times[self._head :]))


class StreamCore:
    """Flow control of one stream: which audio may go out now, what to keep, what to resend.

    Seqs are assigned when a message is first cut from the queued audio; a message stays in
    `retained` until an ack covers it. A batch stream never sends past the window; a realtime
    one ignores the window. An `overloaded` refusal rewinds `next_seq` and stalls the stream
    until an ack moves the window (or a retry timer fires), then everything from the refused
    seq is resent in order. The server refuses audio after `end`, so `end` goes out only when
    nothing is waiting to be (re)sent, right after the last audio (audio a batch send gave up on
    is withdrawn, not waited for: `withdraw`): a refusal that arrives after
    `end` is handled like any other, since the server refuses that `end` too and keeps the
    stream open, so the audio is resent and `end` sent again.

    For resuming on a new connection it also keeps every message cut since the last `durable`
    point (`kept`): `rewind` turns that back into queued audio with seqs from 0, and `seg_base`
    renumbers the new connection's segments so the caller sees one continuous stream.
    """

    def __init__(self, stream: str, *, priority: str, frame_bytes: int, limits: Limits, rate: int) -> None:
        self.stream = stream
        self.batch = priority == "batch"
        self.frame_bytes = frame_bytes  # bytes per input frame (all channels)
        self.set_limits(limits)
        self.log = SendLog(rate)
        self.ready = False
        self.window = 0
        self.accepted = 0  # input frames the server has acked
        self.cut = 0  # input frames put into messages (all of them sent at least once)
        self.sent = 0  # the furthest `cut` has been, over all connections: a resume re-cuts audio before it
        self.withdrawn = 0  # input frames handed over, then taken back unsent (`withdraw`)
        self.next_seq = 0
        self.pending: deque[memoryview] = deque()
        self.retained: deque[OutFrame] = deque()
        self.end_requested = False
        self.stalled_window: int | None = None  # the window when refused; None = not stalled
        self.refused: int | None = None  # the last seq refused as overloaded
        self.last_send = 0.0
        self.retry_at: float | None = None
        self.retry_s = RETRY_S
        self.end_out = False  # `end` sent on the current connection
        self.end_refused: int | None = None  # seq the server is about to refuse our last `end` with
        self.durable = 0  # input frame: audio before it is never needed again, even to resume
        self.kept: deque[OutFrame] = deque()  # messages cut since `durable` (seq unused), oldest first
        self.last_text: str | None = None  # the last non-empty final's text: prompts a resumed stream
        self.last_language: str | None = None  # the language it was heard in: a resumed stream's partials' until its next final
        self.finals = 0  # finals delivered, over all connections
        self.seg_base = 0  # added to the current connection's segment numbers
        self.offset = 0  # input frame the current connection started at
        self.resumes: list[int] = []  # offsets the stream was re-opened at
        self.reopen_at: float | None = None  # when to retry a refused resume
        self.reopen_s = REOPEN_S  # how long the next refused resume waits
        self.resume_by: float | None = None  # when a resume that has not made progress yet gives up

    @property
    def waiting(self) -> bool:
        """Whether the ingest owes this stream an answer: to its open, or an ack (it acks every 100 ms of audio).

        A refused re-open waiting for its retry is owed nothing.
        """
        if not self.ready:
            return self.reopen_at is None
        return self.stalled_window is None and self.cut - self.accepted >= self.log.rate // 10

    def push(self, data: bytes) -> None:
        if data:
            self.pending.append(memoryview(data))

    def end(self) -> None:
        self.end_requested = True

    def withdraw(self) -> int:
        """Drop the queued audio never sent: a batch send gave up on it (no credit in time), and
        its caller is told so; returns the input frames dropped. Left queued, it would go out
        whenever credit came, and `end`, which waits for the queue to empty, only after it: maybe
        never. Audio queued again by a resume (`rewind`) was sent before, so it stays and is resent."""
        unsent = sum(len(data) for data in self.pending) - (self.sent - self.cut) * self.frame_bytes
        frames = unsent // self.frame_bytes
        self.withdrawn += frames
        while unsent > 0:
            tail = self.pending.pop()
            if len(tail) > unsent:
                self.pending.append(tail[: len(tail) - unsent])
            unsent -= len(tail)
        return frames

    def set_limits(self, limits: Limits) -> None:
        """Cut messages to an ingest's limits: a resume's welcome may bring other ones than the first."""
        self.max_frames = max(limits.max_frame_bytes // self.frame_bytes, 1)

    def on_ready(self, window: int) -> None:
        """The (re-)open was taken; a resume is not done until what it resends is (an ingest may
        take the open, then never ack, or crash). With less to resend than the ingest acks (100 ms)
        there is nothing to wait for: an idle stream must not keep a deadline for a later loss."""
        self.ready = True
        self.window = window
        if sum(len(data) for data in self.pending) // self.frame_bytes < self.log.rate // 10:
            self.resume_by = None
        if window > self.offset:  # a message bigger than the server's whole buffer could never be accepted
            self.max_frames = max(1, min(self.max_frames, (window - self.offset) // 4))

    def on_ack(self, ack: Ack) -> None:
        if ack.samples > self.offset:  # the new connection took audio: the resume made progress
            self.resume_by = None
        self.accepted = ack.samples
        self.on_durable(ack.durable)
        while self.retained and self.retained[0].seq <= ack.seq:
            self.retained.popleft()
        self.next_seq = max(self.next_seq, ack.seq + 1)
        if self.stalled_window is not None and ack.window > self.stalled_window:
            self._resume()
            self.retry_s = RETRY_S
        self.window = ack.window

    def on_durable(self, durable: int) -> None:
        """Forget kept audio before `durable`: the server will never need it again."""
        if durable <= self.durable:
            return
        self.durable = durable
        self.log.forget(durable)
        while self.kept and self.kept[0].end <= durable:
            self.kept.popleft()
        if self.kept:
            head = self.kept[0]
            start = head.end - len(head.data) // self.frame_bytes
            if start < durable:
                head.data = head.data[(durable - start) * self.frame_bytes :]

    def on_result(self, msg: Partial | Final) -> None:
        """Number a result in the whole stream; a final also moves `durable` and the resume prompt."""
        msg.seg += self.seg_base
        if isinstance(msg, Final):
            self.resume_by = None  # decoded on the new connection: the resume made progress
            self.finals = msg.seg + 1
            if msg.text:  # the server prompts with the last final that had words, and so does a resume
                self.last_text = msg.text
                self.last_language = msg.language  # None from a server that does not say
            self.on_durable(msg.durable)

    @property
    def complete(self) -> bool:
        """Whether the service has had all of this stream: `end` asked for, and every message
        cut transcribed (`durable`, which a `closed` after the last final sets to all it took)."""
        return self.end_requested and not self.pending and self.durable >= self.cut

    def reopen_later(self, now: float) -> None:
        """Send the refused open again after the back-off, which doubles for the next (up to MAX_REOPEN_S)."""
        self.reopen_at = now + self.reopen_s
        self.reopen_s = min(self.reopen_s * 2, MAX_REOPEN_S)

    def on_closed(self, msg: Closed) -> None:
        """Count `closed`'s figures over the whole stream, not just the last connection."""
        msg.segments += self.seg_base
        msg.audio_s += self.offset / self.log.rate

    def rewind(self, until: float) -> None:
        """Prepare to resume on a new connection, at `durable`, giving up at `until` without progress by then.

        Everything kept from `durable` on is queued again, in front of what was never sent, to go
        out with seqs from 0 once the new `ready` arrives. Send times already recorded stand. A
        resume that loses its connection again before progress keeps its first deadline, so an
        ingest that fails it every time (never acks, unreachable, crashes on it) cannot keep
        the stream retrying for ever. A stream never `ready` is opened again, not resumed.
        """
        if self.ready or self.resumes:
            self.resumes.append(self.durable)
        self.pending.extendleft(reversed([frame.data for frame in self.kept]))
        self.kept.clear()
        self.retained.clear()
        self.cut = self.offset = self.durable
        self.accepted = self.durable  # the new connection has acked nothing: the resent audio is owed an ack
        self.next_seq = 0
        self.ready = False
        self.end_out = False
        self.stalled_window = self.refused = self.end_refused = self.retry_at = self.reopen_at = None
        self.retry_s = RETRY_S
        self.reopen_s = REOPEN_S
        if self.resume_by is None:
            self.resume_by = until
        self.seg_base = self.finals

    def on_error(self, err: ErrorMsg, now: float) -> bool:
        """Apply a stream error; False for a refusal that only echoes an earlier one (not news)."""
        if err.code == NOT_READY and err.seq is not None:
            return False  # its ingest is shutting down: the audio is kept, and resent where the stream resumes
        if err.seq is None or err.code not in (OVERLOADED, OUT_OF_ORDER):
            return True
        if err.code == OVERLOADED and err.seq == self.end_refused:
            self.end_refused = None
            return False  # the server refusing the `end` that crossed the refusal of this seq: already handled
        if err.seq >= self.next_seq:
            return False  # a message sent before we rewound: its resend is already planned
        if err.code == OUT_OF_ORDER and self.refused is not None and err.seq > self.refused:
            return False  # sent behind a refused message (maybe before we heard of it): resent in turn
        if err.code == OUT_OF_ORDER or not self.retained or err.seq < self.retained[0].seq:
            return True  # nothing we hold can fix it
        if self.end_out:
            # `end` crossed this refusal: the server refuses that `end` too, with this seq, and
            # keeps the stream open for the resend; `end` goes out again after it
            self.end_out = False
            self.end_refused = err.seq
        self.next_seq = self.refused = err.seq
        self.stalled_window = self.window
        self.retry_at = now + self.retry_s
        self.retry_s = min(self.retry_s * 2, MAX_RETRY_S)
        return True

    def _resume(self) -> None:
        self.stalled_window = None
        self.retry_at = None

    def take(self, now: float) -> list[ClientMessage]:
        """Messages that may go out now, in order; records send times as if they were sent."""
        out: list[ClientMessage] = []
        if not self.ready:
            return out
        if self.stalled_window is not None:
            if self.retry_at is None or now < self.retry_at:
                return out
            self._resume()
        if self.retained:
            for frame in list(self.retained)[self.next_seq - self.retained[0].seq :]:
                if self.batch and frame.end > self.window:
                    return out
                out.append(Audio(self.stream, frame.seq, frame.data))
                self.next_seq = frame.seq + 1
                self.last_send = now
        while self.pending:
            n = self.max_frames if not self.batch else min(self.max_frames, self.window - self.cut)
            if n <= 0:
                return out
            head = self.pending[0]
            size = min(n * self.frame_bytes, len(head))
            data = head[:size]
            if size == len(head):
                self.pending.popleft()
            else:
                self.pending[0] = head[size:]
            self.cut += size // self.frame_bytes
            self.sent = max(self.sent, self.cut)
            frame = OutFrame(self.next_seq, self.cut, data)
            self.retained.append(frame)
            self.kept.append(OutFrame(0, self.cut, data))
            self.log.record(self.cut, now)
            out.append(Audio(self.stream, frame.seq, data))
            self.next_seq += 1
            self.last_send = now
        if self.end_requested and not self.end_out:
            # At once, acked or not: an `end` that crosses the refusal of earlier audio is refused
            # too and leaves the stream open (`on_error` then resends, and `end` follows again), so
            # waiting for the last ack would only hold the stream's last final back.
            out.append(self._end(now))
        return out

    def take_last(self, now: float) -> list[ClientMessage]:
        """`take` for a client that is closing: a requested `end` goes out now, whatever it waits for.

        Nothing can be resent once the client is closed, so waiting for a retry or a window gains
        nothing; an `end` held back would never go out, and the server would keep the stream
        until its idle timeout, its last segment never decoded. Refused audio gets its last try
        first; audio a batch stream has no window for is dropped.
        """
        if self.stalled_window is not None:
            self._resume()
        out = self.take(now)
        if self.end_requested and not self.end_out:
            out.append(self._end(now))
        return out

    def _end(self, now: float) -> End:
        self.retry_at = None
        self.end_out = True
        if self.log.end_sent is None:
            self.log.end_sent = now
        return End(self.stream)


@dataclass(eq=False)
class Entry:
    """A stream as the socket's owner sees it; shared by the blocking and the asyncio client.

    `opened` is a concurrent.futures or asyncio Future, `events` a queue.SimpleQueue or
    asyncio.Queue of (receive time, message or exception); both have the methods used here.
    `request` is the `open` as first sent, `failure` what sending on the stream raises from then on.
    `held` (a Future of the same kind, or None) is set to why, at the first `waiting` for the open:
    the service holds it for room.
    `resume_token` is the one the stream's last `ready` gave (a realtime stream's, from a service
    that gives them). `refused` holds those of `resume_language` and `resume_token` a service
    refused as unknown fields (one older than them, in a mixed deploy): the stream's later resumes
    go without them, and with the other.
    """

    core: StreamCore
    request: Open
    opened: Any
    events: Any
    held: Any = None
    failure: Exception | None = None
    resume_token: str | None = None
    refused: set[str] = dataclasses.field(default_factory=set)

    def resume(self, until: float) -> Open:
        """The `open` that continues this stream on a new connection (its kept audio then follows).

        Refused for being busy, it is retried until `until`.
        """
        self.core.rewind(until)
        return self.reopen()

    def reopen(self) -> Open:
        """The `open` of the current connection again, after the service refused it for being busy."""
        self.core.reopen_at = None
        # a resume is never held: refused, it is asked again until the resume's own deadline
        return dataclasses.replace(self.request, wait=None, offset=self.core.offset, resume_text=prompt_tail(self.core.last_text),
                                   resume_language=self.resumed_language(),
                                   resume_token=self.resume_token if "resume_token" not in self.refused else None)

    def resumed_language(self) -> str | None:
        """The `resume_language` of a resume: the language the last final with words was heard in.

        Sent only when the service said one (so a client that never heard one sends an old service
        no field it lacks) and the stream was opened without a language, which else decides every decode.
        """
        return self.core.last_language if "resume_language" not in self.refused and self.request.language is None else None

    def newer_fields(self) -> set[str]:
        """The fields of its resume that a service of an older release refuses."""
        carried = {"resume_language"} if self.resumed_language() is not None else set()
        if self.resume_token is not None and "resume_token" not in self.refused:
            carried.add("resume_token")
        return carried

    def fail(self, failure: Exception, now: float) -> None:
        self.failure = failure
        if not self.opened.done():
            self.opened.set_exception(failure)
        else:
            self.events.put_nowait((now, failure))


class Abandoned:
    """Opens the caller gave up on, from the `end` sent after them until the server answers it.

    On one connection the server answers in order: such an open's late `ready` (or its refusal),
    then `closed` (or `unknown_stream`) for its `end`; a stream the service closes itself in
    between (a shutdown) is answered `closed`, then `unknown_stream` for the `end`, which `route`
    drops as news of no open. Until then whatever comes for the id is about that open, so an
    open of the same id again is held back and sent after it: sent at once, it would take the
    first open's late `ready` for its own, and its `closed` would end it. Owned by the socket's
    owner; a new connection starts with none (`clear`).
    """

    def __init__(self) -> None:
        self.ids: set[str] = set()  # abandoned opens whose `end` the server has not answered
        self.held: set[str] = set()  # opens of those ids again, not sent yet

    def give_up(self, streams: dict[str, Entry], entry: Entry, connected: bool) -> bool:
        """The caller gave up on `entry`'s open: forget it. True when an `end` must follow it on
        the connection (`connected`: none is being made anew), the open having been sent."""
        sid = entry.core.stream
        if streams.get(sid) is not entry:
            return False
        del streams[sid]
        if sid in self.held:  # never sent: nothing to end
            self.held.discard(sid)
            return False
        if connected:
            self.ids.add(sid)
        return connected

    def hold(self, sid: str) -> bool:
        """Whether a new open of `sid` must wait for the abandoned one's answer (then it is held)."""
        if sid in self.ids:
            self.held.add(sid)
        return sid in self.ids

    def answered(self, msg: ServerMessage) -> bool:
        """Whether `msg` is news of an abandoned open (then no open stream's); its last news settles it."""
        sid = getattr(msg, "stream", None)
        if sid not in self.ids:
            return False
        if isinstance(msg, Closed) or (isinstance(msg, ErrorMsg) and msg.code == UNKNOWN_STREAM):
            self.ids.discard(sid)
        return True

    def released(self, streams: dict[str, Entry]) -> list[Entry]:
        """Held opens whose abandoned open is settled: to be sent now."""
        ready = [sid for sid in self.held if sid not in self.ids]
        self.held.difference_update(ready)
        return [streams[sid] for sid in ready if sid in streams]

    def clear(self) -> None:
        self.ids.clear()
        self.held.clear()


def route(streams: dict[str, Entry], msg: ServerMessage, now: float) -> bool:
    """Apply one message from the ingest to its stream; True when a stream closed (wake its senders).

    An error naming no stream answers a message the server could not tie to one (or a fault of
    its own): it concerns none of the open streams, so it is only logged. `check_open` keeps this
    client's opens from being refused that way. Raises IngestLost when the ingest answers
    `unknown_stream` for a stream it had opened, or closes one at its shutdown before the
    stream was complete: either way the stream goes on where the front door says.
    """
    sid = getattr(msg, "stream", None)
    if isinstance(msg, ErrorMsg) and sid is None:
        log.warning("error from the ingest about no stream: %s: %s", msg.code, msg.message)
        return False
    entry = streams.get(sid) if isinstance(sid, str) else None
    if entry is None:
        return False  # late news about a stream we dropped
    core = entry.core
    if isinstance(msg, Ready):
        core.on_ready(msg.window)
        if msg.resume_token is not None:
            entry.resume_token = msg.resume_token
        if not entry.opened.done():
            entry.opened.set_result(None)
    elif isinstance(msg, Waiting):
        if entry.held is not None and not entry.held.done() and not entry.opened.done():
            entry.held.set_result(StreamError(msg.code, msg.message, sid))
    elif isinstance(msg, Ack):
        core.on_ack(msg)
    elif isinstance(msg, ErrorMsg) and msg.code == UNKNOWN_STREAM and not entry.opened.done():
        # no answer to an open: the late answer to the `end` of an earlier, given-up open of this
        # id (after the service had closed it itself, say at a shutdown: see Abandoned)
        return False
    elif isinstance(msg, ErrorMsg) and msg.code == NOT_READY and msg.seq is None and not core.ready:
        # an open (or a resume) refused by an ingest shutting down (a restart, a deploy): it goes
        # where the front door says, which sends no client to such an ingest. While the ingest
        # still owes this connection's other streams their finals, it is asked again later:
        # leaving now would lose those (to be decoded again elsewhere, or never, at a stop).
        if any(e is not entry and e.core.ready for e in streams.values()):
            core.reopen_later(now)
            return False
        raise IngestLost(f"stream {sid}: its ingest process is shutting down")
    elif isinstance(msg, ErrorMsg) and not entry.opened.done():
        del streams[sid]
        entry.opened.set_exception(StreamError(msg.code, msg.message, sid))
    elif isinstance(msg, ErrorMsg) and not core.ready and msg.seq is None and msg.code == BAD_MESSAGE and entry.newer_fields():
        # A service older than `resume_language` or `resume_token` refuses them as unknown fields
        # (`check_open` found the rest of the open well-formed): resumed again at once without
        # those it names (both, if it names neither), its partials then detecting their language
        # until the next final, or admitted as a new stream is. One that knows the other field
        # still gets it.
        carried = entry.newer_fields()
        named = {field for field in carried if repr(field) in msg.message}
        entry.refused |= named or carried
        log.warning("stream %s: resuming without %s, which the service refused (%s)", sid,
                    " and ".join(sorted(named or carried)), msg.message)
        core.reopen_at = now
    elif isinstance(msg, ErrorMsg) and not core.ready and msg.seq is None:
        retry_at = now + core.reopen_s
        if msg.code not in REOPEN_CODES:  # the resumed open was refused for good
            failure = StreamError(msg.code, f"resuming the stream: {msg.message}", sid)
        elif core.resume_by is not None and retry_at > core.resume_by:
            failure = StreamError(LOST, f"resuming the stream: still refused when the resume timeout ran out: "
                                        f"{msg.code}: {msg.message}", sid)
        else:
            core.reopen_later(now)
            return False
        del streams[sid]
        entry.fail(failure, now)
        return True
    elif isinstance(msg, ErrorMsg) and msg.code == UNKNOWN_STREAM and core.ready:
        raise IngestLost(f"stream {sid}: the ingest no longer knows it")
    elif isinstance(msg, ErrorMsg):
        if core.on_error(msg, now):
            entry.events.put_nowait((now, msg))
    elif isinstance(msg, Closed):
        core.on_durable(msg.durable)
        if msg.reason == "shutdown" and not core.complete:
            # a restart or a deploy: what it took is transcribed; the rest goes to another ingest
            raise IngestLost(f"stream {sid}: its ingest process is shutting down")
        del streams[sid]
        core.on_closed(msg)
        entry.failure = StreamError(CLOSED, f"stream closed ({msg.reason})", sid)
        entry.events.put_nowait((now, msg))
        return True
    else:
        if isinstance(msg, (Partial, Final)):
            core.on_result(msg)
        entry.events.put_nowait((now, msg))
    return False


class Liveness:
    """Decides when a silent ingest is dead: it owes an answer (ready, ack) and sent nothing for `interval`.

    The protocol has no ping; ZeroMQ's heartbeats and disconnect events catch a dropped
    connection, this catches an ingest that is connected but no longer answering. An ingest that
    owes nothing (say, decoding the last segment after `end`) may stay silent as long as it likes.
    """

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.heard_at = time.monotonic()

    def heard(self, now: float) -> None:
        self.heard_at = now

    def restart_if_owed_nothing(self, streams: dict[str, Entry], now: float) -> bool:
        """Whether the ingest owes nothing; if so the clock restarts, so that an answer owed from
        now on (to an open about to be sent, say) is timed from now, not from the last message."""
        if any(entry.core.waiting for entry in streams.values()):
            return False
        self.heard_at = now
        return True

    def deadline(self, streams: dict[str, Entry], now: float) -> float | None:
        """When the ingest is due to be declared dead; None while it owes nothing."""
        return None if self.restart_if_owed_nothing(streams, now) else self.heard_at + self.interval


def expire(streams: dict[str, Entry], now: float, message: str) -> bool:
    """Fail with `connection_lost` the streams whose resume made no progress by its deadline; True if any."""
    late = [entry for entry in streams.values() if entry.core.resume_by is not None and now >= entry.core.resume_by]
    for entry in late:
        del streams[entry.core.stream]
        entry.fail(StreamError(LOST, message, entry.core.stream), now)
    return bool(late)


def due(streams: dict[str, Entry]) -> float | None:
    """The earliest time a stream needs the IO side again by itself: a retry or a re-open."""
    times = [t for e in streams.values() for t in (e.core.retry_at, e.core.reopen_at) if t is not None]
    return min(times, default=None)


class StreamBase:
    """What both stream classes offer besides IO: identity, flow-control figures, send times."""

    def __init__(self, entry: Entry, msg: Open) -> None:
        self.id = msg.stream
        self.rate = msg.rate
        self.channels = msg.channels
        self.encoding = msg.encoding
        self.priority = msg.priority
        self.received_at = 0.0  # time.monotonic() when the last event `events` yielded arrived
        self._entry = entry
        self._queued = 0  # input frames handed over for sending
        self._ended = False
        self._over: Closed | Exception | None = None  # how `events` ended: later calls end the same way at once

    def _event(self, at: float, item: ServerMessage | Exception) -> ServerMessage:
        """What `events` does with each item: an exception is raised, and remembered with `closed`."""
        if isinstance(item, Exception):
            self._over = item
            raise item
        if isinstance(item, Closed):
            self._over = item
        self.received_at = at
        return item

    def _events_over(self) -> bool:
        """For `events` called again after it ended: raises its failure again, or True after `closed`."""
        if isinstance(self._over, Exception):
            raise self._over
        return self._over is not None

    @property
    def window(self) -> int:
        """Input frame index the server lets this stream send up to."""
        return self._entry.core.window

    @property
    def accepted(self) -> int:
        """Input frames the server has acknowledged."""
        return self._entry.core.accepted

    @property
    def durable(self) -> int:
        """Input frame index before which every segment has had its final delivered, as the server
        last said: a final still to come starts at or after it (its audio before is never needed)."""
        return self._entry.core.durable

    @property
    def resumes(self) -> list[int]:
        """Input frame offsets this stream was re-opened at after losing its ingest connection."""
        return list(self._entry.core.resumes)

    @property
    def send_times(self) -> list[tuple[int, float]]:
        """(input frame index just past a message, time.monotonic() it was first sent), in send order."""
        return self._entry.core.log.pairs()

    def sent_at(self, seconds: float) -> float:
        """time.monotonic() when the sample at `seconds` of input (or `end`, if earlier) was sent."""
        return self._entry.core.log.sent_at(seconds)

    def latency_for(self, end_seconds: float, now: float | None = None) -> float:
        """Seconds from sending the last sample a result covers (its `end`) to `now` (default: now)."""
        return (time.monotonic() if now is None else now) - self.sent_at(end_seconds)

    def _prepare(self, pcm: bytes | bytearray | memoryview | np.ndarray) -> bytes:
        """Checks shared by both `send`s; the audio as bytes, counted as queued."""
        if self._ended:
            raise StreamError(CLOSED, "send after end", self.id)
        if self._entry.failure is not None:
            raise self._entry.failure
        data = to_pcm(pcm, self.encoding, self.channels)
        self._queued += len(data) // self._entry.core.frame_bytes
        return data
