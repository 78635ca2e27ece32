"""The client wire protocol (version 1): msgpack maps over ZeroMQ, audio in its own frame.

A message is one ZeroMQ multipart message: frame 0 is a msgpack map with a "type" key; an
`audio` message carries its samples in frame 1 as raw bytes, so neither side ever copies
audio through msgpack. docs/PROTOCOL.md is the human-readable form of this module.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, Sequence

import msgpack

VERSION = 1
RATES = (8000, 16000, 22050, 44100, 48000)
MAX_CHANNELS = 8
# Bytes per sample of each `open.encoding`. pcm_mulaw and pcm_alaw are G.711 (one byte per
# sample), what telephony sends (Twilio Media Streams, Asterisk and FreeSWITCH `ulaw`/`alaw`),
# taken as it arrives; named as FFmpeg names the codecs, and as other streaming ASR APIs do.
SAMPLE_BYTES = {"pcm_s16le": 2, "f32le": 4, "pcm_mulaw": 1, "pcm_alaw": 1}
ENCODINGS = tuple(SAMPLE_BYTES)
# libsndfile's subtype for each G.711 encoding: the ingest decodes, the client encodes, and headerless files are read through it
G711_SUBTYPES = {"pcm_mulaw": "ULAW", "pcm_alaw": "ALAW"}
PRIORITIES = ("realtime", "batch")
MAX_STREAM_ID = 64
MAX_PROMPT_CHARS = 1000
MAX_OFFSET = 2**48  # input frames: years of audio at 48 kHz
MAX_RESUME_TOKEN = 64
MAX_OPEN_WAIT_S = 3600  # the longest an open may ask to be held for room: an hour
# Largest f32le sample magnitude taken (full scale is ±1; NaN and infinity are refused too,
# bad_format). The bound leaves room for overshoot and rules out overflow in the ingest's channel
# mix-down and resampler, which a merely finite check does not (two samples near float32's
# max sum to infinity).
MAX_F32_SAMPLE = 16.0
# ZMTP heartbeats the server's client-facing sockets (front door, ingest) send: a client whose
# host vanished (powered off, its network cut, a NAT that forgot the connection) sends no FIN,
# and a connection the server has nothing to send on would otherwise be held for ever, its file
# descriptor with it. One that answers a ping with nothing for the timeout is closed. ZeroMQ
# answers pings on its own thread, so a busy client is not taken for gone.
CLIENT_HEARTBEAT_MS = 5_000
CLIENT_HEARTBEAT_TIMEOUT_MS = 30_000

# error codes (ErrorMsg.code)
BAD_MESSAGE = "bad_message"  # not msgpack, not a map, unknown type, wrong field types
UNSUPPORTED_VERSION = "unsupported_version"
BAD_FORMAT = "bad_format"  # sample rate, encoding or channels not supported, or audio bytes not whole frames
FRAME_TOO_LARGE = "frame_too_large"
UNKNOWN_STREAM = "unknown_stream"
DUPLICATE_STREAM = "duplicate_stream"
OUT_OF_ORDER = "out_of_order"  # an audio seq that is not the next expected one
TOO_MANY_STREAMS = "too_many_streams"
OVERLOADED = "overloaded"  # audio refused: the stream's buffer is full, resend later; or a realtime open refused: the service is past its capacity
UNKNOWN_MODEL = "unknown_model"
UNKNOWN_LANGUAGE = "unknown_language"  # an open's language is not one the served model transcribes
NOT_READY = "not_ready"
UNAUTHORIZED = "unauthorized"
INTERNAL = "internal"


class ProtocolError(Exception):
    """A message the receiver refuses; carries what the error reply needs."""

    def __init__(self, code: str, message: str, stream: str | None = None, seq: int | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.stream = stream
        self.seq = seq

    def reply(self) -> "ErrorMsg":
        return ErrorMsg(code=self.code, message=self.message, stream=self.stream, seq=self.seq)


@dataclass(slots=True)
class Limits:
    max_frame_bytes: int = 262_144
    max_message_bytes: int = 1_048_576
    max_streams_per_client: int = 64  # open streams one ingest connection may have (a client's, from the welcome)


# ---------------------------------------------------------------- client -> server


@dataclass(slots=True)
class Hello:
    type: ClassVar[str] = "hello"
    version: int = VERSION


@dataclass(slots=True)
class Open:
    type: ClassVar[str] = "open"
    stream: str
    rate: int = 16000
    encoding: str = "pcm_s16le"
    channels: int = 1
    language: str | None = None
    model: str | None = None
    partials: bool = True
    priority: str = "realtime"
    prompt: str | None = None
    # Resuming after a lost connection: the input frame index this stream's first audio frame
    # has in the original stream (the last `durable` the client saw), so times continue, and
    # the text of the last final received, which prompts the next decode as it would have, and
    # the language it was heard in, which the partials are decoded in until the next final.
    offset: int = 0
    resume_text: str | None = None
    resume_language: str | None = None
    # the `resume_token` of the stream's last `ready`: it shows the stream was admitted before, so
    # the resume is held to twice the admission limits, not refused as a new stream would be
    resume_token: str | None = None
    # seconds the ingest may hold the open while the service has no room for it, first come first
    # served, before refusing it (nil or 0: refused at once)
    wait: float | None = None


@dataclass(slots=True)
class Audio:
    type: ClassVar[str] = "audio"
    stream: str
    seq: int
    data: bytes | memoryview = b""  # travels as frame 1, not inside the map


@dataclass(slots=True)
class End:
    type: ClassVar[str] = "end"
    stream: str


@dataclass(slots=True)
class Status:
    """Ops query on the front door; answered with a StatusReply."""

    type: ClassVar[str] = "status"


# ---------------------------------------------------------------- server -> client


@dataclass(slots=True)
class Welcome:
    type: ClassVar[str] = "welcome"
    ingest: str  # endpoint of the ingest process this client should stream to
    version: int = VERSION
    limits: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class Ready:
    type: ClassVar[str] = "ready"
    stream: str
    window: int  # the client may send input frames (per channel) up to this index before the next ack
    resume_token: str | None = None  # a realtime stream's: sent back in the `open` that resumes it


@dataclass(slots=True)
class Waiting:
    """An open the ingest holds for room (`open.wait`): at once, then every few seconds until its
    `ready` or its refusal."""

    type: ClassVar[str] = "waiting"
    stream: str
    position: int  # 1: the next open this ingest admits, when room frees
    code: str  # what it would be refused with now: overloaded or too_many_streams
    message: str  # and why


@dataclass(slots=True)
class Ack:
    type: ClassVar[str] = "ack"
    stream: str
    seq: int  # last accepted audio seq
    samples: int  # input frames accepted so far (from 0 of the original stream: offset included)
    window: int
    durable: int = 0  # audio before this input frame is never needed again: a resuming client keeps only what follows


@dataclass(slots=True)
class Partial:
    type: ClassVar[str] = "partial"
    stream: str
    seg: int
    text: str
    stable: str  # committed prefix of text: later partials and the final keep it
    start: float  # seconds from stream start
    end: float  # last second of audio this partial covers
    language: str | None = None  # the language it was decoded in (the model's code)


@dataclass(slots=True)
class Final:
    type: ClassVar[str] = "final"
    stream: str
    seg: int
    text: str
    start: float
    end: float
    avg_logprob: float = 0.0
    no_speech_prob: float = 0.0
    durable: int = 0  # as in Ack, once this final is out: resuming from here never repeats it
    revised: bool = False  # the text changed words a partial marked `stable` (case, punctuation, digits aside)
    language: str | None = None  # the language it was decoded in: the stream's, or the one detected (the model's code)
    # Whisper's own segments of the text, [start, end, text] each in the stream's seconds: a long
    # final's phrases timed by the model (a caption's cues); nil when the text is not its decode's
    parts: list[list[Any]] | None = None
    # its words, [start, end, word] each in the stream's seconds, a word with the space before it
    # (joined, they are the text): timed by the model's alignment heads; nil as `parts`, or when
    # the service does not time words
    words: list[list[Any]] | None = None


@dataclass(slots=True)
class ErrorMsg:
    type: ClassVar[str] = "error"
    code: str
    message: str
    stream: str | None = None
    seq: int | None = None


@dataclass(slots=True)
class Closed:
    type: ClassVar[str] = "closed"
    stream: str
    reason: str = "end"  # end | idle_timeout | shutdown
    audio_s: float = 0.0
    segments: int = 0
    durable: int = 0  # as in Ack: all the audio taken when every final was out; less when some never will be


@dataclass(slots=True)
class StatusReply:
    type: ClassVar[str] = "status"
    ready: bool
    ingests: list[dict[str, Any]] = field(default_factory=list)
    workers: list[dict[str, Any]] = field(default_factory=list)
    queued: dict[str, int] = field(default_factory=dict)
    inflight: int = 0
    jobs_done: int = 0
    expired: int = 0
    load: float = 0.0  # seconds realtime jobs wait for a model (smoothed): an admission figure
    busy: float = 0.0  # share of the workers' time realtime decodes take (smoothed)
    stream_share: float = 0.0  # the share one speaking realtime stream asks for: the other admission figure
    stream_share_prior: float = 0.0  # the same from the workers' start-up decodes: a floor until measured with the workers busy
    realtime: int = 0  # realtime streams open over the service, as of each ingest's last heartbeat
    realtime_cap: int = 0  # ingest.admit_max_realtime_streams (0: no cap)


ClientMessage = Hello | Open | Audio | End | Status
ServerMessage = Welcome | Ready | Waiting | Ack | Partial | Final | ErrorMsg | Closed | StatusReply
_CLIENT = {cls.type: cls for cls in (Hello, Open, Audio, End, Status)}
_SERVER = {cls.type: cls for cls in (Welcome, Ready, Waiting, Ack, Partial, Final, ErrorMsg, Closed, StatusReply)}
# The header fields of each message (audio samples travel in frame 1, never in the map), and the
# encoder's field names: both looked up per message, so computed once.
_KNOWN = {cls: frozenset(f.name for f in fields(cls)) - {"data"} for cls in (*_CLIENT.values(), *_SERVER.values())}
_NAMES = {cls: tuple(f.name for f in fields(cls) if f.name != "data") for cls in _KNOWN}
# Optional fields whose default is nil are left out at nil: a server refuses fields it does not
# know, so a client must not send a field newer than its server unless it is used.
_NIL_DEFAULT = {cls: frozenset(f.name for f in fields(cls) if f.default is None) for cls in _KNOWN}

_packer = msgpack.Packer(use_bin_type=True)


def encode(msg: ClientMessage | ServerMessage) -> list[bytes | memoryview]:
    """Frames for `msg`: the msgpack header, plus the audio frame for Audio."""
    header = {"type": msg.type}
    optional = _NIL_DEFAULT[type(msg)]
    for name in _NAMES[type(msg)]:
        value = getattr(msg, name)
        if value is not None or name not in optional:
            header[name] = value
    frames: list[bytes | memoryview] = [_packer.pack(header)]
    if isinstance(msg, Audio):
        frames.append(msg.data)
    return frames


# A client's header is small: these bound what a hostile one can make the server allocate.
CLIENT_HEADER_LIMITS = {"max_str_len": 4096, "max_bin_len": 1024, "max_array_len": 64, "max_map_len": 32, "max_ext_len": 0}


def _unpack_header(frame: bytes | memoryview, bounds: dict[str, int]) -> dict[str, Any]:
    try:
        header = msgpack.unpackb(frame, raw=False, strict_map_key=True, **bounds)
    except Exception as exc:  # msgpack raises several types for corrupt input
        raise ProtocolError(BAD_MESSAGE, f"header is not valid msgpack: {type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise ProtocolError(BAD_MESSAGE, "header must be a map with a string 'type'")
    return header


# What an error quotes of a client's value or field names. A refusal quoting whole 4096-byte
# strings (31 unknown fields of them, say) is ~130 kB, and a client that sends such messages
# without reading the answers has the ingest hold ingest.server.CLIENT_QUEUE of them: gigabytes.
QUOTE_CHARS = 40
QUOTE_NAMES = 4


def _quote(value: Any) -> str:
    """`value`'s repr, cut to QUOTE_CHARS characters."""
    text = repr(value)
    return text if len(text) <= QUOTE_CHARS else text[:QUOTE_CHARS] + "..."


