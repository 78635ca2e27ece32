"""The instance's collector: one SUB socket that every process's publisher connects to.

It keeps the latest snapshot of each process incarnation, adds what a process cannot say about itself
(CPU, memory, threads and descriptors from psutil; supervisord's state; GPU figures from NVML), and
renders two views: a JSON snapshot for the dashboard and `top`, and Prometheus text for scrapers.

Counters must never go down in Prometheus, yet processes restart and start counting from zero. So
when an incarnation dies (replaced by a new pid, or silent for STALE_AFTER_S) its last counters and
histograms are added to a carried total, and the exported value is carried + live. The dashboard's
collector keeps that in a state file of the run directory, so that its own restart, which does not
restart the processes, takes up the carried totals and restart counts where they were (`serve`
removes the file: a new service counts from zero, which Prometheus reads as the reset it is).
"""

from __future__ import annotations

import math
import os
import re
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import msgpack
import psutil
import zmq
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

from config.settings import Config
from metrics.names import PREFIX, SPECS
from metrics.registry import SNAPSHOT_VERSION, endpoint
from protocol.socketfiles import Lost, SocketFiles, endpoint_in_use
from streamasr import service, supervised

STALE_AFTER_S = 10.0  # a process not heard from this long is dropped (its counters carried)
SILENT_AFTER_S = 3.0  # shown as silent after this long: it publishes every second
REFRESH_S = 1.0
WINDOW_S = 10.0  # latency quantiles and rates are over this trailing window
BUSY_WINDOW_S = 5.0  # the worker busy ratio is averaged over this long
RECENT_ERRORS = 50
RETIRED_KEPT = 64  # dead incarnations remembered beyond one per process, in case one was only stalled and speaks again
MAX_MESSAGE_BYTES = 4 << 20
STATE_VERSION = 2

Labels = tuple[tuple[str, str], ...]
Key = tuple[str, Labels]  # (metric name, labels) within one process
Series = tuple[str, str, Labels]  # (process, metric name, labels)


def program_of(process: str) -> str:
    """supervisord's program name of a process: `worker-3` -> `worker`."""
    return re.sub(r"-\d+$", "", process)


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[float]  # one per bound, then +Inf; not cumulative
    total: float

    @classmethod
    def read(cls, bounds: Any, counts: Any, total: Any) -> Histogram:
        """From a snapshot's or the state file's row: numbers of any msgpack kind."""
        return cls(tuple(map(float, bounds)), [float(c) for c in counts], float(total))

    def row(self) -> list[Any]:
        """As `read` takes it back."""
        return [list(self.bounds), self.counts, self.total]

    def copy(self) -> Histogram:
        return Histogram(self.bounds, list(self.counts), self.total)

    def add(self, other: Histogram, sign: int = 1) -> None:
        """Add (or take out) `other`'s observations. Two releases may bucket a metric differently (a
        rolling upgrade, or a carried total from before one): both are then counted in the union
        of their bounds, each bucket's count at its own upper bound, so no observation is dropped
        (`_count` never goes down) and none reads as faster than it was."""
        if other.bounds != self.bounds:
            bounds = tuple(sorted(set(self.bounds) | set(other.bounds)))
            self.counts, self.bounds = self._rebucketed(bounds), bounds
            other = Histogram(bounds, other._rebucketed(bounds), other.total)
        self.counts = [a + sign * b for a, b in zip(self.counts, other.counts)]
        self.total += sign * other.total

    def _rebucketed(self, bounds: tuple[float, ...]) -> list[float]:
        """The counts in `bounds`, a superset of this histogram's own."""
        counts = [0.0] * (len(bounds) + 1)
        for i, c in enumerate(self.counts):
            counts[bounds.index(self.bounds[i]) if i < len(self.bounds) else len(bounds)] += c
        return counts

    @property
    def count(self) -> float:
        return sum(self.counts)

    def max_bound(self) -> float | None:
        """Upper bound of the highest bucket holding an observation (a histogram keeps no exact
        max): infinity past the largest bound, None when empty."""
        top = next((i for i in range(len(self.counts) - 1, -1, -1) if self.counts[i] > 0), None)
        if top is None:
            return None
        return self.bounds[top] if top < len(self.bounds) else math.inf

    def quantile(self, q: float) -> float | None:
        """Prometheus' histogram_quantile: linear within the bucket; the largest bound if beyond it."""
        count = self.count
        if count <= 0:
            return None
        rank, below = q * count, 0.0
        for i, c in enumerate(self.counts):
            if c > 0 and below + c >= rank:
                if i == len(self.bounds):
                    return self.bounds[-1]
                low = self.bounds[i - 1] if i else 0.0
                return low + (self.bounds[i] - low) * (rank - below) / c
            below += c
        return self.bounds[-1]


