"""The ingest loop's VAD scheduling (IngestServer's own methods) over real sessions, real shm
rings and the real VAD thread, driven by hand: its loop is not run, and no client, broker or
worker is there."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from config import settings
from ingest.server import IngestServer
from ingest.session import Session
from ingest.vad import CHUNK
from protocol import messages as m
from shm import reclaim
from streamasr.service import free_ports

SPEECH = Path("/usr/share/pocketsphinx/test/data/librivox/sense_and_sensibility_01_austen_64kb-0880.wav")
pytestmark = pytest.mark.skipif(not SPEECH.exists(), reason="librivox test recordings not installed")
FRAME = 1600  # 100 ms


@pytest.fixture
def ingest() -> Iterator[IngestServer]:
    run = Path(tempfile.mkdtemp(prefix="sasr-"))  # short: ipc socket paths are limited to about 100 bytes
    base = free_ports(2)
    cfg = settings.load(None, {"instance": f"test{uuid.uuid4().hex[:12]}", "run_dir": str(run / "run"),
                               "ingest": {"address": f"tcp://127.0.0.1:{base}", "port_base": base + 1},
                               "shm": {"streams_per_ingest": 2, "ring_seconds": 30}})
    server = IngestServer(cfg, 0)
    yield server
    server.close()
    reclaim(cfg.instance)
    shutil.rmtree(run, ignore_errors=True)


def open_stream(server: IngestServer, key: str) -> Session:
    s = Session(key, b"c", m.Open(stream=key), server.pool.acquire(), server.cfg, 0, server.pool.name, server.metrics)
    server.sessions[key] = s
    server.scratch[key] = np.empty(CHUNK, np.float32)
    server.vad.add(key)
    return s


def feed(server: IngestServer, key: str, audio: np.ndarray, now: float) -> None:
    """Frames as the loop takes them: accepted, the stream marked changed, then the VAD's turn."""
    s = server.sessions[key]
    for i in range(0, len(audio) - FRAME + 1, FRAME):
        assert s.accept_audio(m.Audio(stream=key, seq=s.next_seq, data=audio[i : i + FRAME].tobytes()))
        server._changed(key)
        server._run_vad(now)


def test_a_segment_opens_on_the_loop_s_own_call_while_the_thread_s_round_runs(ingest: IngestServer) -> None:
    """Chunks that could open a segment are classified by the loop at once, without waiting for
    the thread's round in flight; a stream whose chunks are in that round waits for its end."""
    speech, rate = sf.read(SPEECH, dtype="int16")
    assert rate == 16000
    a, b = open_stream(ingest, "a"), open_stream(ingest, "b")
    feed(ingest, "b", speech[:FRAME], now=1.0)  # past VAD_ROUND_S: a gathered round takes b's first chunks
    assert ingest.vad.busy and b.vad_pos == 0
    feed(ingest, "b", speech[FRAME : 20 * FRAME], now=1.0)  # b's next chunks could decide, but b is in the round
    assert "b" in ingest.vad_urgent and b.vad_pos == 0

    feed(ingest, "a", speech[: 20 * FRAME], now=1.0)
    assert ingest.vad.busy, "the loop waited for the thread's round"
    assert a.open_segment is not None and a.vad_pos > 0
    assert "a" in ingest.dirty  # to be stepped this turn: its first partial is due now

    assert ingest.vad.signal.poll(10_000)
    ingest._on_vad()
    assert b.vad_pos == FRAME // CHUNK * CHUNK and b.open_segment is None  # the round's chunks: 96 ms
    ingest._run_vad(1.0)  # b's deciding chunks, on the loop's call now that the round is done
    assert b.vad_pos == b.ring.written // CHUNK * CHUNK and b.open_segment is not None
    assert not ingest.vad.busy and not ingest.vad_urgent
