"""Dynamic batching: one backend call for many streams' jobs.

A batch leaves when it is full or when its oldest job has waited `max_wait_s`, trading at most
that much latency for fewer, larger model calls. Kept free of sockets and clocks for testing.
"""

from __future__ import annotations

import itertools

from broker.jobs import Job


class Batcher:
    def __init__(self, max_batch: int, max_wait_s: float) -> None:
        self.max_batch = max(1, max_batch)
        self.max_wait_s = max(0.0, max_wait_s)
        self._pending: list[tuple[float, int, Job]] = []  # (arrival, seq, job)
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, jobs: list[Job], now: float) -> None:
        self._pending += [(now, next(self._seq), job) for job in jobs]

    def timeout(self, now: float) -> float | None:
        """Seconds until a batch is due: 0 when one is due now, None when nothing is pending."""
        if not self._pending:
            return None
        if len(self._pending) >= self.max_batch:
            return 0.0
        oldest = min(arrival for arrival, _, _ in self._pending)
        return max(0.0, oldest + self.max_wait_s - now)

    def take(self, now: float) -> tuple[list[Job], list[Job]]:
        """`(batch, expired)`: the batch that is due (empty if none) and the pending partials whose
        deadline has passed, which are not worth running any more.

        When more jobs are pending than fit, realtime and finals go first, then earliest deadline.
        """
        late = [p for p in self._pending if not p[2].final and p[2].deadline < now]
        if late:
            self._pending = [p for p in self._pending if p[2].final or p[2].deadline >= now]
        if self.timeout(now) != 0.0:
            return [], [p[2] for p in late]
        self._pending.sort(key=lambda p: (p[2].priority, not p[2].final, p[2].deadline, p[1]))
        batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
        return [p[2] for p in batch], [p[2] for p in late]

