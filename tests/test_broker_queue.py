"""The broker's dispatch rules, without sockets: order, superseding, expiry, cancel, credit."""

from __future__ import annotations

import itertools
import json
import math
import random
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from broker import jobs as wire
from broker.figures import FILE, SAVE_EVERY_S, Figures, SavedFigures
from broker.jobs import BATCH, EXPIRED, FAILED, OK, REALTIME, Job, JobResult
from broker.broker import MIN_LOADED_DECODES, OUTLIER_RATIO, Broker, _decode_cost, typical_cost
from broker.queue import MAX_WORKER_LOSSES, Dispatcher, JobQueue, RealtimeUse, job_key
from config import settings

NOW = 1000.0
_ids = itertools.count(1)


def job(stream: str = "s", *, final: bool = False, priority: int = REALTIME, deadline: float = NOW + 5,
        end: int = 16_000, seg: int = 0, ingest: int = 0, job_id: int | None = None, created: float = NOW) -> Job:
    return Job(
        job_id=next(_ids) if job_id is None else job_id, ingest=ingest, stream=stream, shm="shm", slot=0,
        generation=1, start=0, end=end, final=final, priority=priority, deadline=deadline, seg=seg, created=created,
    )


def drain(q: JobQueue, now: float = NOW) -> tuple[list[Job], list[JobResult]]:
    out, answers = [], []
    while True:
        entry, skipped = q.pop(now)
        answers += skipped
        if entry is None:
            return out, answers
        out.append(entry.job)


def queue() -> JobQueue:
    return JobQueue(partial_deadline_s=2.0, final_deadline_s=10.0)


def done(j: Job, status: int = OK) -> JobResult:
    return JobResult(job_id=j.job_id, ingest=j.ingest, status=status, text="x")


def _held_by_new_worker(d: Dispatcher, ident: bytes, j: Job) -> None:
    d.add_worker(ident, capacity=1, now=NOW)
    assert [x.job_id for x in d.dispatch(NOW)[0][ident]] == [j.job_id]


def requeued_final(worker: bytes) -> tuple[Dispatcher, Job]:
    """A dispatcher whose one job, a final, went to `worker`, which was then declared lost while
    it still computed: the job is queued again."""
    d = Dispatcher(queue())
    j = job("s", final=True)
    d.submit([j], NOW)
    _held_by_new_worker(d, worker, j)
    d.remove_worker(worker, NOW)
    return d, j


def test_order_realtime_then_finals_then_deadline_then_fifo() -> None:
    q = queue()
    batch_final = job("a", final=True, priority=BATCH, deadline=NOW + 1)
    late_partial = job("b", deadline=NOW + 3)
    early_partial = job("c", deadline=NOW + 2)
    final = job("d", final=True, deadline=NOW + 9)
    fifo1 = job("e", deadline=NOW + 4)
    fifo2 = job("f", deadline=NOW + 4)
    for j in (batch_final, late_partial, early_partial, final, fifo1, fifo2):
        assert q.push(j, NOW) == []
    order, answers = drain(q)
    assert [j.stream for j in order] == ["d", "c", "b", "e", "f", "a"]
    assert answers == []


def test_newer_partial_supersedes_queued_partial_of_same_stream() -> None:
    q = queue()
    old = job("s", end=16_000)
    other_stream = job("t", end=8_000)
    other_ingest = job("s", end=8_000, ingest=1)
    for j in (old, other_stream, other_ingest):
        q.push(j, NOW)
    newer = job("s", end=24_000)
    answers = q.push(newer, NOW)
    assert [(a.job_id, a.status) for a in answers] == [(old.job_id, EXPIRED)]
    assert "superseded" in (answers[0].error or "")
    order, _ = drain(q)
    assert {j.job_id for j in order} == {newer.job_id, other_stream.job_id, other_ingest.job_id}


def test_older_partial_arriving_late_is_expired_not_queued() -> None:
    q = queue()
    newer = job("s", end=32_000)
    q.push(newer, NOW)
    older = job("s", end=16_000)  # e.g. re-queued from a dead worker
    answers = q.push(older, NOW, front=True)
    assert [a.job_id for a in answers] == [older.job_id]
    assert [j.job_id for j in drain(q)[0]] == [newer.job_id]


def test_a_requeued_partial_is_expired_when_its_segment_s_final_is_queued() -> None:
    """A worker is lost while it decodes a stream's partial; the segment's final came meanwhile
    and waits. That final supersedes the partial: re-queued at the front, the partial would be
    decoded first, ahead of every final waiting, for text the final replaces."""
    d = Dispatcher(queue())
    partial = job("s", seg=2, end=16_000)
    d.submit([partial], NOW)
    _held_by_new_worker(d, b"a", partial)
    final, other = job("s", final=True, seg=2, end=24_000), job("t", final=True)
    d.submit([final, other], NOW)
    assert [(a.job_id, a.status) for a in d.remove_worker(b"a", NOW)] == [(partial.job_id, EXPIRED)]
    d.add_worker(b"b", capacity=3, now=NOW)
    assert [j.job_id for j in d.dispatch(NOW)[0][b"b"]] == [final.job_id, other.job_id]
    assert d._requeued == set()  # answered: a late result of it is a duplicate


def test_final_supersedes_queued_partial_of_its_segment_and_finals_are_kept() -> None:
    q = queue()
    partial = job("s", seg=3)
    q.push(partial, NOW)
    final = job("s", final=True, seg=3)
    assert [a.job_id for a in q.push(final, NOW)] == [partial.job_id]
    final2 = job("s", final=True, seg=4)
    assert q.push(final2, NOW) == []  # finals never replace finals
    assert [j.job_id for j in drain(q)[0]] == [final.job_id, final2.job_id]


def test_expired_partials_are_answered_and_finals_never_dropped() -> None:
    q = queue()
    stale = job("a", deadline=NOW - 0.1)
    fresh = job("b", deadline=NOW + 1)
    late_final = job("c", final=True, deadline=NOW - 5)
    for j in (stale, fresh, late_final):
        q.push(j, NOW - 1)
    order, answers = drain(q, NOW)
    assert [j.job_id for j in order] == [late_final.job_id, fresh.job_id]
    assert [(a.job_id, a.status) for a in answers] == [(stale.job_id, EXPIRED)]
    assert "deadline" in (answers[0].error or "")


def test_missing_deadline_comes_from_config() -> None:
    q = queue()
    partial = job("a", deadline=0.0)
    final = job("b", final=True, deadline=0.0)
    q.push(partial, NOW)
    q.push(final, NOW)
    assert partial.deadline == pytest.approx(NOW + 2.0)
    assert final.deadline == pytest.approx(NOW + 10.0)


def test_dropping_an_ingest_removes_only_its_jobs() -> None:
    d = Dispatcher(queue())
    gone = [job("a", seg=1, final=True), job("a", seg=2), job("b")]
    kept = [job("a", ingest=1), job("c", ingest=1)]
    d.submit([*gone, *kept], NOW)
    assert {j.job_id for j in d.drop_ingest(0)} == {j.job_id for j in gone}
    assert len(d.queue) == 2
    assert d.queue.counts() == {REALTIME: 2, BATCH: 0}
    assert {j.job_id for j in drain(d.queue)[0]} == {j.job_id for j in kept}


