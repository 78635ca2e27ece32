"""The broker's dispatch logic, kept free of sockets so every rule can be tested directly.

`JobQueue` orders waiting jobs; `Dispatcher` adds the workers: credit (how many jobs each may
hold), in-flight tracking, re-queueing when a worker dies (up to a limit per job) and
de-duplication of the results that re-queueing can produce.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable

import structlog

from broker.jobs import BATCH, EXPIRED, FAILED, REALTIME, Job, JobResult
from shm import SAMPLE_RATE

log = structlog.get_logger()

JobKey = tuple[int, int]  # (ingest, job_id): job ids are unique only within one ingest
StreamKey = tuple[int, str]  # (ingest, stream)
# Workers lost while holding one job before it is answered FAILED instead of re-queued: a job
# whose audio crashes or hangs the model would otherwise take down every worker in turn. Two,
# so one unrelated crash (or a batch shared with such a job) does not fail a job by itself. A
# worker that keeps a job unanswered past `[broker] job_timeout_s` counts as lost for that job:
# another try may find a worker that runs it, and a fault every worker shares (a JOBS message
# none of them can read) fails the job at the second instead of handing it round for ever.
MAX_WORKER_LOSSES = 2


def job_key(job: Job | JobResult) -> JobKey:
    return (job.ingest, job.job_id)


def expired(job: Job, why: str) -> JobResult:
    """The answer for a job that will never run, so its ingest is not left waiting."""
    return JobResult(job_id=job.job_id, ingest=job.ingest, status=EXPIRED, error=why)


@dataclass(slots=True)
class Queued:
    job: Job
    order: tuple[int, int, int, float, int]
    # Since when the stream has waited for this work: a partial that replaces a queued older one
    # inherits its time, so a stream whose partials keep being superseded shows how stale its
    # text really is (the admission figure is built from this, not from the newest job's age).
    since: float
    alive: bool = True  # removal is lazy: dead entries are skipped when they reach the heap top


class JobQueue:
    """Waiting jobs in dispatch order: REALTIME before BATCH, re-queued jobs first within their
    priority (they have waited longest), then finals before partials, earliest deadline, FIFO.

    Only the newest partial of a stream is worth running: a newer partial (or a final of the same
    or a later segment) replaces a queued older one, which is answered EXPIRED; a partial that
    comes after either (re-queued from a lost worker) is answered EXPIRED itself.
    """

    def __init__(self, partial_deadline_s: float, final_deadline_s: float) -> None:
        self._partial_deadline_s = partial_deadline_s
        self._final_deadline_s = final_deadline_s
        self._heap: list[tuple[tuple[int, int, int, float, int], Queued]] = []
        self._seq = itertools.count()
        self._entries: dict[JobKey, Queued] = {}
        self._partials: dict[StreamKey, Queued] = {}  # the queued partial of each stream
        self._finals: dict[StreamKey, list[Queued]] = {}  # the queued finals of each stream
        self._counts = {REALTIME: 0, BATCH: 0}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: JobKey) -> bool:
        return key in self._entries

    def counts(self) -> dict[int, int]:
        """Queued jobs per priority."""
        return dict(self._counts)

    def oldest_waiting(self, priority: int) -> float | None:
        """`since` of the longest-waiting queued job of `priority` (None: none queued)."""
        return min((e.since for e in self._entries.values() if e.job.priority == priority), default=None)

    def push(self, job: Job, now: float, front: bool = False) -> list[JobResult]:
        """Queue `job`; returns EXPIRED answers for the partials it supersedes (or for itself)."""
        if job.deadline <= 0:  # the ingest left it to the broker's configured deadlines
            budget = self._final_deadline_s if job.final else self._partial_deadline_s
            job.deadline = (job.created or now) + budget
        answers: list[JobResult] = []
        order = (job.priority, 0 if front else 1, 0 if job.final else 1, job.deadline, next(self._seq))
        since = job.created or now
        stream = (job.ingest, job.stream)
        key = job_key(job)
        count = self._counts.get(job.priority, 0) + 1
        if not job.final and any(f.job.seg >= job.seg for f in self._finals.get(stream, ())):
            # a re-queued partial whose segment's final waits: it would run first, for nothing
            answers.append(expired(job, "superseded by the segment's final"))
            return answers
        superseded: Queued | None = None
        queued = self._partials.get(stream)
        if queued is not None:
            old = queued.job
            if job.final and old.seg <= job.seg:
                superseded = queued
                answers.append(expired(old, "superseded by the segment's final"))
                since = min(since, queued.since)
            elif not job.final and old.end <= job.end:
                superseded = queued
                answers.append(expired(old, "superseded by a newer partial"))
                # the stream keeps its place in line: a stream whose partials keep being replaced
                # would otherwise always hold the latest deadline and never be served
                order = min(order, (*queued.order[:4], order[4]))
                since = min(since, queued.since)
                # and a segment whose first partial never ran still has no text on screen: its
                # replacement is the one that gets the quick first look (quick_first_partial)
                job.first = job.first or (old.first and old.seg == job.seg)
            elif not job.final:  # a re-queued partial older than the one waiting
                answers.append(expired(job, "superseded by a newer partial"))
                return answers
        # Nothing changes before the push succeeds. One that fails part way (a job whose fields
        # do not compare with those queued; the wire checks keep such out) leaves the entry,
        # or a copy of its parent, in the heap; dead, it is skipped when it comes up.
        entry = Queued(job, order, since)
        try:
            heapq.heappush(self._heap, (order, entry))
        except Exception:
            entry.alive = False
            raise
        self._entries[key] = entry
        self._counts[job.priority] = count
        if superseded is not None:
            self._discard(superseded)  # after the new entry is in: the last one out clears the heap
        if job.final:
            self._finals.setdefault(stream, []).append(entry)
        else:
            self._partials[stream] = entry
        return answers

    def pop(self, now: float) -> tuple[Queued | None, list[JobResult]]:
        """The next job to run, skipping (and answering) partials whose deadline has passed."""
        answers: list[JobResult] = []
        while self._heap:
            _, entry = heapq.heappop(self._heap)
            if not entry.alive:
                continue
            self._discard(entry)
            job = entry.job
            if not job.final and job.deadline < now:
                answers.append(expired(job, "deadline passed before a worker was free"))
                continue
            return entry, answers
        return None, answers

    def remove(self, key: JobKey) -> Job | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._discard(entry)
        return entry.job

    def remove_ingest(self, ingest: int) -> list[Job]:
        """Drop the queued jobs of `ingest`."""
        gone = [e for e in self._entries.values() if e.job.ingest == ingest]
        for entry in gone:
            self._discard(entry)
        return [e.job for e in gone]

    def _discard(self, entry: Queued) -> None:
        if not entry.alive:
            return
        entry.alive = False
        job = entry.job
        del self._entries[job_key(job)]
        self._counts[job.priority] -= 1
        stream = (job.ingest, job.stream)
        if self._partials.get(stream) is entry:
            del self._partials[stream]
        finals = self._finals.get(stream)
        if job.final and finals is not None:
            finals.remove(entry)
            if not finals:
                del self._finals[stream]
        if not self._entries:  # drop the dead entries at once rather than one pop at a time
            self._heap.clear()


@dataclass(slots=True)
class RealtimeUse:
    """Realtime work over one interval, the broker's second admission figure in the raw.

    `costs` holds the seconds each partial and each final took to decode (index 0 partials,
    1 finals; a batch's time split evenly among its jobs, so batch jobs sharing it are not
    counted), `asked` how many of each realtime streams asked for, `speaking` which streams
    asked for a partial (one is due every partial interval of speech; a final comes after the
    speech, at the pause) and `final_speech_s` how much speech the finals asked for cover.
    Demand is counted when asked, not when served: a saturated pool serves fewer jobs than
    streams ask for, and a backlog is decoded after its streams went quiet.
    """

    seconds: float = 0.0
    workers: int = 0
    costs: tuple[list[float], list[float]] = field(default_factory=lambda: ([], []))
    asked: list[int] = field(default_factory=lambda: [0, 0])
    speaking: set[tuple[int, str]] = field(default_factory=set)  # (ingest, stream key)
    final_speech_s: float = 0.0

    @property
    def busy(self) -> float:
        """Share of the workers' time realtime decodes took (0..1)."""
        if not self.seconds or not self.workers:
            return 0.0
        return min(1.0, (sum(self.costs[0]) + sum(self.costs[1])) / (self.seconds * self.workers))


