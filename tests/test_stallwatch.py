"""A serving loop that stops turning ends its process (the ingest's and the broker's loops)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
