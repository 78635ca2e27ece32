"""Messages between ingest, broker and workers: jobs name slot ranges in shm, never audio.

Encoded as msgpack arrays (not maps): a job crosses two hops and arrays pack about 3x faster.
Socket frames are `[kind, body]` after the ROUTER identity; kinds are the constants below.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from operator import attrgetter
from typing import Any

import msgpack

# frame 0 of every internal message
READY = b"READY"  # peer registers: ingest {index, endpoint, pid}; worker {capacity, pid, model, cost: [partial s, final s]}
JOBS = b"JOBS"  # ingest -> broker, broker -> worker: list of Job arrays
RESULTS = b"RESULTS"  # worker -> ingest (straight, no broker), broker -> ingest (jobs it expired): JobResult arrays
DONE = b"DONE"  # worker -> broker: the jobs it answered, for credit and decode times (see pack_done)
LEAVING = b"BYE"  # worker -> broker, last on its job socket: it stops; what it holds unanswered goes back to the queue
HEARTBEAT = b"HB"
# broker -> ingest, answering any message but READY from an ingest it has not registered (it gave
# up on a silent one, dropping its queued jobs, or it restarted): send READY and every job still
# waited for. Without it such an ingest, hearing the broker's answers, would never register again.
# broker -> worker, on its heartbeat socket, answering a heartbeat from a worker it has not
# registered: send READY again now, not after the broker's silence outlasts the worker's patience.
REGISTER = b"REGISTER"
HEARTBEAT_SUFFIX = b"+hb"  # a worker's heartbeat socket is its job socket's identity plus this


def heartbeat_identity(worker: bytes) -> bytes:
    """The identity of `worker`'s heartbeat socket: heartbeats travel apart from jobs, so a
    worker's IO thread keeps the link alive while its main thread computes."""
    return worker + HEARTBEAT_SUFFIX


REALTIME = 0
BATCH = 1

OK = 0
EXPIRED = 1  # a partial whose deadline passed before a worker took it: skipped, never run
FAILED = 2  # the backend raised; `error` says why


@dataclass(slots=True)
class Job:
    job_id: int  # unique within the owning ingest process
    ingest: int  # index of the owning ingest process: results go back to it
    stream: str  # ingest-local stream key, for logs and superseding
    shm: str  # shm segment name holding the ring
    slot: int
    generation: int  # ring generation at submit time; a reused slot has a newer one
    start: int  # absolute 16 kHz sample counter, inclusive
    end: int  # exclusive
    final: bool
    priority: int  # REALTIME or BATCH
    deadline: float  # time.monotonic() (CLOCK_MONOTONIC is machine-wide)
    seg: int  # segment index within the stream
    language: str | None = None
    prompt: str | None = None
    prefix: str | None = None
    created: float = 0.0  # time.monotonic() when ingest made it
    first: bool = False  # the segment's first partial: the backend may take a faster, rougher look

    def to_wire(self) -> tuple[Any, ...]:
        return _JOB_ROW(self)

    @classmethod
    def from_wire(cls, row: list[Any]) -> "Job":
        return cls(*row)


@dataclass(slots=True)
class JobResult:
    job_id: int
    ingest: int
    status: int = OK
    text: str = ""
    segments: list[tuple[float, float, str]] = field(default_factory=list)
    avg_logprob: float = 0.0
    no_speech_prob: float = 0.0
    worker: str = ""
    batch_size: int = 0
    started: float = 0.0  # time.monotonic() when the backend call began
    finished: float = 0.0
    error: str | None = None
    language: str = ""  # the language the decode transcribed in: the job's, or the one detected ("" with no decode)
    words: list[tuple[float, float, str]] = field(default_factory=list)  # a final's timed words, as segments

    def to_wire(self) -> tuple[Any, ...]:
        return _RESULT_ROW(self)

    @classmethod
    def from_wire(cls, row: list[Any]) -> "JobResult":
        return cls(*row)


# field values in declaration order, read in C: `astuple` deep-copies and is the slowest step of a hop
_JOB_ROW = attrgetter(*(f.name for f in fields(Job)))
_RESULT_ROW = attrgetter(*(f.name for f in fields(JobResult)))


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=True)


def pack_jobs(jobs: list[Job]) -> bytes:
    return pack([j.to_wire() for j in jobs])


def unpack_jobs(data: bytes) -> list[Job]:
    return [Job.from_wire(row) for row in unpack(data)]


@dataclass(slots=True)
class BadJob:
    """A row of a JOBS message that is not a well-formed job."""

    job_id: int | None  # when the row names one: its sender can be answered
    field: str  # the first field found wrong ("row": not a list of the right length)
    error: str
    ingest: int | None = None  # when the row names one: where a worker answers it