@dataclass(slots=True)
class WorkerState:
    ident: bytes
    capacity: int  # jobs the worker may hold at once (queued in it plus running)
    pid: int = 0
    model: str = ""
    cost: tuple[float, float] | None = None  # seconds a partial and a final took it at start-up, if it said
    inflight: dict[JobKey, Job] = field(default_factory=dict)
    sent: dict[JobKey, float] = field(default_factory=dict)  # when each held job was handed to it
    jobs_done: int = 0

    @property
    def free(self) -> int:
        return max(0, self.capacity - len(self.inflight))


class Dispatcher:
    """Credit-based load balancing over the ready workers.

    A worker is never sent more jobs than its announced capacity minus the jobs it holds; each
    result returns one credit. Jobs of a worker that dies go back to the front of the queue. The
    first worker may still answer after all, so for re-queued jobs the broker remembers which
    were answered and counts one answer per job (the ingest likewise keeps the first result).
    A job held by MAX_WORKER_LOSSES workers that were lost is answered FAILED instead: it may be
    what kills them. Workers that leave cleanly or register again are not counted; a worker that
    keeps a job unanswered past the broker's limit is, for that job (take_back).
    """

    def __init__(self, queue: JobQueue, remember: int = 65_536) -> None:
        self.queue = queue
        self.workers: dict[bytes, WorkerState] = {}
        self.jobs_done = 0
        self.expired = 0
        self._requeued: set[JobKey] = set()  # jobs that may be answered twice
        self._losses: dict[JobKey, int] = {}  # unanswered jobs: workers lost while holding each
        self._answered: OrderedDict[JobKey, None] = OrderedDict()  # answered re-queued jobs
        self._remember = remember
        self._waited = 0.0  # longest queue wait of a realtime job answered since realtime_wait()
        self._since: dict[JobKey, float] = {}  # in-flight realtime jobs: since when their stream waited
        self._use = RealtimeUse()  # realtime work since realtime_use()
        self._use_since: float | None = None

    @property
    def inflight(self) -> int:
        return sum(len(w.inflight) for w in self.workers.values())

    @property
    def ready(self) -> bool:
        return bool(self.workers)

    def realtime_wait(self, now: float) -> float:
        """Seconds realtime streams waited for a model since the last call: the longest wait of the
        jobs that started (broker queue plus worker batcher, counted from when the stream's oldest
        superseded partial was queued; the decode itself not counted, so a slow model on an idle
        service reads 0) or how long the longest-waiting queued one has waited."""
        waited, self._waited = self._waited, 0.0
        oldest = self.queue.oldest_waiting(REALTIME)
        return max(waited, now - oldest if oldest is not None else 0.0)

    def realtime_use(self, now: float) -> RealtimeUse:
        """What realtime work took and asked for since the last call; see RealtimeUse."""
        use, self._use = self._use, RealtimeUse()
        since, self._use_since = self._use_since, now
        if since is not None and now > since:
            use.seconds, use.workers = now - since, len(self.workers)
        return use

    def submit(self, jobs: Iterable[Job], now: float) -> list[JobResult]:
        """Queue new jobs. An ingest that reconnects re-sends the jobs it still waits for; those
        the broker already holds (queued or at a worker) are not queued twice."""
        answers: list[JobResult] = []
        for job in jobs:
            key = job_key(job)
            if key in self.queue or any(key in w.inflight for w in self.workers.values()):
                continue
            self._answered.pop(key, None)  # asked again: its next result is not a duplicate
            if job.priority == REALTIME:
                if job.final:
                    self._use.final_speech_s += (job.end - job.start) / SAMPLE_RATE
                else:
                    self._use.speaking.add((job.ingest, job.stream))
                self._use.asked[job.final] += 1
            answers += self.queue.push(job, now)
        return self._answer(answers)

    def add_worker(self, ident: bytes, capacity: int, now: float, pid: int = 0, model: str = "",
                   cost: tuple[float, float] | None = None) -> list[JobResult]:
        """Register a (re)connected worker; whatever it held before is re-queued because a READY
        means it started afresh or its socket was replaced and queued messages may be lost."""
        # Not a loss: the same process (the identity holds its pid) replaced its socket, it did not die.
        answers = self.remove_worker(ident, now, lost=False) if ident in self.workers else []
        self.workers[ident] = WorkerState(ident=ident, capacity=max(1, capacity), pid=pid, model=model, cost=cost)
        return answers

    def remove_worker(self, ident: bytes, now: float, lost: bool = True) -> list[JobResult]:
        """Forget a worker; its in-flight jobs go back to the front of the queue.

        `lost`: it died or stopped answering (silent, unreachable), rather than leaving cleanly
        (BYE: it hands back jobs it never started) or registering again. Each job a lost worker
        held counts one loss; a job at MAX_WORKER_LOSSES is answered FAILED, not re-queued.
        """
        worker = self.workers.pop(ident, None)
        if worker is None:
            return []
        return self._take_back(ident, worker.inflight.values(), now, lost)

    def overdue(self, now: float, limit_s: float) -> list[tuple[bytes, Job, float]]:
        """Jobs a worker has held for more than `limit_s` without answering: each with its
        worker and the seconds it has held it."""
        return [(ident, w.inflight[key], now - sent) for ident, w in self.workers.items()
                for key, sent in w.sent.items() if now - sent > limit_s]

    def take_back(self, ident: bytes, jobs: Iterable[Job], now: float) -> list[JobResult]:
        """Take `jobs` from worker `ident`, which has held them past any time a healthy worker
        takes, as from a lost worker: their credit returns, each counts one loss and goes back to
        the front of the queue, or is answered FAILED at MAX_WORKER_LOSSES. The worker stays:
        it answers its other jobs, only these it will not (a JOBS message it could not read)."""
        worker = self.workers.get(ident)
        if worker is None:
            return []
        taken = []
        for job in jobs:
            if worker.inflight.pop(job_key(job), None) is not None:
                del worker.sent[job_key(job)]
                taken.append(job)
        return self._take_back(ident, taken, now, lost=True)

    def excuse(self, seconds: float) -> None:
        """The broker did not listen for `seconds` (frozen, starved): answers may wait unread, so
        that time does not count towards how long the workers have held their jobs."""
        for worker in self.workers.values():
            for key in worker.sent:
                worker.sent[key] += seconds

    def _take_back(self, ident: bytes, jobs: Iterable[Job], now: float, lost: bool) -> list[JobResult]:
        """Jobs worker `ident` no longer holds, back to the front of the queue (see remove_worker)."""
        answers: list[JobResult] = []
        failed: list[JobResult] = []
        for job in jobs:
            key = job_key(job)
            self._since.pop(key, None)
            if key in self._answered:
                # Another copy (a worker given up on that answered late, or an EXPIRED) answered
                # it already: running it again would answer the ingest twice.
                continue
            if lost:
                losses = self._losses[key] = self._losses.get(key, 0) + 1
                if losses >= MAX_WORKER_LOSSES:
                    failed.append(self._give_up(job, losses, ident))
                    continue
            self._requeued.add(key)
            answers += self.queue.push(job, now, front=True)
        return self._answer(answers) + failed

    def unsent(self, ident: bytes, jobs: Iterable[Job], now: float) -> list[JobResult]:
        """Take back `jobs` dispatched to worker `ident` whose message never left (it is gone):
        queued again where they were, no worker having held them, so no loss is counted."""
        worker = self.workers.get(ident)
        answers: list[JobResult] = []
        for job in jobs:
            key = job_key(job)
            if worker is None or worker.inflight.pop(key, None) is None:
                continue
            del worker.sent[key]
            self._since.pop(key, None)
            answers += self.queue.push(job, now, front=key in self._requeued)
        return self._answer(answers)

    def _give_up(self, job: Job, losses: int, ident: bytes) -> JobResult:
        """FAILED for a job that went down with `losses` workers (or that they kept unanswered: see
        take_back); a copy still running elsewhere (a worker given up on may answer late) is then
        a duplicate."""
        key = job_key(job)
        log.warning("broker.job_given_up", job=job.job_id, ingest=job.ingest, stream=job.stream, final=job.final,
                    workers_lost=losses, worker=ident.decode(errors="replace"))
        self._mark_answered(key)
        return JobResult(job_id=job.job_id, ingest=job.ingest, status=FAILED,
                         error=f"held by {losses} workers that were lost, or never answered it, while it was theirs "
                               "(it may crash or hang the model)")

    def dispatch(self, now: float) -> tuple[dict[bytes, list[Job]], list[JobResult]]:
        """Hand queued jobs to workers, each job to the worker with the most free credit.

        Returns one job list per worker (one message each) and the answers for jobs that expired.
        """
        free = {ident: w.free for ident, w in self.workers.items() if w.free > 0}
        sent: dict[bytes, list[Job]] = {}
        answers: list[JobResult] = []
        while free:
            entry, skipped = self.queue.pop(now)
            answers += skipped
            if entry is None:
                break
            job = entry.job
            if job.priority == REALTIME:
                self._since[job_key(job)] = entry.since
            ident = max(free, key=free.__getitem__)
            sent.setdefault(ident, []).append(job)
            self.workers[ident].inflight[job_key(job)] = job
            self.workers[ident].sent[job_key(job)] = now
            free[ident] -= 1
            if not free[ident]:
                del free[ident]
        return sent, self._answer(answers)

    def complete(self, ident: bytes, results: Iterable[JobResult]) -> list[JobResult]:
        """Take the answers worker `ident` reports; returns the first answer of each job (a
        re-queued job can be answered twice; its ingest keeps the first result that arrives)."""
        worker = self.workers.get(ident)
        first: list[JobResult] = []
        for result in results:
            key = job_key(result)
            job = worker.inflight.pop(key, None) if worker is not None else None
            since = self._since.pop(key, None) if job is not None else None
            if job is not None:
                del worker.sent[key]
                worker.jobs_done += 1
                if since is not None and result.started:
                    self._waited = max(self._waited, result.started - since)
                if job.priority == REALTIME and result.finished > result.started > 0:
                    seconds = (result.finished - result.started) / max(1, result.batch_size)
                    self._use.costs[job.final].append(seconds)
            if key in self._answered:
                # A duplicate: no copy of the job may stay queued or remembered as due an answer.
                self._requeued.discard(key)
                self._losses.pop(key, None)
                self.queue.remove(key)
                continue
            if key in self._requeued:
                # Still queued for another try, or held by another worker whose credit returns
                # when it answers.
                self.queue.remove(key)
                self._mark_answered(key)
            self._losses.pop(key, None)
            first.append(result)
        self.jobs_done += len(first)
        return first

    def drop_ingest(self, ingest: int) -> list[Job]:
        return self._forget(self.queue.remove_ingest(ingest))

    def _forget(self, jobs: list[Job]) -> list[Job]:
        for job in jobs:
            self._requeued.discard(job_key(job))
            self._losses.pop(job_key(job), None)
        return jobs

    def _answer(self, answers: list[JobResult]) -> list[JobResult]:
        """Count EXPIRED answers and make sure a late result of the same job is not counted again."""
        for result in answers:
            key = job_key(result)
            if key in self._requeued:
                self._mark_answered(key)
            self._losses.pop(key, None)
        self.expired += len(answers)
        return answers

    def _mark_answered(self, key: JobKey) -> None:
        self._requeued.discard(key)
        self._losses.pop(key, None)
        self._answered[key] = None
        if len(self._answered) > self._remember:
            self._answered.popitem(last=False)
