"""A serving loop that stops turning ends its process (the ingest's and the broker's loops)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from shm import reclaim
from streamasr.service import free_ports

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
