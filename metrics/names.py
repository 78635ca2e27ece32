"""The metrics processes publish: one table shared by publishers (histogram buckets), the collector
(Prometheus types and help) and the operations guide, so a name means the same thing everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "streamasr_"

# Seconds: sub-millisecond (a partial on an idle GPU) up to a final that waited behind a long queue.
LATENCY_BUCKETS: tuple[float, ...] = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                      1.0, 2.5, 5.0, 10.0, 30.0)
# Seconds: one process hop (a tenth of a millisecond) up to a job queued behind a busy pool.
# A job queued for seconds under overload must read as such, not as the last bucket's 1 s.
TRANSIT_BUCKETS: tuple[float, ...] = (0.0001, 0.0002, 0.0003, 0.0004, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003,
                                      0.005, 0.01, 0.025, 0.1, 1.0, 2.5, 5.0, 10.0, 30.0)
# Requests per backend call: powers of two up to the largest batch a worker can be configured for.
BATCH_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64)
# Seconds: a young collection takes tens of microseconds, a full one over a large heap can take 100s of ms.
GC_BUCKETS: tuple[float, ...] = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


@dataclass(frozen=True)
class MetricSpec:
    name: str  # the name processes publish; exported to Prometheus as PREFIX + name
    kind: str  # "counter" | "gauge" | "histogram"
    publisher: str  # the program that publishes it
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()  # histograms only
    per_process: str = ""  # exported with the publishing process's name in this label (not summed)


SPECS: dict[str, MetricSpec] = {s.name: s for s in (
    MetricSpec("streams_active", "gauge", "ingest", "Open client streams.", ("priority",)),
    MetricSpec("refusals_total", "counter", "ingest", "Client requests refused (limits, bad input, overload).", ("code",)),
    MetricSpec("errors_total", "counter", "broker, ingest, worker", "Internal errors, by protocol error code.", ("code",)),
    MetricSpec("auth_refusals_total", "counter", "broker, ingest",
               "CURVE handshakes refused: the client's public key is not authorized."),
    MetricSpec("partial_latency_seconds", "histogram", "ingest",
               "Partial results decoded: from job creation at ingest to the result back at ingest.", buckets=LATENCY_BUCKETS),
    MetricSpec("final_latency_seconds", "histogram", "ingest",
               "Final results: from job creation at ingest to the result back at ingest.", buckets=LATENCY_BUCKETS),
    MetricSpec("job_transit_seconds", "histogram", "ingest",
               "A job's way between processes: leg=to_worker from its creation at ingest to its decode starting (the "
               "broker's queue included), leg=to_ingest from the decode's end to its result back at ingest.", ("leg",),
               buckets=TRANSIT_BUCKETS),
    MetricSpec("finals_revised_total", "counter", "ingest",
               "Finals whose whole-segment decode changed words partials had marked stable."),
    MetricSpec("shm_rings_used", "gauge", "ingest", "Shared-memory audio rings holding a stream."),
    MetricSpec("opens_waiting", "gauge", "ingest", "Opens held for room (open.wait), first come first served."),
    MetricSpec("shm_rings_total", "gauge", "ingest", "Shared-memory audio rings preallocated."),
    MetricSpec("jobs_queued", "gauge", "broker", "Jobs waiting for a worker.", ("priority",)),
    MetricSpec("jobs_inflight", "gauge", "broker", "Jobs handed to a worker and not yet answered."),
    MetricSpec("jobs_total", "counter", "broker", "Jobs finished, by kind (partial, final) and status.", ("kind", "status")),
    MetricSpec("admission_wait_seconds", "gauge", "broker", "How long realtime streams wait for a model, smoothed (admit_max_load_s)."),
    MetricSpec("admission_busy_ratio", "gauge", "broker", "Share of the workers' time realtime decodes take, smoothed."),
    MetricSpec("admission_stream_share", "gauge", "broker",
               "Share of the workers' time one speaking realtime stream asks for: times the streams open plus one, compared with admit_max_busy."),
    MetricSpec("batch_size", "histogram", "worker", "Requests per backend call.", buckets=BATCH_BUCKETS),
    MetricSpec("busy_seconds_total", "counter", "worker", "Seconds spent in backend calls.", per_process="worker"),
    MetricSpec("worker_jobs_total", "counter", "worker", "Requests decoded, by kind.", ("kind",), per_process="worker"),
    MetricSpec("worker_fallbacks_total", "counter", "worker",
               "Finals whose greedy decode looped, by whether the temperature fallback replaced the text.", ("outcome",)),
    MetricSpec("gc_pause_seconds", "histogram", "any",
               "Python garbage-collection pauses after start-up (frozen heap), by generation.", ("generation",),
               buckets=GC_BUCKETS, per_process="process"),
    MetricSpec("gc_cpu_seconds", "histogram", "any",
               "CPU time of the same collections (the collecting thread's): a pause far longer than this was the "
               "process waiting for a core, not the collector working.", ("generation",),
               buckets=GC_BUCKETS, per_process="process"),
)}


def buckets_for(name: str) -> tuple[float, ...]:
    """Histogram bounds of `name`; unlisted names get latency buckets when in seconds, else batch buckets."""
    spec = SPECS.get(name)
    if spec is not None and spec.buckets:
        return spec.buckets
    return LATENCY_BUCKETS if name.endswith("_seconds") else BATCH_BUCKETS
