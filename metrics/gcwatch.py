"""GC pauses of a long-running process.

A full collection walks every object the collector tracks. After start-up most of them (modules,
config, a loaded model's Python side) live as long as the process, so `gc.freeze()` moves them out
of the collector's reach and the pauses left are those the request path causes. Each collection is
timed into `gc_pause_seconds` (wall clock: what a message waiting behind it sees) and
`gc_cpu_seconds` (the thread's CPU time: what the collector did), so a latency spike can be
checked against the collector instead of guessed at, and a long pause on a busy machine told
apart from a large heap.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from metrics.registry import ProcessMetrics


def freeze_and_watch(metrics: ProcessMetrics) -> None:
    """Call once, after start-up/warm-up: collect start-up garbage (so it is not frozen for good),
    freeze the survivors, and time every later collection by generation."""
    gc.collect()
    gc.freeze()
    started = started_cpu = 0.0

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        nonlocal started, started_cpu
        if phase == "start":
            started, started_cpu = time.perf_counter(), time.thread_time()
        else:
            generation = info["generation"]
            metrics.observe("gc_pause_seconds", time.perf_counter() - started, generation=generation)
            metrics.observe("gc_cpu_seconds", time.thread_time() - started_cpu, generation=generation)

    gc.callbacks.append(on_gc)