def _int(value: Any) -> bool:
    return type(value) is int  # not bool: msgpack keeps them apart, and a bool here is a mix-up


def _str(value: Any) -> bool:
    return type(value) is str


def _bool(value: Any) -> bool:
    return type(value) is bool


def finite(value: Any) -> bool:
    """A time: NaN would break the queue's order, and a job created at -inf would have waited
    forever (the admission load, smoothed over ticks, would read infinite for good)."""
    return type(value) in (int, float) and math.isfinite(value)


def _opt_str(value: Any) -> bool:
    return value is None or _str(value)


# A peer's time.monotonic() (the clock is machine-wide) further than this from the broker's is a
# wrong value, not a delay: one job created "long ago" would hold the admission load, halved
# once a tick, above any limit for that many ticks per doubling, and refuse every stream meanwhile.
MAX_CLOCK_GAP_S = 86_400.0
MAX_COUNT = 2**31 - 1  # a pid, a capacity, a number of streams or rings from a peer


def _near(t: float, now: float) -> bool:
    return abs(t - now) <= MAX_CLOCK_GAP_S


def peer_int(info: Any, key: str, default: int | None = None) -> int:
    """A count or pid in a peer's READY or heartbeat, checked where it comes in: a float or a
    huge int stored unchecked would fail later, far from the peer, when the broker packs it for
    another (a status reply, the figures for the other ingests). ValueError refuses the message."""
    if not isinstance(info, dict):
        raise ValueError(f"body is a {type(info).__name__}, not a map")
    value = info.get(key, default)
    if not _int(value) or not 0 <= value <= MAX_COUNT:
        raise ValueError(f"{key} must be an int in 0..{MAX_COUNT}, got {str(value)[:40]!r} ({type(value).__name__})")
    return value


# What each field must be as it comes off the wire. Checked once, where the broker takes jobs
# from an ingest: the queue orders, indexes and sums by these, so a job with a wrongly typed
# field would otherwise fail later, far from the peer that sent it, and take others with it.
_JOB_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "job_id": (_int, "an int"),
    "ingest": (_int, "an int"),
    "stream": (_str, "a str"),
    "shm": (_str, "a str"),
    "slot": (_int, "an int"),
    "generation": (_int, "an int"),
    "start": (_int, "an int"),
    "end": (_int, "an int"),
    "final": (_bool, "a bool"),
    "priority": (lambda v: _int(v) and v in (REALTIME, BATCH), f"REALTIME ({REALTIME}) or BATCH ({BATCH})"),
    "deadline": (finite, "a finite number"),
    "seg": (_int, "an int"),
    "language": (_opt_str, "a str or nil"),
    "prompt": (_opt_str, "a str or nil"),
    "prefix": (_opt_str, "a str or nil"),
    "created": (finite, "a finite number"),
    "first": (_bool, "a bool"),
}
_JOB_FIELDS = tuple(f.name for f in fields(Job))
_JOB_REQUIRED = sum(f.default is MISSING and f.default_factory is MISSING for f in fields(Job))
assert set(_JOB_CHECKS) == set(_JOB_FIELDS), "a field added to Job needs its check here"


def _first_wrong(checks: dict[str, tuple[Callable[[Any], bool], str]], names: tuple[str, ...],
                 values: list[Any]) -> tuple[str, str] | None:
    """The first of `values` (fields `names`, in order) that fails its check: its name and why."""
    for name, value in zip(names, values):
        valid, wanted = checks[name]
        if not valid(value):
            return name, f"{name} must be {wanted}, got {str(value)[:40]!r} ({type(value).__name__})"
    return None


def _rows(data: bytes, kind: str) -> list[Any]:
    """The rows of a `kind` message from a peer, which must be a list."""
    rows = unpack(data)
    if not isinstance(rows, list):
        raise ValueError(f"{kind} body is a {type(rows).__name__}, not a list")
    return rows


def check_job(row: Any, now: float) -> Job | BadJob:
    """The job a wire row describes, or what is wrong with it; `now`: the broker's clock."""
    job_id = row[0] if isinstance(row, list) and row and _int(row[0]) else None
    ingest = row[1] if isinstance(row, list) and len(row) > 1 and _int(row[1]) else None
    if not isinstance(row, list) or not _JOB_REQUIRED <= len(row) <= len(_JOB_FIELDS):
        return BadJob(job_id, "row", f"not a list of {_JOB_REQUIRED} to {len(_JOB_FIELDS)} fields: {str(row)[:80]}", ingest)
    if wrong := _first_wrong(_JOB_CHECKS, _JOB_FIELDS, row):
        return BadJob(job_id, *wrong, ingest)
    job = Job.from_wire(row)
    if job.end < job.start:  # negative speech: a final's would turn the admission share negative
        return BadJob(job_id, "end", f"end {job.end} is before start {job.start}", ingest)
    # not given: created 0, deadline <= 0 (the broker's clock and configured deadlines stand in)
    for name, t, given in (("created", job.created, job.created != 0), ("deadline", job.deadline, job.deadline > 0)):
        if given and not _near(t, now):
            return BadJob(job_id, name, f"{name} {t:g} is more than {MAX_CLOCK_GAP_S:g} s from the clock ({now:g})", ingest)
    return job


