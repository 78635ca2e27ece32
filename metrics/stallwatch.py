"""Ends a process whose serving loop has stopped turning.

The ingest and the broker each serve from one loop that wakes at least once a heartbeat, and a
worker's IO thread ticks as often. A loop stuck for good (a native call that never returns, a
deadlock, a C extension holding the GIL) would leave a process that supervisord sees running but
that serves nobody. The loop pushes back a timer of faulthandler's as it turns; the timer is a C
thread that needs no GIL, and once the loop has not turned for the limit it writes every
thread's stack to stderr (which supervisord keeps in the program's log) and exits the process
with status 1, so supervisord starts it again and its peers recover as from a crash.

The timer is one per process. A worker has two loops, its IO thread's and its main thread's: the
IO thread pushes the timer back only when the main loop has turned since the last push (see
`pushed`), so the one timer ends the process when either loop stops.
"""

from __future__ import annotations

import faulthandler
import math

# Pushing the timer back costs a thread start (~35 µs); a loop turning thousands of times a
# second does it at most this often, so the limit is honoured to within this much.
PUSH_EVERY_S = 1.0


class StallWatch:
    def __init__(self, limit_s: float, wakes_every_s: float) -> None:
        """`limit_s`: 0 is off. `wakes_every_s`: the longest the loop sleeps when idle. A healthy
        loop pushes the timer back at least every PUSH_EVERY_S plus one such sleep (a turn just
        short of the push interval, then an idle sleep), so the timer allows that and one sleep
        more beyond the limit: however small the limit, an idle loop is never ended. A stuck
        loop is ended between `limit_s` and `limit_s` + PUSH_EVERY_S + 2 sleeps after its last turn."""
        self.limit_s = limit_s
        self._timer_s = limit_s + PUSH_EVERY_S + 2 * wakes_every_s
        self._pushed = -math.inf

    def turned(self, now: float) -> None:
        """The loop turned at `now` (time.monotonic())."""
        if self.limit_s > 0 and now - self._pushed >= PUSH_EVERY_S:
            faulthandler.dump_traceback_later(self._timer_s, exit=True, file=2)
            self._pushed = now

    @property
    def pushed(self) -> float:
        """When the timer was last pushed back (-inf: never)."""
        return self._pushed

    def stop(self) -> None:
        """The loop has ended: a process shutting down is not stuck."""
        faulthandler.cancel_dump_traceback_later()