def test_drop_ingest_removes_all_its_queued_jobs() -> None:
    d = Dispatcher(queue())
    d.submit([job("a"), job("b", final=True), job("c", ingest=2)], NOW)
    assert len(d.drop_ingest(0)) == 2
    assert [j.ingest for j in drain(d.queue)[0]] == [2]


def test_credit_never_exceeded_and_spread_by_free_credit() -> None:
    d = Dispatcher(queue())
    d.add_worker(b"w1", capacity=4, now=NOW)
    d.add_worker(b"w2", capacity=2, now=NOW)
    d.submit([job(f"s{i}") for i in range(10)], NOW)
    sent, _ = d.dispatch(NOW)
    assert {k: len(v) for k, v in sent.items()} == {b"w1": 4, b"w2": 2}
    assert len(d.queue) == 4
    assert d.dispatch(NOW)[0] == {}  # no credit left: nothing more
    # one result returns one credit
    forwarded = d.complete(b"w2", [done(sent[b"w2"][0])])
    assert len(forwarded) == 1
    again, _ = d.dispatch(NOW)
    assert {k: len(v) for k, v in again.items()} == {b"w2": 1}


def test_most_free_credit_first() -> None:
    d = Dispatcher(queue())
    d.add_worker(b"w1", capacity=8, now=NOW)
    d.add_worker(b"w2", capacity=8, now=NOW)
    d.submit([job(f"s{i}") for i in range(6)], NOW)
    sent, _ = d.dispatch(NOW)
    assert {k: len(v) for k, v in sent.items()} == {b"w1": 3, b"w2": 3}


def test_credit_property_random_traffic() -> None:
    rng = random.Random(7)
    d = Dispatcher(queue())
    caps = {b"a": 3, b"b": 5, b"c": 1}
    for ident, cap in caps.items():
        d.add_worker(ident, capacity=cap, now=NOW)
    held: dict[bytes, list[Job]] = {ident: [] for ident in caps}
    for _ in range(300):
        d.submit([job(f"s{rng.randrange(50)}", final=rng.random() < 0.3, deadline=NOW + 60) for _ in range(rng.randrange(4))], NOW)
        sent, _ = d.dispatch(NOW)
        for ident, jobs in sent.items():
            held[ident] += jobs
        for ident, jobs in held.items():
            assert len(jobs) <= caps[ident]
            assert len(d.workers[ident].inflight) == len(jobs)
            if jobs and rng.random() < 0.5:
                d.complete(ident, [done(jobs.pop(rng.randrange(len(jobs))))])


def test_dead_worker_jobs_requeued_at_front_of_their_priority() -> None:
    d = Dispatcher(queue())
    d.add_worker(b"w1", capacity=2, now=NOW)
    first = [job("a", final=True), job("b", final=True)]
    d.submit(first, NOW)
    sent, _ = d.dispatch(NOW)
    assert len(sent[b"w1"]) == 2
    waiting = [job("c", final=True, deadline=NOW), job("d", final=True, deadline=NOW)]  # earlier deadlines
    batch = job("e", final=True, priority=BATCH)
    d.submit([*waiting, batch], NOW)
    assert d.remove_worker(b"w1", NOW) == []
    assert d.inflight == 0
    order, _ = drain(d.queue)
    assert [j.stream for j in order] == ["a", "b", "c", "d", "e"]


def test_redispatched_job_is_answered_once() -> None:
    d, j = requeued_final(b"w1")
    d.add_worker(b"w2", capacity=1, now=NOW)
    sent, _ = d.dispatch(NOW)
    assert sent[b"w2"][0].job_id == j.job_id
    assert len(d.complete(b"w1", [done(j)])) == 1  # the first worker was alive after all
    assert d.workers[b"w2"].inflight  # w2 still computes: its credit stays taken
    assert d.complete(b"w2", [done(j)]) == []  # the duplicate is not forwarded
    assert d.workers[b"w2"].free == 1
    assert d.jobs_done == 1


def test_answer_while_requeued_removes_it_from_queue() -> None:
    d, j = requeued_final(b"w1")
    assert job_key(j) in d.queue
    assert len(d.complete(b"w1", [done(j)])) == 1
    assert len(d.queue) == 0


def test_requeued_partial_superseded_is_not_answered_twice() -> None:
    d = Dispatcher(queue())
    d.add_worker(b"w1", capacity=1, now=NOW)
    old = job("a", end=16_000)
    d.submit([old], NOW)
    d.dispatch(NOW)
    d.submit([job("a", end=32_000)], NOW)
    answers = d.remove_worker(b"w1", NOW)
    assert [(a.job_id, a.status) for a in answers] == [(old.job_id, EXPIRED)]
    assert d.complete(b"w1", [done(old)]) == []  # already answered EXPIRED


def test_resent_jobs_are_not_queued_twice() -> None:
    d = Dispatcher(queue())
    d.add_worker(b"w1", capacity=1, now=NOW)
    a, b = job("a", final=True), job("b", final=True)
    d.submit([a, b], NOW)
    d.dispatch(NOW)  # a at the worker, b queued
    d.submit([Job.from_wire(list(a.to_wire())), Job.from_wire(list(b.to_wire()))], NOW)  # ingest reconnected
    assert len(d.queue) == 1
    assert d.inflight == 1


def test_worker_ready_again_requeues_what_it_held() -> None:
    d = Dispatcher(queue())
    d.add_worker(b"w1", capacity=2, now=NOW)
    d.submit([job("a", final=True)], NOW)
    d.dispatch(NOW)
    d.add_worker(b"w1", capacity=2, now=NOW)  # reconnected: messages in its old socket may be lost
    assert d.inflight == 0
    assert len(d.queue) == 1


def test_job_answered_late_is_not_requeued_when_its_other_worker_goes() -> None:
    """A job re-queued off a worker given up on, answered late by that worker while a second one
    holds it: when the second one goes (or registers again) the job is answered already and
    must not run a third time, nor stay remembered as due an answer."""
    d, j = requeued_final(b"a")  # silent: given up on, the job re-queued
    d.add_worker(b"b", capacity=1, now=NOW)
    assert [x.job_id for x in d.dispatch(NOW)[0][b"b"]] == [j.job_id]
    assert len(d.complete(b"a", [done(j)])) == 1  # alive after all: the ingest has its answer
    assert d.add_worker(b"b", capacity=1, now=NOW) == []  # b reconnected: what it held goes back, except this
    assert job_key(j) not in d.queue and d.dispatch(NOW) == ({}, [])
    assert d.complete(b"b", [done(j)]) == []  # its old copy answers: a duplicate
    assert (len(d.queue), d.inflight, d._requeued, d._since) == (0, 0, set(), {})
    assert d.jobs_done == 1


def test_late_duplicate_answer_clears_a_queued_copy() -> None:
    """However an answered job came to be queued or remembered again, its next duplicate answer
    leaves nothing of it behind."""
    d, j = requeued_final(b"a")
    assert len(d.complete(b"a", [done(j)])) == 1
    d.queue.push(j, NOW, front=True)
    d._requeued.add(job_key(j))
    assert d.complete(b"a", [done(j)]) == []
    assert (len(d.queue), d._requeued) == (0, set())