@dataclass
class Incarnation:
    """One run of one process, as its latest snapshot describes it."""

    process: str
    token: str
    pid: int
    started: float
    seen: float = 0.0  # collector's monotonic clock at the latest snapshot
    counters: dict[Key, float] = field(default_factory=dict)
    gauges: dict[Key, float] = field(default_factory=dict)
    hists: dict[Key, Histogram] = field(default_factory=dict)
    # (publisher's monotonic time, busy_seconds_total, jobs_total by kind) of its snapshots over the
    # last window: rates are differences over the span the process itself measured, not over the
    # collector's refreshes, which take in one snapshot more or fewer as the two clocks' phases
    # drift; on its monotonic clock, as the wall clock steps when NTP sets it
    marks: deque[tuple[float, float, dict[str, float]]] = field(default_factory=deque)
    quiet: bool = False  # first sighting after the collector started: its history is not news

    def mark(self, stamped: float, counters: dict[Key, float], window: float) -> None:
        jobs: dict[str, float] = {}
        busy = 0.0
        for (name, labels), value in counters.items():
            if name == "jobs_total":
                kind = dict(labels).get("kind", "")
                jobs[kind] = jobs.get(kind, 0.0) + value
            elif name == "busy_seconds_total":
                busy += value
        self.marks.append((stamped, busy, jobs))
        while len(self.marks) > 2 and self.marks[1][0] <= stamped - window:
            self.marks.popleft()

    def _since(self, seconds: float) -> tuple[float, float, dict[str, float]]:
        """The latest mark at least `seconds` before the newest one (the oldest kept, if none is)."""
        newest = self.marks[-1][0]
        return next((m for m in reversed(self.marks) if m[0] <= newest - seconds), self.marks[0])

    def busy_ratio(self) -> float | None:
        if len(self.marks) < 2:
            return None
        (t0, b0, _), (t1, b1, _) = self._since(BUSY_WINDOW_S), self.marks[-1]
        return min(1.0, max(0.0, (b1 - b0) / (t1 - t0))) if t1 > t0 else None

    def job_rates(self, silent: float) -> dict[str, float]:
        """Jobs per second by kind over the window; a process silent for `silent` seconds counts
        that time as finishing nothing, so a hung one's rate falls instead of freezing."""
        if len(self.marks) < 2:
            return {}
        (t0, _, old), (t1, _, new) = self.marks[0], self.marks[-1]
        span = t1 - t0 + silent
        return {kind: max(0.0, value - old.get(kind, 0.0)) / span for kind, value in new.items()} if span > 0 else {}


def _labels(raw: Any) -> Labels:
    return tuple(sorted((str(k), str(v)) for k, v in dict(raw).items()))


def _histogram_row(bounds: Any, counts: Any, total: Any) -> bool:
    """Whether a snapshot's histogram can be summed, windowed and exported: finite figures, one
    count per bucket and +Inf, and bounds that rise (a quantile needs one bound at least, and
    Prometheus one series per `le`)."""
    return (len(counts) == len(bounds) + 1 and all(math.isfinite(x) for x in (total, *bounds, *counts))
            and len(bounds) > 0 and all(low < high for low, high in zip(bounds, bounds[1:])))


