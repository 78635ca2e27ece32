"""The clients against the real service: streaming, flow control, refusals, the transcribe command."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import CancelledError
from pathlib import Path
from typing import Any, Callable

import msgpack
import numpy as np
import pytest
import soundfile
import soxr
import zmq

from client import AsyncClient, Client, StreamError, status
from client.client import ingest_socket
from client.core import CLOSED, LOST
from config import settings
from conftest import ROOT
from protocol.messages import (
    BAD_FORMAT,
    BAD_MESSAGE,
    INTERNAL,
    OVERLOADED,
    TOO_MANY_STREAMS,
    UNKNOWN_MODEL,
    UNKNOWN_STREAM,
    Ack,
    Audio,
    Closed,
    End,
    ErrorMsg,
    Final,
    Hello,
    Open,
    Partial,
    Ready,
    ServerMessage,
    Welcome,
    decode_client,
    encode,
)
from speech.audio import load_audio
from streamasr import remote, testdata
from streamasr.service import free_ports, processes

RATE = 16000
NEWER_OPEN_FIELDS = {"resume_language", "resume_token"}  # fields of `open` a service of an older release does not know


def utterance(name: str) -> testdata.Utterance:
    found = [u for u in testdata.utterances() if u.name == name]
    assert found, f"dev-set utterance {name} missing (install pocketsphinx-testdata or set ${testdata.DATA_ENV})"
    return found[0]


def goforward() -> np.ndarray:
    return np.fromfile(utterance("goforward").path, dtype="<i2")


def speech_with_pauses(repeats: int) -> np.ndarray:
    """Several utterances separated by a second of silence, so segments end and the ring drains."""
    gap = np.zeros(RATE, np.int16)
    return np.concatenate([part for _ in range(repeats) for part in (goforward(), gap)])


def drain(stream, timeout: float = 60.0) -> list:
    return list(stream.events(timeout=timeout))


def test_one_file_streams_partials_and_finals(service) -> None:
    pcm = goforward()
    with Client(service.address) as client:
        stream = client.open(language="en")
        for start in range(0, len(pcm), 1600):  # 100 ms frames, as fast as a realtime stream may
            stream.send(pcm[start : start + 1600])
        stream.end()
        events = drain(stream)
    finals = [e for e in events if isinstance(e, Final)]
    partials = [e for e in events if isinstance(e, Partial)]
    closed = events[-1]
    assert isinstance(closed, Closed) and closed.reason == "end"
    assert closed.audio_s == pytest.approx(len(pcm) / RATE, abs=0.01)
    assert closed.segments == len(finals) >= 1
    text = " ".join(f.text for f in finals).lower()
    assert "forward" in text and "meters" in text.replace("metres", "meters")
    for ev in partials + finals:
        assert 0 <= ev.start <= ev.end <= closed.audio_s + 0.5
        assert ev.text.startswith(ev.stable) if isinstance(ev, Partial) else True
        assert 0 <= stream.latency_for(ev.end, now=stream.received_at) < 30
    assert [f.seg for f in finals] == sorted(f.seg for f in finals)
    ends = [end for end, _ in stream.send_times]
    assert ends == sorted(ends) and ends[-1] == len(pcm)


def test_a_client_given_several_front_doors_passes_over_one_that_is_silent(service) -> None:
    """A front door that does not answer (its host down) is passed over for the next one given,
    comma-separated or as a list, by either client, and the stream is served there; given alone,
    it fails the client's start, as before."""
    silent = f"tcp://127.0.0.1:{free_ports(1)}"
    with Client(f"{silent}, {service.address}") as client:
        assert client.address == service.address
        stream = client.open(language="en")
        pcm = goforward()
        for start in range(0, len(pcm), 1600):
            stream.send(pcm[start : start + 1600])
        stream.end()
        assert "forward" in " ".join(e.text for e in drain(stream) if isinstance(e, Final)).lower()

    async def main() -> str:
        async with AsyncClient([silent, service.address]) as aclient:
            return aclient.address

    assert asyncio.run(main()) == service.address
    with pytest.raises(TimeoutError, match=f"no answer from {silent}"):
        Client(silent, timeout=1.0)


@pytest.mark.parametrize(("rate", "encoding", "channels"), [(8000, "pcm_s16le", 1), (44100, "f32le", 1), (48000, "pcm_s16le", 2)])
def test_other_rates_are_resampled_frame_by_frame(service, rate: int, encoding: str, channels: int) -> None:
    """Telephone audio at 8 kHz, a browser's 44.1 kHz float and a 48 kHz stereo recording with
    the speech on one side: mixed down and resampled at the ingest, one 20 ms frame at a time,
    into the same words, timed in seconds of the stream."""
    import soxr

    audio = soxr.resample(goforward().astype(np.float32) / 32768, RATE, rate)
    if channels == 2:
        audio = np.stack([audio, np.zeros_like(audio)], axis=1)
    pcm = np.clip(np.round(audio * 32768), -32768, 32767).astype("<i2") if encoding == "pcm_s16le" else audio.astype("<f4")
    frame = rate // 50
    with Client(service.address) as client:
        stream = client.open(rate=rate, encoding=encoding, channels=channels, language="en")
        for start in range(0, len(pcm), frame):
            stream.send(pcm[start : start + frame])
        stream.end()
        events = drain(stream)
    finals = [e for e in events if isinstance(e, Final)]
    closed = events[-1]
    assert isinstance(closed, Closed) and closed.reason == "end"
    assert closed.audio_s == pytest.approx(len(pcm) / rate, abs=0.01)
    text = " ".join(f.text for f in finals).lower()
    assert "forward" in text and "meters" in text.replace("metres", "meters")
    assert finals and all(0 <= f.start <= f.end <= closed.audio_s + 0.5 for f in finals)


def test_telephony_audio_is_transcribed_as_16_bit_audio_is(service) -> None:
    """A call as a telephony platform delivers it: 8 kHz G.711 bytes (mu-law, and A-law), 20 ms a
    message, sent as they came. The same words as the same call sent as 16-bit PCM, at the same
    times, and every byte counted as one sample: in acks, `durable` and the stream's length."""
    u = utterance("librivox/sense_and_sensibility_01_austen_64kb-0890")
    audio, rate = soundfile.read(u.path, dtype="float32")
    s16 = np.clip(np.round(soxr.resample(audio, rate, 8000) * 32768), -32768, 32767).astype("<i2")
    sent = {"pcm_s16le": s16.tobytes()}
    for encoding, subtype in (("pcm_mulaw", "ULAW"), ("pcm_alaw", "ALAW")):
        buf = io.BytesIO()
        soundfile.write(buf, s16, 8000, format="RAW", subtype=subtype)
        sent[encoding] = buf.getvalue()
    duration = len(s16) / 8000
    finals: dict[str, list[Final]] = {}
    with Client(service.address) as client:
        for encoding, data in sent.items():
            step = 160 * len(data) // len(s16)  # 20 ms
            stream = client.open(rate=8000, encoding=encoding, language="en", partials=False)
            for start in range(0, len(data), step):
                stream.send(data[start : start + step])
            stream.end()
            events = drain(stream)
            closed = events[-1]
            assert isinstance(closed, Closed) and closed.reason == "end", (encoding, closed)
            assert closed.audio_s == pytest.approx(duration, abs=0.01), encoding
            assert stream.accepted == len(s16), encoding  # the last ack's samples: input samples, not bytes
            finals[encoding] = [e for e in events if isinstance(e, Final)]
            assert finals[encoding] and 0 < finals[encoding][-1].durable <= len(s16), encoding
    texts = {encoding: " ".join(f.text for f in fs) for encoding, fs in finals.items()}
    reference = finals.pop("pcm_s16le")
    for encoding, fs in finals.items():
        assert testdata.wer([texts["pcm_s16le"]], [texts[encoding]]) <= 0.15, texts
        assert fs[-1].end == pytest.approx(reference[-1].end, abs=0.1), (encoding, fs[-1], reference[-1])
        assert fs[0].start == pytest.approx(reference[0].start, abs=0.1), (encoding, fs[0], reference[0])
        assert duration - 1.0 < fs[-1].end <= duration + 0.05, (encoding, fs[-1], duration)
        assert abs(fs[-1].durable - reference[-1].durable) <= 160, (encoding, fs[-1], reference[-1])


def test_transcribe_takes_headerless_g711_recordings(service, tmp_path: Path) -> None:
    """A call recorded as Asterisk and SoX write it: headerless G.711, 8 kHz mono (`.ulaw`, `.al`;
    libsndfile cannot tell such a file from any other bytes). `transcribe` streams it, and
    `--local` reads it, as the same call in a WAV file: the same length, the same words."""
    u = utterance("librivox/sense_and_sensibility_01_austen_64kb-0890")
    audio, rate = soundfile.read(u.path, dtype="float32")
    s16 = np.clip(np.round(soxr.resample(audio, rate, 8000) * 32768), -32768, 32767).astype("<i2")
    wav = tmp_path / "call.wav"
    soundfile.write(wav, s16, 8000, subtype="PCM_16")
    recordings = {tmp_path / "call.ulaw": "ULAW", tmp_path / "call.al": "ALAW"}
    for path, subtype in recordings.items():
        soundfile.write(path, s16, 8000, format="RAW", subtype=subtype)
    out = io.StringIO()
    assert remote.run([str(wav), *map(str, recordings)], service.address, offline=True, as_json=True, language=None,
                      out=out) == 0
    summaries = {line["file"]: line for line in map(json.loads, out.getvalue().splitlines()) if line["type"] == "summary"}
    said = summaries[str(wav)]["text"]
    assert testdata.wer([u.reference], [said]) <= 0.3, said
    for path in recordings:
        summary = summaries[str(path)]
        assert summary["audio_s"] == pytest.approx(len(s16) / 8000, abs=0.01), summary
        assert testdata.wer([said], [summary["text"]]) <= 0.15, (said, summary)
        local = load_audio(path)  # what `transcribe --local` decodes
        assert len(local) == len(load_audio(wav)) and np.corrcoef(local, load_audio(wav))[0, 1] > 0.99, path


def test_many_streams_share_one_client(null_service) -> None:
    pcm = goforward()
    with Client(null_service.address) as client:
        streams = [client.open(partials=False) for _ in range(6)]
        assert len({s.id for s in streams}) == 6
        for s in streams:
            s.send(pcm)
            s.end()
        results = [drain(s) for s in streams]
        # nothing more comes after `closed`: asking again ends at once instead of waiting out the timeout
        assert list(streams[0].events(timeout=5)) == []
    for events in results:
        assert isinstance(events[-1], Closed) and events[-1].reason == "end"
        assert events[-1].audio_s == pytest.approx(len(pcm) / RATE, abs=0.01)
        assert not any(isinstance(e, Partial) for e in events)


def test_formats_are_converted_to_the_opened_encoding(null_service) -> None:
    pcm = goforward()
    stereo = np.stack([pcm, pcm], axis=1).astype(np.float32) / 32768
    with Client(null_service.address) as client:
        stream = client.open(rate=16000, encoding="f32le", channels=2)
        stream.send(stereo)
        stream.end()
        closed = drain(stream)[-1]
    assert isinstance(closed, Closed) and closed.audio_s == pytest.approx(len(pcm) / RATE, abs=0.01)