def _quote_names(names: set[str | bytes]) -> str:
    """The first QUOTE_NAMES of `names` (map keys: str or bytes), quoted, and how many more there are."""
    shown = sorted(map(_quote, names))[:QUOTE_NAMES]
    more = f" and {len(names) - len(shown)} more" if len(names) > len(shown) else ""
    return ", ".join(shown) + more


def _build(cls: type, header: dict[str, Any], strict: bool = True) -> Any:
    """`strict` refuses unknown fields (server side); clients drop them, so servers may add fields within a version."""
    known = _KNOWN[cls]
    kwargs = {k: v for k, v in header.items() if k != "type" and k in known}
    unknown = set(header) - known - {"type"}
    stream = header.get("stream")
    stream = stream if isinstance(stream, str) and 0 < len(stream) <= MAX_STREAM_ID else None  # a bad id is not echoed
    if unknown and strict:
        raise ProtocolError(BAD_MESSAGE, f"{cls.type}: unknown fields {_quote_names(unknown)}", stream)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ProtocolError(BAD_MESSAGE, f"{cls.type}: {exc}", stream) from None


def _check(cond: bool, code: str, message: str, stream: str | None = None, seq: int | None = None) -> None:
    if not cond:
        raise ProtocolError(code, message, stream, seq)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _optional_str(v: Any, limit: int) -> bool:
    return v is None or (isinstance(v, str) and len(v) <= limit)


