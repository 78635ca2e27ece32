"""`streamasr transcribe --server`: stream audio files to a running service, all at once.

Each file is one stream on one shared Client: a sender thread paces its audio at wall-clock
rate (as a microphone would deliver it) or, offline, pushes it as fast as the server's credit
allows; a reader thread turns its events into output lines with client-side latencies.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import numpy as np
import soundfile
import soxr
import zmq

from client.client import Client, Stream
from client.core import ServerError
from protocol.auth import Curve
from protocol.messages import MAX_CHANNELS, OVERLOADED, RATES, Closed, ErrorMsg, Final, Partial, ProtocolError
from speech.audio import RAW_SUFFIXES, not_a_file, to_mono

RAW_RATE = 16000  # headerless files (RAW_SUFFIXES): 16 kHz s16le mono
EVENT_TIMEOUT_S = 120.0  # longest silence from the server before a stream is given up
CREDIT_TIMEOUT_S = 120.0  # longest an offline stream waits for the window to move


@dataclass
class Audio:
    samples: np.ndarray  # (frames, channels), int16 or float32
    rate: int

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.rate


def load(path: str) -> Audio:
    """A file at its native rate and channels if the protocol takes that rate, else at 16 kHz;
    mixed to mono past the channels a stream carries. Headerless files and a file without
    samples are taken as `transcribe --local` takes them."""
    if why := not_a_file(Path(path)):
        raise ValueError(why)
    if Path(path).suffix.lower() in RAW_SUFFIXES:
        audio = Audio(np.fromfile(path, dtype="<i2").reshape(-1, 1), RAW_RATE)
    elif (info := soundfile.info(path)).samplerate in RATES:
        audio = Audio(soundfile.read(path, dtype="int16", always_2d=True)[0], info.samplerate)
    else:
        data, rate = soundfile.read(path, dtype="float32", always_2d=True)
        audio = Audio(soxr.resample(data, rate, 16000).astype(np.float32), 16000)
    if not len(audio.samples):
        raise ValueError("the file holds no audio samples")
    if audio.samples.shape[1] > MAX_CHANNELS:
        full_scale = np.float32(32768.0 if audio.samples.dtype == np.int16 else 1.0)
        audio.samples = (to_mono(audio.samples) / full_scale)[:, None]
    return audio


@dataclass
class Job:
    """One file's stream and what came back on it."""

    file: str
    audio: Audio
    stream: Stream | None = None
    finals: list[str] = field(default_factory=list)
    closed: Closed | None = None
    error: str | None = None
    started: float = 0.0
    wall_s: float = 0.0


class Output:
    """Serializes lines from the reader threads."""

    def __init__(self, out: TextIO, as_json: bool) -> None:
        self.out = out
        self.as_json = as_json
        self.lock = threading.Lock()

    def json(self, obj: dict) -> None:
        if self.as_json:
            with self.lock:
                self.out.write(json.dumps(obj, ensure_ascii=False) + "\n")
                self.out.flush()