def test_a_job_whose_workers_keep_being_lost_is_failed_not_requeued() -> None:
    """A job whose audio crashes or hangs the model would take every worker down in turn: after
    MAX_WORKER_LOSSES workers lost while holding it, it is answered FAILED and runs no more."""
    assert MAX_WORKER_LOSSES == 2
    d = Dispatcher(queue())
    poison, other = job("p", final=True), job("q", final=True)
    d.submit([poison], NOW)
    _held_by_new_worker(d, b"a", poison)
    assert d.remove_worker(b"a", NOW) == []  # the first loss: re-queued, as for any dead worker
    assert job_key(poison) in d.queue
    _held_by_new_worker(d, b"b", poison)
    with capture_logs() as logs:
        [failed] = d.remove_worker(b"b", NOW)
    assert (failed.job_id, failed.ingest, failed.status) == (poison.job_id, poison.ingest, FAILED)
    assert failed.error == "held by 2 workers that were lost, or never answered it, while it was theirs (it may crash or hang the model)"
    assert [(e["event"], e["log_level"], e["job"], e["workers_lost"]) for e in logs] == \
        [("broker.job_given_up", "warning", poison.job_id, 2)]
    assert len(d.queue) == 0 and d.expired == 0  # not counted as expired: it was tried, and failed
    # A worker given up on answers after all: the ingest has its answer already, this is a duplicate.
    assert d.complete(b"a", [done(poison)]) == []
    assert (d._losses, d._requeued) == ({}, set())
    # Other jobs are unaffected: a job's count is its own.
    d.submit([other], NOW)
    _held_by_new_worker(d, b"c", other)
    assert d.remove_worker(b"c", NOW) == [] and job_key(other) in d.queue


def test_a_job_kept_unanswered_past_the_limit_is_taken_back_as_from_a_lost_worker() -> None:
    """A worker that holds a job and never answers it (it could not read the JOBS message) while
    it answers others: past the limit the job is taken back, its credit returned, and re-queued
    with one loss counted; kept unanswered again, it is answered FAILED, not handed round for
    ever. Time the broker did not listen is not the worker's: its answers may wait unread."""
    d = Dispatcher(queue())
    stuck, other = job("s", final=True), job("t", final=True)
    d.submit([stuck, other], NOW)
    d.add_worker(b"a", capacity=2, now=NOW)
    assert len(d.dispatch(NOW)[0][b"a"]) == 2
    assert d.overdue(NOW + 10, 10.0) == []
    d.excuse(5.0)
    assert d.overdue(NOW + 14, 10.0) == []
    assert len(d.complete(b"a", [done(other)])) == 1
    assert [(ident, j.job_id, held) for ident, j, held in d.overdue(NOW + 16, 10.0)] == [(b"a", stuck.job_id, 11.0)]
    assert d.take_back(b"a", [stuck], NOW + 16) == []  # the first time: re-queued, at the front
    assert d.workers[b"a"].free == 2 and job_key(stuck) in d.queue and d._losses == {job_key(stuck): 1}
    assert [j.job_id for j in d.dispatch(NOW + 16)[0][b"a"]] == [stuck.job_id]
    with capture_logs() as logs:
        [failed] = d.take_back(b"a", [stuck], NOW + 27)
    assert (failed.job_id, failed.status) == (stuck.job_id, FAILED) and "never answered it" in (failed.error or "")
    assert [(e["event"], e["job"]) for e in logs] == [("broker.job_given_up", stuck.job_id)]
    assert d.workers[b"a"].free == 2 and len(d.queue) == 0 and d.overdue(NOW + 100, 10.0) == []
    assert d.complete(b"a", [done(stuck)]) == []  # answered after all: a duplicate, not counted again
    assert (d._losses, d._requeued) == ({}, set())


@pytest.mark.parametrize(("stuck_after_s", "taken"), [(60.0, True), (0.0, False)])
def test_the_broker_takes_back_jobs_held_past_its_limit_only_while_the_workers_watchdog_is_on(
        stuck_after_s: float, taken: bool) -> None:
    """With the watchdog off a model call may run any length: no limit could tell a long one from
    a job that will never be answered, so the broker takes none back."""
    broker = Broker(settings.load(None, {"workers": {"stuck_after_s": stuck_after_s}}))
    try:
        d = broker.dispatcher
        d.add_worker(b"w", capacity=1, now=NOW)
        j = job("s", final=True)
        d.submit([j], NOW)
        d.dispatch(NOW)
        broker._take_back_overdue(NOW + broker.cfg.broker.job_timeout_s + 1)
        assert (job_key(j) in d.queue, job_key(j) in d.workers[b"w"].inflight) == (taken, not taken)
    finally:
        broker.close()


def test_a_final_the_broker_gives_up_on_is_counted_as_a_final() -> None:
    """jobs_total's labels for the broker's own answer: a final whose workers kept being lost is
    a failed final, not a partial."""
    broker = Broker(settings.load())
    try:
        poison = job("p", final=True)
        broker.dispatcher.submit([poison], NOW)
        for ident in (b"a", b"b"):
            _held_by_new_worker(broker.dispatcher, ident, poison)
            broker._lose_worker(ident, "silent", NOW)
        assert [(r.job_id, r.status) for r in broker._outbox[poison.ingest]] == [(poison.job_id, FAILED)]
        assert broker.metrics.snapshot()["counters"] == [["jobs_total", {"kind": "final", "status": "failed"}, 1]]
    finally:
        broker.close()


def test_a_job_whose_done_row_is_malformed_is_counted_unreported_not_done() -> None:
    """The ingest has the worker's answer, the broker only the job's ids: jobs_total must not
    claim the job went well. The well-formed row beside it counts as ever."""
    broker = Broker(settings.load())
    try:
        d = broker.dispatcher
        d.add_worker(b"w", capacity=2, now=NOW)
        garbled, fine = job("a", final=True), job("b", final=True)
        d.submit([garbled, fine], NOW)
        assert len(d.dispatch(NOW)[0][b"w"]) == 2
        rows = [[garbled.job_id, 0, OK, 2, 0.0, 0.0, "a field of a newer worker"], [fine.job_id, 0, OK, 2, 0.0, 0.0]]
        with capture_logs() as logs:
            broker._on_worker([b"w", wire.DONE, wire.pack(rows)], NOW)
        assert [(e["event"], e["job"], e["field"]) for e in logs] == [("broker.bad_done_row", garbled.job_id, "row")]
        assert d.workers[b"w"].inflight == {}  # both credits back
        counters = {(c[1]["kind"], c[1]["status"]): c[2] for c in broker.metrics.snapshot()["counters"] if c[0] == "jobs_total"}
        assert counters == {("final", "unreported"): 1, ("final", "done"): 1}
    finally:
        broker.close()


