"""The blocking Client survives a SIGKILLed ingest: it resumes by itself and the transcript stays whole.

One live stream of three utterances is run twice on the same service: once undisturbed, once
with the ingest process killed right after the first final. supervisord restarts the ingest;
the client must re-hello, re-open at the last `durable` point and resend what it kept, so the
second run's finals cover every utterance, repeat nothing and keep their times in order.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import wave
from typing import Callable, Iterator

import numpy as np
import pytest

from client import Client
from client.client import Stream
from conftest import Service, start_service
from protocol.messages import Closed, ErrorMsg, Final
from shm import pool
from streamasr import service as svc
from streamasr import testdata

RATE = 16000
CHUNK = RATE // 10  # 100 ms per send, as a microphone delivers it
NAMES = ("0880", "0930", "0890")  # 3.0 s, 3.3 s and 5.3 s of read speech


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


def run(service: Service, pcm: np.ndarray, speed: float,
        on_final: Callable[[Final], None] | None = None) -> tuple[Client, Stream, list[Final], list[ErrorMsg]]:
    """Stream `pcm` paced at `speed` × real time from a sender thread; collect events until `closed`."""
    client = Client(service.address, liveness=5.0)
    stream = client.open(language="en", partials=False)
    failures: list[BaseException] = []

    def send() -> None:
        started = time.monotonic()
        try:
            for i, start in enumerate(range(0, len(pcm), CHUNK)):
                time.sleep(max(0.0, started + i * CHUNK / RATE / speed - time.monotonic()))
                stream.send(pcm[start : start + CHUNK])
            stream.end()
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


def joined(finals: list[Final]) -> str:
    return " ".join(f.text.strip() for f in finals)


def test_client_resumes_after_ingest_killed(asr: Service) -> None:
    pcm, reference = speech()
    _, _, base_finals, base_errors = run(asr, pcm, speed=3.0)
    assert base_errors == [] and len(base_finals) >= len(NAMES)
    base_wer = testdata.wer([reference], [joined(base_finals)])

    old_pid, _ = ingest_pid(asr)
    killed: list[float] = []

    def kill_once(final: Final) -> None:
        if not killed:
            killed.append(final.end)
            os.kill(old_pid, signal.SIGKILL)

    client, stream, finals, errors = run(asr, pcm, speed=1.0, on_final=kill_once)
    assert killed, "no final arrived before the end"
    assert client.reconnects >= 1 and stream.resumes, "the client never resumed"
    new_pid, state = ingest_pid(asr)
    assert new_pid != old_pid and state == "RUNNING"
    assert errors == []

    # nothing repeated, numbered and timed as one stream
    assert [f.seg for f in finals] == list(range(len(finals)))
    for before, after in zip(finals, finals[1:]):
        assert after.start >= before.end - 0.25, (before, after)  # 0.25 s: the restarted VAD may move a boundary
        assert after.end > before.end
    texts = [f.text.strip() for f in finals if f.text.strip()]
    assert len(texts) == len(set(texts)), texts

    # the transcript covers every utterance about as well as the undisturbed run
    resumed_wer = testdata.wer([reference], [joined(finals)])
    assert resumed_wer <= base_wer + 0.05, (resumed_wer, base_wer, joined(finals), joined(base_finals))