class _Nvml:
    """GPU utilisation and memory, only where pynvml imports and a GPU exists."""

    def __init__(self) -> None:
        self.handles: list[tuple[int, Any]] = []
        try:
            import pynvml  # optional: not a dependency

            pynvml.nvmlInit()
            self.nvml: Any = pynvml
            count = pynvml.nvmlDeviceGetCount()
        except Exception:  # no module, no driver, no device: GPU figures are omitted
            return
        for i in range(count):
            # NVML counts GPUs it may not talk to (NO_PERMISSION) and answers NOT_SUPPORTED for the
            # utilisation of a MIG-enabled one: such a GPU is left out, not every GPU with it
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                self._figures(i, handle)
            except Exception:
                continue
            self.handles.append((i, handle))

    def _figures(self, i: int, handle: Any) -> dict[str, Any]:
        memory = self.nvml.nvmlDeviceGetMemoryInfo(handle)
        return {"gpu": str(i), "utilization_percent": float(self.nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
                "memory_used_bytes": int(memory.used), "memory_total_bytes": int(memory.total)}

    def read(self) -> list[dict[str, Any]]:
        gpus = []
        try:
            for i, handle in self.handles:
                gpus.append(self._figures(i, handle))
        except Exception:  # a driver gone away mid-run: stop asking
            self.close()
            return []
        return gpus

    def close(self) -> None:
        if self.handles:
            self.handles = []
            try:
                self.nvml.nvmlShutdown()
            except Exception:
                pass


class Collector:
    """Aggregates every process's snapshots; `snapshot()` and `prometheus()` may be called from any thread."""

    def __init__(self, cfg: Config, stale_after: float = STALE_AFTER_S, window: float = WINDOW_S,
                 state_file: Path | None = None, on_socket_lost: Callable[[Lost], None] | None = None) -> None:
        """`state_file`: where the carried totals are kept across this collector's restarts (the
        dashboard's); None for a passing view (`top` without a dashboard). `on_socket_lost`: the
        socket file is bound again when deleted, and this told (the dashboard logs it); None for a
        passing view, which does not take the endpoint back from the dashboard."""
        self.cfg = cfg
        self.state_file = state_file
        self.state_unreadable = ""  # why a predecessor's state file was ignored, for the caller to log
        self._state_error = ""
        self.endpoint = endpoint(cfg)
        self.stale_after = stale_after
        self.window = window
        self._lock = threading.Lock()
        self._live: dict[str, Incarnation] = {}
        self._retired: OrderedDict[str, Incarnation] = OrderedDict()
        self._carried_counters: dict[Series, float] = {}
        self._carried_hists: dict[Series, Histogram] = {}
        self._restarts: dict[str, int] = {}  # per process name
        # per process name ever seen, a predecessor's included: [its last pid, supervisord's start
        # time of that pid, None until matched]; a pid or a start time other than these is a restart
        self._births: dict[str, list[Any]] = {}
        self._heard: set[str] = set()  # heard by this collector: a first snapshot's history is not news
        self._errors: deque[dict[str, Any]] = deque(maxlen=RECENT_ERRORS)
        self._history: deque[tuple[float, dict[str, Histogram]]] = deque()
        self._resources: dict[int, dict[str, Any]] = {}
        self._psutil: dict[int, psutil.Process] = {}
        self._supervisor: list[dict[str, Any]] = []
        self._supervisor_error = ""
        self._gpus: list[dict[str, Any]] = []
        self._nvml = _Nvml()
        self._view: dict[str, Any] = self._build_view(time.monotonic())
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(_Exporter(self))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sock: zmq.Socket | None = None
        self._socket_files = SocketFiles()
        self._on_socket_lost = on_socket_lost

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> Collector:
        """Bind (refusing if another collector of this instance is bound), look once, and collect on a
        daemon thread. The first look is made before this returns, so that nothing is served from a
        predecessor's state alone: a restart of the dashboard itself counts from its first reply."""
        if endpoint_in_use(self.endpoint):
            raise RuntimeError(f"another collector is already bound at {self.endpoint}")
        self.cfg.run_path.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.state_file is not None:
            self._load_state(self.state_file)
        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.RCVHWM, 10_000)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket_files.bind(sock, self.endpoint)
        self._sock = sock
        self.refresh()
        self._thread = threading.Thread(target=self._run, name="collector", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
            if self.state_file is not None:
                with self._lock:
                    self._save_state(self.state_file)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._nvml.close()

    def _run(self) -> None:
        assert self._sock is not None
        next_refresh = time.monotonic() + REFRESH_S
        while not self._stop.is_set():
            if self._sock.poll(100):
                while True:
                    try:
                        data = self._sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    with self._lock:
                        self._apply(data, time.monotonic())
            now = time.monotonic()
            if now >= next_refresh:
                self.refresh()
                if self._on_socket_lost is not None:
                    for lost in self._socket_files.check():
                        self._on_socket_lost(lost)
                next_refresh = now + REFRESH_S

    # -- views ------------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The latest view for the dashboard and `top` (JSON-ready; rebuilt once a second, do not mutate)."""
        return self._view

    def prometheus(self) -> bytes:
        """Prometheus text exposition of everything collected."""
        return generate_latest(self._registry)

    # -- snapshots in -----------------------------------------------------------------------------

    def _apply(self, data: bytes, now: float) -> None:
        """Take one published snapshot; malformed ones are ignored (a collector must not die of a bad peer)."""
        try:
            snap = msgpack.unpackb(data, raw=False)
            if not isinstance(snap, dict) or snap.get("v") != SNAPSHOT_VERSION:
                return
            process, token = str(snap["process"]), str(snap["incarnation"])
            # non-finite values are dropped: they would poison sums and are not valid JSON for the page
            counters = {(str(n), _labels(lb)): float(v) for n, lb, v in snap["counters"] if math.isfinite(v)}
            gauges = {(str(n), _labels(lb)): float(v) for n, lb, v in snap["gauges"] if math.isfinite(v)}
            hists = {(str(n), _labels(lb)): Histogram.read(b, cs, t)
                     for n, lb, b, cs, t in snap["histograms"] if _histogram_row(b, cs, t)}
            pid, started, sent = int(snap["pid"]), float(snap["started"]), float(snap["time"])
            # a publisher of a release before the monotonic stamp (a rolling upgrade): its arrival here
            stamped = float(snap.get("monotonic", now))
            if not all(map(math.isfinite, (started, sent, stamped))):  # uptime and error times on the page; rates
                raise ValueError("a time that is not finite")
            if not 0 < pid < 2 ** 31:  # no process's: psutil refuses a negative one, the state file one past 64 bits
                raise ValueError("not a pid")
        except (ValueError, KeyError, TypeError, OverflowError, msgpack.UnpackException):  # int(inf): OverflowError
            return
        inc = self._incarnation(process, token, pid, started, now)
        if inc is None:
            return
        if inc.quiet:
            self._add_to_history(process, hists)
        else:
            self._note_errors(inc, counters, sent)
        inc.quiet = False
        inc.seen, inc.pid = now, pid
        inc.counters, inc.gauges, inc.hists = counters, gauges, hists
        inc.mark(stamped, counters, max(self.window, BUSY_WINDOW_S))

    def _incarnation(self, process: str, token: str, pid: int, started: float, now: float) -> Incarnation | None:
        """The incarnation a snapshot belongs to, handling restarts; None for a late packet of a replaced one."""
        live = self._live.get(process)
        if live is not None and live.token == token:
            return live
        if token in self._retired:
            if live is not None:
                return None  # the old incarnation's last words, after its successor spoke
            inc = self._retired.pop(token)  # stalled, or live when a predecessor saved: take its counts back out of the carry
            self._carry(inc, -1)
            self._live[process] = inc
            self._heard.add(process)
            return inc
        if live is not None:
            self._retire(live)
        self._born(process, pid)
        inc = Incarnation(process, token, pid, started, quiet=process not in self._heard)
        self._heard.add(process)
        self._live[process] = inc
        return inc

    def _born(self, process: str, pid: int, start: float = 0.0) -> None:
        """Count a restart of `process` when it shows a pid other than its last one (in a snapshot,
        or in supervisord's list with the time supervisord started it), or when supervisord
        started it again since the last look and it is gone already: a process that crashes
        before it publishes, or within a second, still counts. supervisord's list alone would
        miss those that come and go between two looks; snapshots alone, those that crash
        before their first, and the dashboard itself, which sends none."""
        if not pid and not start:
            return  # never started
        known = self._births.get(process)
        if known is None:
            self._births[process] = [pid, start or None]
            return
        last_pid, last_start = known
        if pid and pid != last_pid:
            self._restarts[process] = self._restarts.get(process, 0) + 1
            self._births[process] = [pid, start or None]  # a snapshot's: supervisord's start time to match
        elif pid:
            known[1] = known[1] or start or None
        elif start != last_start:
            if last_start is not None:  # else the start of the pid a snapshot showed
                self._restarts[process] = self._restarts.get(process, 0) + 1
            known[1] = start

    def _retire(self, inc: Incarnation) -> None:
        del self._live[inc.process]
        self._carry(inc, 1)
        self._retired[inc.token] = inc
        self._trim_retired()

    def _trim_retired(self) -> None:
        """Forget the oldest dead incarnations, keeping RETIRED_KEPT and one per process name:
        after this collector's restart every incarnation its predecessor saw live is here, carried,
        until it speaks and takes its counts back; forgotten, it would be counted twice."""
        while len(self._retired) > RETIRED_KEPT + len(self._births):
            self._retired.popitem(last=False)

    def _carry(self, inc: Incarnation, sign: int) -> None:
        for (name, labels), value in inc.counters.items():
            series = (inc.process, name, labels)
            self._carried_counters[series] = self._carried_counters.get(series, 0.0) + sign * value
        for (name, labels), hist in inc.hists.items():
            series = (inc.process, name, labels)
            if series in self._carried_hists:
                self._carried_hists[series].add(hist, sign)
            else:
                self._carried_hists[series] = Histogram(hist.bounds, [sign * c for c in hist.counts], sign * hist.total)

    def _add_to_history(self, process: str, hists: dict[Key, Histogram]) -> None:
        """A process first heard after this collector started brings its whole history: count it in
        the window figures kept so far too, so latencies show what happened since, not a process's
        life at once. (Its rates start from this snapshot: see Incarnation.marks.)"""
        figures = _window_figures({(process, n, lb): h for (n, lb), h in hists.items()})
        for _, entry in self._history:
            for name, hist in figures.items():
                if name in entry:
                    entry[name].add(hist)
                else:
                    entry[name] = hist.copy()

    def _note_errors(self, inc: Incarnation, counters: dict[Key, float], sent: float) -> None:
        """Recent errors are the increases of the error and refusal counters since the last snapshot."""
        for (name, labels), value in counters.items():
            if name in ("errors_total", "refusals_total"):
                delta = value - inc.counters.get((name, labels), 0.0)
                if delta > 0:
                    self._errors.appendleft({"time": sent, "process": inc.process, "kind": name.removesuffix("s_total"),
                                             "code": dict(labels).get("code", ""), "count": delta})

    # -- carried totals across this collector's restarts -------------------------------------------

    def _save_state(self, path: Path) -> None:
        """Write what a restarted collector needs to go on counting (under the lock): the carried
        totals, the restart counts, and every incarnation's latest counts, live ones included, since
        they may die while no collector listens."""
        def incarnation(inc: Incarnation) -> list[Any]:
            return [inc.token, inc.process, inc.pid, inc.started, _pack_counters(inc.counters), _pack_hists(inc.hists)]

        state = {"v": STATE_VERSION, "instance": self.cfg.instance,
                 "counters": [[p, n, list(lb), v] for (p, n, lb), v in self._carried_counters.items()],
                 "hists": [[p, n, list(lb), *h.row()] for (p, n, lb), h in self._carried_hists.items()],
                 "retired": [incarnation(i) for i in self._retired.values()],
                 "live": [incarnation(i) for i in self._live.values()],
                 "restarts": self._restarts, "births": self._births}
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_bytes(msgpack.packb(state))
            os.replace(tmp, path)
            self._state_error = ""
        except OSError as exc:  # a full disk, a removed run directory: said on the page, counting goes on
            self._state_error = f"cannot keep the carried totals in {path}: {exc.strerror or exc}"

    def _load_state(self, path: Path) -> None:
        """Take up a predecessor's state. The incarnations it saw live are taken as retired (their
        counts carried): those still running take their counts back out when they speak, as a
        stalled process does, and those that died meanwhile stay counted."""
        try:
            state = msgpack.unpackb(path.read_bytes(), raw=False, strict_map_key=False)
            if state.get("v") != STATE_VERSION or state.get("instance") != self.cfg.instance:
                return
            counters = {(str(p), str(n), _labels(lb)): float(v) for p, n, lb, v in state["counters"]}
            hists = {(str(p), str(n), _labels(lb)): Histogram.read(b, cs, t) for p, n, lb, b, cs, t in state["hists"]}
            retired = [_unpack_incarnation(row) for row in state["retired"]]
            live = [_unpack_incarnation(row) for row in state["live"]]
            restarts = {str(p): int(n) for p, n in state["restarts"].items()}
            births = {str(p): [int(pid), None if start is None else float(start)] for p, (pid, start) in state["births"].items()}
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError, AttributeError, msgpack.UnpackException) as exc:
            self.state_unreadable = f"not a state file this collector can read ({type(exc).__name__}{f': {exc}' if str(exc) else ''})"
            return
        with self._lock:
            self._carried_counters, self._carried_hists = counters, hists
            self._restarts, self._births = restarts, births
            for inc in retired:
                self._retired[inc.token] = inc
            for inc in live:
                self._carry(inc, 1)
                self._retired[inc.token] = inc
            self._trim_retired()

    # -- once a second ----------------------------------------------------------------------------

    def refresh(self) -> None:
        """Drop silent processes, read resources, supervisord and GPUs, and rebuild the view."""
        now = time.monotonic()
        with self._lock:
            # one that supervisord still runs under the same pid is hung, not gone: kept, to be shown SILENT
            running = {(p["name"], p["pid"]) for p in self._supervisor if p.get("statename") in service.UP_STATES}
            for inc in [i for i in self._live.values() if now - i.seen > self.stale_after and (i.process, i.pid) not in running]:
                self._retire(inc)
            publishing = {i.process: i.pid for i in self._live.values()}
        supervisor, supervisor_error = self._read_supervisor()
        pids = set(publishing.values()) | {p["pid"] for p in supervisor if p.get("pid")}
        resources = self._read_resources(pids)
        gpus = self._nvml.read()
        with self._lock:
            for p in supervisor:
                self._born(p["name"], int(p.get("pid") or 0), float(p.get("start") or 0))
            self._supervisor, self._supervisor_error = supervisor, supervisor_error
            self._resources, self._gpus = resources, gpus
            self._history.append((now, self._window_totals()))
            while len(self._history) > 2 and self._history[1][0] <= now - self.window:
                self._history.popleft()
            if self.state_file is not None:
                self._save_state(self.state_file)
            self._view = self._build_view(now)

    def _read_supervisor(self) -> tuple[list[dict[str, Any]], str]:
        if not (self.cfg.run_path / "supervisor.sock").exists():  # no instance yet, or its socket deleted from under it
            pid = service.supervisord_pid(self.cfg)
            return [], service.socket_gone(self.cfg, pid) if pid is not None else ""
        try:
            return list(service.processes(self.cfg)), ""
        except supervised.RPC_ERRORS as exc:
            return [], f"{type(exc).__name__}: {exc}"

    def _read_resources(self, pids: set[int]) -> dict[int, dict[str, Any]]:
        """CPU %, RSS, threads and open descriptors per pid (psutil.Process kept so CPU % has a baseline)."""
        out: dict[int, dict[str, Any]] = {}
        for pid in list(self._psutil):
            if pid not in pids:
                del self._psutil[pid]
        for pid in pids:
            try:
                proc = self._psutil.get(pid)
                if proc is None or not proc.is_running():
                    proc = self._psutil[pid] = psutil.Process(pid)
                with proc.oneshot():
                    out[pid] = {"cpu_percent": proc.cpu_percent(None), "rss_bytes": proc.memory_info().rss,
                                "threads": proc.num_threads(), "open_fds": proc.num_fds()}
            except (psutil.Error, OSError):
                self._psutil.pop(pid, None)
        return out

    # -- aggregation (under the lock) -------------------------------------------------------------

    def _workers(self) -> list[Incarnation]:
        """The live worker processes: the busy figure is theirs (backend calls), not the broker's or an ingest's."""
        return [i for i in self._live.values() if program_of(i.process) == "worker"]

    def _series(self) -> tuple[dict[Series, float], dict[Series, float], dict[Series, Histogram]]:
        """Counters and histograms as carried + live; gauges of live processes only."""
        counters = dict(self._carried_counters)
        hists = {s: h.copy() for s, h in self._carried_hists.items()}
        gauges: dict[Series, float] = {}
        for inc in self._live.values():
            for (name, labels), value in inc.counters.items():
                series = (inc.process, name, labels)
                counters[series] = counters.get(series, 0.0) + value
            for (name, labels), value in inc.gauges.items():
                gauges[(inc.process, name, labels)] = value
            for (name, labels), hist in inc.hists.items():
                series = (inc.process, name, labels)
                if series in hists:
                    hists[series].add(hist)
                else:
                    hists[series] = hist.copy()
        return counters, gauges, hists

    @staticmethod
    def _exported(series: dict[Series, Any]) -> dict[Key, Any]:
        """Sum over processes, except metrics exported per process (with the process in a label)."""
        out: dict[Key, Any] = {}
        for (process, name, labels), value in series.items():
            spec = SPECS.get(name)
            if spec is not None and spec.per_process:
                labels = tuple(sorted(labels + ((spec.per_process, process),)))
            key = (name, labels)
            if key not in out:
                out[key] = value.copy() if isinstance(value, Histogram) else value
            elif isinstance(value, Histogram):
                out[key].add(value)
            else:
                out[key] += value
        return out

    def _window_totals(self) -> dict[str, Histogram]:
        return _window_figures(self._series()[2])

    def _build_view(self, now: float) -> dict[str, Any]:
        counters, gauges, _ = self._series()
        old, new = (self._history[0], self._history[-1]) if self._history else ((now, {}), (now, {}))
        span = new[0] - old[0]

        def by_label(series: dict[Series, float], name: str, label: str) -> dict[str, float]:
            out: dict[str, float] = {}
            for (_, n, labels), value in series.items():
                if n == name:
                    key = dict(labels).get(label, "")
                    out[key] = out.get(key, 0.0) + value
            return out

        def total(series: dict[Series, float], name: str) -> float:
            return sum(v for (_, n, _), v in series.items() if n == name)

        rates: dict[str, float] = {}
        for inc in self._live.values():
            # silent: from when the page marks it so; a snapshot a little late is jitter, not silence
            for kind, rate in inc.job_rates(silent=max(0.0, now - inc.seen - SILENT_AFTER_S)).items():
                rates[kind] = rates.get(kind, 0.0) + rate
        latency: dict[str, dict[str, Any]] = {}
        for kind, name in (("partial", "partial_latency_seconds"), ("final", "final_latency_seconds"),
                           ("to_worker", "to_worker"), ("to_ingest", "to_ingest")):  # the last two: job_transit_seconds
            latency[kind] = self._window_stats(old[1].get(name), new[1].get(name))
        batch = self._window_stats(old[1].get("batch_size"), new[1].get("batch_size"))
        view: dict[str, Any] = {
            "time": time.time(),
            "instance": self.cfg.instance,
            "window_s": round(span, 1),
            "processes": self._process_rows(now),
            "streams": by_label(gauges, "streams_active", "priority"),
            "queued": by_label(gauges, "jobs_queued", "priority"),
            "inflight": total(gauges, "jobs_inflight"),
            "rings": {"used": total(gauges, "shm_rings_used"), "total": total(gauges, "shm_rings_total")},
            # what a realtime open is admitted against (docs/RELIABILITY.md, "Overload")
            "admission": {"realtime_cap": self.cfg.ingest.admit_max_realtime_streams or None,
                          "wait_s": total(gauges, "admission_wait_seconds"), "busy": total(gauges, "admission_busy_ratio"),
                          "stream_share": total(gauges, "admission_stream_share"),
                          "opens_waiting": total(gauges, "opens_waiting")},
            "workers": [{"name": i.process, "busy_ratio": i.busy_ratio()} for i in sorted(self._workers(), key=lambda i: i.process)],
            "throughput": {"jobs_per_s": sum(rates.values()), "by_kind": rates},
            "latency": latency,
            "batch": batch,
            "totals": {"jobs": total(counters, "jobs_total"), "refusals": by_label(counters, "refusals_total", "code"),
                       "errors": by_label(counters, "errors_total", "code")},
            "restarts": self._program_restarts(),
            "recent_errors": list(self._errors),
        }
        if self._gpus:
            view["gpus"] = self._gpus
        if self._supervisor_error:
            view["supervisor_error"] = self._supervisor_error
        if self._state_error:
            view["state_error"] = self._state_error
        return view

    @staticmethod
    def _window_stats(old: Histogram | None, new: Histogram | None) -> dict[str, Any]:
        """Count, mean and quantiles of what was observed during the window."""
        if new is None:
            return {"count": 0, "mean": None, "p50": None, "p95": None, "p99": None}
        delta = new.copy()
        if old is not None:
            delta.add(old, -1)
        count = delta.count
        return {"count": count, "mean": delta.total / count if count > 0 else None,
                "p50": delta.quantile(0.5), "p95": delta.quantile(0.95), "p99": delta.quantile(0.99)}

    def _program_restarts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for process in self._births.keys() | {p["name"] for p in self._supervisor}:
            out.setdefault(program_of(process), 0)
        for process, n in self._restarts.items():
            out[program_of(process)] += n
        return dict(sorted(out.items()))

    def _process_rows(self, now: float) -> list[dict[str, Any]]:
        """supervisord's processes and the publishing ones, with resource figures."""
        rows: dict[str, dict[str, Any]] = {}
        for p in self._supervisor:
            rows[p["name"]] = {"name": p["name"], "program": p.get("group") or program_of(p["name"]), "state": p["statename"],
                               "pid": p["pid"] or None, "uptime_s": (p["now"] - p["start"]) if p["pid"] else None,
                               "last_seen_s": None,
                               # a failed start, retried or given up on: why, as `status` says it (its log's last line, read only then)
                               **({"why": service.start_failed_why(self.cfg, p)} if p["statename"] in service.FAILED_STATES else {})}
        for inc in self._live.values():
            silent = now - inc.seen
            row = rows.setdefault(inc.process, {"name": inc.process, "program": program_of(inc.process), "state": "RUNNING",
                                                "pid": inc.pid, "uptime_s": time.time() - inc.started})
            if silent > SILENT_AFTER_S and row["state"] in service.UP_STATES and row["pid"] == inc.pid:
                row["state"] = "SILENT"  # supervisord sees it run, but a process that stopped publishing is hung
            row["last_seen_s"] = round(silent, 1)
        for row in rows.values():
            row["restarts"] = self._restarts.get(row["name"], 0)
            row.update(self._resources.get(row["pid"] or -1, {"cpu_percent": None, "rss_bytes": None, "threads": None, "open_fds": None}))
        return sorted(rows.values(), key=lambda r: (r["program"], r["name"]))

    # -- Prometheus -------------------------------------------------------------------------------

    def families(self) -> Iterator[Metric]:
        """Every metric as a Prometheus family (named PREFIX + the published name)."""
        with self._lock:
            counters, gauges, hists = self._series()
            busy = {i.process: i.busy_ratio() for i in self._workers()}
            restarts = self._program_restarts()
            resources = {p: self._resources.get(i.pid) for p, i in self._live.items()}
            for row in self._view["processes"]:
                resources.setdefault(row["name"], self._resources.get(row["pid"] or -1))
            gpus = list(self._gpus)
        yield from _families(self._exported(counters), CounterMetricFamily)
        yield from _families(self._exported(gauges), GaugeMetricFamily)
        yield from _histogram_families(self._exported(hists))
        ratio = GaugeMetricFamily(f"{PREFIX}worker_busy_ratio", "Share of the last seconds a worker spent in backend calls.",
                                  labels=["worker"])
        for process, value in sorted(busy.items()):
            if value is not None:
                ratio.add_metric([process], value)
        yield ratio
        family = CounterMetricFamily(f"{PREFIX}process_restarts", "Restarts seen per program (new pid under the same name).",
                                     labels=["program"])
        for program, n in restarts.items():
            family.add_metric([program], n)
        yield family
        for key, name, doc in (("cpu_percent", "process_cpu_percent", "CPU use per process (100 = one core)."),
                               ("rss_bytes", "process_resident_memory_bytes", "Resident memory per process."),
                               ("threads", "process_threads", "Threads per process."),
                               ("open_fds", "process_open_fds", "Open file descriptors per process.")):
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["process"])
            for process, figures in sorted(resources.items()):
                if figures:
                    family.add_metric([process], figures[key])
            yield family
        if gpus:
            for key, doc in (("utilization_percent", "GPU utilisation."), ("memory_used_bytes", "GPU memory in use."),
                             ("memory_total_bytes", "GPU memory.")):
                family = GaugeMetricFamily(f"{PREFIX}gpu_{key}", doc, labels=["gpu"])
                for gpu in gpus:
                    family.add_metric([gpu["gpu"]], gpu[key])
                yield family


