"""Dynamic batching in the worker: when a batch leaves and what goes into it."""

from __future__ import annotations

import itertools

import pytest

from broker.jobs import BATCH, REALTIME, Job
from workers.batcher import Batcher

NOW = 50.0
_ids = itertools.count(1)


def job(*, final: bool = False, priority: int = REALTIME, deadline: float = NOW + 10) -> Job:
    return Job(job_id=next(_ids), ingest=0, stream="s", shm="x", slot=0, generation=1, start=0, end=160,
               final=final, priority=priority, deadline=deadline, seg=0)


def test_waits_for_more_then_leaves_after_max_wait() -> None:
    b = Batcher(max_batch=4, max_wait_s=0.005)
    assert b.timeout(NOW) is None
    b.add([job()], NOW)
    assert b.timeout(NOW) == pytest.approx(0.005)
    assert b.take(NOW + 0.001) == ([], [])
    b.add([job()], NOW + 0.002)
    assert b.timeout(NOW + 0.002) == pytest.approx(0.003)  # counted from the first job
    batch, late = b.take(NOW + 0.005)
    assert len(batch) == 2 and late == []
    assert len(b) == 0


def test_full_batch_leaves_at_once() -> None:
    b = Batcher(max_batch=3, max_wait_s=1.0)
    b.add([job() for _ in range(5)], NOW)
    assert b.timeout(NOW) == 0.0
    batch, _ = b.take(NOW)
    assert len(batch) == 3
    assert b.timeout(NOW + 0.5) == pytest.approx(0.5)  # the rest waits from its own arrival
    assert len(b.take(NOW + 1.0)[0]) == 2


def test_realtime_and_finals_first_when_more_pending_than_fit() -> None:
    b = Batcher(max_batch=2, max_wait_s=0.0)
    batch_final = job(final=True, priority=BATCH)
    partial = job()
    final = job(final=True)
    b.add([batch_final, partial, final], NOW)
    first, _ = b.take(NOW)
    assert [j.job_id for j in first] == [final.job_id, partial.job_id]
    assert [j.job_id for j in b.take(NOW)[0]] == [batch_final.job_id]


def test_partials_past_deadline_are_returned_as_late() -> None:
    b = Batcher(max_batch=8, max_wait_s=0.0)
    stale = job(deadline=NOW - 1)
    final = job(final=True, deadline=NOW - 1)
    b.add([stale, final], NOW - 2)
    batch, late = b.take(NOW)
    assert [j.job_id for j in batch] == [final.job_id]
    assert [j.job_id for j in late] == [stale.job_id]