def unpack_jobs_checked(data: bytes, now: float) -> tuple[list[Job], list[BadJob]]:
    """A JOBS message from a peer: its well-formed jobs, and what is wrong with the other rows."""
    jobs: list[Job] = []
    bad: list[BadJob] = []
    for row in _rows(data, "JOBS"):
        checked = check_job(row, now)
        if isinstance(checked, Job):
            jobs.append(checked)
        else:
            bad.append(checked)
    return jobs, bad


def pack_results(results: list[JobResult]) -> bytes:
    return pack([r.to_wire() for r in results])


def unpack_results(data: bytes) -> list[JobResult]:
    return [JobResult.from_wire(row) for row in unpack(data)]


_DONE_FIELDS = ("job_id", "ingest", "status", "batch_size", "started", "finished")
_DONE_ROW = attrgetter(*_DONE_FIELDS)


def pack_done(results: list[JobResult]) -> bytes:
    """What the broker needs of results that went to their ingests: no text, no segments."""
    return pack([_DONE_ROW(r) for r in results])


_DONE_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "job_id": (_int, "an int"),
    "ingest": (_int, "an int"),
    "status": (lambda v: _int(v) and v in (OK, EXPIRED, FAILED), f"OK ({OK}), EXPIRED ({EXPIRED}) or FAILED ({FAILED})"),
    "batch_size": (lambda v: _int(v) and v >= 0, "an int >= 0"),
    "started": (finite, "a finite number"),
    "finished": (finite, "a finite number"),
}
assert set(_DONE_CHECKS) == set(_DONE_FIELDS), "a field added to DONE needs its check here"


def check_done(row: Any, now: float) -> tuple[JobResult | None, BadJob | None]:
    """The answer a DONE row reports, and what is wrong with the row; `now`: the broker's clock.
    A row naming its job by well-typed ids still returns the job's credit when the rest is wrong
    (of another length, say: a worker of another version), only without the status and times
    (they feed the admission figures, which one absurd decode time would spoil for long); a row
    that names no job is only reported."""
    if not isinstance(row, list) or len(row) < 2:
        return None, BadJob(None, "row", f"not a list of {len(_DONE_FIELDS)} fields: {str(row)[:80]}")
    if wrong := _first_wrong(_DONE_CHECKS, _DONE_FIELDS[:2], row[:2]):
        return None, BadJob(None, *wrong)
    job_id, ingest = row[0], row[1]
    if len(row) != len(_DONE_FIELDS):
        return JobResult(job_id=job_id, ingest=ingest), BadJob(job_id, "row", f"{len(row)} fields, not {len(_DONE_FIELDS)}")
    if wrong := _first_wrong(_DONE_CHECKS, _DONE_FIELDS[2:], row[2:]):
        return JobResult(job_id=job_id, ingest=ingest), BadJob(job_id, *wrong)
    result = JobResult(**dict(zip(_DONE_FIELDS, row)))
    timed = result.started or result.finished  # both 0: not timed (a job the worker could not run)
    if timed and not (_near(result.finished, now) and 0 <= result.finished - result.started <= MAX_CLOCK_GAP_S):
        return JobResult(job_id=job_id, ingest=ingest), BadJob(
            job_id, "finished", f"a decode from {result.started:g} to {result.finished:g} (the broker's clock: {now:g})")
    return result, None


def unpack_done_checked(data: bytes, now: float) -> tuple[list[JobResult], list[JobResult], list[BadJob]]:
    """A DONE message from a worker: the answers it reports, those of rows that name their job
    but are otherwise wrong (their credit returns, their status is unknown), and what is wrong
    with the rows."""
    results: list[JobResult] = []
    unreadable: list[JobResult] = []
    bad: list[BadJob] = []
    for row in _rows(data, "DONE"):
        result, wrong = check_done(row, now)
        if result is not None:
            (results if wrong is None else unreadable).append(result)
        if wrong is not None:
            bad.append(wrong)
    return results, unreadable, bad