class _Exporter:
    """prometheus_client's custom-collector interface over a Collector."""

    def __init__(self, collector: Collector) -> None:
        self.collector = collector

    def collect(self) -> Iterator[Metric]:
        return self.collector.families()


def _window_figures(hists: dict[Series, Histogram]) -> dict[str, Histogram]:
    """The totals the windowed latencies are differences of: the latency, transit and batch
    histograms summed over processes."""
    summed: dict[str, Histogram] = {}
    for (_, name, labels), hist in hists.items():
        if name == "job_transit_seconds":  # one histogram per leg: to_worker, to_ingest
            name = dict(labels).get("leg", "")
        elif name not in ("partial_latency_seconds", "final_latency_seconds", "batch_size"):
            continue
        if name in summed:
            summed[name].add(hist)
        else:
            summed[name] = hist.copy()
    return summed


def _pack_counters(counters: dict[Key, float]) -> list[list[Any]]:
    return [[n, list(lb), v] for (n, lb), v in counters.items()]


def _pack_hists(hists: dict[Key, Histogram]) -> list[list[Any]]:
    return [[n, list(lb), *h.row()] for (n, lb), h in hists.items()]


def _unpack_incarnation(row: list[Any]) -> Incarnation:
    token, process, pid, started, counters, hists = row
    return Incarnation(str(process), str(token), int(pid), float(started),
                       counters={(str(n), _labels(lb)): float(v) for n, lb, v in counters},
                       hists={(str(n), _labels(lb)): Histogram.read(b, cs, t) for n, lb, b, cs, t in hists})


