"""`streamasr transcribe --server`: stream audio files to a running service, several at once.

Each file is one stream on one shared Client, and a fixed number of files are in flight at once
(`--parallel`, at most what the service lets a connection open): each of that many threads
takes the next file when its last one is done. A file's sender thread reads its audio block by
block and paces it at wall-clock rate (as a microphone would deliver it) or, offline, pushes it
as fast as the server's credit allows; the thread that took the file turns its events into
output lines with client-side latencies. A file the service has no room for yet (its open
refused as busy) waits for a place, held by the service, for up to `--open-timeout`. A file is
opened when its stream starts, and only the blocks on their way are held, so a day of recordings
streams in the memory, and the threads, of the streams open at once. `-` is standard input: a
live source (`arecord`, `ffmpeg` writing to a pipe) sent as it comes, each final printed as it
comes. With `--split-channels` each channel of a file, or of a live call on standard input, is
a stream of its own, and the file's transcript its channels' finals in the order they were
spoken, each its speaker's. With `--out-dir` each file's transcript goes to a file of its own.
Ctrl-C ends the streams with the audio sent so far and keeps what they transcribed (a second one
quits at once).
"""

from __future__ import annotations

import json
import math
import os
import select
import shutil
import signal
import stat
import sys
import threading
import time
from collections import deque
from concurrent.futures import CancelledError, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterator, TextIO

import numpy as np
import soundfile
import soxr
import zmq

from client.client import Client, Stream
from client.core import ServerError, StreamError
from ingest.stabilizer import joined
from protocol.auth import Curve
from protocol.messages import (G711_SUBTYPES, MAX_CHANNELS, OVERLOADED, RATES, SAMPLE_BYTES, Closed, ErrorMsg, Final, Partial,
                               ProtocolError, ServerMessage)
from speech.audio import RAW_SUFFIXES, g711_levels, not_a_file, raw_format, to_mono
from streamasr.outdir import Transcript, stdout_unwritable, suffix, unwritable
from streamasr.subtitles import Conversation, Voiced, Writer

STDIN = "-"  # the file argument that names standard input
RESAMPLED_RATE = 16000  # what a file at a rate the protocol does not take is streamed at
OFFLINE_BLOCK_MS = 1000  # audio an offline stream reads and queues at a time: far below a window (about 60 s)
EVENT_TIMEOUT_S = 120.0  # longest silence from the server before a stream is given up
CREDIT_TIMEOUT_S = 120.0  # longest an offline stream waits for the window to move
STALL_POLL_S = 0.5  # how often a stream's reader, waiting for events, looks whether its sender gave up for lack of credit
OPEN_TIMEOUT_S = 300.0  # how long a file waits for the service to take its stream (`--open-timeout`)
# Ctrl-C, or SIGTERM (a service manager or job scheduler stopping the run): what is said as the streams end
STOP_SIGNALS = {signal.SIGINT: "interrupted: ending the streams with the audio sent so far (Ctrl-C again to quit at once)",
                signal.SIGTERM: "terminated: ending the streams with the audio sent so far (SIGTERM again to quit at once)"}


@dataclass(frozen=True)
class RawFormat:
    """What headerless audio holds: headerless files (RAW_SUFFIXES) are always the default, 16 kHz
    16-bit mono; standard input is what `--rate`, `--encoding` and `--channels` say (a telephony
    feed's 8 kHz G.711, a sound card's 48 kHz stereo)."""

    rate: int = 16000
    encoding: str = "pcm_s16le"  # one of protocol.messages.ENCODINGS
    channels: int = 1

    @property
    def frame_bytes(self) -> int:
        return SAMPLE_BYTES[self.encoding] * self.channels

    def decode(self, data: bytes) -> np.ndarray:
        """Whole frames of `data` as (frames, channels), int16 or float32; G.711 codes expanded
        to 16 bits as the ingest expands them. Raises ValueError for float samples that are no number."""
        if self.encoding in G711_SUBTYPES:
            return g711_levels(self.encoding)[np.frombuffer(data, np.uint8)].reshape(-1, self.channels)
        block = np.frombuffer(data, "<f4" if self.encoding == "f32le" else "<i2").reshape(-1, self.channels)
        if block.dtype.kind == "f" and not np.isfinite(block).all():
            raise ValueError("f32le samples that are NaN or infinite")  # no level to send for them
        return block


