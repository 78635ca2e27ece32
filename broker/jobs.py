"""Messages between ingest, broker and workers: jobs name slot ranges in shm, never audio.

Encoded as msgpack arrays (not maps): a job crosses two hops and arrays pack about 3x faster.
Socket frames are `[kind, body]` after the ROUTER identity; kinds are the constants below.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Any

import msgpack

# frame 0 of every internal message
READY = b"READY"  # peer registers: ingest {index, endpoint, pid}; worker {capacity, pid, model, cost: [partial s, final s]}
JOBS = b"JOBS"  # ingest -> broker, broker -> worker: list of Job arrays
RESULTS = b"RESULTS"  # worker -> ingest (straight, no broker), broker -> ingest (jobs it expired): JobResult arrays
DONE = b"DONE"  # worker -> broker: the jobs it answered, for credit and decode times (see pack_done)
CANCEL = b"CANCEL"  # ingest -> broker: drop queued jobs of these stream keys
LEAVING = b"BYE"  # worker -> broker, last on its job socket: it stops; what it holds unanswered goes back to the queue
HEARTBEAT = b"HB"
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


def pack_results(results: list[JobResult]) -> bytes:
    return pack([r.to_wire() for r in results])


def unpack_results(data: bytes) -> list[JobResult]:
    return [JobResult.from_wire(row) for row in unpack(data)]


def pack_done(results: list[JobResult]) -> bytes:
    """What the broker needs of results that went to their ingests: no text, no segments."""
    return pack([(r.job_id, r.ingest, r.status, r.batch_size, r.started, r.finished) for r in results])


def unpack_done(data: bytes) -> list[JobResult]:
    return [JobResult(job_id=job_id, ingest=ingest, status=status, batch_size=batch_size, started=started, finished=finished)
            for job_id, ingest, status, batch_size, started, finished in unpack(data)]
