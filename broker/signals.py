"""Stop a poll loop promptly on SIGTERM/SIGINT, and on SIGHUP.

SIGHUP is taken as a stop too: its default action ends a process on the spot, and an operator's
`kill -HUP` (a reload, to many daemons) would then cut an ingest's streams without a drain and
leave its shm segment behind. Stopped cleanly, the program is started again by supervisord.

A flag alone is not enough: a loop blocked in `zmq.Poller.poll` would notice it only at its next
timeout. The signal module's wakeup fd makes the signal itself readable on a socketpair that
the loop polls next to its ZeroMQ sockets, so it returns at once, and no lock is taken inside a
signal handler.
"""

from __future__ import annotations

import signal
import socket
from types import FrameType, TracebackType
from typing import Any


class StopSignal:
    """While entered, SIGTERM, SIGINT and SIGHUP set `stopping` and make `fileno()` readable."""

    def __init__(self) -> None:
        self.stopping = False
        self._read, self._write = socket.socketpair()
        self._read.setblocking(False)
        self._write.setblocking(False)
        self._saved: list[tuple[int, Any]] = []
        self._saved_fd = -1

    def fileno(self) -> int:
        return self._read.fileno()

    def drain(self) -> None:
        try:
            while self._read.recv(64):
                pass
        except BlockingIOError:
            pass

    def __enter__(self) -> "StopSignal":
        self._saved_fd = signal.set_wakeup_fd(self._write.fileno())
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            self._saved.append((signum, signal.signal(signum, self._on_signal)))
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        for signum, handler in self._saved:
            if handler is not None:  # None: installed outside Python, cannot be restored
                signal.signal(signum, handler)
        signal.set_wakeup_fd(self._saved_fd)
        self._read.close()
        self._write.close()

    def _on_signal(self, _signum: int, _frame: FrameType | None) -> None:
        self.stopping = True