def decode_client(frames: Sequence[bytes | memoryview], limits: Limits = Limits()) -> ClientMessage:
    """Parse and validate one client message; raises ProtocolError with the code to answer."""
    if not frames or len(frames) > 2:
        raise ProtocolError(BAD_MESSAGE, f"expected 1 or 2 frames, got {len(frames)}")
    if len(frames[0]) > limits.max_message_bytes:
        raise ProtocolError(FRAME_TOO_LARGE, f"header of {len(frames[0])} bytes exceeds {limits.max_message_bytes}")
    header = _unpack_header(frames[0], CLIENT_HEADER_LIMITS)
    cls = _CLIENT.get(header["type"])
    if cls is None:
        raise ProtocolError(BAD_MESSAGE, f"unknown message type {header['type'][:40]!r}")
    if cls is not Audio and len(frames) != 1:
        raise ProtocolError(BAD_MESSAGE, f"{cls.type} takes no payload frame")
    msg = _build(cls, header)
    if isinstance(msg, Hello):
        _check(_is_int(msg.version), BAD_MESSAGE, "hello: version must be an integer")
        _check(msg.version == VERSION, UNSUPPORTED_VERSION, f"protocol version {msg.version} not supported (server speaks {VERSION})")
        return msg
    if isinstance(msg, Status):
        return msg
    sid = msg.stream
    _check(isinstance(sid, str) and 0 < len(sid) <= MAX_STREAM_ID, BAD_MESSAGE, f"stream id must be a string of 1..{MAX_STREAM_ID} characters")
    if isinstance(msg, Open):
        _check(_is_int(msg.rate) and msg.rate in RATES, BAD_FORMAT, f"sample rate {_quote(msg.rate)} not supported; use one of {list(RATES)}", sid)
        _check(msg.encoding in ENCODINGS, BAD_FORMAT, f"encoding {_quote(msg.encoding)} not supported; use one of {list(ENCODINGS)}", sid)
        _check(_is_int(msg.channels) and 1 <= msg.channels <= MAX_CHANNELS, BAD_FORMAT,
               f"channels {_quote(msg.channels)} not supported (1..{MAX_CHANNELS})", sid)
        _check(msg.priority in PRIORITIES, BAD_MESSAGE, f"priority must be one of {list(PRIORITIES)}", sid)
        _check(isinstance(msg.partials, bool), BAD_MESSAGE, "partials must be a boolean", sid)
        _check(_optional_str(msg.language, 16), BAD_MESSAGE, "language must be a language code or nil", sid)
        _check(_optional_str(msg.model, 256), BAD_MESSAGE, "model must be a string or nil", sid)
        _check(_optional_str(msg.prompt, MAX_PROMPT_CHARS), BAD_MESSAGE, f"prompt must be a string of at most {MAX_PROMPT_CHARS} characters", sid)
        _check(_is_int(msg.offset) and 0 <= msg.offset < MAX_OFFSET, BAD_MESSAGE, f"offset must be an integer in 0..{MAX_OFFSET - 1}", sid)
        _check(_optional_str(msg.resume_text, MAX_PROMPT_CHARS), BAD_MESSAGE, f"resume_text must be a string of at most {MAX_PROMPT_CHARS} characters", sid)
        _check(_optional_str(msg.resume_language, 16), BAD_MESSAGE, "resume_language must be a language code or nil", sid)
        _check(_optional_str(msg.resume_token, MAX_RESUME_TOKEN), BAD_MESSAGE,
               f"resume_token must be a string of at most {MAX_RESUME_TOKEN} characters or nil", sid)
        _check(msg.wait is None or (isinstance(msg.wait, (int, float)) and not isinstance(msg.wait, bool)
                                    and 0 <= msg.wait <= MAX_OPEN_WAIT_S), BAD_MESSAGE,
               f"wait must be a number of seconds in 0..{MAX_OPEN_WAIT_S} or nil", sid)
    elif isinstance(msg, Audio):
        _check(_is_int(msg.seq) and 0 <= msg.seq < 2**63, BAD_MESSAGE, "audio: seq must be a non-negative integer", sid)
        _check(len(frames) == 2, BAD_MESSAGE, "audio: the samples must follow in frame 1", sid, msg.seq)
        payload = frames[1]
        size = len(payload)
        _check(size <= limits.max_frame_bytes, FRAME_TOO_LARGE, f"audio frame of {size} bytes exceeds {limits.max_frame_bytes}", sid, msg.seq)
        msg.data = payload
    return msg


def decode_server(frames: Sequence[bytes | memoryview]) -> ServerMessage:
    """Parse a server message (client side). The server is trusted, so only the shape is checked,
    and none of the client headers' bounds apply: a long final's text, a status of a pool of
    many workers, an error quoting what a client sent are all larger."""
    header = _unpack_header(frames[0], {})
    cls = _SERVER.get(header["type"])
    if cls is None:
        raise ProtocolError(BAD_MESSAGE, f"unknown server message type {header['type']!r}")
    return _build(cls, header, strict=False)


def as_dict(msg: ClientMessage | ServerMessage) -> dict[str, Any]:
    out = {"type": msg.type}
    out.update(asdict(msg))
    out.pop("data", None)
    return out