def test_a_clean_leave_or_a_new_socket_is_not_a_loss() -> None:
    """A worker that says BYE hands back jobs it never started, and one that registers again
    replaced its socket, not its process: neither says anything about the jobs it held."""
    d = Dispatcher(queue())
    j = job("s", final=True)
    d.submit([j], NOW)
    _held_by_new_worker(d, b"a", j)
    assert d.remove_worker(b"a", NOW, lost=False) == []  # BYE
    _held_by_new_worker(d, b"b", j)
    assert d.add_worker(b"b", capacity=1, now=NOW) == []  # READY again on a new socket
    assert d._losses == {} and job_key(j) in d.queue
    assert [x.job_id for x in d.dispatch(NOW)[0][b"b"]] == [j.job_id]
    assert d.remove_worker(b"b", NOW) == []  # the first real loss: re-queued
    _held_by_new_worker(d, b"c", j)
    assert d.remove_worker(b"c", NOW, lost=False) == []
    _held_by_new_worker(d, b"d", j)
    assert [(r.job_id, r.status) for r in d.remove_worker(b"d", NOW)] == [(j.job_id, FAILED)]  # the second


def test_a_jobs_losses_are_forgotten_once_it_is_answered() -> None:
    """Counts last until the job is answered, however: a result, an EXPIRED, a cancel. A job
    asked for again afterwards starts from none, and nothing is left remembered."""
    d, j = requeued_final(b"a")
    assert d._losses == {job_key(j): 1}
    _held_by_new_worker(d, b"b", j)
    assert len(d.complete(b"b", [done(j)])) == 1  # answered
    assert d._losses == {}
    d.remove_worker(b"b", NOW, lost=False)
    d.submit([Job.from_wire(list(j.to_wire()))], NOW)  # asked again (its result was lost on the way)
    _held_by_new_worker(d, b"c", j)
    assert d.remove_worker(b"c", NOW) == []  # one loss since it was asked again: re-queued
    assert job_key(j) in d.queue

    # a re-queued partial superseded while it waits is answered EXPIRED: its count goes with it
    d = Dispatcher(queue())
    old = job("t", end=16_000)
    d.submit([old], NOW)
    _held_by_new_worker(d, b"a", old)
    d.remove_worker(b"a", NOW)
    assert d._losses == {job_key(old): 1}
    assert [(a.job_id, a.status) for a in d.submit([job("t", end=32_000)], NOW)] == [(old.job_id, EXPIRED)]
    assert d._losses == {}

    # a dropped ingest's re-queued jobs are forgotten with their counts
    d, j = requeued_final(b"a")
    assert d._losses == {job_key(j): 1}
    assert d.drop_ingest(j.ingest) == [j]
    assert (d._losses, d._requeued) == ({}, set())


def _simulate(seed: int) -> None:
    """One random run of an ingest and workers that die, register again, lose what their old
    socket held and answer after they were given up on, or leave cleanly; then everything is
    served to the end. A job is answered FAILED exactly when the MAX_WORKER_LOSSES-th worker lost
    while holding it goes."""
    rng = random.Random(seed)
    d = Dispatcher(queue())
    now = NOW
    waiting: dict[tuple[int, int], Job] = {}  # what the ingest still waits for
    counted: dict[tuple[int, int], int] = {}  # answers the broker counts (forwarded EXPIRED or first result)
    submitted: set[tuple[int, int]] = set()
    ends: dict[str, int] = {}
    segs: dict[str, int] = {}
    held: dict[bytes, list[Job]] = {}  # what each worker process really holds, given up on or not
    alive: set[bytes] = set()
    losses: dict[tuple[int, int], int] = {}  # workers lost while holding each job not answered yet

    def count(results: list[JobResult]) -> None:
        for r in results:
            counted[job_key(r)] = counted.get(job_key(r), 0) + 1
            waiting.pop(job_key(r), None)

    def new_job(stream: str) -> Job:
        final = rng.random() < 0.25
        ends[stream] = ends.get(stream, 0) + 8000
        seg = segs.get(stream, 0)
        if final:
            segs[stream] = seg + 1
        return job(stream, final=final, priority=rng.choice([REALTIME, BATCH]), deadline=now + rng.choice([0.5, 5, 50]),
                   end=ends[stream], seg=seg, created=now)

    def answer(ident: bytes, j: Job) -> None:
        result = JobResult(job_id=j.job_id, ingest=j.ingest, status=OK, started=now, finished=now + 0.1, batch_size=1)
        waiting.pop(job_key(j), None)  # results go straight to the ingest, which keeps the first
        count(d.complete(ident, [result]))

    def dispatch() -> bool:
        sent, expired = d.dispatch(now)
        count(expired)
        for ident, jobs in sent.items():
            held.setdefault(ident, []).extend(jobs)
            assert len(d.workers[ident].inflight) <= d.workers[ident].capacity
            assert d.workers[ident].sent.keys() == d.workers[ident].inflight.keys()
        return bool(sent or expired)

    for _ in range(300):
        now += rng.random() * 0.3
        op = rng.random()
        if op < 0.3:
            jobs = [new_job(f"s{rng.randrange(6)}") for _ in range(rng.randrange(1, 4))]
            for j in jobs:
                waiting[job_key(j)] = j
                submitted.add(job_key(j))
            count(d.submit(jobs, now))
        elif op < 0.35:  # the ingest reconnected: it re-sends all it waits for
            count(d.submit([Job.from_wire(list(j.to_wire())) for j in waiting.values()], now))
        elif op < 0.45:  # READY: a new worker, or one that reconnected and may have lost what its old socket held
            ident = f"w{rng.randrange(4)}".encode()
            count(d.add_worker(ident, rng.randrange(1, 4), now))
            alive.add(ident)
            held[ident] = [j for j in held.get(ident, []) if rng.random() < 0.5]
        elif op < 0.5 and alive:  # given up on, though it may still answer; or it says BYE
            ident = rng.choice(sorted(alive))
            lost = op < 0.48
            due = {key for key in d.workers[ident].inflight if key not in counted} if lost else set()
            for key in due:
                losses[key] = losses.get(key, 0) + 1
            answers = d.remove_worker(ident, now, lost=lost)
            assert {job_key(r) for r in answers if r.status == FAILED} == \
                {key for key in due if losses[key] == MAX_WORKER_LOSSES}, f"seed {seed}"
            count(answers)
            alive.discard(ident)
        elif op < 0.53:  # kept past the broker's limit: taken back, though the worker may still answer
            overdue = d.overdue(now, 1.0)
            due = {job_key(j) for _, j, _ in overdue if job_key(j) not in counted}
            for key in due:
                losses[key] = losses.get(key, 0) + 1
            answers = [a for ident, j, _ in overdue for a in d.take_back(ident, [j], now)]
            assert {job_key(r) for r in answers if r.status == FAILED} == \
                {key for key in due if losses[key] == MAX_WORKER_LOSSES}, f"seed {seed}"
            count(answers)
        elif op < 0.75:
            dispatch()
        elif busy := [ident for ident, jobs in held.items() if jobs]:
            ident = rng.choice(busy)
            answer(ident, held[ident].pop(rng.randrange(len(held[ident]))))

    count(d.add_worker(b"last", 4, now))
    for _ in range(10_000):
        now += 0.01
        progressed = dispatch()
        for ident, jobs in held.items():
            while jobs:
                answer(ident, jobs.pop())
                progressed = True
        if not progressed and not len(d.queue):
            break
    assert not waiting, f"seed {seed}: never answered {sorted(waiting)}"
    assert all(counted.get(key) == 1 for key in submitted), \
        f"seed {seed}: answered other than once {sorted((k, n) for k, n in counted.items() if n != 1)}"
    assert (len(d.queue), d.inflight, d._since, d._requeued, d._losses) == (0, 0, {}, set(), {}), f"seed {seed}"