def _label_names(name: str, keys: list[Labels]) -> list[str]:
    """The spec's labels first, then any others a publisher used (a family needs one label set)."""
    spec = SPECS.get(name)
    names = list(spec.labels) if spec else []
    if spec and spec.per_process:
        names.append(spec.per_process)
    for labels in keys:
        names.extend(k for k, _ in labels if k not in names)
    return names


def _help(name: str) -> str:
    spec = SPECS.get(name)
    return spec.help if spec else "Published by the processes (not in metrics.names)."


def _families(values: dict[Key, float], kind: type) -> Iterator[Metric]:
    grouped: dict[str, list[tuple[Labels, float]]] = {}
    for (name, labels), value in sorted(values.items()):
        grouped.setdefault(name, []).append((labels, value))
    for name, samples in grouped.items():
        names = _label_names(name, [labels for labels, _ in samples])
        family = kind(PREFIX + name, _help(name), labels=names)
        for labels, value in samples:
            family.add_metric([dict(labels).get(n, "") for n in names], value)
        yield family


def _histogram_families(values: dict[Key, Histogram]) -> Iterator[Metric]:
    grouped: dict[str, list[tuple[Labels, Histogram]]] = {}
    for (name, labels), hist in sorted(values.items(), key=lambda kv: kv[0]):
        grouped.setdefault(name, []).append((labels, hist))
    for name, samples in grouped.items():
        names = _label_names(name, [labels for labels, _ in samples])
        family = HistogramMetricFamily(PREFIX + name, _help(name), labels=names)
        for labels, hist in samples:
            cumulative, buckets = 0.0, []
            for bound, count in zip(hist.bounds, hist.counts):
                cumulative += count
                buckets.append((floatToGoString(bound), cumulative))
            buckets.append(("+Inf", hist.count))
            family.add_metric([dict(labels).get(n, "") for n in names], buckets, hist.total)
        yield family
