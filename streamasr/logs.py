"""Structured logs: one JSON object per line on stderr, so supervisord's log files can be grepped
and joined across processes by `process`, `pid`, `stream` and `job`.

Modules take `log = structlog.get_logger()` at import time; the logger is resolved on first use,
so `configure` only has to run before the first event, not before the imports.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import structlog


class _Stderr:
    """stderr for the log lines, which goes quiet once its reader is gone: a program whose
    supervisord was killed (see streamasr.supervised) must still stop cleanly, shm unlinked,
    rather than die of a broken pipe at its first line."""

    def write(self, text: str) -> None:
        try:
            sys.stderr.write(text)
        except BrokenPipeError:
            _to_devnull()

    def flush(self) -> None:
        try:
            sys.stderr.flush()
        except BrokenPipeError:
            _to_devnull()


def _to_devnull() -> None:
    """Point stdout and stderr at /dev/null: what is still buffered for them goes there too."""
    null = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(null, fd)
    os.close(null)


class Throttle:
    """At most one line a second per key (a client and what it got wrong). A client that sends
    thousands of bad messages a second, or a stream whose frames are refused while the service is
    overloaded, must not make its process a log writer: each line costs tens of microseconds, and
    the ingest's loop serves every stream. Every refusal is still answered and counted in the
    metrics; a line written says how many like it were not (`suppressed`).

    With `new_keys` set, at most that many lines an interval are written for keys not in the
    table, across all keys: for a caller whose keys anyone can make up at will (a CURVE client key),
    where one line per new key would make a flood of them a log writer. The lines held back, and
    those a key forgotten from the table had suppressed, are counted for `take_untold`.

    `event` is the line's event: as its owner goes, `tell_untold` writes `<event>_untold`."""

    MAX_KEYS = 10_000  # past this, the key whose line is oldest is forgotten: a flood of new keys costs no memory

    def __init__(self, event: str, interval_s: float = 1.0, max_keys: int = MAX_KEYS, new_keys: int | None = None) -> None:
        self.event = event
        self.interval_s = interval_s
        self.max_keys = max_keys
        self.new_keys = new_keys
        # key -> [when last written, lines suppressed since], oldest line first
        self._keys: OrderedDict[Hashable, list[float]] = OrderedDict()
        self._new_since = -math.inf  # when the interval counting lines of new keys began
        self._new_written = 0  # lines of new keys written in that interval
        self._untold = 0  # lines of keys not in the table that no line has told: see take_untold
        self._lock = threading.Lock()  # the dashboard's handler threads share one

    def __call__(self, key: Hashable) -> int | None:
        """None when this line is not to be written; else how many were suppressed before it."""
        now = time.monotonic()
        with self._lock:
            entry = self._keys.get(key)
            if entry is not None and now - entry[0] < self.interval_s:
                entry[1] += 1
                return None
            if entry is not None:
                self._keys.move_to_end(key)
            else:
                if self.new_keys is not None:
                    if now - self._new_since >= self.interval_s:
                        self._new_since, self._new_written = now, 0
                    if self._new_written >= self.new_keys:
                        self._untold += 1  # not in the table: its next line is a first one again
                        return None
                    self._new_written += 1
                if len(self._keys) >= self.max_keys:
                    self._untold += int(self._keys.popitem(last=False)[1][1])
            self._keys[key] = [now, 0]
            return int(entry[1]) if entry is not None else 0

    def take_suppressed(self) -> dict[Hashable, int]:
        """The keys with lines suppressed since their last one written, and how many, counted as
        told from now on: for a last word as the process stops, since a count is otherwise told
        only by the key's next line. Lines of keys no longer in the table are `take_untold`'s."""
        with self._lock:
            told = {key: int(entry[1]) for key, entry in self._keys.items() if entry[1]}
            for key in told:
                self._keys[key][1] = 0
        return told

    def take_untold(self) -> int:
        """Lines not written of keys not in the table, counted as told from now on: those a
        forgotten key had suppressed (its next line would have told them) and those of new keys
        held back past `new_keys`. Told by a caller's next line and as it stops."""
        with self._lock:
            untold, self._untold = self._untold, 0
        return untold

    def tell_untold(self, logger: Any, fields: Callable[[Any], dict[str, Any]], **common: Any) -> None:
        """Write what no line of the event has told yet, as its owner goes (its process stopping,
        its stream closing): a `<event>_untold` line per key with lines suppressed since its last
        one (`fields(key)`, `suppressed`), and one with `held_back` for keys no longer in the table.
        Without it a flood's last second goes untold: a count is told only by its key's next line."""
        for key, suppressed in self.take_suppressed().items():
            logger.warning(f"{self.event}_untold", **common, **fields(key), suppressed=suppressed)
        if held_back := self.take_untold():
            logger.warning(f"{self.event}_untold", **common, held_back=held_back)


def _timestamp(_logger: Any, _method: str, event: dict[str, Any]) -> dict[str, Any]:
    """ISO 8601 in UTC to the microsecond, as structlog's "iso" stamper writes it, from `time`:
    formatting an aware datetime keeps a cache of small blocks that grows over hundreds of thousands
    of lines, which reads as memory held per line to the allocation marks of
    `streamasr bench --tracemalloc` and the memory tests."""
    now = time.time()
    event["timestamp"] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}Z"
    return event


def configure(process: str, level: str = "info", **tags: Any) -> Any:
    """Route every structlog logger of this process to JSON on stderr, tagged with `process`, `pid`
    and `tags` (an ingest's `ingest` index, so its VAD and shm lines carry it as its loop's do).

    The tags are added by a processor rather than contextvars because new threads start with an
    empty context: the worker's IO thread would lose them.
    """
    tags = {"process": process, "pid": os.getpid(), **tags}

    def add_tags(_logger: Any, _method: str, event: dict[str, Any]) -> dict[str, Any]:
        for key, value in tags.items():
            event.setdefault(key, value)
        return event

    threshold = logging.getLevelNamesMapping().get(level.upper())
    if threshold is None:
        raise ValueError(f"unknown log level {level!r}")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            add_tags,
            structlog.processors.add_log_level,
            _timestamp,
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(threshold),
        logger_factory=structlog.PrintLoggerFactory(file=_Stderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=True,
    )
    return structlog.get_logger()