def test_dispatcher_property_workers_dying_reconnecting_and_answering_late() -> None:
    for seed in range(150):
        _simulate(seed)


def test_job_rows_with_badly_typed_fields_are_refused_one_by_one() -> None:
    good = job("a", final=True)
    rows = [list(good.to_wire()) for _ in range(6)]
    rows[1][9] = "0"  # priority
    rows[2][8] = 1  # final
    rows[3][10] = None  # deadline
    rows[4] = rows[4][:5]
    rows[5][2] = b"a"  # stream
    jobs, bad = wire.unpack_jobs_checked(wire.pack([*rows, "x"]), NOW)
    assert jobs == [good]
    assert [(b.job_id, b.field) for b in bad] == [(good.job_id, "priority"), (good.job_id, "final"), (good.job_id, "deadline"),
                                                  (good.job_id, "row"), (good.job_id, "stream"), (None, "row")]
    with pytest.raises(ValueError):
        wire.unpack_jobs_checked(wire.pack({"jobs": rows}), NOW)


def test_a_job_whose_audio_ends_before_it_starts_is_refused_and_prices_no_stream() -> None:
    """A final row whose end comes before its start covers negative speech: taken in, it would
    turn the finals' share of a stream negative while it is in the figures' window. It is
    refused like any malformed row, and the share comes from the well-formed final alone."""
    broker = Broker(settings.load())
    try:
        d = broker.dispatcher
        d.add_worker(b"w", capacity=2, now=NOW)
        d.realtime_use(NOW)
        good = job("a", final=True, end=16_000)
        backwards = replace(job("b", final=True, end=16_000), start=48_000)
        jobs, bad = wire.unpack_jobs_checked(wire.pack([list(j.to_wire()) for j in (backwards, good)]), NOW)
        assert [(b.job_id, b.field) for b in bad] == [(backwards.job_id, "end")]
        d.submit(jobs, NOW)
        d.complete(b"w", [JobResult(job_id=j.job_id, ingest=0, started=NOW, finished=NOW + 0.5, batch_size=1)
                          for j in d.dispatch(NOW)[0][b"w"]])
        broker._update_stream_share(d.realtime_use(NOW + 1.0))
        assert broker.figures.share[1] == pytest.approx(0.5 / 1.0 / 1)  # 0.5 s per second of speech, one worker
    finally:
        broker.close()


def test_a_push_that_fails_leaves_the_queue_as_it_was() -> None:
    """A job that does not compare with those queued (the wire checks keep such out) fails its
    own push only: the queue still serves what it held and what comes after."""
    d = Dispatcher(queue())
    first, later = job("a", final=True), job("c", final=True)
    partial = job("b")
    d.submit([first, partial], NOW)
    with pytest.raises(TypeError):
        d.queue.push(job("b", priority="0", end=32_000), NOW)  # type: ignore[arg-type]
    d.submit([later], NOW)
    assert len(d.queue) == 3 and job_key(partial) in d.queue  # not superseded by the job that failed
    d.add_worker(b"w", capacity=8, now=NOW)
    sent, expired_ = d.dispatch(NOW)
    assert sorted(j.job_id for j in sent[b"w"]) == sorted(j.job_id for j in (first, partial, later)) and expired_ == []
    assert (len(d.queue), d.queue.counts()) == (0, {REALTIME: 0, BATCH: 0})


def test_superseding_partial_keeps_the_streams_place_in_line() -> None:
    """A stream whose partials keep being replaced must not be starved by streams that wait quietly."""
    q = queue()
    q.push(job("busy", deadline=NOW + 2.0, end=8_000), NOW)
    q.push(job("quiet", deadline=NOW + 2.1), NOW)
    newer = job("busy", deadline=NOW + 2.5, end=16_000)
    [superseded] = q.push(newer, NOW)
    assert superseded.status == EXPIRED
    order, _ = drain(q)
    assert [j.stream for j in order] == ["busy", "quiet"]
    assert order[0] is newer  # the newest audio runs, at the oldest request's place


def test_a_partial_replacing_a_segment_s_first_one_gets_the_quick_first_look() -> None:
    """With partial_window = "full", a segment's first partial is still decoded on the short
    window (quick_first_partial), so its first words reach the screen sooner. Replaced in the
    queue under load, the first partial never ran; its replacement is what the segment shows
    first, and must keep that quick look instead of a full-window decode (slower, and dearer
    when the workers are already behind)."""
    q = queue()
    q.push(replace(job("s", seg=3, end=8_000), first=True), NOW)
    q.push(replace(job("t", seg=0, end=8_000), first=True), NOW)
    q.push(job("s", seg=3, end=16_000), NOW)
    q.push(job("t", seg=1, end=24_000), NOW)  # the next segment's partial: its own first is yet to come
    assert {j.stream: j.first for j in drain(q)[0]} == {"s": True, "t": False}
    q.push(job("s", seg=4, end=8_000), NOW)  # a later partial of a segment already shown
    q.push(job("s", seg=4, end=16_000), NOW)
    assert [j.first for j in drain(q)[0]] == [False]


def test_realtime_wait_counts_from_the_streams_oldest_superseded_partial() -> None:
    """The admission figure is how stale a stream's text is: a partial that replaced older ones
    has waited since the first of them, however new its own audio."""
    d = Dispatcher(queue())
    d.add_worker(b"w1", capacity=1, now=NOW)
    d.submit([job("a", final=True)], NOW)
    [busy] = d.dispatch(NOW)[0][b"w1"]  # the only worker is taken
    for i in range(4):  # stream b asks for a partial every 0.5 s; each replaces the last
        d.submit([job("b", end=8_000 * (i + 1), created=NOW + 0.5 * i)], NOW + 0.5 * i)
    assert d.realtime_wait(NOW + 2.0) == pytest.approx(2.0)  # not 0.5, the newest partial's age
    d.complete(b"w1", [JobResult(job_id=busy.job_id, ingest=0, started=NOW, finished=NOW + 2.0)])
    [partial] = d.dispatch(NOW + 2.0)[0][b"w1"]
    assert partial.end == 32_000
    d.complete(b"w1", [JobResult(job_id=partial.job_id, ingest=0, started=NOW + 2.1, finished=NOW + 2.3)])
    assert d.realtime_wait(NOW + 2.3) == pytest.approx(2.1)
    assert d.realtime_wait(NOW + 2.4) == 0.0  # nothing waits any more


