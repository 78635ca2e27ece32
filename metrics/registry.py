"""Per-process metrics: cheap recording on the hot path, published as msgpack snapshots once a second.

Recording only updates the recording thread's own dicts (a histogram under its thread's lock, uncontended
but for the publisher's copy: a few hundred nanoseconds); everything costly
(label normalisation, encoding, the socket) happens on the publisher thread. The PUB socket *connects*
to the collector, so processes can start, restart and die in any order, and a PUB socket never blocks:
with no collector listening the snapshots are simply dropped.
"""

from __future__ import annotations

import math
import os
import threading
import time
import uuid
from bisect import bisect_left
from typing import Any

import msgpack
import zmq

from config.settings import Config
from metrics.names import buckets_for

SNAPSHOT_VERSION = 1
PUBLISH_INTERVAL_S = 1.0

Key = tuple[str, tuple[tuple[str, Any], ...]]  # (name, labels as passed)
Labelled = tuple[str, tuple[tuple[str, str], ...]]  # (name, labels sorted, values as text)


def endpoint(cfg: Config) -> str:
    """Where the instance's collector binds and every process's publisher connects."""
    return cfg.metrics_endpoint


def _labels(items: tuple[tuple[str, Any], ...]) -> tuple[tuple[str, str], ...]:
    """Labels in one canonical order, values as text: call sites may pass them in any order."""
    return tuple(sorted((k, str(v)) for k, v in items))


class _ThreadStore:
    """One thread's counters and histograms: only that thread writes them. A counter is one
    store; a histogram's count and sum are two, taken under `lock` with the publisher's copy, or
    a snapshot could hold an observation's count without its value. The lock is reentrant: a
    collection can start while the publisher copies its own store, and gcwatch's callback then
    observes into it on that thread; a plain lock would hang the publisher inside the collector,
    and with it every later automatic collection of the process."""

    __slots__ = ("counters", "hists", "lock")

    def __init__(self) -> None:
        self.counters: dict[Key, float] = {}
        self.hists: dict[Key, list[Any]] = {}  # [bounds, counts (one per bound, then +Inf), sum]
        self.lock = threading.RLock()


class ProcessMetrics:
    """Counters, gauges and histograms of one process, keyed by name and labels.

    Counters and histograms live in per-thread stores that the publisher copies (a dict copy is
    atomic under the GIL) and sums, so concurrent threads never lose an increment and never wait on
    each other; a gauge is a single dict store, atomic by itself.
    """

    def __init__(self, cfg: Config, process: str, interval: float = PUBLISH_INTERVAL_S) -> None:
        self.process = process
        self.endpoint = endpoint(cfg)
        self.interval = interval
        self.incarnation = uuid.uuid4().hex  # tells a restarted process from a late packet of the old one
        self.started = time.time()
        self._local = threading.local()
        self._stores: list[_ThreadStore] = []
        self._gauges: dict[Key, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seq = 0

    # -- hot path ---------------------------------------------------------------------------------

    def _store(self) -> _ThreadStore:
        store = self._local.store = _ThreadStore()
        self._stores.append(store)
        return store

    def inc(self, name: str, value: float = 1, **labels: Any) -> None:
        """Add `value` (never negative: counters only grow) to a counter."""
        key = (name, tuple(labels.items()))
        try:
            counters = self._local.store.counters
        except AttributeError:
            counters = self._store().counters
        counters[key] = counters.get(key, 0) + value

    def set(self, name: str, value: float, **labels: Any) -> None:
        self._gauges[(name, tuple(labels.items()))] = value

    def observe(self, name: str, value: float, **labels: Any) -> None:
        """Count `value` into the histogram's fixed buckets (see metrics.names). A value that is
        not finite is not counted: it would make the histogram's sum NaN for the process's life."""
        if not math.isfinite(value):
            return
        key = (name, tuple(labels.items()))
        try:
            store = self._local.store
        except AttributeError:
            store = self._store()
        hist = store.hists.get(key)
        if hist is None:
            bounds = buckets_for(name)
            hist = store.hists[key] = [bounds, [0] * (len(bounds) + 1), 0.0]
        i = bisect_left(hist[0], value)
        with store.lock:
            hist[1][i] += 1
            hist[2] += value

    # -- publishing -------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Everything recorded so far, as plain msgpack-able data."""
        counters: dict[Labelled, float] = {}
        hists: dict[Labelled, tuple[tuple[float, ...], list[int], float]] = {}
        for store in list(self._stores):
            for (name, items), value in dict(store.counters).items():
                key = (name, _labels(items))
                counters[key] = counters.get(key, 0) + value
            with store.lock:  # the sum read after the counts: copying them may run a collection that observes
                copied = [(key, hist[0], list(hist[1]), hist[2]) for key, hist in dict(store.hists).items()]
            for (name, items), bounds, counts, total in copied:
                key = (name, _labels(items))
                if key in hists:
                    _, seen, seen_total = hists[key]
                    hists[key] = (bounds, [a + b for a, b in zip(seen, counts)], seen_total + total)
                else:
                    hists[key] = (bounds, counts, total)
        gauges = {(name, _labels(items)): value for (name, items), value in dict(self._gauges).items()}
        self._seq += 1
        return {
            "v": SNAPSHOT_VERSION,
            "process": self.process,
            "pid": os.getpid(),
            "incarnation": self.incarnation,
            "started": self.started,
            "time": time.time(),  # wall clock: shown as when, never subtracted (NTP may step it)
            "monotonic": time.monotonic(),  # what the collector takes rates over
            "seq": self._seq,
            "counters": [[name, dict(labels), value] for (name, labels), value in counters.items()],
            "gauges": [[name, dict(labels), value] for (name, labels), value in gauges.items()],
            "histograms": [[name, dict(labels), list(bounds), counts, total]
                           for (name, labels), (bounds, counts, total) in hists.items()],
        }

    def start(self) -> ProcessMetrics:
        """Publish a snapshot every `interval` seconds from a daemon thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="metrics", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop publishing after one last snapshot (so a clean exit reports its final counts)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 200)  # let the final snapshot leave, but never hold up exit for long
        sock.setsockopt(zmq.SNDHWM, 4)  # stale snapshots are worthless: keep at most a few queued
        sock.connect(self.endpoint)
        try:
            while True:
                stopping = self._stop.wait(self.interval)
                try:
                    sock.send(msgpack.packb(self.snapshot()), zmq.NOBLOCK)
                except zmq.Again:
                    pass
                if stopping:
                    return
        finally:
            sock.close()