def run(
    files: list[str],
    server: str,
    offline: bool,
    as_json: bool,
    language: str | None,
    out: TextIO = sys.stdout,
    partials: bool = True,
    frame_ms: int = 100,
    curve: Curve | None = None,
) -> int:
    """Transcribe `files` on the service at `server`; 0 when every file was transcribed, else 1."""
    jobs: list[Job] = []
    failed = False
    for path in files:
        try:
            jobs.append(Job(path, load(path)))
        except (OSError, RuntimeError, ValueError) as exc:  # soundfile raises RuntimeError subclasses
            print(f"{path}: cannot read audio: {exc}", file=sys.stderr)
            failed = True
    if not jobs:
        return 1
    try:
        client = Client(server, curve=curve)
    # ZMQError: an address ZeroMQ cannot connect to; ProtocolError: an answer that is not this protocol's
    except (ServerError, TimeoutError, OSError, ProtocolError, zmq.ZMQError) as exc:
        print(f"cannot connect to {server}: {exc}", file=sys.stderr)
        return 1
    output = Output(out, as_json)
    with client:
        # the ingest refuses a connection more open streams than this: the other files wait for a place
        places = threading.Semaphore(client.limits.max_streams_per_client)
        threads = [threading.Thread(target=_transcribe, args=(client, job, offline, language, partials, frame_ms, output, places),
                                    name=f"transcribe-{i}") for i, job in enumerate(jobs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for job in jobs:
        if job.error is not None:
            print(f"{job.file}: {job.error}", file=sys.stderr)
            failed = True
            if job.closed is None or job.closed.reason != "end":
                continue  # cut short: its transcript would pass for the whole file's
            # a segment the service could not transcribe still had its final (what its partials agreed
            # on) and the stream went on: the transcript is the file's, with that error said
        text = " ".join(job.finals)
        if as_json:
            audio_s = job.closed.audio_s if job.closed is not None else job.audio.seconds
            output.json({"type": "summary", "file": job.file, "text": text, "segments": len(job.finals),
                         "audio_s": round(audio_s, 3), "wall_s": round(job.wall_s, 3)})
        else:
            out.write(f"{job.file}: {text}\n" if len(jobs) > 1 else f"{text}\n")
    out.flush()
    return 1 if failed else 0


def _transcribe(client: Client, job: Job, offline: bool, language: str | None, partials: bool, frame_ms: int,
                output: Output, places: threading.Semaphore) -> None:
    """`_stream` once one of the connection's `places` is free; its `closed` frees the ingest's too."""
    with places:
        _stream(client, job, offline, language, partials, frame_ms, output)


def _stream(client: Client, job: Job, offline: bool, language: str | None, partials: bool, frame_ms: int,
            output: Output) -> None:
    """Open, then send on a helper thread while this one reads events until `closed`."""
    try:
        job.stream = client.open(rate=job.audio.rate, channels=job.audio.samples.shape[1], language=language,
                                 partials=partials, priority="batch" if offline else "realtime")
    except (ServerError, TimeoutError, ValueError) as exc:  # ValueError: an open the protocol does not allow (--language)
        job.error = f"cannot open a stream: {exc}"
        return
    job.started = time.monotonic()
    sender = threading.Thread(target=_send, args=(job, offline, frame_ms), name=f"{threading.current_thread().name}-send")
    sender.start()
    try:
        _read(job, output)
    except (ServerError, TimeoutError) as exc:
        job.error = job.error or str(exc)
    finally:
        sender.join()
    job.wall_s = time.monotonic() - job.started


def _send(job: Job, offline: bool, frame_ms: int) -> None:
    stream = job.stream
    assert stream is not None
    samples = job.audio.samples
    try:
        if offline:
            stream.send(samples, timeout=CREDIT_TIMEOUT_S)
        else:
            step = max(job.audio.rate * frame_ms // 1000, 1)
            for i, start in enumerate(range(0, len(samples), step)):
                chunk = samples[start : start + step]
                # a frame exists once its last sample has been "recorded": send at the end of its span
                delay = job.started + (start + len(chunk)) / job.audio.rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                stream.send(chunk)
        stream.end()
    except (ServerError, TimeoutError) as exc:
        job.error = job.error or f"sending audio failed: {exc}"
        stream.end()


def _read(job: Job, output: Output) -> None:
    stream = job.stream
    assert stream is not None
    for ev in stream.events(timeout=EVENT_TIMEOUT_S):
        if isinstance(ev, (Partial, Final)):
            latency_ms = round(stream.latency_for(ev.end, now=stream.received_at) * 1000, 1)
            final = isinstance(ev, Final)
            if final and ev.text.strip():
                job.finals.append(ev.text.strip())
            row = {"type": "final" if final else "partial", "file": job.file, "seg": ev.seg, "text": ev.text,
                   "stable": ev.text if final else ev.stable, "start": ev.start, "end": ev.end, "latency_ms": latency_ms}
            if final:
                row["revised"] = ev.revised
            output.json(row)
        elif isinstance(ev, ErrorMsg):
            if ev.code != OVERLOADED:  # refused audio is resent by the client; only a slower stream results
                job.error = job.error or f"server error {ev.code}: {ev.message}"
        elif isinstance(ev, Closed):
            job.closed = ev
            # "shutdown" reaches here only for a stream the service had all of (its `end` crossed the
            # shutdown): the client resumes any other elsewhere, so this one is whole
            if ev.reason not in ("end", "shutdown"):
                job.error = job.error or f"stream closed early ({ev.reason})"