def test_the_wait_figure_rises_smoothed_and_falls_once_the_backlog_is_worked_off(tmp_path: Path) -> None:
    """A worker stalls (frozen, say) for four seconds with a realtime job queued behind it: the
    figure rises, a tick behind. Once nothing is queued any more, it falls at once, not halving
    each tick: that went on refusing realtime opens for seconds after the workers had caught up."""
    broker = Broker(settings.load(None, {"run_dir": str(tmp_path)}))
    try:
        d = broker.dispatcher
        d.add_worker(b"w", capacity=1, now=NOW)
        held, waiting = job("a", final=True, deadline=NOW + 60), job("b", final=True, deadline=NOW + 60)
        d.submit([held, waiting], NOW)
        assert [j.job_id for j in d.dispatch(NOW)[0][b"w"]] == [held.job_id]
        loads = []
        for t in (1, 2, 3, 4):
            broker._check_peers(NOW + t)
            loads.append(broker.load)
        assert loads == pytest.approx([0.5, 1.25, 2.125, 3.0625])  # b's age, smoothed: one slow tick refuses nobody
        d.complete(b"w", [JobResult(job_id=held.job_id, ingest=0, started=NOW, finished=NOW + 4.1)])
        assert [j.job_id for j in d.dispatch(NOW + 4.1)[0][b"w"]] == [waiting.job_id]
        d.complete(b"w", [JobResult(job_id=waiting.job_id, ingest=0, started=NOW + 4.1, finished=NOW + 4.2)])
        broker._check_peers(NOW + 5)
        assert broker.load == pytest.approx(3.5813, abs=1e-3)  # b started after waiting 4.1 s: the tick's figure
        broker._check_peers(NOW + 6)
        assert broker.load == 0.0  # nothing waited, nothing queued
    finally:
        broker.close()


def test_realtime_use_counts_decode_time_and_what_streams_ask_for() -> None:
    """The second admission figure in the raw: it grows with each speaking stream while nothing queues."""
    d = Dispatcher(queue())
    d.add_worker(b"w1", capacity=2, now=NOW)
    d.add_worker(b"w2", capacity=2, now=NOW)
    assert d.realtime_use(NOW).busy == 0.0  # the first call only starts the interval
    d.submit([job("a"), job("b", final=True), job("c", priority=BATCH)], NOW)
    sent = d.dispatch(NOW)[0]
    by_stream = {j.stream: (ident, j) for ident, jobs in sent.items() for j in jobs}
    ident_a, a = by_stream["a"]
    ident_b, b = by_stream["b"]
    ident_c, c = by_stream["c"]
    # a and b decoded 0.4 s each (b in a batch of two with the batch job c: half of it is b's)
    d.complete(ident_a, [JobResult(job_id=a.job_id, ingest=0, started=NOW + 0.1, finished=NOW + 0.5, batch_size=1)])
    d.complete(ident_b, [JobResult(job_id=b.job_id, ingest=0, started=NOW, finished=NOW + 0.8, batch_size=2)])
    d.complete(ident_c, [JobResult(job_id=c.job_id, ingest=0, started=NOW, finished=NOW + 0.8, batch_size=2)])
    assert d.realtime_wait(NOW + 1.0) == pytest.approx(0.1)  # hardly any queueing...
    use = d.realtime_use(NOW + 1.0)
    assert use.busy == pytest.approx(0.8 / 2.0)  # ...but the workers were 40 % busy
    assert use.costs == (pytest.approx([0.4]), pytest.approx([0.4])) and use.asked == [1, 1]
    assert use.speaking == {(0, "a")}  # b asked for a final (its speech is over), c is a batch stream
    d.submit([job("d"), job("e"), job("f", final=True)], NOW + 1.5)  # two more speak, one paused; none decoded yet
    use = d.realtime_use(NOW + 2.0)
    assert use.busy == 0.0 and use.asked == [2, 1] and use.speaking == {(0, "d"), (0, "e")}


def test_stream_share_is_what_a_speaking_stream_asks_for_not_the_backlog() -> None:
    """A backlog decoded after its streams went quiet must not make one speaking stream look costly."""
    broker = Broker(settings.load())
    try:
        speaking = {(0, f"s{i}") for i in range(10)}
        # ten streams ask for two partials a second (0.1 s each) and a final every two seconds of speech (0.4 s)
        for _ in range(5):
            broker._update_stream_share(RealtimeUse(seconds=1.0, workers=2, costs=([0.1] * 6, [0.4] * 2),
                                                    asked=[20, 5], speaking=speaking, final_speech_s=10.0))
        steady = broker.stream_share
        assert steady == pytest.approx((20 * 0.1 + 5 * 0.4) / 2 / 10)  # 0.2 of the two workers per stream
        # they stop; one new stream speaks while the workers still decode the others' finals
        for _ in range(5):
            broker._update_stream_share(RealtimeUse(seconds=1.0, workers=2, costs=([0.1], [0.4] * 4),
                                                    asked=[2, 0], speaking={(0, "new")}))
        assert broker.stream_share <= steady  # the new stream asks for what a stream asks, not for the backlog
    finally:
        broker.close()


def test_one_stalled_decode_does_not_price_every_stream_at_its_cost() -> None:
    """What decodes cost with the workers busy is kept through quiet spells. On a lightly loaded
    service one final that stalls (5 s where they take 0.4) makes its tick "busy" by itself; priced
    from it, one speaking stream would ask for most of the workers, and every second realtime
    open would be refused until the service is busy again, which the refusals prevent."""
    def light(final_s: float | None) -> RealtimeUse:
        """A second of one stream speaking: two partials of 0.1 s, and maybe a final for its last 3 s."""
        use = _speaking({"a"})
        if final_s is not None:
            use.costs[1].append(final_s)
            use.asked[1], use.final_speech_s = 1, 3.0
        return use

    busy = RealtimeUse(seconds=1.0, workers=2, costs=([0.1] * 6, [0.4] * 2), asked=[20, 5],
                       speaking={(0, f"s{i}") for i in range(10)}, final_speech_s=10.0)
    shares = []
    for stall in (None, 5.0):
        broker = Broker(settings.load())
        try:
            for _ in range(5):
                broker._update_stream_share(busy)
            loaded = list(broker.figures.loaded_cost)
            for second in range(18):  # a final every third second; after the busy spell has left the window, one stalls
                final = (stall or 0.4) if second == 6 else 0.4 if second % 3 == 0 else None
                broker._update_stream_share(light(final))
            assert broker.figures.loaded_cost == pytest.approx(loaded)
            shares.append(broker.stream_share)
        finally:
            broker.close()
    assert shares[1] == pytest.approx(shares[0])

    # among many decodes of a busy window, stalled ones count at most OUTLIER_RATIO times the median:
    # two in one tick (a machine-wide hiccup), a batch of four held up together in another
    window = [_speaking({f"s{i}" for i in range(10)}, partial_s=0.05) for _ in range(3)]
    window[1].costs[0].extend([3.0, 2.0])
    window[2].costs[0].extend([1.5] * 4)
    assert typical_cost(window, 0, MIN_LOADED_DECODES) == pytest.approx((60 * 0.05 + 6 * OUTLIER_RATIO * 0.05) / 66)
    # a partial of a long segment costing a few times a short one's is not a stall
    assert typical_cost([_speaking({"a", "b"}, partial_s=0.05), _speaking({"c"}, partial_s=0.15)], 0, 1) == pytest.approx(
        (4 * 0.05 + 2 * 0.15) / 6)
    assert typical_cost(window[:1], 1, MIN_LOADED_DECODES) is None  # no final decoded


