"""GC pauses of a long-running process.

A full collection walks every object the collector tracks. After start-up most of them (modules,
config, a loaded model's Python side) live as long as the process, so `gc.freeze()` moves them out
of the collector's reach and the pauses left are those the request path causes. Each collection is
timed with one perf_counter pair into `gc_pause_seconds`, so a latency spike can be checked
against the collector instead of guessed at.
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
    started = 0.0

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        nonlocal started
        if phase == "start":
            started = time.perf_counter()
        else:
            metrics.observe("gc_pause_seconds", time.perf_counter() - started, generation=info["generation"])

    gc.callbacks.append(on_gc)
