"""A serving loop that stops turning ends its process (the ingest's, the broker's and a worker's loops)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from broker import jobs as wire
from broker.jobs import OK
from shm import reclaim
from shm.pool import SHM_DIR
from streamasr.service import free_ports
from test_worker import FakeBroker, job, segment_with_audio

ROOT = Path(__file__).resolve().parents[1]


def run(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=40,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_a_loop_that_stops_turning_ends_its_process_with_its_stacks() -> None:
    """Turning every 50 ms for longer than the limit keeps the process; a call that then holds
    the GIL for good (libc's sleep through ctypes.PyDLL) ends it with status 1, every thread's
    stack in stderr."""
    done = run(
        "import ctypes, time\n"
        "from metrics.stallwatch import StallWatch\n"
        "watch = StallWatch(0.5, wakes_every_s=0.05)\n"
        "end = time.monotonic() + 3.0\n"
        "while time.monotonic() < end:\n"
        "    watch.turned(time.monotonic())\n"
        "    time.sleep(0.05)\n"
        "print('stuck now', flush=True)\n"
        "ctypes.PyDLL(None).sleep(60)\n"  # the test's subprocess timeout is a miss
        "print('the call returned', flush=True)\n"
    )
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "stuck now" in done.stdout and "the call returned" not in done.stdout
    assert "Timeout (0:00:01.600000)!" in done.stderr  # the limit, the push interval and two of the loop's sleeps
    assert 'File "<string>", line 9 in <module>' in done.stderr


def test_a_stopped_watch_and_a_watch_set_to_zero_end_nothing() -> None:
    done = run(
        "import time\n"
        "from metrics.stallwatch import StallWatch\n"
        "watch = StallWatch(0.2, wakes_every_s=0.05)\n"
        "watch.turned(time.monotonic())\n"
        "watch.stop()\n"
        "off = StallWatch(0, wakes_every_s=0.05)\n"
        "off.turned(time.monotonic())\n"
        "time.sleep(3.0)\n"  # past both timers
        "print('still here', flush=True)\n"
    )
    assert done.returncode == 0, done.stderr
    assert "still here" in done.stdout and "Timeout" not in done.stderr


def test_an_idle_loop_is_never_ended_however_small_the_limit() -> None:
    """A limit below the loop's idle sleep: the loop turns just short of the push interval, then
    sleeps its longest between turns, so the timer is pushed back only every push interval plus
    a sleep. That is no stall."""
    done = run(
        "import time\n"
        "from metrics.stallwatch import StallWatch\n"
        "watch = StallWatch(0.1, wakes_every_s=0.5)\n"
        "start = time.monotonic()\n"
        "watch.turned(start)\n"
        "time.sleep(0.95)\n"
        "watch.turned(time.monotonic())\n"  # within the push interval: not pushed
        "while time.monotonic() < start + 4.0:\n"
        "    time.sleep(0.5)\n"
        "    watch.turned(time.monotonic())\n"
        "watch.stop()\n"
        "print('still here', flush=True)\n"
    )
    assert done.returncode == 0, done.stderr
    assert "still here" in done.stdout and "Timeout" not in done.stderr


_STUCK_LOOP = """
import ctypes, tempfile, time
from broker.broker import Broker
from broker.signals import StopSignal
from config import settings
from ingest.server import IngestServer
cfg = settings.load(None, {{'run_dir': tempfile.mkdtemp(prefix='sasr-'), 'instance': '{instance}',
                           'ingest': {{'address': 'tcp://127.0.0.1:{port}', 'port_base': {port} + 1, 'stall_after_s': 0.5}},
                           'broker': {{'heartbeat_ms': 100, 'stall_after_s': 0.5}},
                           'shm': {{'streams_per_ingest': 4, 'ring_seconds': 26.0}}}})
started = time.monotonic()

def hangs_after_a_while(turn):
    def call(now):
        if now - started > 2.0:
            print('stuck now', flush=True)
            ctypes.PyDLL(None).sleep(60)
            print('the call returned', flush=True)
        return turn(now)
    return call

if '{program}' == 'broker':
    broker = Broker(cfg)
    broker._dispatch = hangs_after_a_while(broker._dispatch)
    broker.run()
else:
    with StopSignal() as stop:
        ingest = IngestServer(cfg, 0)
        ingest._heartbeat = hangs_after_a_while(ingest._heartbeat)
        ingest.run(stop)
"""


@pytest.mark.parametrize(("program", "timer"), [("broker", "0:00:01.700000"), ("ingest", "0:00:01.600000")])
def test_the_broker_s_and_the_ingest_s_own_loops_are_ended_when_they_stop_turning(program: str, timer: str) -> None:
    """The real loops push the watch back as they turn: serving for longer than the limit keeps
    the process, and a call on the loop that then holds the GIL for good ends it with status 1
    and every thread's stack, after the limit, the push interval and two of that loop's idle
    wake-ups (the broker's a heartbeat, the ingest's half of one)."""
    instance = f"t{uuid.uuid4().hex[:8]}"
    try:
        done = run(_STUCK_LOOP.format(instance=instance, port=free_ports(2), program=program))
    finally:
        reclaim(instance)  # the ingest's segment: a process ended so cannot unlink it
    assert done.returncode == 1, (done.stdout, done.stderr[-2000:])
    assert "stuck now" in done.stdout and "the call returned" not in done.stdout
    assert f"Timeout ({timer})!" in done.stderr, done.stderr[-2000:]
    assert 'File "<string>", line 17 in call' in done.stderr  # the loop's stack, at the stuck call


def test_a_worker_whose_main_loop_blocks_outside_its_model_is_ended_while_it_heartbeats(tmp_path: Path) -> None:
    """A real worker (null model), the broker's worker socket played by the test. The worker idles
    longer than its switch and answers a job; then a job names a segment that is a FIFO: opening it
    to map it blocks the main thread for good, outside the model, while the IO thread heartbeats
    on, so the broker would take the worker for alive. The worker is ended with status 1 and every
    thread's stack in its log, the main thread's at the open; its heartbeats stop with it, and the
    broker takes its jobs back as from any lost worker. The switch: `[workers] stuck_after_s`,
    the push interval and two of the main loop's one-second idle wake-ups."""
    instance = f"t{uuid.uuid4().hex[:8]}"
    audio, ring = segment_with_audio(f"streamasr.{instance}.ingest0")
    blocking = f"streamasr.{instance}.ingest1"
    os.mkfifo(SHM_DIR / blocking)  # opened to read, a FIFO waits for a writer that never comes
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as log_file:
        broker = FakeBroker({"workers": {"stuck_after_s": 0.5}, "broker": {"heartbeat_ms": 100}}, stderr=log_file)
    heard: list[bytes] = []
    try:
        ready = broker.receive(wire.READY, 30)
        assert ready, "the worker never registered"
        assert broker.receive(wire.DONE, 5.0) is None  # idle, heartbeats answered, past the switch's 3.5 s
        assert broker.proc.poll() is None, "an idle worker was ended"
        broker.sock.send_multipart([ready[0], wire.JOBS, wire.pack_jobs([job(audio, 0, ring.generation, 0, 100, 1)])])
        done = broker.receive(wire.DONE, 30)
        assert done and [row[2] for row in wire.unpack(done[2])] == [OK]
        stuck = job(audio, 0, ring.generation, 0, 100, 2)
        broker.sock.send_multipart([ready[0], wire.JOBS, wire.pack_jobs([replace(stuck, shm=blocking)])])
        deadline = time.monotonic() + 30  # the main thread blocks for ever: running out is a miss
        while broker.proc.poll() is None and time.monotonic() < deadline:
            if broker.sock.poll(100):
                frames = broker.sock.recv_multipart()
                heard.append(frames[1])
                if frames[1] == wire.HEARTBEAT:
                    broker.sock.send_multipart([frames[0], wire.HEARTBEAT])
        status = broker.proc.poll()
    finally:
        if broker.proc.poll() is None:
            broker.proc.kill()  # blocked in open(), it retries after a SIGTERM's handler and blocks again
        broker.close()
        del ring
        audio.close()
        reclaim(instance)
    text = log_path.read_text()
    assert status == 1, ("the worker lived on with its main loop blocked", text[-2000:])
    assert wire.HEARTBEAT in heard and wire.DONE not in heard  # heartbeats went on, the job was never answered
    assert "Timeout (0:00:03.500000)!" in text, text[-2000:]
    assert re.search(r'shm/pool\.py", line \d+ in attach\n', text), text[-2000:]  # the main thread, at the open
    assert "worker.stuck" not in text  # no model call was running