def test_saved_figures_come_back_for_the_same_model_only(tmp_path: Path) -> None:
    """A restarted broker starts from the share its predecessor measured, unless the model
    settings changed (another model costs otherwise) or the file cannot be read."""
    cfg = settings.load(None, {"run_dir": str(tmp_path)})
    saved = SavedFigures(cfg)
    saved.save(Figures([0.05, 0.15], [0.05, 0.3], [0.1, 0.6]), NOW)
    assert SavedFigures(cfg).load() == Figures([0.05, 0.15], [0.05, 0.3], [0.1, 0.6])
    saved.save(Figures([0.05, 0.05], [0.05, 0.3], [0.1, 0.6]), NOW + SAVE_EVERY_S / 2)  # changed, but saved at most every SAVE_EVERY_S
    assert SavedFigures(cfg).load() == Figures([0.05, 0.15], [0.05, 0.3], [0.1, 0.6])
    saved.save(Figures([0.05, 0.05], [0.05, 0.3], [0.1, 0.6]), NOW + SAVE_EVERY_S / 2, at_once=True)  # at shutdown
    assert SavedFigures(cfg).load() == Figures([0.05, 0.05], [0.05, 0.3], [0.1, 0.6])
    saved.save(Figures([math.nan, 0.05], [0.05, 0.3], [0.1, 0.6]), NOW + 10 * SAVE_EVERY_S, at_once=True)
    assert SavedFigures(cfg).load() == Figures([0.05, 0.05], [0.05, 0.3], [0.1, 0.6])  # good ones are not replaced

    other = settings.load(None, {"run_dir": str(tmp_path), "model": {"precision": "int8"}})
    assert SavedFigures(other).load() is None
    (tmp_path / FILE).write_text("{not json")
    with capture_logs() as logs:
        assert SavedFigures(cfg).load() is None
    assert [e["event"] for e in logs] == ["broker.admission_figures_unreadable"]

    broker = Broker(other)  # restored when the broker runs; a fresh one measures from nothing
    try:
        assert broker.stream_share == 0.0
    finally:
        broker.close()


def test_saved_figures_do_not_come_back_for_another_pool_or_partial_rate(tmp_path: Path) -> None:
    """The share is of the workers' time, and its partials' part is per partial interval: one
    saved with two workers is twice what a stream asks of four (a burst cut at half what fits),
    and half what it asks of one; so is one saved at another partial rate. Those figures are
    measured anew, not restored."""
    def cfg(**over: dict[str, int]) -> settings.Config:
        return settings.load(None, {"run_dir": str(tmp_path), "workers": {"processes": 2}, **over})

    SavedFigures(cfg()).save(Figures([0.05, 0.15], [0.05, 0.3], [0.1, 0.6]), NOW)
    assert SavedFigures(cfg()).load() == Figures([0.05, 0.15], [0.05, 0.3], [0.1, 0.6])
    for other in (cfg(workers={"processes": 4}), cfg(workers={"processes": 1}), cfg(ingest={"partial_interval_ms": 250})):
        assert SavedFigures(other).load() is None


def test_figures_measured_on_after_a_restore_are_saved(tmp_path: Path) -> None:
    """A restarted broker measures on into the figures it restored, changing them in place; what
    it measures must reach the file for the next start, not the restored figures forever."""
    cfg = settings.load(None, {"run_dir": str(tmp_path)})
    SavedFigures(cfg).save(Figures([0.05, 0.15], [0.05, 0.3], [0.1, 0.6]), NOW)
    saved = SavedFigures(cfg)
    figures = saved.load()
    assert figures is not None
    figures.share[0], figures.loaded_cost[1] = 0.2, 0.9
    saved.save(figures, NOW + SAVE_EVERY_S)
    assert SavedFigures(cfg).load() == Figures([0.2, 0.15], [0.05, 0.3], [0.1, 0.9])
    figures.share[1] = 0.25
    saved.save(figures, NOW + SAVE_EVERY_S, at_once=True)  # at shutdown
    assert SavedFigures(cfg).load() == Figures([0.2, 0.25], [0.05, 0.3], [0.1, 0.9])


@pytest.mark.parametrize("content", [
    "[]", "null", "3", '"figures"',
    '{"model": MODEL, "share": [0.1, 0.1], "decode_cost": [0.1, 0.1], "loaded_cost": [0, 0], "saved": "yesterday"}',
    '{"model": MODEL, "share": [NaN, 0.1], "decode_cost": [0.1, 0.1], "loaded_cost": [0, 0], "saved": 0}',
    # a number no float holds (OverflowError, which would have ended the broker at every start)
    '{"model": MODEL, "share": [1' + "0" * 400 + ', 0.1], "decode_cost": [0.1, 0.1], "loaded_cost": [0, 0], "saved": 0}',
    '{"model": MODEL, "share": [0.1, 0.1], "decode_cost": [0.1, 0.1], "loaded_cost": [0, 0], "saved": 1' + "0" * 400 + '}',
    # parts that sum to a share but are not one: admission would let in a hundred times too many
    '{"model": MODEL, "share": [-5.0, 5.01], "decode_cost": [0.1, 0.1], "loaded_cost": [0.1, 0.1], "saved": 0}',
    '{"model": MODEL, "share": [0.1, 0.1], "decode_cost": [0.1, 0.1], "loaded_cost": [-1, -1], "saved": 0}',
    '{"model": MODEL, "share": "12", "decode_cost": [0.1, 0.1], "loaded_cost": [0, 0], "saved": 0}',
])
def test_admission_figures_of_another_shape_are_unreadable_not_fatal(tmp_path: Path, content: str) -> None:
    """Valid JSON that is not the figures' object (a hand edit, another tool's file) is skipped
    with a warning like a torn file: the broker starts with no saved figures."""
    cfg = settings.load(None, {"run_dir": str(tmp_path)})
    (tmp_path / FILE).write_text(content.replace("MODEL", json.dumps(asdict(cfg.model))))
    with capture_logs() as logs:
        assert SavedFigures(cfg).load() is None
    assert [e["event"] for e in logs] == ["broker.admission_figures_unreadable"]


def _speaking(streams: set[str], partials_each: int = 2, seconds: float = 1.0, partial_s: float = 0.1,
              workers: int = 2) -> RealtimeUse:
    """One tick in which `streams` each asked for (and had decoded) partials of `partial_s`."""
    n = partials_each * len(streams)
    return RealtimeUse(seconds=seconds, workers=workers, costs=([partial_s] * n, []), asked=[n, 0],
                       speaking={(0, s) for s in streams})


def test_stream_share_counts_a_stream_only_while_it_speaks() -> None:
    """A stream that joins late in the window (or pauses, or ends) is not a stream that asked
    little: streams opened together speak together, and each asks what a speaking one does."""
    broker = Broker(settings.load())
    try:
        for _ in range(4):
            broker._update_stream_share(_speaking({"a"}))
        assert broker.stream_share == pytest.approx(0.2 / 2)  # two partials of 0.1 s a second, on two workers
        broker._update_stream_share(_speaking({"a", "b"}))  # b opens in the last second of the window
        assert broker.stream_share == pytest.approx(0.2 / 2)  # not (0.8 + 0.4) / 2 workers / 5 s / 2 streams
        for _ in range(3):
            broker._update_stream_share(_speaking({"b"}))  # a pauses
        assert broker.stream_share == pytest.approx(0.2 / 2)
    finally:
        broker.close()


