"""`streamasr bench`: a load generator for the service, in the spirit of Triton's perf_analyzer.

N streams are spread over P client processes (streamasr.loadgen), each one DEALER serving its
streams from one loop, paced in real time from the dev set and espeak-ng speech (or, with
--offline, as fast as the flow-control window allows). Latency is measured in the clients, from
the send time of the frame holding a result's last sample; the processes report raw samples here
as msgpack and this module turns them into percentiles, throughput, batch sizes, per-process CPU
and WER. The generator times its own sends, so a run where it fell behind says so instead of
reporting latencies it inflated itself.

With --ramp the streams open one by one during the run instead of together, and admission
control, which reacts to the broker's measured figures, refuses what does not fit: refused opens
are counted by error code, latencies are those of the admitted streams, and the report carries the
peak admission figures and, for a service the bench started, each process's GC pauses. Without a
ramp, and in a sweep, a service the bench starts admits every stream: the run measures what N
streams get, refusing is not its point. Against --server the service's own settings hold.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import msgpack
import numpy as np
import psutil
import zmq

from client.client import handshake
from client.core import LOCAL_HOSTS
from config import settings
from metrics import allocwatch
from metrics.collector import Histogram
from metrics.registry import PUBLISH_INTERVAL_S
from protocol import messages as m
from protocol.auth import Curve
from streamasr.allocmarks import AllocationMarks
from streamasr.loadgen import Clip, Plan, RecordReader
from streamasr.service import LocalService, Refused, launch, ops_curve

ROOT = Path(__file__).resolve().parents[1]
GAP_S = 0.8  # silence after each clip: more than the VAD's minimum silence, so each clip ends a segment
SAMPLE_EVERY_S = 0.5  # psutil sampling period
PERCENTILES = (("p50", 50.0), ("p90", 90.0), ("p99", 99.0), ("p99_9", 99.9))
ESPEAK_SENTENCES = (
    "the quick brown fox jumps over the lazy dog",
    "please call stella and ask her to bring these things with her from the store",
    "we will meet at the station before the train leaves in the morning",
    "a streaming recognizer returns partial words while the speaker is still talking",
    "turn left at the second light and park behind the old library",
    "she sells sea shells by the sea shore",
    "the weather today is cold and windy with a chance of rain in the evening",
    "open the window and let some fresh air into the room",
)


# ---------------------------------------------------------------------------------- the service


@dataclass
class Target:
    """The service under test, and what we can learn about its processes."""

    address: str
    local: LocalService | None = None
    curve: Curve | None = None  # the keys its clients use, when it has CURVE on

    def status(self) -> m.StatusReply | None:
        from streamasr.service import front_door

        try:
            reply = front_door(self.address, m.Status(), timeout=5.0, curve=self.curve)
        except (TimeoutError, m.ProtocolError):
            return None
        return reply if isinstance(reply, m.StatusReply) else None

    def settle(self, timeout: float = 60.0) -> None:
        """Wait until no job is queued or in flight and the admission figures have decayed, so one run's
        backlog neither slows the next nor gets its streams refused as `overloaded`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            reply = self.status()
            if (reply is not None and not reply.inflight and not sum(reply.queued.values()) and reply.load < 0.05
                    and reply.busy < 0.05):
                return
            time.sleep(0.25)

    def pids(self) -> dict[str, int]:
        """Program name -> pid: from supervisord when we started the service, else from the broker
        (which knows ingest and worker pids but not its own)."""
        if self.local is not None:
            from streamasr.service import processes

            return {p["name"]: p["pid"] for p in processes(self.local.cfg) if p["pid"]}
        host = self.address.partition("://")[2].rpartition(":")[0]
        reply = self.status() if host in LOCAL_HOSTS else None  # a remote service's pids are not ours to sample
        if reply is None:
            return {}
        out = {f"ingest-{i.get('index')}": i["pid"] for i in reply.ingests if i.get("pid")}
        out.update({str(w.get("id")): w["pid"] for w in reply.workers if w.get("pid")})
        return out

    def histograms(self) -> dict[tuple[str, str, str], Histogram]:
        """(family, process, label) -> histogram of `gc_pause_seconds` ("pause") and
        `gc_cpu_seconds` ("cpu") by generation, and `job_transit_seconds` ("transit") by leg, from
        the dashboard's /metrics; empty for a service we did not start (its dashboard is on its
        own machine's localhost)."""
        if self.local is None:
            return {}
        from urllib.request import urlopen

        from prometheus_client.parser import text_string_to_metric_families

        try:
            with urlopen(f"http://127.0.0.1:{self.local.cfg.metrics.dashboard_port}/metrics", timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return {}
        buckets: dict[tuple[str, str, str], dict[float, float]] = {}  # cumulative, as exported
        totals: dict[tuple[str, str, str], float] = {}
        families = {"streamasr_gc_pause_seconds": "pause", "streamasr_gc_cpu_seconds": "cpu",
                    "streamasr_job_transit_seconds": "transit"}
        for family in text_string_to_metric_families(text):
            if family.name not in families:
                continue
            for sample in family.samples:
                label = sample.labels.get("generation", sample.labels.get("leg", "?"))
                key = (families[family.name], sample.labels.get("process", "?"), label)
                if sample.name.endswith("_bucket"):
                    buckets.setdefault(key, {})[float(sample.labels["le"])] = sample.value
                elif sample.name.endswith("_sum"):
                    totals[key] = sample.value
        out = {}
        for key, cumulative in buckets.items():
            bounds = sorted(cumulative)  # the last is +Inf
            counts = [cumulative[le] for le in bounds]
            out[key] = Histogram(tuple(bounds[:-1]), [c - p for c, p in zip(counts, [0.0, *counts[:-1]])], totals.get(key, 0.0))
        return out

    def worker_logs(self) -> list[Path]:
        if self.local is None:
            return []
        return sorted((self.local.cfg.run_path / "logs").glob("worker-*.log"))


# ---------------------------------------------------------------------------------- the audio


def corpus(workdir: Path) -> list[Clip]:
    """The dev set plus espeak-ng sentences (synthesized once per run into `workdir`)."""
    from streamasr.testdata import utterances

    clips = [Clip(u.name, u.path, u.reference) for u in utterances()]
    espeak = shutil.which("espeak-ng")
    if espeak:
        for i, text in enumerate(ESPEAK_SENTENCES):
            path = workdir / f"espeak-{i}.wav"
            subprocess.run([espeak, "-v", "en-us", "-s", "160", "-w", str(path), text], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            clips.append(Clip(f"espeak/{i}", str(path), text))
    if not clips:
        raise SystemExit("error: no speech to send: install pocketsphinx-testdata or espeak-ng")
    return clips


# ---------------------------------------------------------------------------------- sampling


@dataclass
class Sampler:
    """CPU time and RSS of every process under test, sampled from a thread during the run."""

    pids: dict[str, int]
    load: Callable[[], tuple[float, float, float] | None] | None = None  # the broker's admission figures, sampled alongside
    samples: dict[str, list[tuple[float, float, int]]] = field(default_factory=dict)  # (t, cpu s, rss)
    loads: list[tuple[float, float, float, float]] = field(default_factory=list)  # (t, load s, busy, stream share)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Sampler:
        procs = {}
        for name, pid in self.pids.items():
            try:
                procs[name] = psutil.Process(pid)
            except psutil.NoSuchProcess:
                continue

        def run() -> None:
            while True:
                for name, p in procs.items():
                    try:
                        with p.oneshot():
                            t = p.cpu_times()
                            self.samples.setdefault(name, []).append((time.monotonic(), t.user + t.system, p.memory_info().rss))
                    except psutil.NoSuchProcess:
                        continue
                value = self.load() if self.load is not None else None
                if value is not None:
                    self.loads.append((time.monotonic(), *value))
                if self._stop.wait(SAMPLE_EVERY_S):
                    return

        self._thread = threading.Thread(target=run, name="bench-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def report(self, start: float, end: float) -> list[dict[str, Any]]:
        """Mean and peak CPU % (of one core) over [start, end], and the largest RSS seen."""
        out = []
        for name, rows in self.samples.items():
            inside = [r for r in rows if start - SAMPLE_EVERY_S <= r[0] <= end + SAMPLE_EVERY_S] or rows
            if len(inside) < 2:
                continue
            (t0, c0, _), (t1, c1, _) = inside[0], inside[-1]
            steps = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(inside, inside[1:]) if b[0] > a[0]]
            out.append({"name": name, "pid": self.pids[name], "cpu_pct": round(100 * (c1 - c0) / max(t1 - t0, 1e-9), 1),
                        "cpu_peak_pct": round(100 * max(steps, default=0.0), 1),
                        "rss_mb": round(max(r[2] for r in inside) / 2**20, 1)})
        return sorted(out, key=lambda r: r["name"])


def _ms(bound: float | None) -> float | None:
    return round(1000 * bound, 3) if bound is not None and math.isfinite(bound) else None


def _this_run(before: dict[tuple[str, str, str], Histogram],
              after: dict[tuple[str, str, str], Histogram]) -> dict[tuple[str, str, str], Histogram]:
    """What the histograms took during the run: `after` less `before`."""
    runs: dict[tuple[str, str, str], Histogram] = {}
    for key, h in after.items():
        runs[key] = h.copy()
        if key in before:
            runs[key].add(before[key], sign=-1)
    return runs


def _total(hists: list[Histogram]) -> Histogram | None:
    """The histograms added up (None for none)."""
    if not hists:
        return None
    out = hists[0].copy()
    for h in hists[1:]:
        out.add(h)
    return out


def transit_report(before: dict[tuple[str, str, str], Histogram],
                   after: dict[tuple[str, str, str], Histogram]) -> dict[str, dict[str, Any]]:
    """Per leg of a decoded job's way (to the worker, back to the ingest), over every ingest:
    count and p50 / p90 / p99 ms, interpolated within the histogram's buckets."""
    by_leg: dict[str, list[Histogram]] = {}
    for (family, _, leg), h in _this_run(before, after).items():
        if family == "transit":
            by_leg.setdefault(leg, []).append(h)
    legs = {leg: _total(hists) for leg, hists in by_leg.items()}
    return {leg: {"count": int(h.count), **{f"p{q}_ms": _ms(h.quantile(q / 100)) for q in (50, 90, 99)}}
            for leg, h in sorted(legs.items()) if h is not None and h.count}


def gc_report(before: dict[tuple[str, str, str], Histogram],
              after: dict[tuple[str, str, str], Histogram]) -> dict[str, dict[str, Any]]:
    """Per process, the GC pauses of this run: count, total ms and max (as a bucket's upper bound),
    the collector's CPU time at most, and the same per generation: a pause much longer than its
    CPU time is the process waiting for a core."""
    runs = {key: h for key, h in _this_run(before, after).items() if key[0] in ("pause", "cpu")}

    out: dict[str, dict[str, Any]] = {}
    for proc in sorted({p for _, p, _ in runs}):
        mine = {(family, gen): h for (family, p, gen), h in runs.items() if p == proc}
        wall = _total([h for (family, _), h in mine.items() if family == "pause"])
        if wall is None:
            continue
        cpu = _total([h for (family, _), h in mine.items() if family == "cpu"])
        top = wall.max_bound()
        out[proc] = {"count": int(wall.count), "total_ms": round(1000 * wall.total, 3),
                     "max_ms_at_most": _ms(top), "over_largest_bucket": top == math.inf,
                     "cpu_max_ms_at_most": _ms(cpu.max_bound()) if cpu is not None else None,
                     "by_generation": {gen: {"count": int(h.count), "total_ms": round(1000 * h.total, 3), "max_ms_at_most": _ms(h.max_bound()),
                                             "cpu_max_ms_at_most": _ms(mine[("cpu", gen)].max_bound()) if ("cpu", gen) in mine else None}
                                       for (family, gen), h in sorted(mine.items()) if family == "pause" and h.count}}
    return out


def batch_log_offsets(paths: list[Path]) -> dict[Path, int]:
    return {p: p.stat().st_size for p in paths if p.exists()}


def batch_sizes(offsets: dict[Path, int], paths: list[Path]) -> tuple[list[int], list[float]]:
    """Sizes and backend seconds of the batches the workers logged since `offsets` (they log them at
    debug level, which the bench turns on when it starts the service)."""
    sizes: list[int] = []
    seconds: list[float] = []
    for path in paths:
        with path.open("rb") as f:
            f.seek(offsets.get(path, 0))
            for line in f:
                if b'"worker.batch"' not in line:
                    continue
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                sizes.append(int(event.get("size", event.get("batch_size", 0))))
                seconds.append(float(event.get("seconds", 0.0)))
    return sizes, seconds


# ---------------------------------------------------------------------------------- statistics


def stats_ms(values: np.ndarray) -> dict[str, Any]:
    """Percentiles, max, mean and stdev in milliseconds (None when there is nothing to measure)."""
    out: dict[str, Any] = {"count": int(values.size)}
    keys = [k for k, _ in PERCENTILES] + ["max", "mean", "stdev"]
    if values.size == 0:
        return out | {k: None for k in keys}
    ms = values * 1000.0
    for key, q in PERCENTILES:
        out[key] = round(float(np.percentile(ms, q)), 3)
    out["max"] = round(float(ms.max()), 3)
    out["mean"] = round(float(ms.mean()), 3)
    out["stdev"] = round(float(ms.std()), 3)
    return out


def cpu_pressure() -> float | None:
    """Linux PSI: % of the last 60 s in which some runnable task waited for a CPU (None if unavailable).
    High values mean every latency here includes waiting for a core."""
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    fields = dict(kv.split("=") for kv in line.split()[1:])
    return float(fields["avg60"]) if "avg60" in fields else None


def _rows(blob: bytes, width: int) -> np.ndarray:
    return np.frombuffer(blob, dtype=np.float64).reshape(-1, width)


def firsts(partials: list[np.ndarray]) -> np.ndarray:
    """Each segment's first partial that arrived (its row), per stream: the time to first text."""
    rows = []
    for p in partials:
        if len(p):
            _, first = np.unique(p[:, 2], return_index=True)
            rows.append(p[first])
    return np.concatenate(rows) if rows else np.empty((0, 4))


def intervals(partials: list[np.ndarray]) -> np.ndarray:
    """Receive-time gaps between consecutive partials of the same segment of the same stream."""
    gaps = []
    for p in partials:
        if len(p) < 2:
            continue
        same = p[1:, 2] == p[:-1, 2]
        gaps.append(np.diff(p[:, 0])[same])
    return np.concatenate(gaps) if gaps else np.empty(0)


def per_worker_jobs(before: m.StatusReply, after: m.StatusReply) -> dict[str, int]:
    """Jobs each worker did during the run: the broker's counts are since the service started,
    so an earlier run of a sweep, or other clients' work, would count too."""
    done = {str(w.get("id")): int(w.get("jobs_done") or 0) for w in before.workers}
    return {str(w.get("id")): int(w.get("jobs_done") or 0) - done.get(str(w.get("id")), 0) for w in after.workers}


@dataclass
class RunSpec:
    streams: int
    duration_s: float
    offline: bool
    frame_ms: float
    clients: int | None
    model: str
    workers: int | None
    max_batch: int | None
    drain_s: float
    ramp_s: float = 0.0
    rate: int = 16000  # the clients' sample rate
    encoding: str = "pcm_s16le"  # the clients' `open.encoding`
    admit_limit_s: float | None = None  # the started service's ingest.admit_max_load_s (unknown for --server)
    precision: str | None = None  # the started service's model settings (unknown for --server)
    partial_precision: str | None = None
    partial_window: str | None = None
    trace_dir: Path | None = None  # --tracemalloc: where the service's processes write their reports


def summarize(spec: RunSpec, results: list[dict[str, Any]], t0: float, wall_end: float, sampler: Sampler,
              batches: tuple[list[int], list[float]] | None, jobs: tuple[m.StatusReply | None, m.StatusReply | None],
              processes: int, gc_pauses: dict[str, dict[str, Any]],
              transit: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """One summary object, plus the raw arrays the plot needs."""
    streams = [s for r in results for s in r["streams"]]
    opened = [s for s in streams if s["ready"]]
    partials = [_rows(s["partials"], 4) for s in opened]
    finals = [_rows(s["finals"], 4) for s in opened]
    p_all = np.concatenate(partials) if partials else np.empty((0, 4))
    f_all = np.concatenate(finals) if finals else np.empty((0, 4))
    lag = np.concatenate([np.frombuffer(r["lag"], dtype=np.float64) for r in results]) if results else np.empty(0)
    errors: dict[str, int] = {}
    for s in opened:
        for code, n in s["errors"].items():
            errors[code] = errors.get(code, 0) + n
    refused: dict[str, int] = {}
    for s in streams:
        if s["open_error"]:
            code = s["open_error"].partition(": ")[0]
            refused[code] = refused.get(code, 0) + 1
            if refused[code] == 1:
                print(f"stream refused: {s['open_error']}", file=sys.stderr)
    # A stream the service cut (a shutdown, an idle timeout) did not finish: its last segment
    # may be untranscribed, and a run with one is no measure of N streams served.
    closed = [s for s in opened if s["closed_at"] is not None and s["closed_reason"] == "end"]
    cut: dict[str, int] = {}
    for s in opened:
        if s["closed_at"] is not None and s["closed_reason"] != "end":
            cut[s["closed_reason"]] = cut.get(s["closed_reason"], 0) + 1
    audio_s = sum(s["audio_s"] for s in opened)
    ends = [s["closed_at"] for s in closed] + [float(f[:, 0].max()) for f in finals if len(f)]
    send_end = max((s["end_sent"] or 0.0) for s in opened) if opened else wall_end
    # nothing closed and no final: the audio sent is what was served, not the wait for a drain
    wall = max((max(ends) if ends else send_end) - t0, 0.0)

    lag_stats = stats_ms(lag)
    partial_stats = stats_ms(p_all[:, 1])
    lag_p99 = lag_stats["p99"] or 0.0
    # Behind: frames left more than a frame late, and late enough to matter next to what is measured
    # (the same loop takes the receive times, so they are late by about as much).
    tolerance = max(spec.frame_ms, 0.1 * (partial_stats["p99"] or 0.0))
    behind = lag_p99 > tolerance
    if behind:
        note = (f"GENERATOR BEHIND: p99 send lag {lag_p99:.1f} ms exceeds {tolerance:.1f} ms (a frame, or a tenth of "
                "the p99 partial latency); it could not keep the schedule and its receive times are late too: "
                "these latencies are not valid")
    elif partial_stats["p99"] is not None and lag_p99 > 0.5 * partial_stats["p99"]:
        note = (f"p99 send lag {lag_p99:.2f} ms is comparable to the p99 partial latency: the generator's own "
                "scheduling delay is a large part of these latencies (an upper bound for the service)")
    else:
        note = "generator kept up"

    wer = None
    if spec.model != "null" and closed:
        try:
            from streamasr.testdata import wer as word_error_rate

            wer = round(word_error_rate([" ".join(s["refs"]) for s in closed], [" ".join(s["texts"]) for s in closed]), 4)
        except ImportError:
            wer = None

    sizes, seconds = batches if batches is not None else ([], [])
    before, after = jobs
    summary = {
        "config": {"streams": spec.streams, "duration_s": spec.duration_s, "mode": "offline" if spec.offline else "realtime",
                   "model": spec.model, "workers": spec.workers, "max_batch": spec.max_batch, "frame_ms": spec.frame_ms,
                   "rate": spec.rate, "encoding": spec.encoding, "ramp_s": spec.ramp_s, "client_processes": processes,
                   "precision": spec.precision, "partial_precision": spec.partial_precision,
                   "partial_window": spec.partial_window},
        "streams": {"requested": spec.streams, "opened": len(opened), "refused": refused, "closed": len(closed),
                    "cut": cut, "unfinished": len(opened) - len(closed), "with_finals": sum(1 for f in finals if len(f))},
        "partials": int(len(p_all)),
        "finals": int(len(f_all)),
        "finals_revised": sum(s["revised"] for s in opened),
        "partial_latency_ms": partial_stats,
        "first_partial_latency_ms": stats_ms(firsts(partials)[:, 1]),
        "final_latency_ms": stats_ms(f_all[:, 1]),
        "ack_latency_ms": stats_ms(np.concatenate([_rows(s["acks"], 2)[:, 1] for s in opened]) if opened else np.empty(0)),
        "jitter_ms": {"partial_latency_stdev": partial_stats["stdev"],
                      "partial_interval": stats_ms(intervals(partials))},
        "throughput": {"audio_s": round(audio_s, 3), "wall_s": round(wall, 3),
                       "audio_s_per_s": round(audio_s / wall, 3) if wall > 0 else None,
                       "rtf": round(wall / audio_s, 5) if audio_s > 0 else None},
        "errors": errors,
        "refused_frames": errors.get(m.OVERLOADED, 0),
        "batches": ({"count": len(sizes), "mean_size": round(float(np.mean(sizes)), 3),
                     "histogram": {str(k): int(v) for k, v in zip(*np.unique(sizes, return_counts=True))},
                     "backend_ms": stats_ms(np.asarray(seconds))} if sizes else None),
        "jobs": ({"done": after.jobs_done - before.jobs_done, "expired": after.expired - before.expired,
                  "per_worker": per_worker_jobs(before, after)}
                 if before is not None and after is not None else None),
        "processes": sampler.report(t0, t0 + wall if spec.offline else send_end),
        "generator": {"send_lag_ms": lag_stats, "behind": behind, "note": note},
        # The figure admission control compares with ingest.admit_max_load_s: why streams were or were not refused.
        "admission_load_s": {"max": max((v for _, v, _, _ in sampler.loads), default=None), "samples": len(sampler.loads),
                             "limit": spec.admit_limit_s,
                             "first_over_limit_s": next((round(t - t0, 1) for t, v, _, _ in sampler.loads
                                                         if spec.admit_limit_s and v > spec.admit_limit_s), None),
                             "over_time": [[round(t - t0, 2), v] for t, v, _, _ in sampler.loads]},
        # The workers' realtime busy share and the share one speaking stream asks for (the figure
        # admission multiplies by the streams open plus one and compares with ingest.admit_max_busy).
        "admission_busy": {"max": max((b for _, _, b, _ in sampler.loads), default=None),
                           "stream_share_last": sampler.loads[-1][3] if sampler.loads else None,
                           "over_time": [[round(t - t0, 2), b, share] for t, _, b, share in sampler.loads]},
        "gc_pauses": gc_pauses,
        # Where decoded jobs' latency went outside the model, measured inside the service.
        "job_transit_ms": transit,
        "wer": wer,
        "load_average": [round(x, 2) for x in os.getloadavg()],  # 1/5/15 min at the end: was the machine shared?
        "cpu_pressure_pct": cpu_pressure(),
    }
    raw = {"partials": p_all, "finals": f_all, "t0": np.array([t0])}
    return summary, raw


# ---------------------------------------------------------------------------------- one run


def client_processes(streams: int, requested: int | None, per_client: int) -> int:
    """P processes: as asked (default 2), at least enough for the service's per-client stream limit."""
    p = requested if requested else min(2, streams)
    return max(1, min(streams, max(p, math.ceil(streams / max(per_client, 1)))))


def run_load(target: Target, spec: RunSpec, clips: list[Clip]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Open every stream, start them together (or, with a ramp, open them one by one during the run),
    collect the clients' samples and summarize."""
    welcome = handshake(zmq.Context.instance(), target.address, 30.0, target.curve)
    procs_n = client_processes(spec.streams, spec.clients, int(welcome.limits.get("max_streams_per_client", 64)))
    tag = uuid.uuid4().hex[:8]
    procs: list[subprocess.Popen] = []
    readers: list[RecordReader] = []
    share, extra = divmod(spec.streams, procs_n)
    first = 0
    try:
        for k in range(procs_n):
            count = share + (1 if k < extra else 0)
            plan = Plan(address=target.address, tag=tag, first=first, count=count, clips=clips,
                        duration_s=spec.duration_s, frame_ms=spec.frame_ms, offline=spec.offline, gap_s=GAP_S,
                        drain_s=spec.drain_s, ramp_s=spec.ramp_s, total=spec.streams, rate=spec.rate,
                        encoding=spec.encoding,
                        curve=[key.decode() for key in target.curve] if target.curve else None)
            first += count
            proc = subprocess.Popen([sys.executable, "-m", "streamasr.loadgen"], cwd=ROOT, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE)
            assert proc.stdin is not None
            proc.stdin.write(msgpack.packb(plan.to_wire(), use_bin_type=True))
            proc.stdin.flush()
            procs.append(proc)
            assert proc.stdout is not None
            readers.append(RecordReader(proc.stdout.fileno()))
        for k, reader in enumerate(readers):
            try:
                reader.next()  # "ready": its streams are open
            except EOFError:
                raise RuntimeError(f"bench client {k} exited before opening its streams") from None
        pids = target.pids() | {f"bench-client-{k}": p.pid for k, p in enumerate(procs)}
        logs = target.worker_logs()
        offsets = batch_log_offsets(logs)
        before = target.status()
        hist_before = target.histograms()
        sampler = Sampler(pids, load=lambda: ((reply.load, reply.busy, reply.stream_share)
                                              if (reply := target.status()) is not None else None)).start()
        t0 = time.monotonic() + 0.5
        marks = None
        if spec.trace_dir is not None:  # at 1/4, 1/2, 3/4 of the load: streams open, warm, still sending
            marks = AllocationMarks(spec.trace_dir, pids, lambda: (r.jobs_done if (r := target.status()) is not None else None))
            marks.schedule([t0 + k * spec.duration_s / 4 for k in (1, 2, 3)])
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(msgpack.packb({"t0": t0}))
            proc.stdin.close()
        results = []
        for k, reader in enumerate(readers):
            try:
                results.append(reader.next())
            except EOFError:
                raise RuntimeError(f"bench client {k} exited without a result") from None
        wall_end = time.monotonic()
        sampler.stop()
        after = target.status()
        if target.local is not None:
            time.sleep(PUBLISH_INTERVAL_S)  # the last pauses reach the dashboard with the next publish
        hist_after = target.histograms()
        allocations = marks.collect(spec.streams, spec.frame_ms) if marks is not None else None
        batches = batch_sizes(offsets, logs) if logs else None
        for proc in procs:
            proc.wait(30)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    summary, raw = summarize(spec, results, t0, wall_end, sampler, batches, (before, after), procs_n,
                             gc_report(hist_before, hist_after), transit_report(hist_before, hist_after))
    if allocations is not None:
        summary["allocations"] = allocations
    return summary, raw


# ---------------------------------------------------------------------------------- output


def _fmt(v: Any, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def print_report(s: dict[str, Any], out: Any = sys.stdout) -> None:
    c = s["config"]
    w = print
    w(f"\n{c['streams']} streams x {c['duration_s']:g} s {c['mode']}, model {c['model']}, workers {c['workers'] or '?'}, "
      f"max batch {c['max_batch'] or '?'}, frame {c['frame_ms']:g} ms at {c['rate'] / 1000:g} kHz {c['encoding']}, "
      f"{c['client_processes']} client processes"
      + (f", {c['precision']}, {c['partial_precision']} {c['partial_window']}-window partials" if c.get("precision") and c["model"] != "null" else "")
      + (f", opened over {c['ramp_s']:g} s" if c["ramp_s"] else ""), file=out)
    st = s["streams"]
    w(f"machine at the end: load average (1/5/15 min) {s['load_average']}, CPU pressure (some, 60 s) "
      f"{_fmt(s['cpu_pressure_pct'], 1)} %", file=out)
    cut = f" (cut by the service: {st['cut']})" if st["cut"] else ""
    w(f"streams: {st['opened']} opened, {st['closed']} closed, {st['unfinished']} unfinished{cut}, refused {st['refused'] or 0}", file=out)
    w("latencies below are of the admitted (opened) streams only", file=out)
    w(f"{'latency (ms)':<16}{'count':>8}{'p50':>9}{'p90':>9}{'p99':>9}{'p99.9':>9}{'max':>9}{'stdev':>9}", file=out)
    for label, key in (("partial", "partial_latency_ms"), ("  first of a seg", "first_partial_latency_ms"),
                       ("final", "final_latency_ms"), ("ack (ingest RTT)", "ack_latency_ms")):
        x = s[key]
        w(f"{label:<16}{x['count']:>8}" + "".join(f"{_fmt(x[k]):>9}" for k in ("p50", "p90", "p99", "p99_9", "max", "stdev")), file=out)
    iv = s["jitter_ms"]["partial_interval"]
    w(f"jitter: partial latency stdev {_fmt(s['jitter_ms']['partial_latency_stdev'])} ms; "
      f"interval between partials of a segment p50 {_fmt(iv['p50'], 1)} ms, stdev {_fmt(iv['stdev'], 1)} ms", file=out)
    t = s["throughput"]
    w(f"throughput: {t['audio_s']:.1f} s of audio in {t['wall_s']:.1f} s = {_fmt(t['audio_s_per_s'])} audio s per wall s "
      f"(RTF {_fmt(t['rtf'], 4)})", file=out)
    w(f"errors: {s['errors'] or 'none'}; refused frames {s['refused_frames']}", file=out)
    b = s["batches"]
    if b:
        w(f"batches: {b['count']}, mean size {b['mean_size']:.2f}, histogram {b['histogram']}, "
          f"backend call p50 {_fmt(b['backend_ms']['p50'], 3)} ms p99 {_fmt(b['backend_ms']['p99'], 3)} ms", file=out)
    else:
        w("batches: unknown (batch sizes come from the worker logs of a service the bench starts)", file=out)
    if s["jobs"]:
        w(f"jobs: {s['jobs']['done']} done, {s['jobs']['expired']} stale partials skipped", file=out)
    if s["wer"] is not None:
        w(f"WER of finals: {100 * s['wer']:.2f} %; {s['finals_revised']} of {s['finals']} finals revised words "
          "the partials had marked stable", file=out)
    w(f"{'process':<18}{'cpu %':>8}{'peak %':>8}{'rss MB':>9}", file=out)
    for p in s["processes"]:
        w(f"{p['name']:<18}{p['cpu_pct']:>8.1f}{p['cpu_peak_pct']:>8.1f}{p['rss_mb']:>9.1f}", file=out)
    load = s["admission_load_s"]
    if load["samples"]:
        over = (f", first above the limit ({load['limit']:g} s) {load['first_over_limit_s']:g} s after the start"
                if load["first_over_limit_s"] is not None else "")
        w(f"admission load (broker's realtime queue wait, sampled every {SAMPLE_EVERY_S:g} s): max {load['max']:.3f} s"
          + over, file=out)
        busy = s["admission_busy"]
        w(f"workers' realtime busy share: max {busy['max']:.2f}, per speaking stream at the end {busy['stream_share_last']:.3f}",
          file=out)
    if s["job_transit_ms"]:
        legs = "; ".join(f"{leg.replace('_', ' ')} p50 {_fmt(t['p50_ms'], 3)} p90 {_fmt(t['p90_ms'], 3)} p99 {_fmt(t['p99_ms'], 3)}"
                         for leg, t in s["job_transit_ms"].items())
        w(f"job transit outside the model (ms, within histogram buckets): {legs}", file=out)
    if s["gc_pauses"]:
        def bound(ms: float | None, n: int) -> str:
            return "-" if not n else "> largest bucket" if ms is None else f"<= {ms:g} ms"

        w("GC pauses (wall clock; the collector's CPU time in brackets):", file=out)
        for name, g in s["gc_pauses"].items():
            gens = "; ".join(f"gen {gen}: {h['count']}, max {bound(h['max_ms_at_most'], h['count'])} "
                             f"[{bound(h['cpu_max_ms_at_most'], h['count'])}]" for gen, h in g["by_generation"].items())
            w(f"  {name:<14} {g['count']} ({g['total_ms']:.1f} ms), max {bound(g['max_ms_at_most'], g['count'])} "
              f"[{bound(g['cpu_max_ms_at_most'], g['count'])}]" + (f" -- {gens}" if gens else ""), file=out)
    if alloc := s.get("allocations"):
        w(f"allocations held (tracemalloc), blocks since the first mark at the second / third, and the growth between "
          f"them ({alloc['interval_s']:g} s, {alloc['frames']} frames, {alloc['jobs']} jobs):", file=out)
        for name, a in alloc["per_process"].items():
            where = ", ".join(f"{t['where']} {t['blocks']:+d}" for t in a["top"][:3])
            w(f"  {name:<10} {a['held_blocks'][0]:+6d} / {a['held_blocks'][1]:+6d}  growth {a['growth_blocks']:+6d} "
              f"({_fmt(a['growth_blocks_per_frame'], 4)} per frame, {_fmt(a['growth_blocks_per_job'], 3)} per job), "
              f"peak {a['peak_bytes'] / 1024:,.0f} KiB above the second mark; held most at {where}", file=out)
    g = s["generator"]
    lag = g["send_lag_ms"]
    if lag["count"]:
        w(f"generator send lag: p50 {_fmt(lag['p50'], 3)} ms, p99 {_fmt(lag['p99'], 3)} ms, max {_fmt(lag['max'], 1)} ms "
          f"over {lag['count']} frames: {g['note']}", file=out)


def plot(path: str, runs: list[tuple[dict[str, Any], dict[str, np.ndarray]]]) -> None:
    """Latency distribution and latency over time of the last run; for a sweep, p50/p99 against N too."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary, raw = runs[-1]
    ncols = 3 if len(runs) > 1 else 2
    fig, axes = plt.subplots(1, ncols, figsize=(6 * ncols, 4.5))
    t0 = float(raw["t0"][0])
    for label, key, color in (("partial", "partials", "tab:blue"), ("final", "finals", "tab:orange")):
        lat = raw[key][:, 1] * 1000
        if lat.size:
            x = np.sort(lat)
            axes[0].plot(x, np.arange(1, x.size + 1) / x.size, label=label, color=color)
            axes[1].scatter(raw[key][:, 0] - t0, lat, s=2, label=label, color=color, alpha=0.5)
    axes[0].set(xscale="log", xlabel="latency (ms)", ylabel="fraction", title="latency distribution (CDF)")
    axes[1].set(yscale="log", xlabel="seconds since start", ylabel="latency (ms)", title="latency over time")
    for ax in axes[:2]:
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    if len(runs) > 1:
        ns = [r[0]["config"]["streams"] for r in runs]
        for key, label in (("partial_latency_ms", "partial"), ("final_latency_ms", "final")):
            for q, style in (("p50", "--"), ("p99", "-")):
                axes[2].plot(ns, [r[0][key][q] or np.nan for r in runs], style, marker="o", label=f"{label} {q}")
        axes[2].plot(ns, [r[0]["jitter_ms"]["partial_interval"]["p90"] or np.nan for r in runs], ":", marker="s",
                     label="interval between partials p90")
        axes[2].set_xscale("log", base=2)
        axes[2].set_xticks(ns, [str(n) for n in ns])
        axes[2].set(yscale="log", xlabel="streams", ylabel="latency (ms)", title="sweep")
        axes[2].grid(True, which="both", alpha=0.3)
        axes[2].legend()
    c = summary["config"]
    fig.suptitle(f"streamasr bench: {c['streams']} streams {c['mode']}, model {c['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------- CLI


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default in its help, except where the help names its own or there is none (a
    flag, an option unset unless given): `(default: False)` after "(default)" contradicts it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="streamasr bench", description=__doc__.split("\n\n")[0],
                                formatter_class=_HelpFormatter)
    p.add_argument("--streams", type=int, default=1, help="concurrent streams")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of audio per stream (whole clips, so a little more)")
    pace = p.add_mutually_exclusive_group()
    pace.add_argument("--realtime", action="store_true", help="send frames on a wall-clock schedule (default)")
    pace.add_argument("--offline", action="store_true", help="send as fast as the window allows, priority batch")
    p.add_argument("--model", help="null, whisper-tiny.en or whisper-base, for the service the bench starts (default: "
                                   "--config's [model] name, else whisper-tiny.en); with --server, the model its workers report")
    p.add_argument("--server", metavar="ADDR", help="front door of a running service (default: start one)")
    p.add_argument("--workers", type=int, default=2, help="worker processes of the service the bench starts (0: one per CPU core)")
    p.add_argument("--max-batch", type=int, help="the started service's model.max_batch (default: the config's)")
    p.add_argument("--config", metavar="FILE", help="TOML settings for the started service, e.g. [model] precision = \"int8\" "
                                                   "(under the bench's own options)")
    p.add_argument("--clients", type=int, help="client processes (default 2, fewer for fewer streams)")
    p.add_argument("--frame-ms", type=float, default=20.0, help="audio per message in real-time mode")
    p.add_argument("--rate", type=int, choices=m.RATES, default=16000,
                   help="the clients' sample rate (mono); other rates make the ingest resample")
    p.add_argument("--encoding", choices=m.ENCODINGS, default="pcm_s16le",
                   help="how the clients encode their samples: pcm_mulaw and pcm_alaw are G.711, one byte a sample, "
                        "as telephony sends them (with --rate 8000), which the ingest decodes")
    p.add_argument("--ramp", type=float, default=0.0, metavar="SECONDS",
                   help="real-time only: stream i of N opens at i x SECONDS / N, and admission control refuses what does "
                        "not fit; a refused open is counted by its error code and not retried (0: open all at once, "
                        "with admission control off in a service the bench starts)")
    p.add_argument("--sweep", type=_stream_counts, help="comma-separated stream counts, e.g. 1,2,4,8: runs each, reports the largest N within the bounds "
                                   "(admission control off in a service the bench starts)")
    p.add_argument("--p99-bound-ms", type=float, default=1000.0, help="sweep bound on p99 partial latency (finals: 1.5x; offline, finals only)")
    p.add_argument("--interval-bound-ms", type=float, default=1000.0,
                   help="sweep bound on the p90 interval between a segment's partials: superseded partials keep "
                        "latency low under load, so the update rate is bounded too")
    p.add_argument("--drain", type=float, default=60.0, help="give up waiting for results after this long without any")
    p.add_argument("--tracemalloc", action="store_true",
                   help="trace the started service's Python allocations and report what each process kept per frame and "
                        "per job between marks at 1/2 and 3/4 of the load, and the most it allocated at once "
                        "(slows the service: not a latency run)")
    p.add_argument("--json", dest="json_path", metavar="FILE", help="write the summary as one JSON object")
    p.add_argument("--plot", metavar="FILE.png", help="latency distribution and latency over time (matplotlib)")
    args = p.parse_args(argv)
    if not all(map(math.isfinite, (args.duration, args.frame_ms, args.ramp, args.drain))):
        # an endless playlist, a frame of no size, a drain that never gives up: none can be run
        p.error("--duration, --frame-ms, --ramp and --drain must be finite numbers")
    if args.streams < 1 or args.duration <= 0 or args.frame_ms <= 0:
        p.error("--streams, --duration and --frame-ms must be positive")
    if any(n is not None and n < 1 for n in (args.max_batch, args.clients)):  # 0 read as "the default" before
        p.error("--max-batch and --clients must be 1 or more")
    if args.tracemalloc and (args.offline or args.ramp or args.server):
        p.error("--tracemalloc needs a service the bench starts, real-time streams and no ramp (all streams steady between the marks)")
    if args.ramp < 0 or (args.ramp and args.offline):
        p.error("--ramp must be >= 0 and applies to real-time streams only (batch streams are never refused as overloaded)")
    return args


def _stream_counts(text: str) -> list[int]:
    """`--sweep`'s comma-separated stream counts, each at least 1, refused with the usage otherwise."""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"stream counts must be whole numbers separated by commas, not {text!r}") from None
    if min(counts) < 1:
        raise argparse.ArgumentTypeError(f"stream counts must be at least 1, not {text}")
    return counts


def within_bounds(s: dict[str, Any], bound_ms: float, interval_bound_ms: float) -> bool:
    """Whether all N streams were served: a refused open means the latencies are of fewer streams.
    Offline streams get finals only, so an offline run is judged by its finals."""
    pl, fl = s["partial_latency_ms"]["p99"], s["final_latency_ms"]["p99"]
    iv = s["jitter_ms"]["partial_interval"]["p90"]
    st = s["streams"]
    served = st["opened"] == st["requested"] and st["unfinished"] == 0 and not s["generator"]["behind"]
    if s["config"]["mode"] == "offline":
        return served and fl is not None and fl <= 1.5 * bound_ms
    return (served and None not in (pl, fl, iv)
            and pl <= bound_ms and fl <= 1.5 * bound_ms and iv <= interval_bound_ms)


def served(target: Target, asked: str | None, asked_batch: int | None = None) -> tuple[str, int | None, int | None]:
    """The model, worker count and max batch of a running service, from its status: a report must
    say what was measured, and the null model's fixed text has no word error rate to score."""
    reply = target.status()
    if reply is None:
        raise SystemExit(f"streamasr bench: no status from {target.address}: is the service running?")
    models = sorted({str(w.get("model")) for w in reply.workers})
    model = "+".join(models) if models else (asked or "unknown")
    if asked and models and models != [asked]:
        print(f"note: --model {asked} ignored: the service at {target.address} serves {model}", file=sys.stderr)
    capacities = {int(w["capacity"]) for w in reply.workers if w.get("capacity")}  # a worker's model.max_batch
    max_batch = capacities.pop() if len(capacities) == 1 else None
    if asked_batch and max_batch != asked_batch:
        print(f"note: --max-batch {asked_batch} ignored: the service at {target.address} has its own "
              f"(its workers batch up to {max_batch if max_batch is not None else 'unknown'})", file=sys.stderr)
    return model, len(reply.workers) or None, max_batch


def client_curve(cfg: settings.Config) -> Curve | None:
    """The keys the bench's clients talk to a CURVE service with (see service.ops_curve); a key
    missing or unreadable is the config's error."""
    try:
        return ops_curve(cfg)
    except (ValueError, OSError) as exc:
        raise settings.ConfigError(str(exc)) from None


def started_settings(args: argparse.Namespace, counts: list[int]) -> dict[str, Any]:
    """The settings of the service the bench starts: --config's (its relative paths from its own
    directory, as `serve` takes them), under the bench's options; the model is --model, else
    --config's (a directory from the file's own), else the default."""
    base = settings.read_absolute(args.config) if args.config else {}
    model = args.model or base.get("model", {}).get("name", "whisper-tiny.en")
    overrides: dict[str, Any] = {"log_level": "debug",  # the workers log each batch's size at debug
                                 "ingest": {"max_streams_per_client": max(64, max(counts))}}
    if args.max_batch:
        overrides["model"] = {"max_batch": args.max_batch}
    if args.sweep or not args.ramp:
        # Such a run measures what N streams get. Admission would cut the burst where the
        # workers' start-up decodes price a stream, and in a sweep, after the first run,
        # where that run's streams were measured.
        overrides["ingest"] |= {"admit_max_load_s": 0, "admit_max_busy": 0, "admit_max_realtime_streams": 0}
    overrides = settings.merge({"model": {"name": model, "backend": "null" if model == "null" else "onnxruntime"},
                                "workers": {"processes": args.workers}}, overrides)
    merged = settings.merge(base, overrides)
    held = settings.load(None, merged)
    per_ingest = -(-max(counts) // held.ingest.processes)
    if per_ingest > held.shm.streams_per_ingest:  # rings for every stream: the run measures N, not a refusal
        merged = settings.merge(merged, {"shm": {"streams_per_ingest": per_ingest}})
    return merged


def _terminate(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwind, so the service we started is stopped


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    signal.signal(signal.SIGTERM, _terminate)
    counts = args.sweep or [args.streams]
    command = " ".join(["streamasr", "bench", *argv])
    workdir = Path(tempfile.mkdtemp(prefix="streamasr-bench-"))
    target: Target | None = None
    trace_dir: Path | None = None
    try:
        clips = corpus(workdir)
        if args.server:
            # a service with CURVE on answers only the keys of the config's ingest.curve_client_key
            target = Target(args.server, curve=client_curve(settings.load(args.config)))
            model, workers, served_batch = served(target, args.model, args.max_batch)
        else:
            overrides = started_settings(args, counts)
            started = settings.load(None, overrides)
            curve = client_curve(started)
            model, workers = overrides["model"]["name"], started.worker_count  # 0: one per core
            served_batch = None
            print(f"starting the service: model {model}, {workers} workers ...", file=sys.stderr, flush=True)
            if args.tracemalloc:
                trace_dir = workdir / "tracemalloc"
                trace_dir.mkdir()
                os.environ[allocwatch.ENV] = str(trace_dir)  # the service's processes inherit it
            try:
                local = launch(workdir, overrides)
            finally:
                os.environ.pop(allocwatch.ENV, None)
            target = Target(local.address, local, curve)
        runs: list[tuple[dict[str, Any], dict[str, np.ndarray]]] = []
        best: int | None = None
        cfg = target.local.cfg if target.local else None  # settings are known only for a service we started
        for n in counts:
            spec = RunSpec(n, args.duration, args.offline, args.frame_ms, args.clients, model, workers,
                           (args.max_batch or cfg.model.max_batch) if cfg else served_batch, args.drain, args.ramp, args.rate,
                           encoding=args.encoding,
                           admit_limit_s=cfg.ingest.admit_max_load_s if cfg else None,
                           precision=cfg.model.precision if cfg else None,
                           partial_precision=cfg.model.partials_precision if cfg else None,
                           partial_window=cfg.model.partial_window if cfg else None,
                           trace_dir=trace_dir)
            target.settle()
            summary, raw = run_load(target, spec, clips)
            runs.append((summary, raw))
            print_report(summary)
            if args.sweep:
                ok = within_bounds(summary, args.p99_bound_ms, args.interval_bound_ms)
                summary["within_bounds"] = ok
                bounds = (f"p99 final {1.5 * args.p99_bound_ms:g} ms" if args.offline else
                          f"p99 partial {args.p99_bound_ms:g} ms, final {1.5 * args.p99_bound_ms:g} ms, "
                          f"p90 partial interval {args.interval_bound_ms:g} ms")
                print(f"-> {n} streams: {'within' if ok else 'outside'} the bounds ({bounds}, "
                      "every stream opened and finished, generator on time)")
                if ok and (best is None or n > best):
                    best = n
        result: dict[str, Any] = runs[-1][0] if not args.sweep else {
            "sweep": [r[0] for r in runs], "p99_bound_ms": args.p99_bound_ms, "interval_bound_ms": args.interval_bound_ms,
            "best_streams": best}
        result |= {"command": command, "machine": {"cpus": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
                                                   "python": platform.python_version(), "platform": platform.platform()},
                   "date": time.strftime("%Y-%m-%d")}
        if args.sweep:
            bounds = (f"p99 final <= {1.5 * args.p99_bound_ms:g} ms" if args.offline else
                      f"p99 partial <= {args.p99_bound_ms:g} ms, p99 final <= {1.5 * args.p99_bound_ms:g} ms and "
                      f"p90 partial interval <= {args.interval_bound_ms:g} ms")
            print(f"\nsweep: largest N within {bounds}: {best if best is not None else 'none'}")
            if best is not None and not args.offline:
                print(f"to admit no more on this machine: [ingest] admit_max_realtime_streams = {best}")
        if args.json_path:
            Path(args.json_path).write_text(json.dumps(result, indent=1))
        if args.plot:
            plot(args.plot, runs)
        return 0
    except settings.ConfigError as exc:
        print(f"streamasr bench: error: {exc}", file=sys.stderr)
        return 2
    except Refused as exc:  # `serve`'s own words: a model or setting the service cannot run
        print(exc, file=sys.stderr)
        return exc.code
    finally:
        if target is not None and target.local is not None:
            target.local.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