class Reader:
    """One file's samples as its stream carries them, read block by block as they are sent, so
    memory holds what is being streamed rather than whole files: at the file's rate and channels
    if the protocol takes that rate (else resampled to 16 kHz as they are read), mixed to mono
    past the channels a stream carries, or one `channel` of them alone. Headerless files and a
    file without samples are taken as `transcribe --local` takes them. Opening reads the header
    alone. Standard input (STDIN) is headerless, in the format `stdin` says, of a length known at
    its end; a pipe or a device is `live`: it comes at the speed it is spoken, and is sent as it
    comes rather than paced again. Split by channels, each channel's reader reads standard input
    through the `split`'s pipe for it."""

    def __init__(self, path: str, stdin: RawFormat = RawFormat(), channel: int | None = None,
                 split: Split | None = None) -> None:
        self._raw: BinaryIO | None = None
        self._format = stdin if path == STDIN else RawFormat()
        self._file: soundfile.SoundFile | None = None
        self.live = False
        self.frames: int | None
        if path == STDIN:  # not closed with the reader: it is opened again for the stream
            self._raw = sys.stdin.buffer if split is None or channel is None else split.pipe(channel)
            self.live = not stat.S_ISREG(os.fstat(sys.stdin.buffer.fileno()).st_mode)
            self.file_rate, channels, self.frames = stdin.rate, stdin.channels, None
        elif why := not_a_file(Path(path)):
            raise ValueError(why)
        elif Path(path).suffix.lower() in RAW_SUFFIXES:
            self._raw = open(path, "rb")
            self.file_rate, channels = self._format.rate, self._format.channels
            self.frames = os.fstat(self._raw.fileno()).st_size // self._format.frame_bytes
        else:
            self._file = soundfile.SoundFile(path, **raw_format(Path(path)))
            self.file_rate, channels, self.frames = self._file.samplerate, self._file.channels, self._file.frames
        if self.frames == 0:
            self.close()
            raise ValueError("the file holds no audio samples")
        self.file_channels = channels
        if channel is not None and not 0 <= channel < channels:
            self.close()
            raise ValueError(f"no channel {channel + 1}: the file has {channels}")
        self.channel = channel  # this channel alone, as a stream of its own (--split-channels)
        self.mix = channel is None and channels > MAX_CHANNELS
        self.channels = 1 if self.mix or channel is not None else channels
        self.rate = self.file_rate if self.file_rate in RATES else RESAMPLED_RATE

    @property
    def seconds(self) -> float | None:
        return None if self.frames is None else self.frames / self.file_rate

    def blocks(self, ms: int) -> Iterator[np.ndarray]:
        """The samples, (frames, channels) int16 or float32, `ms` of the file at a time (a
        resampled block's length varies by a frame, the first and last more)."""
        resampler = None
        if self.rate != self.file_rate:  # one resampler over the whole file: blocks join with no seam
            resampler = soxr.ResampleStream(self.file_rate, self.rate, self.channels, dtype="float32")
        step = max(self.file_rate * ms // 1000, 1)
        while len(block := self._read(step, "int16" if resampler is None else "float32")):
            if self.channel is not None:
                block = block[:, self.channel:self.channel + 1]
            if self.mix:
                full_scale = np.float32(32768.0 if block.dtype == np.int16 else 1.0)
                block = (to_mono(block) / full_scale)[:, None]
            yield block if resampler is None else resampler.resample_chunk(block)
        if resampler is not None:
            yield resampler.resample_chunk(np.zeros((0, self.channels), np.float32), last=True)

    def _read(self, frames: int, dtype: str) -> np.ndarray:
        """Up to `frames` frames from where the last read ended; none at the end of the file."""
        if self._raw is not None:
            width = self._format.frame_bytes
            data = self._raw.read(frames * width)
            block = self._format.decode(data[: len(data) // width * width])  # a torn last frame is no sample
            return block.astype(np.float32) / np.float32(32768.0) if dtype == "float32" and block.dtype == np.int16 else block
        assert self._file is not None
        return self._file.read(frames, dtype=dtype, always_2d=True)

    def close(self) -> None:
        for f in (self._raw, self._file):
            if f is not None and f is not sys.stdin.buffer:
                f.close()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Split:
    """Standard input shared by its channels' streams (`--split-channels` on `-`): it can be read
    once, so one thread reads it as it comes and writes it to a pipe per channel, which that
    channel's Reader reads as it would standard input. A channel not read for a while (its stream
    waits for room) falls behind in memory while the others go on, up to BACKLOG; past that
    standard input is read no further until it catches up, as the one stream of the channels mixed
    would hold it. A channel whose reader is closed (its stream ended, or failed) is written no
    more."""

    CHUNK = 1 << 16  # at most this read at a time: a live source gives what it has, at once
    BACKLOG = 32 << 20  # bytes of standard input a channel may fall behind by: minutes of a call

    def __init__(self, channels: int, source: int) -> None:
        self._source = source  # standard input's descriptor
        pipes = [os.pipe() for _ in range(channels)]
        self._pipes: list[BinaryIO] = [os.fdopen(r, "rb") for r, _ in pipes]  # by channel
        for _, w in pipes:
            os.set_blocking(w, False)
        self._ends = [w for _, w in pipes]
        # a daemon: one blocked reading a live source that stays quiet must not hold the command's exit
        threading.Thread(target=self._copy, name="transcribe-split", daemon=True).start()

    def pipe(self, channel: int) -> BinaryIO:
        return self._pipes[channel]

    def _copy(self) -> None:
        source = self._source
        behind: dict[int, deque[memoryview]] = {end: deque() for end in self._ends}  # by each pipe's write end
        size = dict.fromkeys(self._ends, 0)
        reading = True
        try:
            while behind:
                if not reading:  # standard input ended: a channel given all of it ends too
                    for end in [end for end in behind if not size[end]]:
                        self._end(end, behind, size)
                    if not behind:
                        break
                poll = select.poll()  # not epoll: standard input may be a regular file
                if reading and max(size.values()) < self.BACKLOG:
                    poll.register(source, select.POLLIN)
                for end in behind:
                    if size[end]:
                        poll.register(end, select.POLLOUT)
                for fd, _ in poll.poll():
                    if fd == source:
                        data = self._read(source)
                        reading = bool(data)
                        for end in behind if data else ():
                            behind[end].append(memoryview(data))
                            size[end] += len(data)
                        continue
                    try:
                        while behind[fd]:
                            written = os.write(fd, behind[fd][0])
                            size[fd] -= written
                            behind[fd][0] = behind[fd][0][written:]
                            if not behind[fd][0]:
                                behind[fd].popleft()
                    except BlockingIOError:  # the pipe is full: the rest when it has room
                        pass
                    except OSError:  # BrokenPipeError: its reader closed
                        self._end(fd, behind, size)
        finally:
            for end in list(behind):
                self._end(end, behind, size)

    @staticmethod
    def _end(end: int, behind: dict[int, deque[memoryview]], size: dict[int, int]) -> None:
        del behind[end], size[end]
        os.close(end)

    @staticmethod
    def _read(source: int) -> bytes:
        """What standard input has, up to CHUNK; nothing at its end, or once it failed (said)."""
        try:
            return os.read(source, Split.CHUNK)
        except OSError as exc:
            print(f"{STDIN}: cannot read audio: {exc}", file=sys.stderr)
            return b""


@dataclass(frozen=True)
class Streaming:
    """How each file's stream is opened and sent, the same for all of a run's files."""

    offline: bool  # as fast as the service takes it, priority batch; else at the speed of speech
    language: str | None
    partials: bool
    prompt: str | None  # names and words to expect: each decode's prompt, before the stream's last final
    frame_ms: int  # audio a realtime stream sends at a time
    open_timeout: float  # how long an open waits for room


@dataclass(frozen=True)
class Speakers:
    """A call's channels each streamed as a stream of its own (`--split-channels`), and who each
    one carries as its lines and cues name them (`--speakers`, by channel; past those given, and
    by default, "channel N" from 1)."""

    names: tuple[str, ...] = ()

    def of(self, channel: int) -> str:
        return self.names[channel] if channel < len(self.names) else f"channel {channel + 1}"


@dataclass
class Job:
    """One file's stream and what came back on it."""

    file: str
    seconds: float | None  # the file's length, as its header (or size) says; None for standard input
    stdin: RawFormat = RawFormat()  # what standard input holds, when the file is STDIN
    channel: int | None = None  # the file's one channel this stream carries (--split-channels), from 0
    split: Split | None = None  # standard input split by channels: where this channel reads it
    speakers: Speakers = Speakers()  # a split file's channels' names
    conversation: Conversation | None = None  # a split file's cues, its channels' together
    stream: Stream | None = None
    sent_all: bool = False  # every sample went out: a transcript is the whole file's
    sent_s: float = 0.0  # of the file's audio, what went out
    interrupted: bool = False  # Ctrl-C came before all of it went out
    stalled: threading.Event = field(default_factory=threading.Event)  # no credit for CREDIT_TIMEOUT_S: the service stopped taking it
    finals: list[Final] = field(default_factory=list)  # those with words
    closed: Closed | None = None
    error: str | None = None
    started: float = 0.0
    wall_s: float = 0.0

    @property
    def speaker(self) -> str | None:
        """Who a split file's stream carries, as its lines and cues name them."""
        return None if self.channel is None else self.speakers.of(self.channel)

    @property
    def name(self) -> str:
        """What its lines on stderr call it: the file, and its channel when split."""
        return self.file if self.speaker is None else f"{self.file} {self.speaker}"


class Output:
    """Serializes lines from the reader threads."""

    def __init__(self, out: TextIO | Transcript, as_json: bool, named: bool, subtitles: Writer | None = None,
                 lock: threading.RLock | None = None) -> None:
        self.out = out
        # the first write that failed (a full disk, standard output's reader gone): nothing more is
        # written here, and the files written here end their streams instead of failing a thread
        self.broken: OSError | None = None
        self.as_json = as_json
        self.named = named  # several files: each transcript line begins with its file's name
        self.subtitles = subtitles  # cues instead of text, as each final comes
        # on a terminal, a live source's partials show in place, on the line its final then takes
        self.terminal = not as_json and subtitles is None and out.isatty()
        self.showing = False  # a partial is on the terminal's last line
        # shared by a run's outputs, their lines on stderr whole among each other's; re-entrant, so that a
        # conversation's cues are released and written in one hold of it, in the order released
        self.lock = lock or threading.RLock()

    def text(self, file: str, text: str) -> None:
        """A transcript line, whole among the other threads' lines (over a partial shown)."""
        with self.lock:
            self._put(self._clear() + (f"{file}: {text}\n" if self.named else f"{text}\n"))

    def partial(self, file: str, text: str) -> None:
        """A live source's partial, in place of the last one, cut at its start to the terminal's width
        (one with no words yet, a segment's first often, leaves the line as it is)."""
        if not self.terminal or not text:
            return
        line = f"{file}: {text}" if self.named else text
        width = shutil.get_terminal_size().columns - 1
        with self.lock:
            self._put(self._clear() + (line if len(line) <= width else "…" + line[len(line) - width + 1:]))
            self.showing = True

    def unshow(self) -> None:
        """Take a partial shown off the terminal: its segment's final had no words."""
        with self.lock:
            self._put(self._clear())

    def _clear(self) -> str:
        showing, self.showing = self.showing, False
        return "\r\x1b[K" if showing else ""

    def write(self, text: str) -> None:
        """Output as it is (subtitle cues), whole among the other threads'."""
        with self.lock:
            self._put(text)

    def say(self, line: str) -> None:
        """A line on stderr, whole among the other threads' lines."""
        with self.lock:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()

    def json(self, obj: dict) -> None:
        if self.as_json:
            with self.lock:
                self._put(json.dumps(obj, ensure_ascii=False) + "\n")

    def _put(self, text: str) -> None:
        """Write and flush, with the lock held; a failure is kept in `broken`, not raised."""
        if self.broken is not None:
            return
        try:
            self.out.write(text)
            self.out.flush()
        except OSError as exc:
            self.broken = exc


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
    parallel: int | None = None,
    open_timeout: float = OPEN_TIMEOUT_S,
    subtitles: str | None = None,
    stdin: RawFormat = RawFormat(),
    speakers: Speakers | None = None,
    prompt: str | None = None,
    out_dir: Path | None = None,
) -> int:
    """Transcribe `files` on the service at `server`, `parallel` at a time (None: as many as the
    service lets a client open), each waiting up to `open_timeout` for the service to have room
    for its stream; `subtitles` ("srt", "vtt": one file) prints cues as its finals come instead
    of text; `stdin` is standard input's format; with `speakers` each channel of a file is a
    stream of its own (a call with each party on its own channel), its transcript the channels'
    finals in the order they were spoken, each its speaker's (its cues written as they speak, in
    the order they start); `prompt` primes each stream with names and words to expect; with
    `out_dir` each file's output goes to a file of its own there, put in place once it is
    transcribed (`subtitles` then takes many files); 0 when every file was transcribed, else 1."""
    jobs: list[Job] = []
    failed = False
    if files.count(STDIN) > 1:
        print(f"{STDIN} (standard input) can be given once", file=sys.stderr)
        return 1
    for path in files:
        try:  # the header alone: a file that cannot be streamed is said at once, before any is
            with Reader(path, stdin) as reader:
                channels = range(reader.file_channels) if speakers is not None and reader.file_channels > 1 else [None]
                jobs += [Job(path, reader.seconds, stdin=stdin, channel=channel, speakers=speakers or Speakers())
                         for channel in channels]
        except (OSError, RuntimeError, ValueError) as exc:  # soundfile raises RuntimeError subclasses
            print(f"{path}: cannot read audio: {exc}", file=sys.stderr)
            failed = True
    if not jobs:
        return 1
    live_split = [job for job in jobs if job.file == STDIN and job.channel is not None]
    if live_split:  # its channels' streams read it together, so they run at once
        split = Split(len(live_split), sys.stdin.buffer.fileno())
        for job in live_split:
            job.split = split
    try:
        client = Client(server, curve=curve)
    # ZMQError: an address ZeroMQ cannot connect to; ProtocolError: an answer that is not this protocol's
    except (ServerError, TimeoutError, OSError, ProtocolError, zmq.ZMQError) as exc:
        print(f"cannot connect to {server}: {exc}", file=sys.stderr)
        return 1
    output = Output(out, as_json, named=len({job.file for job in jobs}) > 1, subtitles=Writer(subtitles) if subtitles else None)
    if output.subtitles is not None and out_dir is None:
        output.write(output.subtitles.header())
    transcripts: dict[str, Transcript] = {}  # with out_dir: each file's own, put in place once it is transcribed
    stop = threading.Event()  # Ctrl-C or SIGTERM: streams end with what they sent, files not begun are left
    try:
        with client, _interruptible(stop) as taken:
            places = _places(client, parallel, len(jobs), len(live_split))
            if places is None:
                return 1
            outputs = _outputs(jobs, output, out_dir, transcripts, as_json, subtitles)
            # a thread per place, not per file: each takes the next file once done with its last (its `closed` frees the ingest's place)
            with ThreadPoolExecutor(places, thread_name_prefix="transcribe") as pool:
                streaming = Streaming(offline, language, partials, prompt, frame_ms, open_timeout)
                done = [pool.submit(_stream, client, job, streaming, outputs[job.file], stop) for job in jobs]
                for future in done:
                    future.result()  # a fault of this code, not of a file: raised rather than lost
        withheld = _conclude(jobs, outputs)
    except BaseException:  # a fault of this code: no transcript is left half written
        for transcript in transcripts.values():
            transcript.drop()
        raise
    failed |= not _settle(transcripts, outputs, withheld)
    if output.broken is not None:
        stdout_unwritable(out, output.broken)
        failed = True
    # a run a signal ended exits as a shell says a command that signal killed did (130 for Ctrl-C)
    return 128 + taken[0] if taken else 1 if failed or any(job.error for job in jobs) else 0


def _places(client: Client, parallel: int | None, streams: int, live_split: int) -> int | None:
    """How many of the run's `streams` (a file's, or a split file's channel's) go at once:
    `parallel`, within what the ingest lets a connection open (one past it is cut to it, said);
    None, said, when standard input's channels cannot all be streamed at once, as they are read
    together."""
    allowed = client.limits.max_streams_per_client
    if parallel is not None and parallel > allowed:
        print(f"--parallel {parallel}: the service lets a client open {allowed} streams at once; "
              f"{allowed} files are streamed at a time", file=sys.stderr)
    places = min(parallel or allowed, allowed, streams)
    if live_split and places < streams:
        print(f"{STDIN}: its {live_split} channels are streamed at once, and "
              f"{'--parallel' if parallel is not None and parallel < allowed else 'the service'} allows {places}",
              file=sys.stderr)
        return None
    return places


def _outputs(jobs: list[Job], output: Output, out_dir: Path | None, transcripts: dict[str, Transcript], as_json: bool,
             subtitles: str | None) -> dict[str, Output]:
    """Where each file's lines and cues go: the run's `output`, or with `out_dir` a transcript of
    its own (added to `transcripts`). A split file's cues go through one Conversation of its
    channels, so they are written in the order they start."""
    outputs = dict.fromkeys((job.file for job in jobs), output)
    if out_dir is not None:
        for file in outputs:
            cues = Writer(subtitles) if subtitles else None
            transcripts[file] = Transcript(out_dir, file, suffix(as_json, subtitles, rows=True), cues.header() if cues else "")
            outputs[file] = Output(transcripts[file], as_json, named=False, subtitles=cues, lock=output.lock)
    for file in {job.file for job in jobs if job.channel is not None}:
        if (cues := outputs[file].subtitles) is not None:
            conversation = Conversation(cues, [job.channel for job in jobs if job.file == file and job.channel is not None])
            for job in jobs:
                if job.file == file:
                    job.conversation = conversation
    return outputs


def _conclude(jobs: list[Job], outputs: dict[str, Output]) -> set[str]:
    """Each file's transcript, or what kept it from one, once all are done; the files whose
    transcript is not given (cut short, or interrupted before any was)."""
    withheld: set[str] = set()
    spoken: dict[str, list[Voiced]] = {}  # a split file's finals, said by their channels
    for job in jobs:
        mine = outputs[job.file]
        ended = job.closed is not None and job.closed.reason == "end"  # every sample sent was transcribed
        if job.error is not None:
            print(f"{job.name}: {job.error}", file=sys.stderr)
            if not ended or not (job.sent_all or job.interrupted):
                withheld.add(job.file)
                continue  # cut short: its transcript would pass for the whole file's
            # a segment the service could not transcribe still had its final (what its partials agreed
            # on) and the stream went on: the transcript is the file's, with that error said
        if mine.broken is not None:  # its output could not be written, and its stream was ended: said once, by run
            withheld.add(job.file)
            continue
        if job.interrupted:  # the part it has is given, and said to be a part
            if not ended or not job.sent_s:
                print(f"{job.name}: interrupted before it was transcribed", file=sys.stderr)
                withheld.add(job.file)
                continue
            whole = "" if job.seconds is None else f" of {job.seconds:.1f} s"
            print(f"{job.name}: interrupted: the transcript of its first {job.sent_s:.1f} s{whole}", file=sys.stderr)
        text = joined([f.text.strip() for f in job.finals])  # Chinese or Japanese finals follow each other with no space, as in `--local`
        if mine.as_json:
            audio_s = job.closed.audio_s if job.closed is not None else job.seconds or 0.0
            mine.json({"type": "summary", "file": job.file, **_channel(job), "text": text, "segments": len(job.finals),
                       "audio_s": round(audio_s, 3), "wall_s": round(job.wall_s, 3), "interrupted": job.interrupted})
        elif mine.subtitles is not None or job.file == STDIN:  # its cues, or a live source's lines, were written as they came
            continue
        elif job.speaker is not None:
            spoken.setdefault(job.file, []).extend(Voiced(job.speaker, f.start, f.end, f.text.strip()) for f in job.finals)
        else:
            mine.text(job.file, text)
    for file, finals in spoken.items():  # a split file's lines, in the order they were spoken
        for f in sorted(finals, key=lambda f: (f.start, f.voice)):
            outputs[file].text(file, _said(f.start, f.voice, f.text))
    return withheld


def _settle(transcripts: dict[str, Transcript], outputs: dict[str, Output], withheld: set[str]) -> bool:
    """Put each file's transcript in place, or remove it: its file's transcript is withheld, or
    it could not be written (said); False when one could not."""
    whole = True
    for file, transcript in transcripts.items():
        broken = outputs[file].broken
        if broken is None and file not in withheld:
            try:
                transcript.keep()
                continue
            except OSError as exc:
                broken = exc
        transcript.drop()
        if broken is not None:
            unwritable(str(transcript.path), broken, file)
            whole = False
    return whole


def _channel(job: Job) -> dict[str, int | str]:
    """A split file's JSON rows name their channel, from 1, and its speaker."""
    return {} if job.channel is None or job.speaker is None else {"channel": job.channel + 1, "speaker": job.speaker}


def _said(start: float, speaker: str, text: str) -> str:
    """A split call's line: when it was said, and by whom."""
    return f"[{_clock(start)}] {speaker}: {text}"


def _clock(seconds: float) -> str:
    """A time in a call: 01:05.2, or 1:02:05.2 past the hour."""
    tenths = round(seconds * 10)
    minutes, tenths = divmod(tenths, 600)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{tenths / 10:04.1f}" if hours else f"{minutes:02d}:{tenths / 10:04.1f}"


@contextmanager
def _interruptible(stop: threading.Event) -> Iterator[list[int]]:
    """Ctrl-C or SIGTERM sets `stop` (said once on stderr) and is kept in the list yielded; a
    second quits at once, as that signal does. Off the main thread (an application's) signals are
    its own, and `stop` is never set here."""
    taken: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield taken
        return

    def interrupted(signum: int, _frame: object) -> None:
        if stop.is_set():
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        taken.append(signum)
        stop.set()
        print(STOP_SIGNALS[signum], file=sys.stderr)

    before = {signum: signal.signal(signum, interrupted) for signum in STOP_SIGNALS}
    try:
        yield taken
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def _stream(client: Client, job: Job, streaming: Streaming, output: Output, stop: threading.Event) -> None:
    """Transcribe the job's file; once done, a split call's other channels' cues wait for it no more."""
    try:
        _transcribe(client, job, streaming, output, stop)
    finally:
        if job.conversation is not None:
            _heard(job, output, math.inf)


def _heard(job: Job, output: Output, until: float) -> None:
    """A split file's channel will have no final that starts before `until`: the other channels' cues before it are written."""
    assert job.conversation is not None and job.channel is not None
    with output.lock:
        if cues := job.conversation.heard(job.channel, until):
            output.write(cues)


def _transcribe(client: Client, job: Job, streaming: Streaming, output: Output, stop: threading.Event) -> None:
    """Open the file, then its stream; send on a helper thread while this one reads events until `closed`."""
    if stop.is_set() or output.broken is not None:  # Ctrl-C, or nowhere left to write its transcript
        job.interrupted = stop.is_set()
        if job.split is not None and job.channel is not None:
            job.split.pipe(job.channel).close()  # read no more: the other channels are not held for it
        return
    try:
        reader = Reader(job.file, job.stdin, job.channel, job.split)
    except (OSError, RuntimeError, ValueError) as exc:  # changed since it was checked: gone, cut to nothing
        job.error = f"cannot read audio: {exc}"
        return
    with reader:
        try:
            job.stream = _open(client, job, reader, streaming, output, stop)
        except CancelledError:  # Ctrl-C while it waited for room
            job.interrupted = True
            return
        except (ServerError, TimeoutError, ValueError) as exc:  # ValueError: an open the protocol does not allow (--language, --prompt)
            job.error = f"cannot open a stream: {exc}"
            return
        job.started = time.monotonic()
        sender = threading.Thread(target=_send, args=(job, reader, streaming, output, stop),
                                  name=f"{threading.current_thread().name}-send")
        sender.start()
        try:
            _read(job, output)
        except (ServerError, TimeoutError) as exc:
            job.error = job.error or str(exc)
        finally:
            sender.join()
    job.wall_s = time.monotonic() - job.started


def _open(client: Client, job: Job, reader: Reader, streaming: Streaming, output: Output, stop: threading.Event) -> Stream:
    """Open the file's stream. One the service has no room for waits, held by the service in line
    with other callers', until `open_timeout` has passed (client.core.RoomWait): a folder of
    recordings on a busy service must not fail the files that came a moment too soon. Said once
    per file, as the waiting begins."""

    def waiting(refused: StreamError) -> None:
        output.say(f"{job.name}: the service has no room for the stream ({refused}); "
                   f"waiting up to {streaming.open_timeout:g} s for room")

    return client.open(rate=reader.rate, channels=reader.channels, language=streaming.language, partials=streaming.partials,
                       prompt=streaming.prompt, priority="batch" if streaming.offline else "realtime",
                       wait=streaming.open_timeout, on_wait=waiting, cancel=stop)


def _send(job: Job, reader: Reader, streaming: Streaming, output: Output, stop: threading.Event) -> None:
    """Read and send the file block by block, then `end`. A file that fails part-way (cut short,
    corrupt) or whose audio cannot be sent fails this file alone: what was sent is ended, and its
    transcript, a part's, is not given as the file's. Ctrl-C (`stop`) ends it where it is, and so
    does an `output` that can be written no more: the rest would be transcribed for nothing."""
    stream = job.stream
    assert stream is not None
    offline = streaming.offline
    sent = 0  # frames, at the stream's rate
    try:
        for block in reader.blocks(OFFLINE_BLOCK_MS if offline else streaming.frame_ms):
            if stop.is_set():
                job.interrupted = True
                break
            if output.broken is not None:
                break
            sent += len(block)
            if not offline and not reader.live:  # a frame exists once its last sample has been "recorded": sent at the end of its span
                delay = job.started + sent / reader.rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            stream.send(block, timeout=CREDIT_TIMEOUT_S if offline else None)
            job.sent_s = sent / reader.rate
        else:
            job.sent_all = True
    except TimeoutError as exc:  # no credit (before OSError's clause: TimeoutError is one); the rest is left unsent
        job.error = job.error or f"sending audio failed: {exc}"
        job.stalled.set()
    except ServerError as exc:
        job.error = job.error or f"sending audio failed: {exc}"
    except (OSError, RuntimeError, ValueError) as exc:  # the file failed part-way (soundfile raises RuntimeError subclasses)
        job.error = job.error or f"cannot read audio: {exc}"
    try:
        stream.end()  # after what was sent, at once: the audio a timed-out send left unsent is not waited for
    except ServerError as exc:  # the client failed: the reading thread hears it too
        job.error = job.error or f"sending audio failed: {exc}"


def _read(job: Job, output: Output) -> None:
    """Write the stream's events until `closed`. A stream the service gave no credit for
    CREDIT_TIMEOUT_S (`job.stalled`) is not waited for once nothing more has come: the service
    is not decoding it either, and the file has failed already; what it did decode is written."""
    stream = job.stream
    assert stream is not None
    heard = time.monotonic()
    while True:
        # Where the stream's next final starts at the soonest, read before waiting: every final
        # that came before it is shown by the time the wait finds nothing more.
        until = stream.durable / stream.rate
        try:
            for ev in stream.events(timeout=STALL_POLL_S):
                heard = time.monotonic()
                _show(job, ev, output)
                until = stream.durable / stream.rate
            return
        except TimeoutError:  # nothing within STALL_POLL_S; events() may be called again
            if job.conversation is not None:
                _heard(job, output, until)
            if job.stalled.is_set():
                return
            if time.monotonic() - heard >= EVENT_TIMEOUT_S:
                raise TimeoutError(f"stream {stream.id}: no event within {EVENT_TIMEOUT_S:.1f}s") from None


def _show(job: Job, ev: ServerMessage, output: Output) -> None:
    """One event of the stream: a line of output, and what it tells of the file's transcript."""
    stream = job.stream
    assert stream is not None
    if isinstance(ev, (Partial, Final)):
        latency_ms = round(stream.latency_for(ev.end, now=stream.received_at) * 1000, 1)
        final = isinstance(ev, Final)
        if final and output.subtitles is not None:
            if job.conversation is None:
                output.write(output.subtitles.final(ev.start, ev.end, ev.text.strip(), ev.parts, ev.words))
            elif ev.text.strip() and job.speaker is not None and job.channel is not None:
                with output.lock:
                    output.write(job.conversation.said(job.channel, Voiced(job.speaker, ev.start, ev.end, ev.text.strip(), ev.parts, ev.words)))
        elif job.file == STDIN:  # a live source has no end to wait for
            text = ev.text.strip()
            if not final:
                output.partial(job.file, f"{job.speaker}: {text}" if job.speaker and text else text)
            elif text and not output.as_json:
                output.text(job.file, text if job.speaker is None else _said(ev.start, job.speaker, text))
            else:
                output.unshow()
        if isinstance(ev, Final) and ev.text.strip():
            job.finals.append(ev)
        row = {"type": "final" if final else "partial", "file": job.file, **_channel(job), "seg": ev.seg, "text": ev.text,
               "stable": ev.text if final else ev.stable, "start": ev.start, "end": ev.end, "language": ev.language,
               "latency_ms": latency_ms}
        if final:
            row["revised"] = ev.revised
            row["parts"] = ev.parts
            row["words"] = ev.words
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