def test_a_stream_is_priced_from_the_workers_start_up_decodes_until_measured() -> None:
    """Before any stream was measured (or restored), each part of the share is priced from what
    a partial and a final cost the workers when they started, and the price follows the workers
    present. A part measured with the workers to themselves counts at no less than that price
    (a burst will share the cores); measured with the workers busy, it counts as measured."""
    broker = Broker(settings.load())  # partials every 0.5 s, 0.5 s of silence ends a segment
    try:
        assert broker.stream_share == 0.0  # no worker: nothing to price a stream at
        broker.dispatcher.add_worker(b"w0", 1, NOW, cost=(0.05, 0.6))
        broker.dispatcher.add_worker(b"w1", 1, NOW, cost=(0.07, 0.6))
        broker.dispatcher.add_worker(b"w2", 1, NOW)  # said nothing of its costs: it counts as a worker
        # a 3 s segment asks for 7 partials (every 0.5 s of the 3.5 s until it ends) and one final
        prior = [7 / 3 * 0.06 / 3, 0.6 / 3 / 3]
        assert broker.share_prior == pytest.approx(prior)
        assert broker.stream_share == pytest.approx(sum(prior))

        def tick(streams: int, partial_s: float) -> RealtimeUse:
            """One second in which `streams` streams each asked for two partials of `partial_s`."""
            return _speaking({f"s{i}" for i in range(streams)}, partial_s=partial_s, workers=3)

        for _ in range(5):
            broker._update_stream_share(tick(1, 0.3))  # dearer than the price, on idle workers
        assert broker.stream_share == pytest.approx(0.6 / 3 + prior[1])  # partials measured, finals not yet
        for _ in range(5):
            broker._update_stream_share(tick(1, 0.03))  # cheaper, on idle workers
        assert broker.stream_share == pytest.approx(sum(prior))  # no less than the price
        for _ in range(5):
            broker._update_stream_share(tick(15, 0.05))  # 15 streams: the workers busy
        assert broker.figures.loaded_cost[0] == pytest.approx(0.05)
        assert broker.stream_share == pytest.approx(0.1 / 3 + prior[1])  # measured under load, below the price
        broker.dispatcher.remove_worker(b"w2", NOW)
        assert broker.share_prior == pytest.approx([7 / 3 * 0.06 / 2, 0.6 / 3 / 2])
        # what a READY may carry: a worker whose figures are unusable is served without them
        assert _decode_cost([0.05, 0.6]) == (0.05, 0.6)
        assert [_decode_cost(x) for x in (None, [0.1], ["x", 1], [float("nan"), 1], [-1, 1], [1, float("inf")])] == [None] * 6
    finally:
        broker.close()


def test_stream_share_with_a_short_heartbeat() -> None:
    """With ticks shorter than two partial intervals a speaking stream does not ask in every
    one; it is counted over spans of a second, so its share is the same."""
    broker = Broker(settings.load(None, {"broker": {"heartbeat_ms": 250}}))
    try:
        assert broker.figures_window_s == pytest.approx(5.0)
        for tick in range(24):  # one partial every other tick: two a second
            broker._update_stream_share(_speaking({"a"}, 1, 0.25) if tick % 2 else RealtimeUse(seconds=0.25, workers=2))
        assert broker.stream_share == pytest.approx(0.2 / 2)
    finally:
        broker.close()


def test_stream_share_is_not_taken_from_a_window_that_holds_little_speech() -> None:
    """A final is asked after its speech: it counts per second of the speech it covers, not in
    the second it was asked in; and once the window has slid past the speech, the second or
    two left of it do not make the partials' share."""
    broker = Broker(settings.load())
    try:
        for _ in range(4):
            broker._update_stream_share(_speaking({"a"}))
        final = RealtimeUse(seconds=1.0, workers=2, costs=([], [0.5]), asked=[0, 1], final_speech_s=4.0)
        broker._update_stream_share(final)  # at the pause, for the four seconds spoken
        speaking = 0.2 / 2 + 0.5 / 4.0 / 2  # partials: 0.2 s a second; the final: 0.5 s per 4 s; on two workers
        assert broker.stream_share == pytest.approx(speaking)
        for _ in range(5):
            broker._update_stream_share(RealtimeUse(seconds=1.0, workers=2))  # silence
        assert broker.stream_share == pytest.approx(speaking)  # not (0.2 + 0.5) / 2 from the last second of speech
    finally:
        broker.close()


def test_stream_share_is_priced_at_what_decodes_cost_with_the_workers_busy() -> None:
    """Decodes take longer when streams share the cores: once that has been seen, one stream
    alone on idle workers is priced at it, since admission decides near capacity."""
    broker = Broker(settings.load())
    try:
        for _ in range(5):  # alone: 0.1 s a partial, 10 % busy
            broker._update_stream_share(_speaking({"a"}))
        alone = broker.stream_share
        assert alone == pytest.approx(0.2 / 2)
        for _ in range(5):  # six streams, 0.25 s a partial, workers at 100 % (of 1.2 s of decoding asked)
            broker._update_stream_share(RealtimeUse(seconds=1.0, workers=2, costs=([0.25] * 8, []), asked=[12, 0],
                                                    speaking={(0, f"s{i}") for i in range(6)}))
        for _ in range(5):  # one stream again, on idle workers
            broker._update_stream_share(_speaking({"a"}))
        assert broker.stream_share == pytest.approx(2 * 0.25 / 2) and broker.stream_share > 2 * alone
    finally:
        broker.close()


def test_partials_asked_while_no_worker_serves_do_not_price_a_stream() -> None:
    """Every worker restarting at once (a deploy, a crash of all): the streams go on asking
    for partials, with no worker-seconds to serve them. Those asks are no measure of what a
    stream costs; counted against the seconds of the ticks that had workers, they priced each
    stream at up to a window's ticks times its share, and admission refused streams for
    seconds after the workers were back (and a broker restarted then restored that price)."""
    broker = Broker(settings.load())
    try:
        ten = {f"s{i}" for i in range(10)}
        for _ in range(5):
            broker._update_stream_share(_speaking(ten))
        steady = broker.stream_share
        assert steady == pytest.approx(0.2 / 2)
        for _ in range(8):  # no worker: the partials wait in the queue, none decoded
            broker._update_stream_share(replace(_speaking(ten), workers=0, costs=([], [])))
            assert broker.stream_share == pytest.approx(steady)
        for _ in range(6):  # the workers are back
            broker._update_stream_share(_speaking(ten))
            assert broker.stream_share == pytest.approx(steady)
    finally:
        broker.close()


def test_a_worker_s_absurd_start_up_decode_times_price_no_stream_at_infinity() -> None:
    """A READY whose decode times are finite but absurd (1e308 s: a worker of another version, a
    bug) must not make the admission figures infinite: priced from them, one stream's share was
    inf, sent to every ingest and shown by status; an ingest multiplying it by no stream got NaN."""
    broker = Broker(settings.load())
    try:
        broker._on_worker([b"worker-1-1", wire.READY, wire.pack(
            {"capacity": 1, "pid": 1, "model": "null", "cost": [1e308, 1e308]})], NOW)
        assert list(broker.dispatcher.workers) == [b"worker-1-1"]  # registered, served all the same
        assert all(math.isfinite(x) for x in broker.share_prior), broker.share_prior
        assert math.isfinite(broker.stream_share)
        assert math.isfinite(broker.status(NOW).stream_share_prior)
    finally:
        broker.close()