def test_float_audio_the_server_would_refuse_is_refused_at_send_and_the_stream_carries_on(null_service) -> None:
    """One f32le message with a NaN (a glitch upstream) refused by the server would make it refuse every
    later message `out_of_order`, for good: the client refuses it at `send` and the stream takes the rest."""
    good = np.zeros(RATE // 10, np.float32)
    glitch = good.copy()
    glitch[7] = np.nan
    with Client(null_service.address) as client:
        stream = client.open(encoding="f32le", partials=False)
        stream.send(good)
        for bad in (glitch, np.full(4, 17.0, np.float32).tobytes(), np.full(4, np.inf, np.float32)):
            with pytest.raises(ValueError):
                stream.send(bad)
        for _ in range(5):
            stream.send(good)
        stream.end()
        events = drain(stream)
    assert not [e for e in events if isinstance(e, ErrorMsg)], events
    assert isinstance(events[-1], Closed) and events[-1].audio_s == pytest.approx(0.6)


def test_open_refusals_raise_stream_errors(null_service) -> None:
    with Client(null_service.address) as client:
        with pytest.raises(StreamError) as err:
            client.open(rate=11025)
        assert err.value.code == BAD_FORMAT
        with pytest.raises(StreamError) as err:
            client.open(model="no-such-model")
        assert err.value.code == UNKNOWN_MODEL
        stream = client.open("same-id")
        with pytest.raises(ValueError):
            client.open("same-id")
        stream.end()
        assert isinstance(drain(stream)[-1], Closed)
        with pytest.raises(StreamError):
            stream.send(goforward())


def test_front_door_status(null_service) -> None:
    reply = status(null_service.address)
    assert reply.ready and reply.ingests and reply.workers


def test_batch_stream_waits_for_the_window_and_completes(service_factory) -> None:
    svc = service_factory(model="null", workers=1, shm={"ring_seconds": 4.0}, vad={"max_segment_s": 3.0})
    pcm = speech_with_pauses(6)  # ~23 s through a 4 s buffer
    with Client(svc.address) as client:
        stream = client.open(priority="batch", partials=False)
        first_window = stream.window
        assert first_window < len(pcm)
        done = threading.Event()
        sender = threading.Thread(target=lambda: (stream.send(pcm, timeout=60), done.set()))
        sender.start()
        sender.join(60)
        assert done.is_set()
        stream.end()
        events = drain(stream)
    assert not [e for e in events if isinstance(e, ErrorMsg)], "a batch stream must never be refused"
    closed = events[-1]
    assert isinstance(closed, Closed) and closed.reason == "end"
    assert closed.audio_s == pytest.approx(len(pcm) / RATE, abs=0.01)
    assert closed.segments >= 2
    sends = stream.send_times
    assert max(t for end, t in sends if end <= first_window) < min(t for end, t in sends if end > first_window)


def test_overloaded_realtime_audio_is_resent_until_accepted(service_factory) -> None:
    svc = service_factory(model="null", workers=1, shm={"ring_seconds": 4.0}, vad={"max_segment_s": 3.0})
    pcm = speech_with_pauses(6)
    with Client(svc.address) as client:
        stream = client.open(partials=False)
        stream.send(pcm)  # realtime: all at once, far past the window
        stream.end()
        events = drain(stream)
    refused = [e for e in events if isinstance(e, ErrorMsg)]
    assert refused and {e.code for e in refused} == {OVERLOADED}
    closed = events[-1]
    assert isinstance(closed, Closed) and closed.reason == "end"
    assert closed.audio_s == pytest.approx(len(pcm) / RATE, abs=0.01), "refused audio must be resent"


@pytest.mark.parametrize("rate", [16000, 8000])  # 8 kHz: the resampler holds the most audio back
def test_speech_that_never_pauses_streams_through_the_smallest_ring_the_config_allows(service_factory, rate: int) -> None:
    """The ring holds a segment from its start until the VAD cuts it at max_segment_s: the
    least ring `load` allows (max_segment_s + settings.RING_ROOM) must let the cut come, or the
    stream's every frame and its end would be refused for good."""
    ring_s = 4.0
    svc = service_factory(model="null", workers=1, shm={"ring_seconds": ring_s},
                          vad={"max_segment_s": ring_s - settings.RING_ROOM / RATE, "min_silence_ms": 60_000})
    pcm = np.concatenate([goforward()] * 6)[:: RATE // rate]  # pauses far shorter than min_silence_ms: cuts only
    with Client(svc.address) as client:
        stream = client.open(priority="batch", partials=False, rate=rate)
        stream.send(pcm, timeout=60)
        stream.end()
        events = drain(stream)
    assert not [e for e in events if isinstance(e, ErrorMsg)], events[-3:]
    closed = events[-1]
    assert isinstance(closed, Closed) and closed.reason == "end"
    assert closed.audio_s == pytest.approx(len(pcm) / rate, abs=0.01)
    assert closed.segments >= len(pcm) / rate / ring_s  # cut at max_segment_s, over and over


def test_async_client(null_service) -> None:
    pcm = goforward()

    async def main() -> list:
        async with AsyncClient(null_service.address) as client:
            realtime, batch = await client.open(), await client.open(priority="batch")
            for s in (realtime, batch):
                await s.send(pcm)
                await s.end()
            events = [[ev async for ev in s.events(timeout=60)] for s in (realtime, batch)]
            assert [ev async for ev in realtime.events(timeout=5)] == []  # ended: nothing more comes
            return events

    for events in asyncio.run(main()):
        assert isinstance(events[-1], Closed) and events[-1].reason == "end"
        assert events[-1].audio_s == pytest.approx(len(pcm) / RATE, abs=0.01)


def test_cancelling_the_task_that_closes_an_async_client_cancels_it(null_service) -> None:
    """close() waits for its reader task; a cancellation of the caller's task meanwhile is the
    caller's (a shutdown, a timeout) and must reach it, with the client closed all the same."""

    async def main() -> AsyncClient:
        aclient = await AsyncClient.connect(null_service.address)
        await aclient.open()
        closer = asyncio.create_task(aclient.close())
        await asyncio.sleep(0)  # the closer now waits for the reader
        closer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closer
        return aclient

    aclient = asyncio.run(main())
    assert aclient._ctx.closed


def test_transcribe_files_concurrently(service) -> None:
    files = [utterance("goforward").path, testdata.utterances()[0].path]
    out = io.StringIO()
    assert remote.run(files, service.address, offline=True, as_json=True, language="en", out=out) == 0
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    summaries = {line["file"]: line for line in lines if line["type"] == "summary"}
    assert set(summaries) == set(files)
    assert "forward" in summaries[files[0]]["text"].lower()
    for line in lines:
        if line["type"] in ("partial", "final"):
            assert line["file"] in files and line["latency_ms"] >= 0 and line["start"] <= line["end"]
    finals = [line for line in lines if line["type"] == "final"]
    assert sum(s["segments"] for s in summaries.values()) == len([f for f in finals if f["text"].strip()])


def test_transcribe_realtime_paces_at_wall_clock(null_service) -> None:
    path = utterance("goforward").path
    out = io.StringIO()
    assert remote.run([path], null_service.address, offline=False, as_json=True, language=None, out=out) == 0
    summary = json.loads(out.getvalue().splitlines()[-1])
    assert summary["type"] == "summary"
    assert summary["wall_s"] >= summary["audio_s"] - 0.2  # paced, not bursted


def test_transcribe_reports_unreadable_files(null_service, tmp_path, capsys) -> None:
    bad = tmp_path / "not-audio.wav"
    bad.write_text("hello")
    out = io.StringIO()
    assert remote.run([str(bad), utterance("goforward").path], null_service.address, offline=True,
                      as_json=False, language=None, out=out) == 1
    assert "not-audio.wav" in capsys.readouterr().err
    assert out.getvalue().strip()  # the readable file is still transcribed


def test_transcribe_takes_files_as_local_transcription_does(null_service, tmp_path, capsys) -> None:
    """Headerless `.pcm` and `.s16` files are 16 kHz 16-bit mono, as `.raw` is and as `transcribe
    --local` reads them; a file without samples is said to be one, not transcribed to nothing."""
    raw = Path(utterance("goforward").path).read_bytes()
    pcm, s16, empty = tmp_path / "a.pcm", tmp_path / "a.s16", tmp_path / "empty.raw"
    pcm.write_bytes(raw)
    s16.write_bytes(raw)
    empty.write_bytes(b"")
    out = io.StringIO()
    assert remote.run([str(pcm), str(s16), str(empty)], null_service.address, offline=True, as_json=True,
                      language=None, out=out) == 1
    summaries = {line["file"]: line for line in map(json.loads, out.getvalue().splitlines()) if line["type"] == "summary"}
    assert set(summaries) == {str(pcm), str(s16)} and all(s["audio_s"] == pytest.approx(len(raw) / 32000, abs=0.001) for s in summaries.values())
    assert "empty.raw: cannot read audio: the file holds no audio samples" in capsys.readouterr().err


def test_transcribe_takes_a_file_of_more_channels_than_a_stream_carries(null_service, tmp_path, capsys) -> None:
    """A stream carries at most 8 channels; a microphone array's recording of more is mixed to
    mono, as `transcribe --local` mixes it, rather than refused `bad_format`."""
    voice, rate = goforward(), 16000
    many = tmp_path / "array.wav"
    soundfile.write(many, np.repeat(voice[:, None], 10, axis=1), rate, subtype="PCM_16")
    out = io.StringIO()
    code = remote.run([str(many)], null_service.address, offline=True, as_json=True, language=None, out=out)
    assert (code, capsys.readouterr().err) == (0, "")
    summary = json.loads(out.getvalue().splitlines()[-1])
    assert summary["type"] == "summary" and summary["text"] and summary["audio_s"] == pytest.approx(len(voice) / rate, abs=0.001)


def test_transcribe_takes_more_files_than_one_connection_may_stream_at_once(service_factory, capsys) -> None:
    """One connection may have `max_streams_per_client` streams open (64 by default): the files past
    that wait for a stream to end, and are transcribed, rather than refused `too_many_streams`."""
    svc = service_factory(model="null", workers=1, ingest={"max_streams_per_client": 2})
    out = io.StringIO()
    code = remote.run([utterance("goforward").path] * 3, svc.address, offline=True, as_json=True, language=None, out=out)
    assert capsys.readouterr().err == "" and code == 0
    summaries = [line for line in map(json.loads, out.getvalue().splitlines()) if line["type"] == "summary"]
    assert len(summaries) == 3 and all(s["text"] for s in summaries), summaries


def test_transcribe_streams_a_bounded_number_of_files_at_once(service_factory, tmp_path, capsys) -> None:
    """A day of recordings on the command line: `--parallel` files stream at once, the others as
    those end, each with its transcript in the order given; the command holds the threads of the
    files in flight, not one per file (it started a thread for each of hundreds of files). A
    `--parallel` past what the service lets a client open is cut to that, and said."""
    voice = goforward()
    files = []
    for i in range(120):  # short slices of speech, each its own file
        path = tmp_path / f"rec-{i:03d}.wav"
        soundfile.write(path, voice[i * 100 : i * 100 + RATE // 2], RATE, subtype="PCM_16")
        files.append(str(path))
    svc = service_factory(model="null", workers=1)  # of its own: its open streams are this test's
    parallel = 3
    streams: list[int] = []  # open streams over the service, as its status tells
    threads: list[int] = []  # this process's threads
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            threads.append(threading.active_count())
            streams.append(sum(ingest.get("streams", 0) for ingest in status(svc.address).ingests))

    before = threading.active_count() + 1  # the watcher's own
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    out = io.StringIO()
    try:
        code = remote.run(files, svc.address, offline=True, as_json=True, language=None, out=out, parallel=parallel)
    finally:
        stop.set()
        watcher.join(30)
    assert (code, capsys.readouterr().err) == (0, "")
    summaries = [line for line in map(json.loads, out.getvalue().splitlines()) if line["type"] == "summary"]
    assert [s["file"] for s in summaries] == files
    assert all(s["audio_s"] == pytest.approx(0.5, abs=0.001) for s in summaries), summaries
    assert max(streams) > 0, "the service never saw a stream open"  # the watch saw the run
    assert max(streams) <= parallel, max(streams)
    # a place holds the thread that reads its stream's events and one that sends its audio; the client has one more
    assert max(threads) - before <= 2 * parallel + 1, max(threads) - before

    code = remote.run(files[:2], svc.address, offline=True, as_json=False, language=None, out=io.StringIO(),
                      parallel=1000)
    assert (code, capsys.readouterr().err) == (0, "--parallel 1000: the service lets a client open 64 streams at once; "
                                                  "64 files are streamed at a time\n")
    done = svc.cli("transcribe", "--server", svc.address, "--offline", "--parallel", "2", *files[:3])
    assert done.returncode == 0 and len(done.stdout.splitlines()) == 3, done
    refused = svc.cli("transcribe", "--server", svc.address, "--parallel", "0", files[0])
    assert refused.returncode == 2 and "files must be 1 to" in refused.stderr, refused


def short_files(tmp_path: Path, count: int) -> list[str]:
    """`count` recordings of a second of speech, each its own file."""
    files = []
    for i in range(count):
        path = tmp_path / f"call-{i}.wav"
        soundfile.write(path, goforward()[:RATE], RATE, subtype="PCM_16")
        files.append(str(path))
    return files


@pytest.mark.parametrize("limit, offline, code, said", [
    ({"admit_max_realtime_streams": 1}, False, OVERLOADED, "admit_max_realtime_streams"),
    ({"max_streams": 1}, True, TOO_MANY_STREAMS, "stream limit"),  # full: batch streams are refused too
])
def test_transcribe_waits_for_room_on_a_busy_service(service_factory, tmp_path, capsys, limit: dict[str, int],
                                                     offline: bool, code: str, said: str) -> None:
    """A folder of recordings on a busy service: an open the service has no room for (past its
    realtime admission cap, `overloaded`; past its stream limit, `too_many_streams`) waits, held
    by the service, until another file's stream ends and frees a place, rather than failing the
    file at once; each file that waits says so once on stderr."""
    svc = service_factory(model="null", workers=1, ingest=limit)
    files = short_files(tmp_path, 3)
    out = io.StringIO()
    done = remote.run(files, svc.address, offline=offline, as_json=True, language=None, out=out, parallel=3)
    err = capsys.readouterr().err.splitlines()
    assert done == 0, err
    summaries = [line for line in map(json.loads, out.getvalue().splitlines()) if line["type"] == "summary"]
    assert [s["file"] for s in summaries] == files, summaries
    assert all(s["audio_s"] == pytest.approx(1.0, abs=0.001) for s in summaries), summaries
    # the three opened at once, one place: files waited, and each said so once
    waited = [line.partition(":")[0] for line in err]
    assert waited and len(set(waited)) == len(waited), err
    assert all(f"no room for the stream ({code}: " in line and said in line and line.endswith("waiting up to 300 s for room")
               for line in err), err
    held = [e for e in svc.events("ingest-0") if e["event"] == "ingest.open_waiting"]
    assert len(held) == len(waited) and all(e["code"] == code for e in held), held  # the service held them meanwhile


def test_an_open_asked_to_wait_for_room_takes_the_place_a_stream_frees(service_factory) -> None:
    """A call that comes while the service is at its realtime cap: `open()` raises the refusal at
    once, as it did; `open(wait=S)` asks again until a place frees (saying so once, through
    `on_wait`), and gives up after S saying how long it waited. Both clients."""
    service = service_factory(model="null", workers=1, ingest={"admit_max_realtime_streams": 1, "idle_timeout_s": 600})
    said: list[StreamError] = []
    with Client(service.address) as client:
        first = client.open("first")
        with pytest.raises(StreamError) as refused:
            client.open("second")
        assert refused.value.code == OVERLOADED
        with pytest.raises(StreamError, match=r"still refused after waiting 1 s\)$") as waited:
            client.open("second", wait=1.0, on_wait=said.append)
        assert waited.value.code == OVERLOADED and [e.code for e in said] == [OVERLOADED]
        freed = threading.Timer(1.0, first.end)  # its place frees once its `closed` is out
        freed.start()
        second = client.open("second", wait=60.0)
        freed.join()
        assert [type(e) for e in first.events(timeout=10)][-1] is Closed

        async def main() -> None:
            async with AsyncClient(service.address) as aclient:
                with pytest.raises(StreamError, match="still refused after waiting 1 s"):
                    await aclient.open("third", wait=1.0)
                asyncio.get_running_loop().call_later(1.0, second.end)
                third = await aclient.open("third", wait=60.0, on_wait=said.append)
                await third.end()
                assert [e.code for e in said] == [OVERLOADED, OVERLOADED]

        asyncio.run(main())


def test_calls_waiting_for_room_get_it_in_the_order_they_came(service_factory) -> None:
    """Calls that wait for room (`open(wait=S)`) on a full service get the places that free in
    the order they asked, whichever client and connection they are on: each client asks the
    service to hold its open, which it admits first come, first served. Asked again on a timer,
    as before, a call that had waited longest lost its place to whichever asked first after a
    place freed. Each caller is told once that it waits, through `on_wait`; one caller is an
    AsyncClient."""
    service = service_factory(model="null", workers=1, ingest={"admit_max_realtime_streams": 1, "idle_timeout_s": 600})
    admitted: list[str] = []
    said: dict[str, list[str]] = {}

    def use(name: str, stream: Any) -> None:
        admitted.append(name)
        time.sleep(0.2)  # the call, short

    def call(name: str) -> None:
        told = said.setdefault(name, [])
        if name != "b":
            with Client(service.address) as client:
                stream = client.open(name, wait=60.0, on_wait=lambda e: told.append(e.code))
                use(name, stream)
                stream.end()
                drain(stream)
            return

        async def main() -> None:
            async with AsyncClient(service.address) as aclient:
                astream = await aclient.open(name, wait=60.0, on_wait=lambda e: told.append(e.code))
                use(name, astream)
                await astream.end()
                async for _ in astream.events(timeout=60):
                    pass

        asyncio.run(main())

    def held() -> list[str]:  # the calls whose open reached the ingest and found no room
        return [e["stream"] for e in service.events("ingest-0") if e["event"] in ("ingest.open_waiting", "ingest.open_refused")]

    with Client(service.address) as holder:
        first = holder.open("first")
        callers = []
        for name in "abcd":
            callers.append(threading.Thread(target=call, args=(name,)))
            callers[-1].start()
            assert wait_for(lambda: name in held(), 20), f"call {name} held"  # each asks after the last is in line
        first.end()
        drain(first)
        for caller in callers:
            caller.join(120)
    assert admitted == list("abcd"), admitted
    assert said == {name: [OVERLOADED] for name in "abcd"}, said


def test_an_open_that_waits_on_a_service_older_than_held_opens_is_asked_again() -> None:
    """A service of an older release refuses `open.wait` as an unknown field (`bad_message`,
    naming it): the open is sent again at once without it, and asked again after a growing pause
    while it is refused for room, as before the field. Both clients."""
    fake = FakeIngest(unknown=frozenset({"wait"}))
    try:
        with Client(fake.address, timeout=2.0) as client:
            client.open("s", wait=30.0)

        async def main() -> None:
            async with AsyncClient(fake.address, timeout=2.0) as aclient:
                await aclient.open("a", wait=30.0)

        asyncio.run(main())
        for sid in "sa":
            waits = [o.wait for o in fake.opens if o.stream == sid]
            assert len(waits) == 2 and 29 < waits[0] <= 30 and waits[1] is None, waits
    finally:
        fake.close()


def test_a_call_that_hangs_up_while_it_waits_for_room_withdraws_its_open(service_factory) -> None:
    """A caller who hangs up while its open waits for room (`open(wait=S, cancel=event)`, the
    event set from another thread; an AsyncClient's `open` task cancelled) gets CancelledError,
    and the service lets its place in line go: the place that frees goes to the call behind it,
    not to nobody. Closing the client would fail every other stream on it."""
    service = service_factory(model="null", workers=1, ingest={"admit_max_realtime_streams": 1, "idle_timeout_s": 600})
    hung_up = threading.Event()
    outcome: dict[str, Any] = {}

    def call(name: str, cancel: threading.Event | None) -> None:
        if name == "c":
            async def main() -> None:
                async with AsyncClient(service.address) as aclient:
                    opening = asyncio.ensure_future(aclient.open(name, wait=60.0))
                    while not cancel.is_set():
                        await asyncio.sleep(0.02)
                    opening.cancel()
                    try:
                        await opening
                    except asyncio.CancelledError as exc:
                        outcome[name] = exc

            asyncio.run(main())
            return
        with Client(service.address) as client:
            try:
                stream = client.open(name, wait=60.0, cancel=cancel)
            except CancelledError as exc:
                outcome[name] = exc
                return
            outcome[name] = "admitted"
            stream.end()
            drain(stream)

    def held() -> list[str]:
        return [e["stream"] for e in service.events("ingest-0") if e["event"] == "ingest.open_waiting"]

    with Client(service.address) as holder:
        first = holder.open("first")
        callers = [threading.Thread(target=call, args=(name, cancel)) for name, cancel in (("a", hung_up), ("b", None), ("c", hung_up))]
        for caller, name in zip(callers, "abc"):
            caller.start()
            assert wait_for(lambda: name in held(), 20), f"call {name} held"
        hung_up.set()
        for caller in callers[::2]:
            caller.join(10)
        assert isinstance(outcome.get("a"), CancelledError) and isinstance(outcome.get("c"), asyncio.CancelledError), outcome

        def withdrawn() -> list[str]:
            return [e["stream"] for e in service.events("ingest-0") if e["event"] == "ingest.open_refused"
                    and e["reason"].endswith("(ended while it waited for room)")]

        assert wait_for(lambda: sorted(withdrawn()) == ["a", "c"], 10), withdrawn()
        first.end()
        drain(first)
        callers[1].join(30)
    assert outcome == {"a": outcome["a"], "b": "admitted", "c": outcome["c"]}, outcome
    opened = [e["stream"] for e in service.events("ingest-0") if e["event"] == "ingest.stream_opened"]
    assert opened == ["first", "b"], opened


@pytest.mark.parametrize(("signum", "said_first"), [
    (signal.SIGINT, "interrupted: ending the streams with the audio sent so far (Ctrl-C again to quit at once)"),
    (signal.SIGTERM, "terminated: ending the streams with the audio sent so far (SIGTERM again to quit at once)"),
], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_ends_a_transcription_with_what_it_sent_and_keeps_its_transcript(service, tmp_path, signum: signal.Signals,
                                                                                 said_first: str) -> None:
    """Ctrl-C while `streamasr transcribe` streams ends the streams with the audio sent so far:
    their transcript is given, said to be a part (how much of the file), a file not begun is said
    to be left, and the exit status is a SIGINT's (130), with no traceback. The stream ends as an
    `end` ends it, not as a client gone: the ingest closes it with reason `end`. A second Ctrl-C
    quits at once. SIGTERM (a service manager or a job scheduler stopping the run) alike, its
    exit status 143."""
    path = tmp_path / "long.wav"
    soundfile.write(path, speech_with_pauses(10), RATE, subtype="PCM_16")  # about 30 s, a final every 3 s
    argv = [sys.executable, "-m", "streamasr.cli", "transcribe", "--server", service.address, "--json", "--parallel", "1",
            str(path), str(path)]
    logged_before = len(service.events("ingest-0"))
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rows = []
    for line in proc.stdout:  # the first file's first final: it is well under way
        rows.append(json.loads(line))
        if rows[-1]["type"] == "final" and rows[-1]["text"].strip():
            break
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    rows += [json.loads(line) for line in out.splitlines()]
    assert proc.returncode == 128 + signum, (proc.returncode, err)
    assert "Traceback" not in err, err
    said = [line for line in err.splitlines() if "no room for the stream" not in line]  # a busy moment of the shared service
    assert said[0] == said_first, said
    assert said[2:] == [f"{path}: interrupted before it was transcribed"], said
    part = re.fullmatch(rf"{re.escape(str(path))}: interrupted: the transcript of its first ([0-9.]+) s of ([0-9.]+) s", said[1])
    assert part, said
    sent_s, whole_s = map(float, part.groups())
    assert 3 < sent_s < whole_s - 5 and abs(whole_s - len(speech_with_pauses(10)) / RATE) < 0.1, said
    [summary] = [r for r in rows if r["type"] == "summary"]
    finals = [r["text"].strip() for r in rows if r["type"] == "final" and r["text"].strip()]
    assert summary["interrupted"] is True and summary["text"] == " ".join(finals), summary
    assert abs(summary["audio_s"] - sent_s) < 0.2, (summary, sent_s)
    assert "forward" in summary["text"].lower() and summary["segments"] == len(finals), summary
    assert all(r["end"] <= sent_s + 0.1 for r in rows if r["type"] == "final"), rows
    closed = [e for e in service.events("ingest-0")[logged_before:] if e["event"] in ("ingest.stream_closed", "ingest.stream_dropped")
              and abs(e.get("audio_s", 0) - summary["audio_s"]) < 0.01]
    assert [(e["event"], e["reason"]) for e in closed] == [("ingest.stream_closed", "end")], closed

    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if json.loads(line)["type"] == "partial":
            break
    proc.send_signal(signum)
    for said_line in proc.stderr:  # said once the first signal is taken
        if said_line.rstrip("\n") == said_first:
            break
    proc.send_signal(signum)
    proc.communicate(timeout=30)
    assert proc.returncode == -signum


def speak_into(pipe: Any, audio: np.ndarray, fed: threading.Event) -> None:
    """Write `audio` to a pipe as a microphone would, 100 ms at a time, then close it."""
    step = RATE // 10
    for i in range(0, len(audio), step):
        pipe.write(audio[i:i + step].tobytes())
        pipe.flush()
        time.sleep(0.1)
    fed.set()
    pipe.close()


def transcribe_live(service: Any, audio: np.ndarray, *flags: str) -> tuple[list[tuple[str, bool]], str]:
    """`transcribe - FLAGS` with `audio` spoken into its standard input as a microphone gives it:
    each line printed, with whether the audio had all been fed by then, and its stderr. It must
    exit 0."""
    proc = subprocess.Popen([sys.executable, "-m", "streamasr.cli", "transcribe", "--server", service.address, *flags, "-"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    fed = threading.Event()
    speaker = threading.Thread(target=speak_into, args=(proc.stdin, audio, fed))
    speaker.start()
    lines = [(line.decode().strip(), fed.is_set()) for line in proc.stdout]
    speaker.join()
    stderr = proc.stderr.read().decode()
    assert proc.wait(30) == 0, stderr
    return lines, stderr


def test_transcribe_captions_a_live_source_on_standard_input(service, tmp_path) -> None:
    """`streamasr transcribe -` reads headerless 16 kHz 16-bit mono from standard input, as
    `arecord` or `ffmpeg` write it to a pipe: a live source has no end to wait for, so each final
    is printed as it comes, while the audio still flows, and the audio is sent as it comes (it is
    paced by the speaker). Standard input redirected from a file is paced as a file is. `-` is
    for the service only, and once."""
    audio = speech_with_pauses(4)  # four times "go forward ten meters", a second of silence after each
    lines, stderr = transcribe_live(service, audio)
    assert [line for line in stderr.splitlines() if "no room for the stream" not in line] == []
    assert len(lines) == 4 and all("forward" in text.lower() for text, _ in lines), lines
    assert not lines[0][1], "the first final came only after the audio ended"

    raw = tmp_path / "call.raw"
    audio.tofile(raw)
    with open(raw, "rb") as stdin:
        paced = subprocess.run([sys.executable, "-m", "streamasr.cli", "transcribe", "--server", service.address, "--json", "-"],
                               stdin=stdin, capture_output=True, text=True, timeout=120)
    assert paced.returncode == 0, paced.stderr
    summary = json.loads(paced.stdout.splitlines()[-1])
    assert summary["file"] == "-" and summary["text"].lower().count("forward") == 4, summary
    assert summary["audio_s"] == pytest.approx(len(audio) / RATE, abs=0.01) and summary["wall_s"] >= summary["audio_s"] - 0.5, summary

    local = service.cli("transcribe", "--local", "-")
    assert local.returncode == 2 and "standard input" in local.stderr, local
    twice = service.cli("transcribe", "--server", service.address, "-", "-")
    assert twice.returncode == 1 and twice.stderr == "- (standard input) can be given once\n", twice


def test_transcribe_reads_standard_input_in_the_format_it_is_told(service) -> None:
    """A telephony feed's 8 kHz G.711 mu-law, or a sound card's 48 kHz stereo float, piped to
    `streamasr transcribe -` with `--rate`, `--encoding` and `--channels`, is transcribed as the
    same speech in 16 kHz 16-bit mono is; float samples that are no number fail it, said; the
    flags without `-` are refused."""
    audio = speech_with_pauses(2)
    level = audio.astype(np.float32) / 32768
    mulaw = io.BytesIO()
    soundfile.write(mulaw, soxr.resample(level, RATE, 8000), 8000, format="RAW", subtype="ULAW")
    wide = soxr.resample(level, RATE, 48000)
    stereo = np.stack([wide, wide / 2], axis=1).astype("<f4").tobytes()
    for flags, data in ((["--rate", "8000", "--encoding", "pcm_mulaw"], mulaw.getvalue()),
                        (["--rate", "48000", "--encoding", "f32le", "--channels", "2"], stereo)):
        run = subprocess.run([sys.executable, "-m", "streamasr.cli", "transcribe", "--server", service.address, "--json",
                              *flags, "-"], input=data, capture_output=True, timeout=120)
        assert run.returncode == 0, (flags, run.stderr)
        summary = json.loads(run.stdout.splitlines()[-1])
        assert summary["text"].lower().count("forward") == 2, (flags, summary)
        assert summary["audio_s"] == pytest.approx(len(audio) / RATE, abs=0.01), (flags, summary)
    broken = subprocess.run([sys.executable, "-m", "streamasr.cli", "transcribe", "--server", service.address, "--encoding",
                             "f32le", "-"], input=np.full(8000, np.nan, "<f4").tobytes(), capture_output=True, text=False, timeout=120)
    assert broken.returncode == 1 and b"-: cannot read audio: f32le samples that are NaN or infinite" in broken.stderr, broken
    refused = service.cli("transcribe", "--server", service.address, "--encoding", "pcm_alaw", "call.wav")
    assert refused.returncode == 2 and "--encoding says what standard input holds" in refused.stderr, refused


def test_transcribe_writes_names_and_words_as_its_prompt_spells_them(service) -> None:
    """`--prompt` tells the model the names and words a call holds, written as they should be:
    "Go forward ten meters." spells the number out where the model alone writes digits, and the
    card's suit is heard as the prompt names it rather than as a word of its own ("Queen of
    Cloves"). Streamed through the service and with --local alike; an empty prompt, or one past
    what an open carries, is refused."""
    files = [utterance("goforward").path, utterance("cards/002").path]
    plain = service.cli("transcribe", "--server", service.address, *files)
    assert plain.returncode == 0 and "Go forward 10 meters." in plain.stdout and "clubs" not in plain.stdout.lower(), plain
    prompt = "Go forward ten meters. Ten of clubs."
    for where in (["--server", service.address], ["--local"]):
        primed = service.cli("transcribe", *where, "--prompt", prompt, *files)
        assert primed.returncode == 0, (where, primed.stderr)
        assert "Go forward ten meters." in primed.stdout and "queen of clubs" in primed.stdout.lower(), (where, primed.stdout)
    for refused in (" ", "x" * 1001):
        bad = service.cli("transcribe", "--prompt", refused, files[0])
        assert bad.returncode == 2 and "the prompt is 1 to 1000 characters" in bad.stderr, bad


def test_transcribe_writes_each_file_s_transcript_to_a_file_of_its_own(service, tmp_path) -> None:
    """`--out-dir` captions a folder of recordings in one run: each file's cues (or text, or JSON)
    in a file named after it, put in place whole once it is transcribed; a file that breaks off
    part-way leaves none, and no half-written file is left behind. `--local` alike. Two files of
    one name, standard input, and a directory that is a file or cannot be made are refused before
    anything streams."""
    recordings = tmp_path / "calls"
    recordings.mkdir()
    first, second = recordings / "first.raw", recordings / "second.wav"
    goforward().tofile(first)
    soundfile.write(second, soundfile.read(utterance("cards/001").path, dtype="int16")[0], RATE)
    cut = recordings / "cut.flac"
    soundfile.write(cut, speech_with_pauses(8), RATE)
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size * 2 // 3])
    captions = tmp_path / "captions"
    run = service.cli("transcribe", "--server", service.address, "--offline", "--subtitles", "vtt", "--out-dir",
                      str(captions), str(first), str(second), str(cut))
    assert run.returncode == 1 and run.stdout == "" and f"{cut}: cannot read audio" in run.stderr, run
    assert sorted(p.name for p in captions.iterdir()) == ["first.vtt", "second.vtt"]  # nothing of cut.flac, no part
    assert re.fullmatch(r"WEBVTT\n\n00:00:00\.\d{3} --> 00:00:0\d\.\d{3}\nGo forward 10 meters\.\n\n",
                        (captions / "first.vtt").read_text()), (captions / "first.vtt").read_text()
    assert "clubs" in (captions / "second.vtt").read_text().lower()
    assert service.cli("transcribe", "--server", service.address, "--json", "--out-dir", str(captions), str(first)).returncode == 0
    rows = [json.loads(line) for line in (captions / "first.jsonl").read_text().splitlines()]
    assert rows[-1]["type"] == "summary" and rows[-1]["text"] == "Go forward 10 meters.", rows
    local = service.cli("transcribe", "--local", "--out-dir", str(captions), str(second), timeout=180)
    assert local.returncode == 0 and local.stdout == "" and "clubs" in (captions / "second.txt").read_text().lower(), local
    for where, files, why in ((captions, [first, tmp_path / "first.wav"], "would both be written as first"),
                              (captions, [first, second, first], f"{first} is named twice"),
                              (captions, ["-"], "standard input"), (first, [second], "not a directory"),
                              (first / "captions", [second], "cannot make it")):
        bad = service.cli("transcribe", "--server", service.address, "--out-dir", str(where), *map(str, files))
        assert bad.returncode == 2 and why in bad.stderr, (where, files, bad)


def test_a_folder_of_more_recordings_than_the_open_files_limit_is_transcribed(service, tmp_path) -> None:
    """A folder of recordings may hold thousands of files: `--out-dir` holds a transcript file
    open only while it writes to it, so a run of more files than the limit on open files (here
    128, a shell's is often 1024) is transcribed, each file its transcript."""
    folder = tmp_path / "calls"
    folder.mkdir()
    names = [folder / f"{i:03d}.raw" for i in range(150)]
    for name in names:
        np.zeros(RATE // 2, np.int16).tofile(name)  # half a second of quiet: no decode, a quick stream
    out = tmp_path / "transcripts"
    run = service.cli("transcribe", "--server", service.address, "--offline", "--json", "--out-dir", str(out), *map(str, names),
                      preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128)), timeout=300)
    assert run.returncode == 0 and run.stderr == "", run
    assert sorted(p.name for p in out.iterdir()) == [f"{i:03d}.jsonl" for i in range(150)]
    assert all(json.loads((out / f"{i:03d}.jsonl").read_text())["audio_s"] == 0.5 for i in range(150))


def test_a_transcript_that_cannot_be_written_fails_its_file_alone_and_ends_its_stream(service, tmp_path) -> None:
    """A full disk (here a limit on the size of a file, EFBIG where ENOSPC would come) fails the
    file whose transcript cannot be written, said with why, and leaves nothing of it; the other
    files are written whole. Standard output that cannot be written (a full disk, a reader gone)
    ends the run's streams at once, said unless its reader asked for no more, with exit 1 and no
    traceback; what it sent is all the service was given. A run killed outright left a hidden
    part-file: the next run into the folder removes it, and no other host's or live process's."""
    def size_limited(size: int) -> Callable[[], None]:
        return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))

    def closed() -> list[dict[str, Any]]:
        return [e for e in service.events("ingest-0") if e["event"] == "ingest.stream_closed"]

    def streamed_s(closed_before: int) -> float:
        """The audio the service was given by the one stream that closed after `closed_before` others."""
        assert wait_for(lambda: len(closed()) > closed_before, 10)
        return closed()[closed_before]["audio_s"]

    short, long = tmp_path / "short.raw", tmp_path / "long.wav"
    goforward().tofile(short)
    speech = speech_with_pauses(8)  # 30 s, four finals
    soundfile.write(long, speech, RATE)
    captions = tmp_path / "captions"
    captions.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()
    host = socket.gethostname()
    leftovers = [f".a.jsonl.{host}.{gone.pid}.partial", f".b.jsonl.elsewhere.{gone.pid}.partial", f".c.jsonl.{host}.{os.getpid()}.partial"]
    for name in leftovers:
        (captions / name).write_text("{")
    # a final's row is about 300 bytes: the short file's transcript fits, the long one's four do not
    run = service.cli("transcribe", "--server", service.address, "--offline", "--json", "--out-dir", str(captions),
                      str(long), str(short), preexec_fn=size_limited(700))
    assert run.returncode == 1 and run.stdout == "" and "Traceback" not in run.stderr, run
    assert f"{long}: cannot write {captions / 'long.jsonl'}: File too large" in run.stderr, run.stderr
    assert sorted(p.name for p in captions.iterdir()) == sorted(leftovers[1:] + ["short.jsonl"])
    assert json.loads((captions / "short.jsonl").read_text().splitlines()[-1])["text"] == "Go forward 10 meters."

    local = service.cli("transcribe", "--local", "--json", "--out-dir", str(captions), str(long), str(short),
                        preexec_fn=size_limited(700), timeout=180)
    assert local.returncode == 1 and "Traceback" not in local.stderr, local
    assert f"{long}: cannot write {captions / 'long.json'}: File too large" in local.stderr, local.stderr
    assert json.loads((captions / "short.json").read_text())["text"] == "Go forward 10 meters."
    assert sorted(p.name for p in captions.iterdir()) == sorted(leftovers[1:] + ["short.json", "short.jsonl"])

    before = len(closed())
    with open("/dev/full", "w") as full:
        realtime = service.cli("transcribe", "--server", service.address, "--json", str(long), stdout=full)
    assert realtime.returncode == 1 and realtime.stderr == "cannot write standard output: No space left on device\n", realtime
    assert streamed_s(before) < len(speech) / RATE / 2  # ended at its first row, not streamed on for nothing
    before = len(closed())
    reading = subprocess.Popen([sys.executable, "-m", "streamasr.cli", "transcribe", "--server", service.address, "--json", str(long)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "STREAMASR_CONFIG": str(service.config_file)})
    assert reading.stdout is not None and reading.stderr is not None
    assert json.loads(reading.stdout.readline())["type"] == "partial"
    reading.stdout.close()  # as `head -1` does once it has its line
    assert reading.wait(timeout=60) == 1 and reading.stderr.read() == ""
    assert streamed_s(before) < len(speech) / RATE / 2
    with open("/dev/full", "w") as full:
        local = service.cli("transcribe", "--local", str(short), stdout=full, timeout=180)
    assert local.returncode == 1 and local.stderr == "cannot write standard output: No space left on device\n", local


def two_party_call() -> np.ndarray:
    """A call of 9 s, the agent on channel 1 ("go forward ten meters" at 0.5 s and 6 s), the caller
    on channel 2 ("ten of clubs" at 4 s)."""
    agent, caller = goforward(), soundfile.read(utterance("cards/001").path, dtype="int16")[0]
    call = np.zeros((9 * RATE, 2), np.int16)
    call[RATE // 2:RATE // 2 + len(agent), 0] = agent
    call[4 * RATE:4 * RATE + len(caller), 1] = caller
    call[6 * RATE:6 * RATE + len(agent), 0] = agent
    return call


def test_transcribe_splits_a_call_recorded_with_each_party_on_its_own_channel(service, tmp_path) -> None:
    """`--split-channels` streams each channel of a file as a stream of its own (a call recorded
    with the agent on one channel, the caller on the other): the transcript is the channels'
    finals in the order they were spoken, each line its time and channel, nothing of one
    party's speech in the other's lines; `--json` names each row's channel; `--subtitles` gives
    one track of both parties' cues, each its speaker's. Without the flag the channels are mixed,
    as before; a mono file has nothing to split."""
    call = two_party_call()
    path = tmp_path / "call.wav"
    soundfile.write(path, call, RATE)
    run = service.cli("transcribe", "--server", service.address, "--split-channels", str(path))
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == 3 and [line.split("] ")[1].split(":")[0] for line in lines] == ["channel 1", "channel 2", "channel 1"], lines
    assert all(re.match(r"\[00:0\d\.\d\] channel \d: ", line) for line in lines), lines
    starts = [float(line[4:8]) for line in lines]
    assert starts == sorted(starts) and abs(starts[1] - 4.0) < 0.7 and abs(starts[2] - 6.0) < 0.7, lines
    assert "forward" in lines[0].lower() and "clubs" in lines[1].lower() and "forward" in lines[2].lower(), lines

    rows = [json.loads(line) for line in service.cli("transcribe", "--server", service.address, "--split-channels",
                                                     "--offline", "--json", str(path)).stdout.splitlines()]
    summaries = {r["channel"]: r for r in rows if r["type"] == "summary"}
    assert set(summaries) == {1, 2} and all(r["file"] == str(path) for r in rows), rows
    assert summaries[1]["text"].lower().count("forward") == 2 and "clubs" not in summaries[1]["text"].lower(), summaries
    assert "clubs" in summaries[2]["text"].lower() and "forward" not in summaries[2]["text"].lower(), summaries
    assert {(r["channel"], r["speaker"]) for r in rows if r["type"] == "final"} == {(1, "channel 1"), (2, "channel 2")}

    mixed = service.cli("transcribe", "--server", service.address, str(path))
    assert mixed.returncode == 0 and len(mixed.stdout.splitlines()) == 1 and " of " in mixed.stdout, mixed  # one transcript of both
    mono = tmp_path / "mono.wav"
    soundfile.write(mono, goforward(), RATE)
    one = service.cli("transcribe", "--server", service.address, "--split-channels", str(mono))
    assert one.returncode == 0 and one.stdout.lower().count("forward") == 1 and "channel" not in one.stdout, one
    captions = service.cli("transcribe", "--server", service.address, "--split-channels", "--speakers", "Agent,Caller",
                           "--offline", "--subtitles", "vtt", str(path))
    assert captions.returncode == 0, captions.stderr
    cues = re.findall(r"^(\d\d:\d\d:\d\d\.\d{3}) --> \d\d:\d\d:\d\d\.\d{3}\n<v (\w+)>(.*)$", captions.stdout, re.M)
    assert captions.stdout.startswith("WEBVTT\n\n") and [voice for _, voice, _ in cues] == ["Agent", "Caller", "Agent"], captions.stdout
    assert [at for at, _, _ in cues] == sorted(at for at, _, _ in cues) and "clubs" in cues[1][2].lower(), captions.stdout
    for refused in (["--split-channels", "--local", str(path)], ["--split-channels", "-", str(path)],
                    ["--speakers", "agent,caller", str(path)]):
        bad = service.cli("transcribe", *refused)
        assert bad.returncode == 2 and "--split-channels" in bad.stderr, (refused, bad)
    for names in (",caller", "agent,call\ner", "x" * 65):
        bad = service.cli("transcribe", "--split-channels", "--speakers", names, str(path))
        assert bad.returncode == 2 and "printable characters" in bad.stderr, (names, bad)


def test_transcribe_splits_a_live_call_on_standard_input_as_it_is_spoken(service) -> None:
    """A telephony bridge's live call, each party on its own channel, piped to `transcribe -
    --channels 2 --split-channels`: each party is a stream of its own and each final is printed
    as it comes, while the call goes on, with its time and its channel; nothing of one party is
    in the other's lines, each line its party's name (`--speakers`). `--subtitles vtt` writes both
    parties' cues as one track while the call goes on, in the order they start. `--json` names each
    row's channel and speaker."""
    call = two_party_call()
    lines, _ = transcribe_live(service, call, "--channels", "2", "--split-channels", "--speakers", "agent,caller")
    assert [line.split("] ")[1].split(":")[0] for line, _ in lines] == ["agent", "caller", "agent"], lines
    assert all(re.match(r"\[00:0\d\.\d\] \w+: ", line) for line, _ in lines), lines
    assert "forward" in lines[0][0].lower() and "clubs" in lines[1][0].lower() and "forward" in lines[2][0].lower(), lines
    assert not lines[0][1] and not lines[1][1], "the finals came only after the call ended"
    captions, _ = transcribe_live(service, call, "--channels", "2", "--split-channels", "--subtitles", "vtt")
    cues = [(i, line[3:].rstrip("."), ended) for i, (line, ended) in enumerate(captions) if line.startswith("<v ")]
    assert [voice for _, voice, _ in cues] == ["channel 1>Go forward 10 meters", "channel 2>10 of clubs",
                                                "channel 1>Go forward 10 meters"], captions
    starts = [captions[i - 1][0].split(" --> ")[0] for i, _, _ in cues]
    assert starts == sorted(starts) and not cues[0][2] and not cues[1][2], captions  # written as the call went on

    rows = [json.loads(line) for line in subprocess.run(
        [sys.executable, "-m", "streamasr.cli", "transcribe", "--server", service.address, "--channels", "2",
         "--split-channels", "--speakers", "agent", "--offline", "--json", "-"], input=call.tobytes(), capture_output=True,
        timeout=120).stdout.splitlines()]
    assert {(r["channel"], r["speaker"]) for r in rows} == {(1, "agent"), (2, "channel 2")}, rows  # channels past the names given
    summaries = {r["channel"]: r["text"].lower() for r in rows if r["type"] == "summary"}
    assert set(summaries) == {1, 2} and summaries[1].count("forward") == 2 and "clubs" not in summaries[1], summaries
    assert "clubs" in summaries[2] and "forward" not in summaries[2], summaries


@pytest.mark.timeout(60)  # a channel held back by another would wait for ever
def test_standard_input_split_by_channels_goes_on_for_the_channels_read() -> None:
    """Split among its channels' pipes, standard input reaches a channel read at once while another
    is not read yet (its stream waiting for room): that one falls behind in memory and gets all of
    it once read; a channel whose reader closed holds nothing back."""
    source, feed = os.pipe()
    split = remote.Split(3, source)
    data = os.urandom(3 * remote.Split.CHUNK + 123)  # past a pipe's own buffer (64 KiB)
    writer = threading.Thread(target=lambda: (os.write(feed, data), os.close(feed)))
    writer.start()
    split.pipe(2).close()
    assert split.pipe(0).read() == data  # to its end, while channel 1 is not read
    assert split.pipe(1).read() == data
    writer.join()
    os.close(source)


def test_transcribe_shows_a_live_source_s_partials_in_place_on_a_terminal(service) -> None:
    """Printed to a terminal, a live source's partials show as they come on one line, each in
    place of the last, and its final takes that line; a pipe or a file gets the finals alone (the
    test above)."""
    import pty

    terminal, its_end = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "streamasr.cli", "transcribe", "--server", service.address, "-"],
                            stdin=subprocess.PIPE, stdout=its_end, stderr=subprocess.PIPE)
    os.close(its_end)
    speaker = threading.Thread(target=speak_into, args=(proc.stdin, speech_with_pauses(2), threading.Event()))
    speaker.start()
    shown = b""
    while True:
        try:
            chunk = os.read(terminal, 4096)
        except OSError:  # the process ended: its end of the terminal is closed
            break
        if not chunk:
            break
        shown += chunk
    os.close(terminal)
    speaker.join()
    assert proc.wait(30) == 0, proc.stderr.read()
    lines = shown.decode().split("\r\n")  # the terminal's line ends
    assert lines[-1] == "" and len(lines) == 3, lines
    for line in lines[:2]:
        *partials, final = line.split("\r\x1b[K")
        assert partials and all(partials), line  # each partial written over the one before
        assert "forward" in final.lower() and final.endswith("."), line


def test_transcribe_gives_up_on_room_after_its_open_timeout(service_factory, tmp_path) -> None:
    """A file the service keeps refusing for load fails once `--open-timeout` has passed, saying
    why and for how long it waited; `--open-timeout 0` fails it at the first refusal; `--offline`
    (priority batch) is not refused for load at all."""
    # the place is held by a stream sending nothing: not closed as idle while the commands run
    svc = service_factory(model="null", workers=1, ingest={"admit_max_realtime_streams": 1, "idle_timeout_s": 600})
    [path] = short_files(tmp_path, 1)
    with Client(svc.address) as client:
        held = client.open()  # the one realtime place, for the whole test
        failed = svc.cli("transcribe", "--server", svc.address, "--open-timeout", "2", path)
        assert failed.returncode == 1 and failed.stdout == "", failed
        waited, gave_up = failed.stderr.splitlines()
        assert waited == (f"{path}: the service has no room for the stream (overloaded: the service admits 1 realtime "
                          f"streams at a time (ingest.admit_max_realtime_streams); try again later or open with priority "
                          f"batch); waiting up to 2 s for room"), failed.stderr
        assert gave_up.startswith(f"{path}: cannot open a stream: overloaded: the service admits 1 realtime streams"), gave_up
        assert gave_up.endswith("(still refused after waiting 2 s)"), gave_up
        at_once = svc.cli("transcribe", "--server", svc.address, "--open-timeout", "0", path)
        assert at_once.returncode == 1 and "waiting" not in at_once.stderr, at_once
        assert at_once.stderr.startswith(f"{path}: cannot open a stream: overloaded: "), at_once.stderr
        batch = svc.cli("transcribe", "--server", svc.address, "--offline", "--open-timeout", "0", path)
        assert (batch.returncode, batch.stderr) == (0, "") and batch.stdout.strip(), batch
        held.end()
        assert isinstance(drain(held)[-1], Closed)


def test_transcribe_fails_a_file_refused_for_anything_but_room_at_once(service, capsys) -> None:
    """An open refused for what waiting cannot cure (a language the model does not transcribe) is
    not asked again: the file fails at the first refusal, with no word of waiting for room."""
    path = utterance("goforward").path
    done = remote.run([path], service.address, offline=False, as_json=False, language="fr", out=io.StringIO())
    err = capsys.readouterr().err.splitlines()
    assert done == 1 and len(err) == 1, err
    assert err[0].startswith(f"{path}: cannot open a stream: unknown_language: language 'fr' is not one"), err


PEAK_RSS = ("import resource, subprocess, sys; done = subprocess.run(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(done.returncode)")


def transcribe_measured(address: str, path: Path) -> tuple[dict[str, Any], list[dict[str, Any]], int]:
    """`streamasr transcribe --offline --json` of one file in a process of its own: its summary,
    its finals and its peak resident memory in bytes."""
    done = subprocess.run([sys.executable, "-c", PEAK_RSS, sys.executable, "-m", "streamasr.cli", "transcribe",
                           "--server", address, "--offline", "--json", str(path)],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    *said, peak_kb = done.stderr.splitlines()
    assert done.returncode == 0 and said == [], done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    return lines[-1], [line for line in lines if line["type"] == "final"], int(peak_kb) * 1024


def test_transcribe_holds_the_audio_being_streamed_not_whole_files(null_service, tmp_path) -> None:
    """An operator transcribing a day of recordings: a 20-minute file, at a rate the protocol takes
    and at one it does not (resampled as it is read), streams in about the memory a short file
    takes, not in memory growing with the file (held whole, a 16 kHz file took 3 times its 16-bit
    size more, an 11025 Hz one 6 times), and still comes out whole: a final for each utterance,
    the last at the file's end, and all of its audio."""
    repeats = 320
    part = np.concatenate([goforward(), np.zeros(RATE, np.int16)])
    long = np.tile(part, repeats)
    seconds, size = len(long) / RATE, long.nbytes  # 1212 s, 39 MB
    soundfile.write(tmp_path / "short.wav", part, RATE, subtype="PCM_16")
    soundfile.write(tmp_path / "long.wav", long, RATE, subtype="PCM_16")
    soundfile.write(tmp_path / "long-11025.wav", soxr.resample(long, RATE, 11025), 11025, subtype="PCM_16")
    _, _, baseline = transcribe_measured(null_service.address, tmp_path / "short.wav")
    for name in ("long.wav", "long-11025.wav"):
        summary, finals, peak = transcribe_measured(null_service.address, tmp_path / name)
        assert peak - baseline < size / 4, f"{name}: {(peak - baseline) / 1e6:.1f} MB more than a short file's"
        assert summary["audio_s"] == pytest.approx(seconds, abs=0.001), summary
        assert summary["segments"] == len(finals) == repeats, summary
        assert finals[-1]["end"] == pytest.approx(seconds - 1, abs=0.5), finals[-1]


def test_a_file_that_fails_part_way_through_fails_alone(null_service, tmp_path, capsys) -> None:
    """A file whose header reads but whose audio breaks off (a FLAC cut short in a copy) is read as
    it streams: what came before the break is transcribed and shown as it comes, but the file is
    said to have failed and given no transcript, which would pass for the whole file's; the other
    files are transcribed."""
    whole = tmp_path / "whole.flac"
    soundfile.write(whole, speech_with_pauses(8), RATE)
    cut = tmp_path / "cut.flac"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size * 2 // 3])
    out = io.StringIO()
    code = remote.run([str(cut), utterance("goforward").path], null_service.address, offline=True, as_json=True,
                      language=None, out=out)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert code == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"{cut}: cannot read audio: "), err
    assert [line["file"] for line in lines if line["type"] == "summary"] == [utterance("goforward").path]
    assert [line for line in lines if line["type"] == "final" and line["file"] == str(cut)]  # streamed until the break


# ---------------------------------------------------------------- against a fake ingest, no service


class FakeIngest:
    """One ROUTER on a thread, front door and ingest at once: it welcomes, opens every stream,
    swallows audio unanswered, like an ingest still connected but wedged, and answers `end` with
    `closed` (`unknown_stream` for a stream it has not open), in order after the replies it holds.

    `ingest` makes it a front door only, naming that ingest; `resumed` replaces welcome fields from
    the second hello on (a resume: another ingest, other limits); `garble_hellos` are the hellos (1
    for the first) it answers with bytes that are not msgpack; `refuse_reopens` answers an `open` of
    an id it opened before `overloaded`, like a busy service refusing a resume; `ready_delay` is how
    long the first `ready` of each id takes, like a busy ingest's; `at_end` makes it a working
    ingest: it acks audio, and gives, for a stream id, what it sends between that stream's `end`
    and its `closed`, which gives `end_reason` and all the audio taken as `durable`; `stalled`
    makes it a service that stopped decoding (its workers stopped): it acks audio, never moves
    the window past the first 30 s, and never answers `end`. `heard` is the language of a final it
    sends after each first `ready` (a service that says one); `unknown` makes it a service of an
    older release, before those fields of `open`: it refuses an open naming any of them, even at
    nil, `bad_message`, naming them, as a real one refuses any field it does not know; `token` is
    the `resume_token` its `ready`s give (one that an ingest of a newer release gave, with
    `unknown`: a mixed deploy).
    """

    def __init__(self, *, ingest: str | None = None, resumed: dict[str, Any] | None = None, garble_hellos: tuple[int, ...] = (),
                 refuse_reopens: bool = False, ready_delay: float = 0.0,
                 at_end: Callable[[str], list[ServerMessage]] | None = None, end_reason: str = "end",
                 stalled: bool = False, heard: str | None = None, unknown: frozenset[str] = frozenset(),
                 token: str | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.ingest = ingest or self.address
        self.resumed = resumed or {}
        self.garble_hellos = garble_hellos
        self.refuse_reopens = refuse_reopens
        self.ready_delay = ready_delay
        self.at_end = at_end
        self.end_reason = end_reason
        self.stalled = stalled
        self.heard = heard
        self.unknown = unknown
        self.token = token
        self.opens: list[Open] = []  # every open received
        self.taken: Counter[str] = Counter()  # input frames of each stream, acked when `at_end` is given
        self.held: list[tuple[float, list[bytes]]] = []  # (when, frames) of replies held back
        self.opened: set[str] = set()
        self.live: set[str] = set()  # opened and not ended
        self.received: Counter[str] = Counter()
        self.log: list[str] = []  # "<type> <stream>" of each open and end received
        self.audio: list[tuple[int, int]] = []  # (hellos received by then, payload bytes) of each audio message
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            now = time.monotonic()
            for _, frames in [item for item in self.held if item[0] <= now]:
                self.sock.send_multipart(frames)
            self.held = [item for item in self.held if item[0] > now]
            if not self.sock.poll(20):
                continue
            ident, *frames = self.sock.recv_multipart()
            msg = decode_client(frames)
            self.received[msg.type] += 1
            if isinstance(msg, Hello) and self.received["hello"] in self.garble_hellos:
                self.sock.send_multipart([ident, b"\xc1"])  # a byte msgpack never uses
                continue
            if isinstance(msg, Hello):
                fields = {"ingest": self.ingest, **(self.resumed if self.received["hello"] > 1 else {})}
                reply: ServerMessage = Welcome(**fields)
            elif isinstance(msg, Open) and self.refuse_reopens and msg.stream in self.opened:
                reply = ErrorMsg(code=OVERLOADED, message="the service is busy", stream=msg.stream)
            elif isinstance(msg, Open) and (newer := self.unknown & msgpack.unpackb(frames[0]).keys()):
                self.opens.append(msg)
                reply = ErrorMsg(code=BAD_MESSAGE, message=f"open: unknown fields {sorted(newer)}", stream=msg.stream)
            elif isinstance(msg, Open):
                self.opens.append(msg)
                self.log.append(f"open {msg.stream}")
                first = msg.stream not in self.opened
                self.opened.add(msg.stream)
                self.live.add(msg.stream)
                reply = Ready(stream=msg.stream, window=RATE * 30, resume_token=self.token)
                if self.heard and first:
                    self.sock.send_multipart([ident, *encode(reply)])
                    reply = Final(stream=msg.stream, seg=0, text="Hola.", start=0.0, end=0.0, language=self.heard)
                if self.ready_delay and first:
                    self.held.append((time.monotonic() + self.ready_delay, [ident, *encode(reply)]))
                    continue
            elif isinstance(msg, End):
                self.log.append(f"end {msg.stream}")
                if self.stalled:
                    continue
                if msg.stream in self.live:
                    self.live.discard(msg.stream)
                    for said in self.at_end(msg.stream) if self.at_end else []:
                        self.sock.send_multipart([ident, *encode(said)])
                    reply = Closed(stream=msg.stream, reason=self.end_reason, durable=self.taken[msg.stream])
                else:
                    reply = ErrorMsg(code=UNKNOWN_STREAM, message="no such stream", stream=msg.stream)
            elif isinstance(msg, Audio):
                self.audio.append((self.received["hello"], len(msg.data)))
                if self.at_end is None and not self.stalled:
                    continue
                taken = self.taken[msg.stream] = self.taken[msg.stream] + len(msg.data) // 2
                reply = Ack(stream=msg.stream, seq=msg.seq, samples=taken, window=RATE * 30 if self.stalled else taken + RATE * 30)
            else:
                continue
            if self.held:  # answers leave in order
                self.held.append((max(at for at, _ in self.held), [ident, *encode(reply)]))
            else:
                self.sock.send_multipart([ident, *encode(reply)])
        self.sock.close()

    def close(self) -> None:
        """The whole service goes away: front door and ingest."""
        self.stop.set()
        self.thread.join()
        self.ctx.term()


def test_async_client_takes_an_ingest_that_stops_acking_for_lost() -> None:
    """Audio sent while the reader waits owing nothing must still arm the liveness deadline."""
    fake = FakeIngest()

    async def main() -> int:
        client = await AsyncClient.connect(fake.address, timeout=2.0, liveness=0.5, resume_timeout=5.0)
        try:
            stream = await client.open("s")
            await asyncio.sleep(0.2)  # the reader now waits with nothing owed
            await stream.send(np.zeros(RATE // 2, np.int16))  # owes an ack from here on
            sent = time.monotonic()
            while client.reconnects == 0 and time.monotonic() < sent + 30.0:
                await asyncio.sleep(0.02)
            assert client.reconnects, "an ingest that never acks was not taken for lost"
            return time.monotonic() - sent
        finally:
            await client.close()

    try:
        # after `liveness` (0.5 s), counted from the send; a deadline never armed waits for ever
        assert 0.45 <= asyncio.run(main()) < 15.0
        assert fake.received["hello"] >= 2
    finally:
        fake.close()


def test_a_failed_resume_fails_the_streams_and_the_client_still_closes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the service cannot be reached again, the streams fail with `connection_lost`; the
    sockets a failed resume already closed are not closed again: the blocking client's IO thread
    ends without a traceback and either client's close() terminates its context."""
    uncaught: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: uncaught.append(args.exc_value))
    fake = FakeIngest()
    client = Client(fake.address, timeout=0.5, liveness=1.0, resume_timeout=1.0)
    stream = client.open("s")
    fake.close()
    with pytest.raises(StreamError) as failed:
        drain(stream, timeout=10)
    assert failed.value.code == LOST
    with pytest.raises(StreamError) as again:  # at once, not after the timeout: the stream is over
        drain(stream, timeout=5)
    assert again.value is failed.value
    client._thread.join(5)
    assert not client._thread.is_alive() and uncaught == []
    client.close()
    assert client._ctx.closed

    async def main() -> AsyncClient:
        fake = FakeIngest()
        aclient = await AsyncClient.connect(fake.address, timeout=0.5, liveness=1.0, resume_timeout=1.0)
        astream = await aclient.open("s")
        fake.close()
        with pytest.raises(StreamError) as failed:
            async for _ in astream.events(timeout=10):
                pass
        assert failed.value.code == LOST
        with pytest.raises(StreamError) as again:
            async for _ in astream.events(timeout=5):
                pass
        assert again.value is failed.value
        await aclient.close()
        return aclient

    assert asyncio.run(main())._ctx.closed


def wait_for(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


async def await_for(cond, timeout: float) -> bool:
    """`wait_for` on the event loop: the client's own tasks run while it waits."""
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return cond()


async def lost_stream(aclient: AsyncClient, timeout: float) -> StreamError:
    """Open stream "a" and send it half a second the ingest never acks, so it is taken for lost:
    what the stream's events end with once the client gives up resuming it."""
    astream = await aclient.open("a")
    await astream.send(np.zeros(RATE // 2, np.int16))
    with pytest.raises(StreamError) as failed:
        async for _ in astream.events(timeout=timeout):
            pass
    return failed.value


def test_closing_right_after_end_still_sends_it() -> None:
    """A client closed right after `end` must still get it out (its socket lingers), or the server
    keeps the stream until its idle timeout and never decodes its last segment."""
    fake = FakeIngest()  # never acks: the audio and the `end` are still unanswered when the client closes
    try:
        with Client(fake.address) as client:
            with client.open("s") as stream:
                stream.send(np.zeros(RATE // 10, np.int16))
        assert wait_for(lambda: fake.received["end"] == 1, 2.0), fake.received

        async def main() -> None:
            async with AsyncClient(fake.address) as aclient:
                async with await aclient.open("a") as astream:
                    await astream.send(np.zeros(RATE // 10, np.int16))

        asyncio.run(main())
        assert wait_for(lambda: fake.received["end"] == 2, 2.0), fake.received
    finally:
        fake.close()


FROZEN_INGEST = """
import zmq
from protocol.messages import Open, Ready, decode_client, encode
sock = zmq.Context().socket(zmq.ROUTER)
print(sock.bind_to_random_port("tcp://127.0.0.1"), flush=True)
while True:
    ident, *frames = sock.recv_multipart()
    msg = decode_client(frames)
    if isinstance(msg, Open):
        sock.send_multipart([ident, *encode(Ready(stream=msg.stream, window=4000))])
"""


def test_an_ingest_that_stops_reading_never_blocks_the_io_thread() -> None:
    """A frozen ingest host (SIGSTOP) with thousands of messages queued for it: sends must not
    block, so liveness still finds it lost, the client resumes, and close() returns."""
    ingest = subprocess.Popen([sys.executable, "-c", FROZEN_INGEST], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        front = FakeIngest(ingest=f"tcp://127.0.0.1:{int(ingest.stdout.readline())}")
        try:
            client = Client(front.address, timeout=5.0, liveness=1.0, resume_timeout=30.0)
            stream = client.open("s")  # window 4000: 1000-frame (2000-byte) messages
            os.kill(ingest.pid, signal.SIGSTOP)
            stream.send(np.zeros(RATE * 1000, np.int16))  # 16000 messages, far past every buffer on the way
            assert wait_for(lambda: client.reconnects >= 1, 10.0), "the IO thread is stuck in a send"
            closer = threading.Thread(target=client.close, daemon=True)
            closer.start()
            closer.join(5)
            assert not closer.is_alive(), "close() hangs"
        finally:
            front.close()
    finally:
        ingest.kill()
        ingest.wait()


def test_a_garbled_front_door_answer_during_a_resume_is_retried() -> None:
    """The front door may be restarting: an answer that cannot be decoded is retried like no answer."""
    fake = FakeIngest(garble_hellos=(2,))  # the first hello of the resume
    try:
        with Client(fake.address, timeout=2.0, liveness=0.5, resume_timeout=5.0) as client:
            stream = client.open("s")
            stream.send(np.zeros(RATE // 2, np.int16))  # never acked: the ingest is taken for lost
            assert wait_for(lambda: client.reconnects >= 1, 5.0)
            stream.send(np.zeros(RATE // 10, np.int16))  # the stream carries on
        assert fake.received["hello"] >= 3
    finally:
        fake.close()

    async def main() -> int:
        async with AsyncClient(afake.address, timeout=2.0, liveness=0.5, resume_timeout=5.0) as aclient:
            astream = await aclient.open("a")
            await astream.send(np.zeros(RATE // 2, np.int16))
            await await_for(lambda: aclient.reconnects >= 1, 5.0)
            await astream.send(np.zeros(RATE // 10, np.int16))
            return aclient.reconnects

    afake = FakeIngest(garble_hellos=(2,))
    try:
        assert asyncio.run(main()) >= 1
        assert afake.received["hello"] >= 3
    finally:
        afake.close()


def test_a_resume_an_older_service_refuses_for_its_language_is_sent_again_without_it() -> None:
    """A stream resumed on a service before `open.resume_language` (a mixed or rolled-back
    deploy) is refused `bad_message` for the field: each client re-opens it at once without the
    field, and the stream goes on, where failing it would lose the audio it keeps."""
    fake = FakeIngest(heard="es", unknown=NEWER_OPEN_FIELDS)
    try:
        with Client(fake.address, timeout=2.0, liveness=0.5, resume_timeout=5.0) as client:
            stream = client.open("s")
            stream.send(np.zeros(RATE // 2, np.int16))  # never acked: the ingest is taken for lost
            assert wait_for(lambda: client.reconnects >= 1 and len(fake.opens) >= 3, 10.0)
            stream.send(np.zeros(RATE // 10, np.int16))  # the stream carries on

        async def main() -> None:
            async with AsyncClient(fake.address, timeout=2.0, liveness=0.5, resume_timeout=5.0) as aclient:
                astream = await aclient.open("a")
                await astream.send(np.zeros(RATE // 2, np.int16))
                await await_for(lambda: aclient.reconnects >= 1 and len(fake.opens) >= 6, 10.0)
                await astream.send(np.zeros(RATE // 10, np.int16))

        asyncio.run(main())
        for sid in ("s", "a"):
            opens = [(o.offset, o.resume_text, o.resume_language) for o in fake.opens if o.stream == sid][:3]
            assert opens == [(0, None, None), (0, "Hola.", "es"), (0, "Hola.", None)], opens
    finally:
        fake.close()


@pytest.mark.parametrize("unknown", [set(), {"resume_token"}, NEWER_OPEN_FIELDS],
                         ids=["same-release", "ingest-before-tokens", "ingest-before-both"])
def test_a_resume_brings_back_the_token_its_ready_gave(unknown: set[str]) -> None:
    """A realtime stream's `ready` gives a resume token: its resume sends it back, which is what
    holds the resume to twice the admission limits rather than refusing it as new load. An ingest
    of an older release (a mixed deploy: a newer one gave the token) refuses the field: the
    stream is resumed again at once without it, and goes on. Without `resume_language` too when
    the ingest refuses that as well; with it when the ingest knows it, so the resume keeps the
    stream's language."""
    fake = FakeIngest(heard="es", unknown=frozenset(unknown), token="0123abcd")
    older = bool(unknown)
    try:
        with Client(fake.address, timeout=2.0, liveness=0.5, resume_timeout=5.0) as client:
            stream = client.open("s")
            stream.send(np.zeros(RATE // 2, np.int16))  # never acked: the ingest is taken for lost
            assert wait_for(lambda: client.reconnects >= 1 and len(fake.opens) >= 2 + older, 10.0)
            stream.send(np.zeros(RATE // 10, np.int16))  # the stream carries on
        opens = [(o.offset, o.resume_language, o.resume_token) for o in fake.opens][:2 + older]
        again = (0, None if "resume_language" in unknown else "es", None)
        assert opens == [(0, None, None), (0, "es", "0123abcd"), *[again] * older], opens
    finally:
        fake.close()


def test_a_resume_the_service_keeps_refusing_fails_when_the_resume_timeout_runs_out() -> None:
    """`overloaded` for a re-open is retried, backing off, but not past `resume_timeout`."""
    fake = FakeIngest(refuse_reopens=True)
    try:
        client = Client(fake.address, timeout=2.0, liveness=0.5, resume_timeout=2.5)
        with client:
            stream = client.open("s")
            stream.send(np.zeros(RATE // 2, np.int16))  # never acked: the ingest is taken for lost
            started = time.monotonic()
            with pytest.raises(StreamError) as failed:
                drain(stream, timeout=60.0)
            # liveness and resume_timeout come to 3 s; more on a loaded machine, but far from for ever
            assert failed.value.code == LOST and time.monotonic() - started < 20.0

        async def main() -> StreamError:
            async with AsyncClient(fake.address, timeout=2.0, liveness=0.5, resume_timeout=2.5) as aclient:
                return await lost_stream(aclient, timeout=60.0)

        assert asyncio.run(main()).code == LOST
        assert fake.received["open"] >= 6  # each client: its open, then at least two refused re-opens
    finally:
        fake.close()


def test_an_open_after_a_quiet_spell_is_not_taken_for_a_lost_ingest() -> None:
    """The liveness clock starts when an answer becomes owed: an open on a client that owed nothing
    for longer than `liveness` waits for its `ready`, it does not resume every stream at once."""
    fake = FakeIngest(ready_delay=0.5)  # well within `liveness` once its clock starts at the open
    try:
        with Client(fake.address, timeout=5.0, liveness=2.0) as client:
            time.sleep(2.5)
            client.open("s")
            time.sleep(0.3)
            assert client.reconnects == 0

        async def main() -> int:
            async with AsyncClient(fake.address, timeout=5.0, liveness=2.0) as aclient:
                await asyncio.sleep(2.5)
                await aclient.open("a")
                await asyncio.sleep(0.3)
                return aclient.reconnects

        assert asyncio.run(main()) == 0
        assert fake.received["hello"] == 2 and fake.received["open"] == 2
    finally:
        fake.close()


def test_async_close_against_an_ingest_that_stops_reading_leaves_the_event_loop_running() -> None:
    """close() gives queued messages the socket's linger to leave; with a frozen ingest they never
    do, and the other tasks on the loop (a service's other clients, its timers) must run meanwhile."""
    ingest = subprocess.Popen([sys.executable, "-c", FROZEN_INGEST], stdout=subprocess.PIPE, text=True, cwd=ROOT)

    async def main(address: str) -> tuple[float, int]:
        aclient = await AsyncClient.connect(address, timeout=5.0, liveness=60.0)
        stream = await aclient.open("s")
        os.kill(ingest.pid, signal.SIGSTOP)
        await stream.send(np.zeros(RATE * 1000, np.int16))  # far past every buffer on the way
        ticks: list[float] = []

        async def tick() -> None:
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.05)
        started = time.monotonic()
        await aclient.close()
        ended = time.monotonic()
        ticker.cancel()
        return ended - started, sum(started < t < ended for t in ticks)

    try:
        front = FakeIngest(ingest=f"tcp://127.0.0.1:{int(ingest.stdout.readline())}")
        try:
            took, ticked = asyncio.run(main(front.address))
        finally:
            front.close()
    finally:
        ingest.kill()
        ingest.wait()
    assert took >= 0.4, f"close() took {took:.3f}s: the queued audio left, nothing was waited for"
    # every 10 ms when the loop runs; a close() that blocked the loop would let it tick once at most
    assert ticked >= 3, f"the ticker ran {ticked} times during close()'s {took:.3f}s"


def test_closing_while_a_resume_waits_for_the_front_door_returns_at_once() -> None:
    """With the whole service gone a resume says hello until `resume_timeout` runs out; close() must
    not wait for that, and the streams fail as closed."""
    fake = FakeIngest()
    client = Client(fake.address, timeout=5.0, resume_timeout=60.0)
    stream = client.open("s")
    ingest = client._sock
    fake.close()  # the connection drops: the client starts resuming
    assert wait_for(lambda: ingest.closed, 10.0), "no resume started"
    closer = threading.Thread(target=client.close, daemon=True)
    closer.start()
    closer.join(15.0)  # far below the 60 s the resume would take to give up
    assert not closer.is_alive(), "close() waits for the resume to give up"
    with pytest.raises(StreamError) as failed:
        drain(stream, timeout=1.0)
    assert failed.value.code == CLOSED

    async def main() -> float:
        afake = FakeIngest()
        aclient = await AsyncClient.connect(afake.address, timeout=5.0, resume_timeout=60.0)
        await aclient.open("a")
        ingest = aclient._sock
        assert ingest is not None
        afake.close()
        assert await await_for(lambda: ingest.closed, 10.0), "no resume started"
        started = time.monotonic()
        await aclient.close()
        return time.monotonic() - started

    assert asyncio.run(main()) < 15.0  # far below the 60 s the resume would take to give up


def test_an_open_its_caller_cancels_is_abandoned() -> None:
    """An asyncio open given up by the caller's own timeout (its task cancelled) is forgotten and
    ended, as one past the client's `timeout` is: the id can be opened again."""
    fake = FakeIngest(ready_delay=0.5)

    async def main() -> None:
        async with AsyncClient(fake.address, timeout=3.0) as aclient:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(aclient.open("s"), 0.1)
            await aclient.open("s")

    try:
        asyncio.run(main())
        assert wait_for(lambda: fake.received["end"] == 1, 2.0), fake.received
    finally:
        fake.close()


def test_an_id_whose_open_timed_out_opens_again_as_a_new_stream() -> None:
    """The server answers a given-up open late (`ready`), then its `end` (`closed`). An open of the
    same id meanwhile must wait for those, not take them for its own: else it returns at once and
    the stream is closed under the caller, who never ended it."""
    fake = FakeIngest(ready_delay=1.5)
    try:
        with Client(fake.address, timeout=1.0) as client:
            with pytest.raises(TimeoutError):
                client.open("s")
            stream = client.open("s")
            with pytest.raises(TimeoutError):  # the first open's `closed` is not this stream's
                next(stream.events(timeout=1.5))
            stream.end()
            assert isinstance(next(stream.events(timeout=5)), Closed)
        assert fake.log == ["open s", "end s", "open s", "end s"]

        async def main() -> None:
            async with AsyncClient(fake.address, timeout=1.0) as aclient:
                with pytest.raises(TimeoutError):
                    await aclient.open("a")
                astream = await aclient.open("a")
                with pytest.raises(TimeoutError):
                    await anext(astream.events(timeout=1.5))
                await astream.end()
                assert isinstance(await anext(astream.events(timeout=5)), Closed)

        asyncio.run(main())
        assert fake.log[4:] == ["open a", "end a", "open a", "end a"]
    finally:
        fake.close()


def test_a_batch_send_times_out_while_other_streams_move() -> None:
    """`send(timeout=)` bounds the wait for this stream's window, as in the blocking client: audio another
    stream sends meanwhile does not restart it."""
    fake = FakeIngest()  # a 30 s window, never moved: the batch stream's last second waits for good

    async def main() -> float:
        async with AsyncClient(fake.address, timeout=3.0, liveness=60.0) as aclient:
            batch = await aclient.open("b", priority="batch")
            live = await aclient.open("r")

            async def talk() -> None:  # 20 s of audio, within its 30 s window: a timeout it restarted ends after it
                for _ in range(200):
                    await live.send(np.zeros(RATE // 10, np.int16))
                    await asyncio.sleep(0.1)

            talker = asyncio.create_task(talk())
            started = time.monotonic()
            try:
                with pytest.raises(TimeoutError):
                    await batch.send(np.zeros(RATE * 31, np.int16), timeout=0.5)
                return time.monotonic() - started
            finally:
                talker.cancel()

    try:
        assert asyncio.run(main()) < 10.0  # the 0.5 s asked for, not the 20 s the other stream talks
    finally:
        fake.close()


def test_a_batch_send_that_runs_out_of_credit_leaves_its_unsent_audio_out_so_end_goes_out_at_once() -> None:
    """The window stops moving (the service stopped decoding): the send that gives up raises, and
    what it had not sent is not sent later either: the stream's `end` goes out at once after the
    audio that went out, not behind audio waiting for credit that may never come. An asyncio send
    its caller cancels (its own timeout) is given up the same way."""
    fake = FakeIngest(stalled=True)  # acks, but never moves the window past the first 30 s
    try:
        with Client(fake.address, timeout=5.0) as client:
            stream = client.open("s", priority="batch")
            with pytest.raises(TimeoutError, match="left out of the stream"):
                stream.send(np.zeros(RATE * 31, np.int16), timeout=0.5)
            stream.end()
            assert wait_for(lambda: fake.received["end"] == 1, 10.0), "end waits behind the audio no credit came for"
        assert fake.taken["s"] == RATE * 30  # what the window allowed, no more

        async def main() -> None:
            async with AsyncClient(fake.address, timeout=5.0) as aclient:
                astream = await aclient.open("a", priority="batch")
                with pytest.raises(TimeoutError, match="left out of the stream"):
                    await astream.send(np.zeros(RATE * 31, np.int16), timeout=0.5)
                await astream.end()
                cancelled = await aclient.open("c", priority="batch")
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(cancelled.send(np.zeros(RATE * 31, np.int16)), 0.5)
                await cancelled.end()
                assert await await_for(lambda: fake.received["end"] == 3, 10.0), "end waits behind the audio no credit came for"

        asyncio.run(main())
        assert fake.taken["a"] == fake.taken["c"] == RATE * 30
        assert fake.log[-2:] == ["open c", "end c"]
    finally:
        fake.close()


def test_a_batch_send_that_runs_out_of_credit_says_exactly_how_much_of_it_went_out(service_factory) -> None:
    """The service stops decoding (its worker stopped) and a stream's buffer fills: a batch send
    that gives up says how many of its samples went out, both clients alike, so that the caller
    can send the rest once the service is back, and the stream holds its audio whole, each sample
    once. (The blocking client raised before its IO thread had taken the rest back, and sent what
    credit came meanwhile, so it could not say.)"""
    svc = service_factory(model="null", workers=1, broker={"heartbeat_ms": 1000, "liveness": 60})
    [worker] = [p["pid"] for p in processes(svc.cfg) if p["name"].startswith("worker-") and p["pid"]]
    audio = speech_with_pauses(30)  # 104 s: more than a stream's buffer (60 s) holds undecoded
    os.kill(worker, signal.SIGSTOP)
    try:
        with Client(svc.address, timeout=10.0) as client:
            stream = client.open("blocking", priority="batch")
            with pytest.raises(TimeoutError, match="left out of the stream") as blocking:
                stream.send(audio, timeout=1.0)

            async def main() -> tuple[TimeoutError, Closed]:
                async with AsyncClient(svc.address, timeout=10.0) as aclient:
                    astream = await aclient.open("asyncio", priority="batch")
                    with pytest.raises(TimeoutError, match="left out of the stream") as caught:
                        await astream.send(audio, timeout=1.0)
                    os.kill(worker, signal.SIGCONT)  # the service decodes again: the rest goes out
                    await astream.send(audio[caught.value.sent :], timeout=60.0)
                    await astream.end()
                    events = [ev async for ev in astream.events(timeout=60.0)]
                    assert isinstance(events[-1], Closed), events[-1]
                    return caught.value, events[-1]

            gave_up, aclosed = asyncio.run(main())
            stream.send(audio[blocking.value.sent :], timeout=60.0)
            stream.end()
            closed = drain(stream)[-1]
    finally:
        os.kill(worker, signal.SIGCONT)  # again, if the test failed first
    for caught, done in ((blocking.value, closed), (gave_up, aclosed)):
        assert 0 < caught.sent < len(audio) and caught.sent + caught.unsent == len(audio), caught
        assert isinstance(done, Closed) and done.reason == "end", done
        # the input frames the service took, in order: all of it, none twice, none missing
        assert done.durable == len(audio) and done.audio_s == pytest.approx(len(audio) / RATE, abs=0.001), (caught, done)


def test_transcribe_reports_a_file_the_service_stops_taking_at_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                                    capsys) -> None:
    """An offline file whose window stops moving (the service stopped decoding) fails once its
    credit timeout runs out, saying so: its reader does not then wait out the event timeout for
    finals the service is not decoding, nor for the `closed` of an `end` that waited behind the
    audio the credit never came for."""
    monkeypatch.setattr(remote, "CREDIT_TIMEOUT_S", 0.5)
    path = tmp_path / "long.wav"
    soundfile.write(path, np.zeros(RATE * 35, np.int16), RATE)  # past the fake's 30 s window
    fake = FakeIngest(stalled=True)
    codes: list[int] = []
    try:
        # the event timeout is 120 s: waiting it out is the hang
        assert finishes(lambda: codes.append(remote.run([str(path)], fake.address, offline=True, as_json=False,
                                                        language=None)), 60.0), "transcribe waits for a stream that is stuck"
        assert wait_for(lambda: fake.received["end"] == 1, 5.0)  # the service may still free it
    finally:
        fake.close()
    assert codes == [1]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"{path}: sending audio failed: ") and "no send credit for 0.5s" in err[0], err


def test_opens_the_protocol_does_not_allow_are_refused_at_once(null_service) -> None:
    """A bad id or a header too large to decode gets an error naming no stream: the client must not
    send it and wait for an answer it cannot recognise, nor show that error to its other streams."""
    bad = [{"stream": "x" * 65}, {"stream": "p", "prompt": "word " * 1000}, {"stream": "l", "language": "x" * 17},
           {"stream": ""},  # an empty id is no id: not a random one in its place
           {"stream": "r", "rate": np.int64(16000)}]  # msgpack's own TypeError before
    with Client(null_service.address, timeout=60.0) as client:
        other = client.open("other")
        for kwargs in bad:
            started = time.monotonic()
            with pytest.raises(ValueError):
                client.open(**kwargs)
            assert time.monotonic() - started < 15.0  # not the 60 s timeout an answer would be awaited for
        with pytest.raises(TimeoutError):
            next(other.events(timeout=0.5))
        other.end()
        assert isinstance(drain(other)[-1], Closed)

    async def main() -> None:
        async with AsyncClient(null_service.address, timeout=60.0) as aclient:
            for kwargs in bad:
                with pytest.raises(ValueError):
                    await asyncio.wait_for(aclient.open(**kwargs), 15.0)  # a TimeoutError if an answer is awaited

    asyncio.run(main())


def finishes(fn: Callable[[], object], timeout: float = 10.0) -> bool:
    """Whether `fn` returns within `timeout`; run on a daemon thread, so a hang fails the test instead of stalling it."""
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    thread.join(timeout)
    return not thread.is_alive()


@pytest.mark.parametrize("unreachable", [False, True], ids=["ingest-never-acks", "ingest-unreachable"])
def test_a_resume_that_never_makes_progress_fails_when_the_resume_timeout_runs_out(unreachable: bool) -> None:
    """The front door answers every resume, but the ingest it names takes the re-open and never acks the
    resent audio, or cannot be reached at all: each loss starts another resume, so the deadline must
    count from the first loss, or the stream retries for ever."""
    resumed = {"ingest": f"tcp://127.0.0.1:{free_ports(1)}"} if unreachable else None  # nothing listens there
    fake = FakeIngest(resumed=resumed)
    try:
        with Client(fake.address, timeout=2.0, liveness=0.5, resume_timeout=1.5) as client:
            stream = client.open("s")
            stream.send(np.zeros(RATE // 2, np.int16))  # never acked: the ingest is taken for lost
            with pytest.raises(StreamError) as failed:
                drain(stream, timeout=20)
            assert (failed.value.code, failed.value.stream) == (LOST, "s") and client.reconnects >= 1
    finally:
        fake.close()

    async def main() -> tuple[StreamError, int]:
        async with AsyncClient(afake.address, timeout=2.0, liveness=0.5, resume_timeout=1.5) as aclient:
            return await lost_stream(aclient, timeout=20), aclient.reconnects

    afake = FakeIngest(resumed=resumed)
    try:
        error, reconnects = asyncio.run(main())
        assert (error.code, error.stream) == (LOST, "a") and reconnects >= 1
    finally:
        afake.close()


def test_a_welcome_naming_an_endpoint_that_cannot_be_connected_to_leaves_no_socket_open() -> None:
    """ZeroMQ refuses the connect at once: the new socket and its monitor must be closed, or the
    context's term, and so the client's close(), waits for them for ever."""
    bad = "tcp://127.0.0.1:notaport"
    ctx = zmq.Context()
    with pytest.raises(zmq.ZMQError) as failed:  # kept, and with it the frames of the failed call
        ingest_socket(ctx, bad)
    assert "notaport" in str(failed.value) and finishes(ctx.term), "a socket was left open"

    fake = FakeIngest(ingest=bad)
    try:
        aclient = AsyncClient(fake.address, timeout=2.0)

        def start() -> None:
            with pytest.raises(zmq.ZMQError):
                asyncio.run(aclient.start())

        assert finishes(start) and aclient._ctx.closed, "start() failed leaving its context open"
    finally:
        fake.close()

    errors: list[StreamError] = []

    async def main() -> None:  # the resume's welcome names it
        aclient = await AsyncClient.connect(fake.address, timeout=2.0, liveness=0.5, resume_timeout=5.0)
        errors.append(await lost_stream(aclient, timeout=10))
        await aclient.close()

    fake = FakeIngest(resumed={"ingest": bad})
    try:
        assert finishes(lambda: asyncio.run(main()), 20.0), "close() hangs"
        assert len(errors) == 1, "the stream did not fail"
    finally:
        fake.close()


def test_a_resume_cuts_its_audio_to_the_limits_the_new_welcome_gives() -> None:
    """The ingest a stream resumes on may take smaller messages than the first one: resent at the
    first one's size they would be refused `frame_too_large`, and the stream would take no more."""
    def resent(fake: FakeIngest) -> list[int]:
        return [size for hellos, size in fake.audio if hellos > 1]

    fake = FakeIngest(resumed={"limits": {"max_frame_bytes": 3200}})
    try:
        with Client(fake.address, timeout=2.0, liveness=0.5, resume_timeout=30.0) as client:
            stream = client.open("s")
            stream.send(np.zeros(RATE, np.int16))  # one 32000-byte message, never acked: the ingest is taken for lost
            assert wait_for(lambda: sum(resent(fake)) >= RATE * 2, 10.0), fake.audio
            assert client.limits.max_frame_bytes == 3200
        assert fake.audio[0] == (1, RATE * 2) and max(resent(fake)) <= 3200
    finally:
        fake.close()

    async def main() -> int:
        async with AsyncClient(afake.address, timeout=2.0, liveness=0.5, resume_timeout=30.0) as aclient:
            astream = await aclient.open("a")
            await astream.send(np.zeros(RATE, np.int16))
            await await_for(lambda: sum(resent(afake)) >= RATE * 2, 10.0)
            return aclient.limits.max_frame_bytes

    afake = FakeIngest(resumed={"limits": {"max_frame_bytes": 3200}})
    try:
        assert asyncio.run(main()) == 3200
        assert afake.audio[0] == (1, RATE * 2) and sum(resent(afake)) >= RATE * 2 and max(resent(afake)) <= 3200, afake.audio
    finally:
        afake.close()


def test_an_open_waiting_on_a_resume_that_fails_fails_with_it() -> None:
    """An open asked for while the IO thread resumes is taken only after the resume; if the resume
    fails, the thread ends without taking it, and the open must fail then, not wait out its timeout."""
    fake = FakeIngest()
    client = Client(fake.address, timeout=300.0, resume_timeout=2.0)
    failures: list[BaseException] = []

    def open_new() -> None:
        try:
            client.open("new")
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            failures.append(exc)

    try:
        client.open("s")
        ingest = client._sock
        fake.close()  # the whole service goes: the client resumes, and fails
        assert wait_for(lambda: ingest.closed, 10.0), "no resume started"
        assert finishes(open_new, 60.0), "open() waits out its own timeout"
        assert len(failures) == 1 and isinstance(failures[0], StreamError) and failures[0].code == LOST, failures
    finally:
        client.close()


def test_an_open_in_flight_when_the_ingest_is_lost_reports_no_resume() -> None:
    """The open is sent again on the new connection; the caller never had the stream before, so
    it was not resumed, in either client."""
    fake = FakeIngest(ready_delay=3.0)  # the first open's `ready` (and those sent meanwhile) come well past `liveness`
    try:
        with Client(fake.address, timeout=10.0, liveness=1.0) as client:
            stream = client.open("s")
            assert client.reconnects >= 1 and stream.resumes == []

        async def main() -> tuple[int, list[int]]:
            async with AsyncClient(fake.address, timeout=10.0, liveness=1.0) as aclient:
                astream = await aclient.open("a")
                return aclient.reconnects, astream.resumes

        reconnects, resumes = asyncio.run(main())
        assert reconnects >= 1 and resumes == []
    finally:
        fake.close()


def test_transcribe_with_a_language_the_protocol_does_not_allow_fails_the_file(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """`transcribe --server --language <17 characters>`: `Client.open` refuses it with ValueError
    before sending. Raised on the file's thread, it left a traceback, no error for the file, an
    empty transcript and exit status 0."""
    uncaught: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: uncaught.append(args.exc_value))
    fake = FakeIngest()
    try:
        out = io.StringIO()
        code = remote.run([utterance("goforward").path], fake.address, offline=True, as_json=False,
                          language="english-as-spoken", out=out)
    finally:
        fake.close()
    assert uncaught == []
    assert code == 1
    assert "language must be a language code" in capsys.readouterr().err


def test_transcribe_against_a_front_door_that_is_not_one_says_it_cannot_connect(capsys) -> None:
    """An answer to `hello` that is not the protocol's (another ZeroMQ service on that port)
    raised ProtocolError out of `remote.run`: a traceback, not `cannot connect to ...`."""
    fake = FakeIngest(garble_hellos=(1,))
    try:
        code = remote.run([utterance("goforward").path], fake.address, offline=True, as_json=False, language=None,
                          out=io.StringIO())
    finally:
        fake.close()
    assert code == 1
    assert f"cannot connect to {fake.address}" in capsys.readouterr().err


def test_a_client_on_the_services_host_reaches_an_ingest_bound_to_the_wildcard() -> None:
    """A service on `tcp://*:7700` (ZeroMQ's wildcard, which the config takes) names its ingests
    `tcp://*:<port>`; a client that reached the front door on 127.0.0.1 connected to that as it
    was and failed with ZMQError 'Invalid argument', in either client."""
    fake = FakeIngest()
    fake.ingest = fake.address.replace("127.0.0.1", "*")
    try:
        with Client(fake.address, timeout=5.0) as client:
            client.open("s")
            assert client.ingest == fake.address

        async def main() -> str:
            async with AsyncClient(fake.address, timeout=5.0) as aclient:
                await aclient.open("a")
                return aclient.ingest

        assert asyncio.run(main()) == fake.address
    finally:
        fake.close()


def test_transcribe_prints_a_file_whose_segment_failed_with_the_error(capsys) -> None:
    """A segment the service could not transcribe is said (`error internal`) and still gets its
    final; the stream goes on to `closed` "end". The file's transcript is printed with the
    error beside it and the exit status 1: it was left out as if nothing had been heard."""
    fake = FakeIngest(at_end=lambda stream: [
        Final(stream=stream, seg=0, text="go forward", start=0.1, end=1.0),
        ErrorMsg(code=INTERNAL, stream=stream, message="segment 1 could not be transcribed: a worker failed"),
        Final(stream=stream, seg=1, text="ten", start=1.0, end=1.6),
        Final(stream=stream, seg=2, text="meters", start=1.6, end=2.5),
    ])
    try:
        out = io.StringIO()
        code = remote.run([utterance("goforward").path], fake.address, offline=True, as_json=False, language=None, out=out)
    finally:
        fake.close()
    assert code == 1
    assert out.getvalue() == "go forward ten meters\n"
    assert "server error internal: segment 1 could not be transcribed" in capsys.readouterr().err


def test_transcribe_prints_a_file_whose_end_crossed_the_services_shutdown() -> None:
    """The service is stopping as the file's `end` goes out: the ingest ends the stream itself and
    answers `closed` "shutdown" with every frame transcribed (`durable`). The client passes such a
    `closed` on only for a stream the service had all of (it resumes the others elsewhere), so the
    file is whole: printed, exit 0, not failed as "closed early"."""
    fake = FakeIngest(at_end=lambda stream: [Final(stream=stream, seg=0, text="go forward ten meters", start=0.1, end=2.5)],
                      end_reason="shutdown")
    try:
        out = io.StringIO()
        code = remote.run([utterance("goforward").path], fake.address, offline=True, as_json=False, language=None, out=out)
    finally:
        fake.close()
    assert (code, out.getvalue()) == (0, "go forward ten meters\n")


def test_finals_that_arrived_behind_another_streams_shutdown_reach_their_stream() -> None:
    """An ingest shutting down closes a stream still speaking (`closed` "shutdown": it goes on elsewhere)
    and, in the same flush, sends another stream its last final and `closed`. Those arrived: dropped
    with the old connection, that stream would be decoded again on another ingest, or, with none
    left to take it (the whole service stopping), fail with `connection_lost` for a final it had."""
    nowhere = {"ingest": f"tcp://127.0.0.1:{free_ports(1)}"}  # no ingest left to resume on

    def shutting_down(speaking: str) -> tuple[FakeIngest, Callable[[], None]]:
        """The fake, and what holds the client's IO until the fake's answer to `end` is all in, so it
        arrives as the results of one flush do: together."""
        held, answering = threading.Event(), threading.Event()

        def at_end(stream: str) -> list[ServerMessage]:
            held.wait(10)
            answering.set()
            return [Closed(stream=speaking, reason="shutdown"),
                    Final(stream=stream, seg=0, text="the last words", start=0.1, end=0.4, durable=RATE // 2)]

        def hold() -> None:
            held.set()
            answering.wait(10)
            time.sleep(0.2)

        return FakeIngest(resumed=nowhere, at_end=at_end), hold

    fake, hold = shutting_down("a")
    try:
        with Client(fake.address, timeout=2.0, liveness=0.5, resume_timeout=1.5) as client:
            speaking = client.open("a")
            speaking.send(np.zeros(RATE // 2, np.int16))
            done = client.open("b")
            done.send(np.zeros(RATE // 2, np.int16))
            done.end()
            assert wait_for(lambda: "end b" in fake.log, 5.0)
            client._submit(hold)  # on the IO thread
            events = drain(done, timeout=20)
            assert [type(ev) for ev in events] == [Final, Closed] and events[0].text == "the last words", events
            assert done.resumes == []
            with pytest.raises(StreamError) as failed:  # the stream cut short still fails: nowhere to resume it
                drain(speaking, timeout=20)
            assert failed.value.code == LOST
    finally:
        fake.close()

    async def main() -> tuple[list[ServerMessage], list[int]]:
        async with AsyncClient(afake.address, timeout=2.0, liveness=0.5, resume_timeout=1.5) as aclient:
            aspeaking = await aclient.open("x")
            await aspeaking.send(np.zeros(RATE // 2, np.int16))
            adone = await aclient.open("y")
            await adone.send(np.zeros(RATE // 2, np.int16))
            await adone.end()
            ahold()  # on the event loop, which the reader runs on
            return [ev async for ev in adone.events(timeout=20)], adone.resumes

    afake, ahold = shutting_down("x")
    try:
        events, resumes = asyncio.run(main())
        assert [type(ev) for ev in events] == [Final, Closed] and events[0].text == "the last words", events
        assert resumes == []
    finally:
        afake.close()
