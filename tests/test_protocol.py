"""The wire protocol codec: round trips, every refusal decode_client can give, and fuzzing."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import messages as m


def pack(header: Any) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


CLIENT_MESSAGES = [
    m.Hello(),
    m.Open(stream="s1"),
    m.Open(stream="s2", rate=48000, encoding="f32le", channels=2, language="de", model="whisper-tiny",
           partials=False, priority="batch", prompt="Glossary: ZeroMQ"),
    m.Open(stream="call-us", rate=8000, encoding="pcm_mulaw"),  # telephony: G.711 as Twilio or Asterisk send it
    m.Open(stream="call-eu", rate=8000, encoding="pcm_alaw", channels=2),
    m.Open(stream="s3", offset=96_000, resume_text="Hoy vamos a la playa.", resume_language="es",
           resume_token="9f86d081884c7d659a2feaa0c55ad015"),  # a resume
    m.Open(stream="s4", wait=300.0),  # held for room up to 5 minutes
    m.Open(stream="s5", wait=m.MAX_OPEN_WAIT_S),
    m.Audio(stream="s1", seq=0, data=b"\x01\x00" * 160),
    m.Audio(stream="s1", seq=2**63 - 1, data=b""),
    m.End(stream="s1"),
    m.Status(),
]

SERVER_MESSAGES = [
    m.Welcome(ingest="tcp://127.0.0.1:7701", limits={"max_frame_bytes": 262144, "max_message_bytes": 1048576}),
    m.Ready(stream="s1", window=960000),
    m.Ready(stream="s2", window=960000, resume_token="9f86d081884c7d659a2feaa0c55ad015"),
    m.Waiting(stream="s4", position=3, code=m.OVERLOADED, message="the service is at its capacity"),
    m.Ack(stream="s1", seq=41, samples=67200, window=1027200),
    m.Partial(stream="s1", seg=0, text="go forward ten", stable="go forward", start=0.31, end=1.47, language="en"),
    m.Final(stream="s1", seg=0, text="go forward ten meters", start=0.31, end=2.47, avg_logprob=-0.21, no_speech_prob=0.01,
            language="en"),
    m.Final(stream="s1", seg=1, text="Go forward ten meters. Then turn left.", start=3.1, end=7.9, language="en",
            parts=[[3.42, 5.2, "Go forward ten meters."], [5.2, 7.9, "Then turn left."]]),
    m.ErrorMsg(code=m.OVERLOADED, message="stream buffer full", stream="s1", seq=42),
    m.ErrorMsg(code=m.NOT_READY, message="no worker is ready yet"),
    m.Closed(stream="s1", reason="idle_timeout", audio_s=12.5, segments=3),
    m.StatusReply(ready=True, ingests=[{"index": 0, "endpoint": "tcp://127.0.0.1:7701", "streams": 2}],
                  workers=[{"id": "w0", "inflight": 1}], queued={"realtime": 0, "batch": 4}, inflight=1, jobs_done=9, expired=0),
]


@pytest.mark.parametrize("msg", CLIENT_MESSAGES, ids=lambda msg: msg.type)
def test_client_messages_round_trip(msg: m.ClientMessage) -> None:
    frames = m.encode(msg)
    assert len(frames) == (2 if isinstance(msg, m.Audio) else 1)
    back = m.decode_client(frames)
    assert type(back) is type(msg)
    assert m.as_dict(back) == m.as_dict(msg)
    if isinstance(msg, m.Audio):
        assert bytes(back.data) == bytes(msg.data)


@pytest.mark.parametrize("msg", SERVER_MESSAGES, ids=lambda msg: msg.type)
def test_server_messages_round_trip(msg: m.ServerMessage) -> None:
    back = m.decode_server(m.encode(msg))
    assert back == msg


def test_audio_payload_is_not_copied_into_the_header() -> None:
    payload = b"\x00\x01" * 4096
    header, data = m.encode(m.Audio(stream="s", seq=3, data=payload))
    assert data is payload
    assert len(header) < 32


def test_server_messages_tolerate_fields_from_a_newer_server() -> None:
    frames = [pack({"type": "ready", "stream": "s", "window": 100, "added_later": [1, 2]})]
    assert m.decode_server(frames) == m.Ready(stream="s", window=100)


def test_a_client_message_names_no_optional_field_it_leaves_at_nil() -> None:
    """A server refuses fields it does not know, a nil one as any other: a client that sent every
    field of its own release, nil or not, had every `open` refused by a server of an earlier one."""
    header = msgpack.unpackb(m.encode(m.Open(stream="s"))[0])
    assert header == {"type": "open", "stream": "s", "rate": 16000, "encoding": "pcm_s16le", "channels": 1,
                      "partials": True, "priority": "realtime", "offset": 0}
    header = msgpack.unpackb(m.encode(m.Open(stream="s", offset=16_000, resume_token="t"))[0])
    assert "resume_token" in header and "resume_language" not in header and "resume_text" not in header


def test_server_messages_larger_than_a_client_header_are_decoded() -> None:
    """The bounds on a client's header guard the server; a client must read what a server sends
    beyond them: a long final in a script of two bytes a letter, the status of a pool of 96
    workers, an error quoting what the client sent."""
    for msg in (m.Final(stream="s", seg=0, text="привет " * 700, start=0.0, end=30.0),
                m.StatusReply(ready=True, workers=[{"name": f"worker-{i}", "jobs": i} for i in range(96)]),
                m.ErrorMsg(code=m.BAD_FORMAT, message="sample rate " + "x" * 4090 + " not supported", stream="s")):
        frames = m.encode(msg)
        with pytest.raises(m.ProtocolError):
            m.decode_client(frames)  # as a client header, each is over the bounds
        assert m.decode_server(frames) == msg


def test_unknown_server_message_type_is_a_protocol_error() -> None:
    with pytest.raises(m.ProtocolError) as err:
        m.decode_server([pack({"type": "telemetry"})])
    assert err.value.code == m.BAD_MESSAGE


def audio(seq: Any = 0, stream: Any = "s", **extra: Any) -> bytes:
    return pack({"type": "audio", "stream": stream, "seq": seq, **extra})


def open_(**fields: Any) -> list[bytes]:
    return [pack({"type": "open", "stream": "s", **fields})]


REFUSALS: list[tuple[str, list[Any], str]] = [
    # framing
    ("no frames", [], m.BAD_MESSAGE),
    ("three frames", [audio(), b"\0\0", b"\0\0"], m.BAD_MESSAGE),
    ("payload on a non-audio message", [pack({"type": "end", "stream": "s"}), b"\0\0"], m.BAD_MESSAGE),
    ("payload on hello", [pack({"type": "hello", "version": 1}), b""], m.BAD_MESSAGE),
    ("audio without its payload frame", [audio()], m.BAD_MESSAGE),
    ("truncated msgpack", [pack({"type": "end", "stream": "s"})[:-2]], m.BAD_MESSAGE),
    ("not msgpack", [b"\xc1"], m.BAD_MESSAGE),
    ("trailing bytes after the map", [pack({"type": "end", "stream": "s"}) + b"\x00"], m.BAD_MESSAGE),
    ("header is a list", [pack(["open", "s"])], m.BAD_MESSAGE),
    ("header is an int", [pack(7)], m.BAD_MESSAGE),
    ("map without type", [pack({"stream": "s"})], m.BAD_MESSAGE),
    ("type is not a string", [pack({"type": 3})], m.BAD_MESSAGE),
    ("unknown type", [pack({"type": "flush", "stream": "s"})], m.BAD_MESSAGE),
    ("server message sent by a client", [pack({"type": "ready", "stream": "s", "window": 1})], m.BAD_MESSAGE),
    ("non-string map key", [pack({"type": "end", "stream": "s", 5: 1})], m.BAD_MESSAGE),
    ("bytes and str keys mixed", [pack({"type": "end", "stream": "s", b"x": 1, "y": 2})], m.BAD_MESSAGE),
    ("oversized string", [pack({"type": "end", "stream": "s" * 5000})], m.BAD_MESSAGE),
    ("ext type", [pack({"type": "end", "stream": msgpack.ExtType(5, b"abcd")})], m.BAD_MESSAGE),
    # fields
    ("unknown field", open_(sample_rate=16000), m.BAD_MESSAGE),
    ("audio samples inside the map", [audio(data=b"\0\0"), b"\0\0"], m.BAD_MESSAGE),
    ("missing stream on end", [pack({"type": "end"})], m.BAD_MESSAGE),
    ("missing stream on open", [pack({"type": "open", "rate": 16000})], m.BAD_MESSAGE),
    ("missing seq", [pack({"type": "audio", "stream": "s"}), b""], m.BAD_MESSAGE),
    ("stream id not a string", [pack({"type": "end", "stream": 12})], m.BAD_MESSAGE),
    ("empty stream id", [pack({"type": "end", "stream": ""})], m.BAD_MESSAGE),
    ("stream id too long", [pack({"type": "end", "stream": "x" * (m.MAX_STREAM_ID + 1)})], m.BAD_MESSAGE),
    ("seq as a string", [audio(seq="1"), b""], m.BAD_MESSAGE),
    ("seq as a float", [audio(seq=1.0), b""], m.BAD_MESSAGE),
    ("seq as a bool", [audio(seq=True), b""], m.BAD_MESSAGE),
    ("negative seq", [audio(seq=-1), b""], m.BAD_MESSAGE),
    ("huge seq", [audio(seq=2**63), b""], m.BAD_MESSAGE),
    ("hello version as a string", [pack({"type": "hello", "version": "1"})], m.BAD_MESSAGE),
    ("partials not a bool", open_(partials=1), m.BAD_MESSAGE),
    ("unknown priority", open_(priority="urgent"), m.BAD_MESSAGE),
    ("language not a string", open_(language=7), m.BAD_MESSAGE),
    ("language too long", open_(language="x" * 17), m.BAD_MESSAGE),
    ("model not a string", open_(model=["tiny"]), m.BAD_MESSAGE),
    ("prompt too long", open_(prompt="p" * (m.MAX_PROMPT_CHARS + 1)), m.BAD_MESSAGE),
    ("resume_language not a string", open_(resume_language=["es"]), m.BAD_MESSAGE),
    ("resume_language too long", open_(resume_language="x" * 17), m.BAD_MESSAGE),
    ("wait negative", open_(wait=-1), m.BAD_MESSAGE),
    ("wait over an hour", open_(wait=m.MAX_OPEN_WAIT_S + 0.5), m.BAD_MESSAGE),
    ("wait not a number", open_(wait="60"), m.BAD_MESSAGE),
    ("wait as a bool", open_(wait=True), m.BAD_MESSAGE),
    ("wait not a number at all", open_(wait=float("nan")), m.BAD_MESSAGE),
    ("wait infinite", open_(wait=float("inf")), m.BAD_MESSAGE),
    # versions and formats
    ("newer protocol version", [pack({"type": "hello", "version": 2})], m.UNSUPPORTED_VERSION),
    ("unsupported rate", open_(rate=11025), m.BAD_FORMAT),
    ("rate as a string", open_(rate="16000"), m.BAD_FORMAT),
    ("rate as a float", open_(rate=16000.0), m.BAD_FORMAT),
    ("unsupported encoding", open_(encoding="mp3"), m.BAD_FORMAT),
    ("no channels", open_(channels=0), m.BAD_FORMAT),
    ("too many channels", open_(channels=9), m.BAD_FORMAT),
    ("channels as a bool", open_(channels=True), m.BAD_FORMAT),
    # sizes
    ("oversized audio frame", [audio(seq=4), b"\0" * (m.Limits().max_frame_bytes + 2)], m.FRAME_TOO_LARGE),
    ("oversized header", [b"\0" * (m.Limits().max_message_bytes + 1)], m.FRAME_TOO_LARGE),
]


@pytest.mark.parametrize("frames, code", [(f, c) for _, f, c in REFUSALS], ids=[name for name, _, _ in REFUSALS])
def test_decode_client_refuses(frames: list[Any], code: str) -> None:
    with pytest.raises(m.ProtocolError) as err:
        m.decode_client(frames)
    assert err.value.code == code
    reply = err.value.reply()
    assert isinstance(reply, m.ErrorMsg) and reply.code == code
    assert m.decode_server(m.encode(reply)) == reply


def test_refusals_name_the_stream_and_seq_they_concern() -> None:
    with pytest.raises(m.ProtocolError) as err:
        m.decode_client([audio(seq=4, stream="abc"), b"\0" * (m.Limits().max_frame_bytes + 2)])
    assert (err.value.stream, err.value.seq) == ("abc", 4)
    with pytest.raises(m.ProtocolError) as err:
        m.decode_client(open_(rate=11025))
    assert err.value.stream == "s"
    for bad in ("", "x" * 65):  # an id the server refuses is not echoed back as if it named a stream
        with pytest.raises(m.ProtocolError) as err:
            m.decode_client([pack({"type": "end", "stream": bad, "unknown": 1})])
        assert err.value.stream is None


def test_an_unsupported_encoding_is_refused_naming_those_taken() -> None:
    with pytest.raises(m.ProtocolError) as err:
        m.decode_client(open_(encoding="ulaw"))
    assert (err.value.code, err.value.stream) == (m.BAD_FORMAT, "s")
    assert err.value.message == "encoding 'ulaw' not supported; use one of ['pcm_s16le', 'f32le', 'pcm_mulaw', 'pcm_alaw']"


def test_frame_limits_come_from_the_receiver() -> None:
    small = m.Limits(max_frame_bytes=64, max_message_bytes=1024)
    assert m.decode_client([audio(), b"\0" * 64], small).seq == 0
    with pytest.raises(m.ProtocolError) as err:
        m.decode_client([audio(), b"\0" * 66], small)
    assert err.value.code == m.FRAME_TOO_LARGE


def test_memoryview_frames_are_accepted() -> None:
    msg = m.decode_client([memoryview(audio(seq=9)), memoryview(b"\1\0\2\0")])
    assert isinstance(msg, m.Audio) and msg.seq == 9 and bytes(msg.data) == b"\1\0\2\0"


# ---------------------------------------------------------------- fuzzing

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1), st.floats(allow_nan=True),
    st.text(max_size=80), st.binary(max_size=80),
)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
                      max_leaves=20)
field_names = st.sampled_from(["type", "stream", "seq", "rate", "encoding", "channels", "language", "model",
                               "partials", "priority", "prompt", "offset", "resume_text", "resume_language", "wait", "version",
                               "data", "window", "x"])
message_types = st.sampled_from(["hello", "open", "audio", "end", "status", "ready", "waiting", "bogus"])


def refused_or_parsed(frames: list[bytes]) -> None:
    try:
        msg = m.decode_client(frames)
    except m.ProtocolError as exc:
        assert exc.code in {m.BAD_MESSAGE, m.UNSUPPORTED_VERSION, m.BAD_FORMAT, m.FRAME_TOO_LARGE}
        assert isinstance(exc.message, str)
        return
    assert isinstance(msg, (m.Hello, m.Open, m.Audio, m.End, m.Status))


@settings(max_examples=400, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=4))
def test_fuzz_random_bytes(frames: list[bytes]) -> None:
    refused_or_parsed(frames)


@settings(max_examples=600, deadline=None)
@given(message_types, st.dictionaries(field_names, values, max_size=8), st.lists(st.binary(max_size=64), max_size=2))
def test_fuzz_random_maps(kind: str, fields: dict[str, Any], payload: list[bytes]) -> None:
    refused_or_parsed([pack({**fields, "type": kind}), *payload])


@settings(max_examples=300, deadline=None)
@given(values, st.lists(st.binary(max_size=16), max_size=2))
def test_fuzz_random_values(header: Any, payload: list[bytes]) -> None:
    refused_or_parsed([pack(header), *payload])
