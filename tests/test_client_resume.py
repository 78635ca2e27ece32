"""Both clients survive a SIGKILLed ingest, and one restarted (SIGTERM: a deploy, `supervisorctl
restart`): they resume by themselves and the transcript stays whole.

One live stream of three utterances is run undisturbed once, then with each client (blocking and
asyncio) with the ingest process killed right after the first final. supervisord restarts the
ingest; the client must re-hello, re-open at the last `durable` point and resend what it kept, so
the finals cover every utterance, repeat nothing and keep their times in order. Stopped with
SIGTERM, the ingest ends the stream itself at its next pause (`closed` "shutdown") after the
finals of what it took, refusing the audio that comes after (`not_ready`): the client must take
neither for the end of its stream.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import threading
import time
import wave
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import psutil
import pytest

from client import Client
from client.aio import AsyncClient, AsyncStream
from client.client import Stream
from config import settings
from conftest import Service, start_service
from protocol.messages import Closed, ErrorMsg, Final
from shm import pool
from streamasr import service as svc
from streamasr import testdata
from streaming import send_paced, wait_for

RATE = 16000
CHUNK = RATE // 10  # 100 ms per send, as a microphone delivers it
NAMES = ("0880", "0930", "0890")  # 3.0 s, 3.3 s and 5.3 s of read speech
PAD_S = settings.load(None).vad.pad_ms / 1000  # quiet a segment keeps after its speech
FROZEN_S = 8.0  # past the clients' liveness (5 s here)


@pytest.fixture(scope="module")
def asr(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    service = start_service(tmp_path_factory.mktemp("resume"), model="whisper-tiny.en", workers=2)
    yield service
    service.stop()
    assert pool.segments(service.cfg.instance) == []


def speech() -> tuple[np.ndarray, str]:
    """The utterances with a second of silence after each (a pause ends a segment), and their joined reference."""
    found = {u.name.rsplit("-", 1)[-1]: u for u in testdata.utterances() if u.name.startswith("librivox/")}
    assert all(n in found for n in NAMES), "librivox dev-set utterances missing (install pocketsphinx-testdata)"
    gap = np.zeros(RATE, np.int16)
    parts = []
    for name in NAMES:
        parts += [read(found[name].path), gap]
    return np.concatenate(parts), " ".join(found[n].reference for n in NAMES)


def read(path: str) -> np.ndarray:
    with wave.open(path) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (RATE, 1, 2), path
        return np.frombuffer(w.readframes(w.getnframes()), np.int16)


def ingest_pid(service: Service) -> tuple[int, str]:
    info = next(p for p in svc.processes(service.cfg) if p["name"] == "ingest-0")
    return int(info["pid"]), info["statename"]


def run(service: Service, pcm: np.ndarray, speed: float, on_final: Callable[[Final], None] | None = None,
        on_sent: Callable[[int], None] | None = None, doors: list[str] | None = None
        ) -> tuple[Client, Stream, list[Final], list[ErrorMsg]]:
    """Stream `pcm` paced at `speed` × real time from a sender thread; collect events until `closed`.
    `on_sent` is called with the frames sent so far after each message; `doors`: the front doors
    the client is given (the service's alone unless told)."""
    client = Client(doors or service.address, liveness=5.0)
    stream = client.open(language="en", partials=False)
    failures: list[BaseException] = []

    def send() -> None:
        try:
            send_paced(stream, pcm, RATE, CHUNK, speed, on_sent)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failures.append(exc)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    finals: list[Final] = []
    errors: list[ErrorMsg] = []
    try:
        for ev in stream.events(timeout=40):
            if isinstance(ev, Final):
                finals.append(ev)
                if on_final is not None:
                    on_final(ev)
            elif isinstance(ev, ErrorMsg):
                errors.append(ev)
            elif isinstance(ev, Closed):
                assert ev.reason == "end", ev
    finally:
        sender.join(10)
        client.close()
    assert not failures, failures
    return client, stream, finals, errors


async def run_async(service: Service, pcm: np.ndarray, speed: float, on_final: Callable[[Final], None] | None = None,
                    doors: list[str] | None = None) -> tuple[AsyncClient, AsyncStream, list[Final], list[ErrorMsg]]:
    """`run` on the asyncio client: a sender task paces the audio while this coroutine reads events."""
    client = await AsyncClient.connect(doors or service.address, liveness=5.0)
    finals: list[Final] = []
    errors: list[ErrorMsg] = []
    try:
        stream = await client.open(language="en", partials=False)

        async def send() -> None:
            started = time.monotonic()
            for i, start in enumerate(range(0, len(pcm), CHUNK)):
                await asyncio.sleep(max(0.0, started + i * CHUNK / RATE / speed - time.monotonic()))
                await stream.send(pcm[start : start + CHUNK])
            await stream.end()

        sender = asyncio.create_task(send())
        try:
            async for ev in stream.events(timeout=40):
                if isinstance(ev, Final):
                    finals.append(ev)
                    if on_final is not None:
                        on_final(ev)
                elif isinstance(ev, ErrorMsg):
                    errors.append(ev)
                elif isinstance(ev, Closed):
                    assert ev.reason == "end", ev
        except BaseException:
            sender.cancel()
            raise
        await asyncio.wait_for(sender, 10)  # re-raises what the sender failed with
    finally:
        await client.close()
    return client, stream, finals, errors


def joined(finals: list[Final]) -> str:
    return " ".join(f.text.strip() for f in finals)


@pytest.fixture(scope="module")
def baseline(asr: Service) -> tuple[str, list[Final]]:
    """The reference text and the finals of an undisturbed run: what a resumed run is held to."""
    pcm, reference = speech()
    _, _, finals, errors = run(asr, pcm, speed=3.0)
    assert errors == [] and len(finals) >= len(NAMES)
    return reference, finals


class Killer:
    """Signals the ingest process (SIGKILL unless told) at the first final it is shown, once."""

    def __init__(self, service: Service, sig: signal.Signals = signal.SIGKILL) -> None:
        self.service = service
        self.sig = sig
        self.pid, _ = ingest_pid(service)
        self.at: float | None = None  # the end of the final it killed at

    def __call__(self, final: Final) -> None:
        if self.at is None:
            self.at = final.end
            os.kill(self.pid, self.sig)


def check_resumed(killer: Killer, reconnects: int, resumes: list[int], finals: list[Final],
                  errors: list[ErrorMsg], baseline: tuple[str, list[Final]], restarted: bool = True) -> None:
    """The stream resumed (on a restarted ingest, unless told) and its finals read as one undisturbed stream."""
    assert killer.at is not None, "no final arrived before the end"
    assert reconnects >= 1 and resumes, "the client never resumed"
    new_pid, state = ingest_pid(killer.service)
    assert (new_pid != killer.pid) == restarted and state in svc.UP_STATES
    check_one_stream(finals, errors, baseline)


def check_one_stream(finals: list[Final], errors: list[ErrorMsg], baseline: tuple[str, list[Final]]) -> None:
    """The finals read as one undisturbed stream's: no error, nothing repeated, numbered and timed in order,
    the words as the undisturbed run's."""
    assert errors == []

    # nothing repeated, numbered and timed as one stream
    assert [f.seg for f in finals] == list(range(len(finals)))
    for before, after in zip(finals, finals[1:]):
        assert after.start >= before.end - 0.25, (before, after)  # 0.25 s: the restarted VAD may move a boundary
        assert after.end > before.end
    texts = [f.text.strip() for f in finals if f.text.strip()]
    assert len(texts) == len(set(texts)), texts

    # the transcript covers every utterance about as well as the undisturbed run
    reference, base_finals = baseline
    base_wer = testdata.wer([reference], [joined(base_finals)])
    resumed_wer = testdata.wer([reference], [joined(finals)])
    assert resumed_wer <= base_wer + 0.05, (resumed_wer, base_wer, joined(finals), joined(base_finals))


class Outage:
    """Takes a whole service down outright at the first final it is shown, once: supervisord and
    every program killed at once (SIGKILL), as when its host is lost; its shm segment is left, as
    it would be, and unlinked here for the tests' own check."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.at: float | None = None

    def __call__(self, final: Final) -> None:
        if self.at is None:
            self.at = final.end
            supervisord = psutil.Process(self.service.proc.pid)
            everything = [supervisord, *supervisord.children(recursive=True)]
            for process in everything:
                process.kill()
            psutil.wait_procs(everything, timeout=10)
            pool.reclaim(self.service.cfg.instance)


def test_a_stream_whose_service_is_lost_outright_resumes_on_another(service_factory: Callable[..., Service], tmp_path: Path,
                                                                     baseline: tuple[str, list[Final]]) -> None:
    """Services on two hosts share a resume key (`[ingest] resume_key_file`), and a client is given
    both front doors. The service its stream is on is lost outright mid-stream: the client finds
    that front door silent, passes over to the other, and resumes the stream there from the audio
    it kept, admitted as resuming with its token (as within one service: twice the admission
    limits); the finals read as one undisturbed stream's. The blocking and the asyncio clients
    alike, each on a service of its own that is lost, resuming on the one they share."""
    key = tmp_path / "resume.key"
    key.write_text(secrets.token_hex(32) + "\n")
    survivor, *lost = (service_factory(model="whisper-tiny.en", workers=1, ingest={"resume_key_file": str(key)})
                       for _ in range(3))
    pcm, _ = speech()
    outages = [Outage(service) for service in lost]
    client, stream, finals, errors = run(lost[0], pcm, speed=1.0, on_final=outages[0], doors=[lost[0].address, survivor.address])
    aclient, astream, afinals, aerrors = asyncio.run(run_async(lost[1], pcm, speed=1.0, on_final=outages[1],
                                                               doors=[lost[1].address, survivor.address]))
    runs = [(client.reconnects, client.address, stream.id, stream.resumes, finals, errors),
            (aclient.reconnects, aclient.address, astream.id, astream.resumes, afinals, aerrors)]
    for outage, (reconnects, address, stream_id, resumes, finals, errors) in zip(outages, runs):
        assert outage.at is not None and outage.service.proc.poll() is not None, "the service was not lost mid-stream"
        assert reconnects >= 1 and resumes and address == survivor.address, (reconnects, address)
        check_one_stream(finals, errors, baseline)
        opened = [e for e in survivor.events("ingest-0") if e["event"] == "ingest.stream_opened" and e["stream"] == stream_id]
        assert [e["resuming"] for e in opened] == [True], opened  # its token taken: the key is shared


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["killed", "restarted"])
def test_client_resumes_after_ingest_killed(asr: Service, baseline: tuple[str, list[Final]], sig: signal.Signals) -> None:
    pcm, _ = speech()
    killer = Killer(asr, sig)
    client, stream, finals, errors = run(asr, pcm, speed=1.0, on_final=killer)
    check_resumed(killer, client.reconnects, stream.resumes, finals, errors, baseline)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["killed", "restarted"])
def test_async_client_resumes_after_ingest_killed(asr: Service, baseline: tuple[str, list[Final]], sig: signal.Signals) -> None:
    pcm, _ = speech()
    killer = Killer(asr, sig)
    client, stream, finals, errors = asyncio.run(run_async(asr, pcm, speed=1.0, on_final=killer))
    check_resumed(killer, client.reconnects, stream.resumes, finals, errors, baseline)


def test_a_restart_while_the_stream_speaks_changes_no_word(asr: Service, baseline: tuple[str, list[Final]]) -> None:
    """A deploy restarts the ingest in the middle of an utterance. Ended there, the utterance
    would be finalised at the cut and its rest transcribed alone on the restarted ingest, words
    lost or garbled either side. The ingest takes the stream's audio on to the pause after the
    utterance and ends the stream there: every final up to that pause is the undisturbed run's,
    word for word and at the same times, and the stream resumes from the pause."""
    pcm, _ = speech()
    _, base_finals = baseline
    found = {u.name.rsplit("-", 1)[-1]: u for u in testdata.utterances() if u.name.startswith("librivox/")}
    first, second = (len(read(found[name].path)) for name in NAMES[:2])
    middle = first + RATE + second // 2  # frames: half-way through the second utterance
    spoken = [f for f in base_finals if f.start < middle / RATE < f.end]
    assert spoken, ("no final of the undisturbed run spans the stop", middle / RATE, base_finals)
    killer = Killer(asr, signal.SIGTERM)

    def stop_midway(sent: int) -> None:
        if sent >= middle and killer.at is None:
            killer.at = sent / RATE
            os.kill(killer.pid, signal.SIGTERM)

    client, stream, finals, errors = run(asr, pcm, speed=1.0, on_sent=stop_midway)
    check_resumed(killer, client.reconnects, stream.resumes, finals, errors, baseline)
    upto = [f for f in base_finals if f.start <= spoken[0].start]

    def row(f: Final) -> tuple[int, float, float, str]:
        return f.seg, round(f.start, 2), round(f.end, 2), f.text

    assert [row(f) for f in finals[: len(upto)]] == [row(f) for f in upto], (upto, finals)
    # from the pause: after the words, within the quiet the final ends with (its pad, which the
    # resumed stream may hear again: resumes start on the VAD's chunk grid)
    assert stream.resumes and stream.resumes[0] >= (spoken[0].end - PAD_S) * RATE, (stream.resumes, spoken[0])
    draining = [e for e in asr.events("ingest-0") if e["event"] in ("ingest.draining", "ingest.segment_cut_at_shutdown")]
    assert [e["event"] for e in draining][-1] == "ingest.draining", draining


def test_a_stream_resumed_away_from_a_frozen_ingest_leaves_nothing_there(asr: Service, baseline: tuple[str, list[Final]]) -> None:
    """The ingest is frozen (SIGSTOP, as a host that stalls) past the client's liveness: the
    client gives it up for dead, closes that connection and resumes its stream. The ingest was
    alive and thaws with the stream's old copy still open: that copy must be dropped as soon as
    the ingest finds its connection closed, not closed by the idle timeout (30 s) after it held
    its ring and was decoded for nobody all that time."""
    pcm, _ = speech()
    freezer = Killer(asr, signal.SIGSTOP)
    thaw = threading.Timer(FROZEN_S, os.kill, (freezer.pid, signal.SIGCONT))

    def freeze(final: Final) -> None:
        if freezer.at is None:
            freezer(final)
            thaw.start()

    try:
        client, stream, finals, errors = run(asr, pcm, speed=1.0, on_final=freeze)
    finally:
        thaw.cancel()
        os.kill(freezer.pid, signal.SIGCONT)
    check_resumed(freezer, client.reconnects, stream.resumes, finals, errors, baseline, restarted=False)

    def ours() -> list[tuple[str, str | None]]:
        """The stream's two copies: opened, dropped or closed (by the idle timeout too)."""
        return [(e["event"], e.get("reason")) for e in asr.events("ingest-0") if e.get("stream") == stream.id and e["event"] in
                ("ingest.stream_opened", "ingest.stream_dropped", "ingest.stream_closed", "ingest.stream_idle")][-4:]

    wait_for(lambda: ours()[-1] == ("ingest.stream_closed", "end"), what="the ingest's log of the stream's close")
    # the old copy dropped, whether before or after the resumed one opened, and never idle
    assert sorted(ours()) == [("ingest.stream_closed", "end"), ("ingest.stream_dropped", "client_gone"),
                              ("ingest.stream_opened", None), ("ingest.stream_opened", None)], ours()
