"""Metrics end to end: real publisher processes, a real collector, a real ipc socket.

Publishers are `python -c` processes that record made-up but plausible figures with ProcessMetrics,
so these tests need no model and no service; the dashboard tests reuse the helpers below.
"""

from __future__ import annotations

import json
import math
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import msgpack
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from config import settings
from config.settings import Config
from metrics.collector import RETIRED_KEPT, Collector, Histogram, endpoint_in_use
from metrics.names import SPECS
from metrics.registry import ProcessMetrics, endpoint
from streaming import wait_for

ROOT = Path(__file__).resolve().parents[1]

# Records a bit of everything every 50 ms, publishes every `interval` seconds, runs until killed.
PUBLISHER = r"""
import random, sys, time
from config import settings
from metrics.registry import ProcessMetrics

cfg = settings.load(sys.argv[1])
m = ProcessMetrics(cfg, sys.argv[2], interval=float(sys.argv[3])).start()
print("ready", flush=True)
n = 0
while True:
    n += 1
    m.inc("jobs_total", kind="partial", status="done")
    if n % 4 == 0:
        m.inc("jobs_total", kind="final", status="done")
        m.observe("final_latency_seconds", random.uniform(0.1, 1.0))
    m.observe("partial_latency_seconds", random.uniform(0.01, 0.2))
    m.observe("job_transit_seconds", random.uniform(0.0005, 0.00075), leg="to_worker")  # one bucket each
    m.observe("job_transit_seconds", random.uniform(0.003, 0.005), leg="to_ingest")
    m.observe("batch_size", random.randint(1, 8))
    m.inc("busy_seconds_total", 0.02)
    m.set("streams_active", random.randint(1, 9), priority="realtime")
    m.set("jobs_queued", random.randint(0, 5), priority="realtime")
    m.set("jobs_inflight", random.randint(0, 3))
    m.set("shm_rings_used", random.randint(1, 9))
    m.set("shm_rings_total", 16)
    if n % 20 == 0:
        m.inc("errors_total", code="internal")
    if n % 30 == 0:
        m.inc("refusals_total", code="overloaded")
    time.sleep(0.05)
"""


@dataclass
class Publisher:
    name: str
    proc: subprocess.Popen

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


def start_publisher(config_file: Path, name: str, interval: float = 0.25) -> Publisher:
    proc = subprocess.Popen([sys.executable, "-c", PUBLISHER, str(config_file), name, str(interval)],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return Publisher(name, proc)


def instance_config(tmp: Path) -> tuple[Config, Path]:
    """A fresh instance (own run directory, so its own metrics socket) and its config file."""
    instance = f"m{uuid.uuid4().hex[:8]}"
    cfg = settings.load(None, {"instance": instance, "run_dir": str(tmp / instance)})
    config_file = tmp / f"{instance}.toml"
    config_file.write_text(settings.dump(cfg))
    return cfg, config_file


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text -> {(sample name, labels): value}; parsing is itself part of the check."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def processes(collector: Collector) -> dict[str, dict[str, Any]]:
    return {p["name"]: p for p in collector.snapshot()["processes"]}


@pytest.fixture
def instance(tmp_path: Path) -> tuple[Config, Path]:
    return instance_config(tmp_path)


@pytest.fixture
def publishers() -> Iterator[Callable[..., Publisher]]:
    started: list[Publisher] = []

    def start(config_file: Path, name: str, interval: float = 0.25) -> Publisher:
        started.append(start_publisher(config_file, name, interval))
        return started[-1]

    yield start
    for p in started:
        p.kill()


@pytest.fixture
def collector(instance: tuple[Config, Path]) -> Iterator[Collector]:
    c = Collector(instance[0], stale_after=2.0).start()
    yield c
    c.close()


def test_snapshots_of_several_processes_aggregate(instance, publishers, collector) -> None:
    _, config_file = instance
    workers = [publishers(config_file, f"worker-{i}") for i in range(2)]
    seen = wait_for(lambda: (p := processes(collector)) and len(p) == 2 and all(r["rss_bytes"] for r in p.values()) and p,
                    what="both publishers with resource figures")
    for w in workers:
        row = seen[w.name]
        assert row["pid"] == w.pid and row["state"] == "RUNNING" and row["program"] == "worker"
        assert row["threads"] >= 2 and row["open_fds"] > 0 and row["rss_bytes"] > 10_000_000
    snap = wait_for(lambda: (s := collector.snapshot())["latency"]["partial"]["count"] and s["throughput"]["jobs_per_s"] and s,
                    what="windowed latency and throughput")
    assert 0.01 <= snap["latency"]["partial"]["p50"] <= 0.25
    assert 0.0005 <= snap["latency"]["to_worker"]["p95"] <= 0.00075  # each leg on its own, summed over processes
    assert 0.003 <= snap["latency"]["to_ingest"]["p50"] <= 0.005
    assert 1 <= snap["batch"]["mean"] <= 8
    assert snap["throughput"]["jobs_per_s"] > 5  # two publishers at ~20 partials/s each
    assert 2 <= snap["streams"]["realtime"] <= 18 and snap["rings"]["total"] == 32  # gauges sum over processes
    assert {w["name"] for w in snap["workers"]} == {"worker-0", "worker-1"}
    ratios = wait_for(lambda: [w["busy_ratio"] for w in collector.snapshot()["workers"] if w["busy_ratio"] is not None] or None,
                      what="busy ratios")
    assert all(0 < r <= 1 for r in ratios)
    assert wait_for(lambda: collector.snapshot()["recent_errors"], what="recent errors from counter changes")[0]["code"] in ("internal", "overloaded")
    assert snap["restarts"] == {"worker": 0}


def test_counters_stay_monotonic_across_a_restart(instance, publishers, collector) -> None:
    _, config_file = instance
    key = ("streamasr_jobs_total", (("kind", "partial"), ("status", "done")))
    first = publishers(config_file, "ingest-0")
    wait_for(lambda: samples(collector.prometheus().decode()).get(key, 0) > 20, what="first incarnation's jobs")
    seen = [samples(collector.prometheus().decode())[key]]
    first.kill()
    second = publishers(config_file, "ingest-0")
    wait_for(lambda: processes(collector).get("ingest-0", {}).get("pid") == second.pid, what="the new incarnation")
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        seen.append(samples(collector.prometheus().decode())[key])
        time.sleep(0.1)
    assert all(b >= a for a, b in zip(seen, seen[1:])), "a counter went down across the restart"
    assert seen[-1] > seen[0]
    text = collector.prometheus().decode()
    assert samples(text)[("streamasr_process_restarts_total", (("program", "ingest"),))] == 1
    assert processes(collector)["ingest-0"]["restarts"] == 1


def test_a_restarted_dashboard_goes_on_counting_where_its_predecessor_stopped(instance, publishers) -> None:
    """The dashboard's collector can restart while the service runs on. Its successor takes up the
    carried totals of processes that restarted before, the restart counts, and the last counts of
    a process that died while no collector listened: no exported counter goes down."""
    cfg, config_file = instance
    jobs = ("streamasr_jobs_total", (("kind", "partial"), ("status", "done")))
    restarts = ("streamasr_process_restarts_total", (("program", "ingest"),))
    first = Collector(cfg, stale_after=30.0, state_file=cfg.metrics_state_path).start()
    try:
        publishers(config_file, "broker")
        ingest = publishers(config_file, "ingest-0")
        wait_for(lambda: len(processes(first)) == 2 and samples(first.prometheus().decode()).get(jobs, 0) > 40,
                 what="both processes' jobs")
        ingest.kill()
        ingest = publishers(config_file, "ingest-0")
        wait_for(lambda: processes(first).get("ingest-0", {}).get("pid") == ingest.pid, what="the restarted ingest")
        time.sleep(1.5)  # a few snapshots of it, and a refresh that saves them
    finally:
        first.close()
    before = samples(first.prometheus().decode())
    assert before[restarts] == 1
    ingest.kill()  # dies and comes back while no collector listens
    ingest = publishers(config_file, "ingest-0")
    second = Collector(cfg, stale_after=30.0, state_file=cfg.metrics_state_path).start()
    try:
        wait_for(lambda: processes(second).get("ingest-0", {}).get("pid") == ingest.pid and "broker" in processes(second),
                 what="both processes in the new collector")
        after = samples(second.prometheus().decode())
        assert after[jobs] >= before[jobs], (before[jobs], after[jobs])
        assert after[restarts] == 2
        assert after[("streamasr_process_restarts_total", (("program", "broker"),))] == 0
        assert {p["name"]: p["restarts"] for p in second.snapshot()["processes"]} == {"broker": 0, "ingest-0": 2}
    finally:
        second.close()
    assert "state_error" not in second.snapshot()


def test_a_restarted_dashboard_counts_each_of_many_workers_once(instance) -> None:
    """A machine of many cores runs more workers than the collector keeps dead incarnations for
    (a worker per core by default). A restarted dashboard carries every incarnation its
    predecessor saw live and takes its counts back out when it speaks again: none of them may be
    forgotten in between, or its counts would be carried and live at once, doubled."""
    cfg, _ = instance
    key = "streamasr_worker_jobs_total"
    workers = [ProcessMetrics(cfg, f"worker-{i}") for i in range(RETIRED_KEPT + 6)]
    for w in workers:
        w.inc("worker_jobs_total", 10, kind="partial")
    sock = publisher_socket(cfg)
    try:
        for name in ("first", "second"):
            collector = Collector(cfg, state_file=cfg.metrics_state_path).start()
            try:
                send_until_heard(sock, cfg, collector, f"{name} before")
                for w in workers:
                    sock.send(msgpack.packb(w.snapshot()))
                send_until_heard(sock, cfg, collector, f"{name} after")  # every worker's snapshot is in
                jobs = {s.labels["worker"]: s.value for f in text_string_to_metric_families(collector.prometheus().decode())
                        if f.name == key.removesuffix("_total") for s in f.samples}
                assert jobs == {w.process: 10 for w in workers}, (name, {p: n for p, n in jobs.items() if n != 10})
            finally:
                collector.close()
            wait_for(lambda: not endpoint_in_use(endpoint(cfg)), what="the socket let go")  # closed by zmq's own thread
    finally:
        sock.close()


def test_an_unreadable_state_file_is_said_and_replaced(instance, publishers) -> None:
    cfg, config_file = instance
    cfg.run_path.mkdir(mode=0o700, parents=True)
    cfg.metrics_state_path.write_bytes(b"\xc1 not msgpack")
    collector = Collector(cfg, state_file=cfg.metrics_state_path).start()
    try:
        assert collector.state_unreadable.startswith("not a state file"), collector.state_unreadable
        publishers(config_file, "broker")
        wait_for(lambda: "broker" in processes(collector), what="the broker")
        wait_for(lambda: msgpack.unpackb(cfg.metrics_state_path.read_bytes())["live"], what="a state file of this collector's own")
    finally:
        collector.close()


def test_silent_process_is_dropped_but_its_counts_are_kept(instance, publishers, collector) -> None:
    _, config_file = instance
    key = ("streamasr_jobs_total", (("kind", "partial"), ("status", "done")))
    broker = publishers(config_file, "broker")
    wait_for(lambda: "broker" in processes(collector), what="the broker")
    broker.kill()
    before = samples(collector.prometheus().decode())[key]
    wait_for(lambda: "broker" not in processes(collector), timeout=6, what="the silent process to be dropped")
    assert samples(collector.prometheus().decode())[key] >= before > 0
    assert collector.snapshot()["streams"].get("realtime", 0) == 0  # gauges of the dead are not carried


def test_prometheus_text_parses_and_counters_increase(instance, publishers, collector) -> None:
    _, config_file = instance
    publishers(config_file, "worker-0")
    publishers(config_file, "ingest-0")
    wait_for(lambda: len(processes(collector)) == 2, what="two publishers")
    time.sleep(1.5)
    first = collector.prometheus().decode()
    families = {f.name: f for f in text_string_to_metric_families(first)}
    for name, kind in (("streamasr_jobs", "counter"), ("streamasr_streams_active", "gauge"), ("streamasr_jobs_queued", "gauge"),
                       ("streamasr_jobs_inflight", "gauge"), ("streamasr_batch_size", "histogram"),
                       ("streamasr_partial_latency_seconds", "histogram"), ("streamasr_final_latency_seconds", "histogram"),
                       ("streamasr_worker_busy_ratio", "gauge"), ("streamasr_shm_rings_used", "gauge"),
                       ("streamasr_shm_rings_total", "gauge"), ("streamasr_errors", "counter"), ("streamasr_refusals", "counter"),
                       ("streamasr_process_restarts", "counter"), ("streamasr_process_cpu_percent", "gauge"),
                       ("streamasr_process_resident_memory_bytes", "gauge"), ("streamasr_process_threads", "gauge"),
                       ("streamasr_process_open_fds", "gauge"), ("streamasr_busy_seconds", "counter")):
        assert name in families and families[name].type == kind, name
    busy = {s.labels["worker"] for s in families["streamasr_worker_busy_ratio"].samples}
    assert busy == {"worker-0"}  # the ingest's fake records busy time too: the figure is the workers' only
    assert [w["name"] for w in collector.snapshot()["workers"]] == ["worker-0"]  # as the JSON view has it
    assert {s.labels["process"] for s in families["streamasr_process_threads"].samples} == {"worker-0", "ingest-0"}
    buckets = [s for s in families["streamasr_batch_size"].samples if s.name.endswith("_bucket")]
    assert [s.value for s in buckets] == sorted(s.value for s in buckets)  # cumulative
    growing = {key: value for key, value in samples(first).items()
               if key[0] in ("streamasr_jobs_total", "streamasr_busy_seconds_total", "streamasr_partial_latency_seconds_count")}
    assert {key[0] for key in growing} == {"streamasr_jobs_total", "streamasr_busy_seconds_total",
                                           "streamasr_partial_latency_seconds_count"}, sorted(growing)

    def all_grown() -> bool:
        second = samples(collector.prometheus().decode())
        return all(second[key] > value for key, value in growing.items())

    wait_for(all_grown, what=f"each of {sorted(growing)} to increase")


def test_window_figures_count_only_what_happened_since_a_process_was_first_heard(instance) -> None:
    """A collector that starts after the service (a restarted dashboard, `streamasr top` with a
    collector of its own) hears each process's whole history in its first snapshot: the windowed
    rate and latency figures count only what was recorded after that, not the history at once."""
    cfg, _ = instance
    collector = Collector(cfg, window=60.0)

    def refreshed(after: dict[str, Any]) -> dict[str, Any]:
        """The first view the collector builds after `after` (it rebuilds it once a second)."""
        return wait_for(lambda: (view := collector.snapshot()) is not after and view, what="the collector's next refresh")

    unstarted = collector.snapshot()
    collector.start()
    broker = ProcessMetrics(cfg, "broker", interval=0.1)
    try:
        for _ in range(5000):  # an hour of service before the collector started
            broker.inc("jobs_total", kind="partial", status="done")
            broker.observe("partial_latency_seconds", 2.0)
        refreshed(unstarted)  # the collector's first figures are taken before it hears anyone
        broker.start()
        heard = wait_for(lambda: next((v for v in [collector.snapshot()] if "broker" in {p["name"] for p in v["processes"]}), None),
                         what="the broker's first snapshot")
        snap = refreshed(refreshed(heard))  # a refresh or two with the history in
        assert snap["throughput"]["jobs_per_s"] == 0, snap["throughput"]
        assert snap["latency"]["partial"]["count"] == 0, snap["latency"]["partial"]
        for _ in range(7):
            broker.inc("jobs_total", kind="partial", status="done")
            broker.observe("partial_latency_seconds", 0.02)
        latency = wait_for(lambda: (p := collector.snapshot()["latency"]["partial"])["count"] and p,
                           what="the new observations in the window")
        assert latency["count"] == 7 and latency["p99"] <= 0.025, latency
        assert 0 < collector.snapshot()["throughput"]["jobs_per_s"] <= 7
    finally:
        broker.close()
        collector.close()


def test_job_rate_is_taken_over_the_span_the_process_measured(instance) -> None:
    """Jobs per second are the change of a process's counters over the time between the snapshots
    compared, as the process stamped them. Over the collector's own refreshes a window would take
    in one snapshot more or fewer as the two clocks drift apart (here a snapshot every 0.7 s
    against a refresh every second: -7 % to +17 %). A process that falls silent counts its silence
    as finishing nothing once it is shown silent."""
    cfg, _ = instance
    collector = Collector(cfg, stale_after=60.0, window=3.0).start()
    broker = ProcessMetrics(cfg, "broker", interval=0.7)
    stop = threading.Event()

    def finish_jobs() -> None:  # 20 jobs a second on the clock, however late a turn wakes
        t0, done = time.monotonic(), 0
        while not stop.wait(0.01):
            due = int(20 * (time.monotonic() - t0))
            broker.inc("jobs_total", due - done, kind="partial", status="done")
            done = due

    worker = threading.Thread(target=finish_jobs, daemon=True)
    try:
        worker.start()
        broker.start()
        wait_for(lambda: "broker" in processes(collector), what="the broker's first snapshot")
        time.sleep(4.5)  # a window of snapshots
        rates = []
        for _ in range(30):
            rates.append(collector.snapshot()["throughput"]["jobs_per_s"])
            time.sleep(0.2)
        assert all(18.5 <= r <= 21.5 for r in rates), rates  # a snapshot's count is whole jobs: ±1 in 3 s
        stop.set()
        worker.join()
        broker.close()
        wait_for(lambda: collector.snapshot()["throughput"]["jobs_per_s"] < 10, timeout=20,
                 what="the silent process's rate to fall")
    finally:
        stop.set()
        broker.close()
        collector.close()


def test_rates_read_right_when_the_wall_clock_steps_back_or_forward(instance) -> None:
    """NTP steps the wall clock an hour back, then an hour forward: the `time` a process stamps
    its snapshots with jumps, while the jobs it finishes per second and its busy share do not.
    Rates are taken on the process's monotonic clock, so the page reads them right through both
    steps; on the wall clock it read no rate for the hour after a step back."""
    cfg, _ = instance
    collector = Collector(cfg, stale_after=60.0, window=3.0).start()
    worker = ProcessMetrics(cfg, "worker-0")
    sock = publisher_socket(cfg)
    try:
        send_until_heard(sock, cfg, collector, "before")  # the collector hears this socket
        t0, done = time.monotonic(), 0.0
        rates, busy = [], []
        for step in (0.0, -3600.0, 3600.0):
            for _ in range(12):  # 3 s of snapshots: a window's worth
                due = 20 * (time.monotonic() - t0)  # 20 jobs a second, half of each second busy
                worker.inc("jobs_total", due - done, kind="partial", status="done")
                worker.inc("busy_seconds_total", (due - done) / 40)
                done = due
                snap = worker.snapshot()
                snap["time"] += step
                sock.send(msgpack.packb(snap))
                time.sleep(0.25)
                if step:  # from the first step on, a window of snapshots is in
                    view = collector.snapshot()
                    rates.append(view["throughput"]["jobs_per_s"])
                    busy.extend(w["busy_ratio"] for w in view["workers"])
    finally:
        sock.close()
        collector.close()
    assert all(19 <= r <= 21 for r in rates), rates
    assert all(b is not None and 0.45 <= b <= 0.55 for b in busy), busy


def test_an_observation_that_is_not_a_number_does_not_spoil_its_histogram(tmp_path: Path) -> None:
    m = ProcessMetrics(instance_config(tmp_path)[0], "ingest-0")
    for value in (0.01, math.nan, math.inf, -math.inf, 0.02):
        m.observe("partial_latency_seconds", value)
    [(_, _, _, counts, total)] = m.snapshot()["histograms"]
    assert sum(counts) == 2 and total == pytest.approx(0.03)


def test_publisher_with_no_collector_never_blocks(tmp_path: Path) -> None:
    """Recording while nobody collects neither blocks nor loses counts, and closing does not wait
    for a collector (a hang here would stop the test at its timeout)."""
    cfg, _ = instance_config(tmp_path)  # nobody binds this endpoint
    metrics = ProcessMetrics(cfg, "worker-0", interval=0.01).start()
    n = 100_000
    for i in range(n):
        metrics.inc("jobs_total", kind="partial", status="done")
        metrics.observe("partial_latency_seconds", 0.01)
        metrics.set("jobs_queued", i, priority="realtime")
    time.sleep(0.1)  # several publish attempts into the void
    metrics.close()
    snap = metrics.snapshot()
    assert snap["counters"] == [["jobs_total", {"kind": "partial", "status": "done"}, n]]
    assert snap["histograms"][0][3][4] == n  # 0.01 s falls in the le=0.01 bucket (the fifth)


def test_recording_from_many_threads_loses_nothing(tmp_path: Path) -> None:
    import threading

    cfg, _ = instance_config(tmp_path)
    metrics = ProcessMetrics(cfg, "ingest-0")

    def work() -> None:
        for _ in range(20_000):
            metrics.inc("jobs_total", kind="final", status="done")
            metrics.observe("final_latency_seconds", 0.2)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = metrics.snapshot()
    assert snap["counters"][0][2] == 160_000
    assert sum(snap["histograms"][0][3]) == 160_000


def test_a_snapshot_taken_while_a_thread_observes_holds_each_observation_whole(tmp_path: Path) -> None:
    """A histogram's count and sum come from the same observations: snapshots taken while
    another thread records never hold a count without its value. Without the store's lock
    about one snapshot in ten thousand did, so the test takes a few hundred thousand."""
    import sys
    import threading

    metrics = ProcessMetrics(instance_config(tmp_path)[0], "ingest-0")
    done = threading.Event()

    def work() -> None:
        while not done.is_set():
            metrics.observe("final_latency_seconds", 1.0)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=work)
    thread.start()
    try:
        torn = []
        until = time.monotonic() + 3.0
        while time.monotonic() < until:
            for _, _, _, counts, total in metrics.snapshot()["histograms"]:
                if sum(counts) != total:
                    torn.append((sum(counts), total))
    finally:
        done.set()
        thread.join()
        sys.setswitchinterval(switch)
    assert not torn, torn[:5]


def publisher_socket(cfg: Config) -> zmq.Socket:
    """A PUB socket on the instance's metrics endpoint, for snapshots a test makes itself."""
    sock = zmq.Context.instance().socket(zmq.PUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint(cfg))
    return sock


def send_until_heard(sock: zmq.Socket, cfg: Config, collector: Collector, process: str) -> None:
    """A good snapshot of `process` on `sock`, sent until the collector shows it."""
    good = msgpack.packb(ProcessMetrics(cfg, process).snapshot())
    wait_for(lambda: sock.send(good) or process in processes(collector), what=f"the good snapshot of {process!r}")


def test_collector_ignores_malformed_snapshots_and_refuses_a_second_bind(instance, publishers, collector) -> None:
    cfg, config_file = instance
    sock = publisher_socket(cfg)
    heard = partial(send_until_heard, sock, cfg, collector)
    try:
        # The collector hears this socket before any junk goes (a PUB drops what it sends before
        # the subscription arrives), and hears it through: what follows the junk on the same
        # connection arrives after it, so once "after" is shown every piece of junk was read.
        heard("before")
        for junk in (b"\xc1not msgpack", msgpack.packb([1, 2]), msgpack.packb({"v": 1, "process": "x"}),
                     msgpack.packb({"v": 1, "process": "x", "incarnation": "i", "pid": "no", "started": 0, "time": 0,
                                    "counters": [], "gauges": [], "histograms": []}),
                     msgpack.packb({"v": 1, "process": "x", "incarnation": "i", "pid": float("inf"), "started": 0, "time": 0,
                                    "counters": [], "gauges": [], "histograms": []}),
                     # times the page would show as uptime and error times: Infinity is no JSON
                     msgpack.packb({"v": 1, "process": "x", "incarnation": "i", "pid": 7, "started": float("-inf"), "time": 0,
                                    "counters": [], "gauges": [], "histograms": []}),
                     msgpack.packb({"v": 1, "process": "x", "incarnation": "i", "pid": 7, "started": 0, "time": float("nan"),
                                    "counters": [], "gauges": [], "histograms": []})):
            sock.send(junk)
        # a histogram bounded at infinity would make its quantiles Infinity, which is no JSON
        infinite = ProcessMetrics(cfg, "infinite").snapshot()
        infinite["histograms"] = [["partial_latency_seconds", {}, [0.1, math.inf], [1, 1, 0], 0.2]]
        sock.send(msgpack.packb(infinite))
        heard("after")
    finally:
        sock.close()
    assert "x" not in processes(collector) and "infinite" in processes(collector)
    view = wait_for(lambda: (v := collector.snapshot()) and v["latency"]["partial"]["count"] == 0 and v, what="a view")
    json.dumps(view, allow_nan=False)  # strict JSON: the page's parser stops at Infinity
    publishers(config_file, "broker")
    wait_for(lambda: "broker" in processes(collector), what="a good publisher after junk")
    assert "x" not in processes(collector)
    with pytest.raises(RuntimeError, match="already bound"):
        Collector(cfg).start()


def test_a_snapshot_with_an_impossible_pid_or_histogram_neither_stops_the_collector_nor_spoils_its_export(instance) -> None:
    """A pid that is no process's (psutil refuses a negative one, the state file one past 64
    bits) and a histogram without bounds (no bucket to put a quantile in) or with a bound twice
    (two series of one `le` in /metrics) are malformed as a non-finite time is: dropped, while the
    dashboard's collector goes on hearing the rest."""
    cfg, _ = instance
    collector = Collector(cfg, state_file=cfg.metrics_state_path).start()
    sock = publisher_socket(cfg)
    heard = partial(send_until_heard, sock, cfg, collector)
    try:
        heard("before")
        for name, pid in (("negative", -1), ("huge", float(2 ** 64))):
            impossible = ProcessMetrics(cfg, name).snapshot()
            impossible["pid"] = pid
            sock.send(msgpack.packb(impossible))
        boundless = ProcessMetrics(cfg, "boundless")
        for count in (1, 2):  # the first is the process's history; the second, news in the window
            snap = boundless.snapshot()
            snap["histograms"] = [["batch_size", {}, [], [count], float(count)]]
            sock.send(msgpack.packb(snap))
        doubled = ProcessMetrics(cfg, "doubled").snapshot()
        doubled["histograms"] = [["partial_latency_seconds", {}, [0.1, 0.1], [1, 0, 0], 0.05]]
        sock.send(msgpack.packb(doubled))
        heard("after")
        assert not {"negative", "huge"} & set(processes(collector))
        text = collector.prometheus().decode()
        series = [(s.name, tuple(sorted(s.labels.items()))) for f in text_string_to_metric_families(text) for s in f.samples]
        assert len(series) == len(set(series)), sorted(s for s in series if series.count(s) > 1)
        assert "streamasr_partial_latency_seconds_bucket" not in text and "streamasr_batch_size_bucket" not in text
    finally:
        sock.close()
        collector.close()


def test_histograms_bucketed_differently_by_two_releases_add_up(instance, collector) -> None:
    """A rolling upgrade that changes a histogram's buckets: ingest-0 on the old release, ingest-1
    on the new one, then ingest-0 restarted on the new one too. Every observation of both shapes is
    still counted, in the union of their bounds, so `_count` never goes down (a reset to
    Prometheus); before, the sum kept one shape and dropped the other's counts."""
    cfg, _ = instance
    sock = publisher_socket(cfg)
    heard = partial(send_until_heard, sock, cfg, collector)

    def publish(process: str, bounds: list[float], counts: list[int], total: float) -> None:
        snap = ProcessMetrics(cfg, process).snapshot()  # a new incarnation each time
        snap["histograms"] = [["partial_latency_seconds", {}, bounds, counts, total]]
        sock.send(msgpack.packb(snap))

    def exported() -> dict[str, float]:
        return {s.labels.get("le", s.name.rsplit("_", 1)[1]): s.value
                for f in text_string_to_metric_families(collector.prometheus().decode())
                if f.name == "streamasr_partial_latency_seconds" for s in f.samples}

    try:
        heard("before")
        publish("ingest-0", [0.1, 1.0], [3, 0, 0], 0.15)  # the old release: 3 at most 0.1 s
        publish("ingest-1", [0.1, 0.5, 1.0], [0, 2, 0, 0], 0.6)  # the new one: 2 in (0.1, 0.5]
        heard("after")
        assert exported() == pytest.approx({"0.1": 3, "0.5": 5, "1.0": 5, "+Inf": 5, "count": 5, "sum": 0.75})
        publish("ingest-0", [0.1, 0.5, 1.0], [1, 0, 0, 0], 0.05)  # restarted on the new release
        heard("again")
        assert exported() == pytest.approx({"0.1": 4, "0.5": 6, "1.0": 6, "+Inf": 6, "count": 6, "sum": 0.8})
        # the page's window holds the one observation made since the collector first heard them
        latency = wait_for(lambda: (p := collector.snapshot()["latency"]["partial"])["count"] and p, what="the window")
        assert latency["count"] == 1 and 0 < latency["p99"] <= 0.1, latency
    finally:
        sock.close()


def read_request(conn: socket.socket) -> None:
    """Read one HTTP request whole: its headers, then as much body as they announce."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    want = int(length.group(1)) if length else 0
    while len(body) < want:
        chunk = conn.recv(65536)
        if not chunk:
            return
        body += chunk


def test_a_supervisord_socket_that_answers_no_http_is_reported_and_the_collector_lives_on(instance, publishers, collector) -> None:
    """Whatever listens on the supervisord socket (another program, a supervisord of another
    version gone wrong) must not end the collector's thread, which would freeze the dashboard:
    the view says what went wrong and keeps following the processes."""
    cfg, config_file = instance
    cfg.run_path.mkdir(parents=True, exist_ok=True)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(cfg.run_path / "supervisor.sock"))
    server.listen(8)
    stop = threading.Event()

    def answer_garbage() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                read_request(conn)  # all of it: answering before the body leaves would make the error a broken pipe
                conn.sendall(b"garbage, not HTTP\r\n\r\n")

    thread = threading.Thread(target=answer_garbage, daemon=True)
    thread.start()
    try:
        wait_for(lambda: "supervisor_error" in collector.snapshot(), what="the socket's failure in the view")
        publishers(config_file, "broker")
        wait_for(lambda: "broker" in processes(collector), what="a publisher heard after the failures")
        assert "BadStatusLine" in collector.snapshot()["supervisor_error"]
    finally:
        stop.set()
        thread.join(2)
        server.close()


def test_a_supervisord_socket_that_never_answers_does_not_freeze_the_collector(instance, publishers, collector) -> None:
    """A supervisord that takes the request and never answers (stopped, or wedged) must not hold
    the collector's one thread: processes that publish are still heard and the view still moves."""
    cfg, config_file = instance
    cfg.run_path.mkdir(parents=True, exist_ok=True)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(cfg.run_path / "supervisor.sock"))
    server.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def take_and_hold() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=take_and_hold, daemon=True)
    thread.start()
    try:
        wait_for(lambda: held, what="the collector to ask supervisord")
        publishers(config_file, "broker")
        wait_for(lambda: "broker" in processes(collector), what="a publisher heard while supervisord says nothing")
        assert "timed out" in collector.snapshot().get("supervisor_error", ""), collector.snapshot().get("supervisor_error")
    finally:
        stop.set()
        thread.join(2)
        for conn in held:
            conn.close()
        server.close()


def test_histogram_quantiles_follow_prometheus() -> None:
    h = Histogram((0.1, 0.2, 0.4), [0, 10, 10, 0], 4.0)
    assert h.quantile(0.5) == pytest.approx(0.2)
    assert h.quantile(0.75) == pytest.approx(0.3)
    assert Histogram((1.0,), [0, 3], 9.0).quantile(0.5) == 1.0  # beyond the last bound
    assert Histogram((1.0,), [0, 0], 0.0).quantile(0.5) is None


def test_a_job_queued_for_seconds_reads_as_seconds_in_its_transit(instance) -> None:
    """Under overload jobs wait seconds for a worker: that leg's quantiles must say so, not
    stop at a last bucket of 1 s."""
    cfg, _ = instance
    m = ProcessMetrics(cfg, "worker-0")
    for _ in range(20):
        m.observe("job_transit_seconds", 4.0, leg="to_worker")
    [(_, _, bounds, counts, total)] = [h for h in m.snapshot()["histograms"] if h[0] == "job_transit_seconds"]
    assert 3.0 < Histogram(tuple(bounds), counts, total).quantile(0.95) <= 5.0


def test_operations_guide_documents_every_metric() -> None:
    guide = (ROOT / "docs" / "OPERATIONS.md").read_text()
    for name in SPECS:
        assert f"`{name}`" in guide, name


LOG_CALL = re.compile(r"\blog\.(debug|info|warning|error|exception)\(\s*\"([a-z_.]+)\"")
LEVELS = {"exception": "error"}  # log.exception logs at error level
RUN_CALL = re.compile(r"\bsupervised\.run\(\s*\"([a-z_]+)\"")  # a program's main: it logs `<name>.crashed`
THROTTLE = re.compile(r"\bThrottle\(\s*\"([a-z_.]+)\"")  # throttled lines of an event: `<event>_untold` tells the rest


def test_operations_guide_documents_every_log_event() -> None:
    """Every event the service logs is in the guide's table under its program prefix and actual level,
    so the table can be trusted for alerting and for grepping the files."""
    guide = (ROOT / "docs" / "OPERATIONS.md").read_text()
    table = guide[guide.index("## Log events"):]
    rows = {cells[0].strip("`"): cells[2] for line in table.splitlines() if line.startswith("| `")
            for cells in [[c.strip() for c in line.strip("|").split("|")]]}
    logged: dict[str, str] = {}
    sources = [source for package in ("broker", "workers", "ingest", "dashboard", "protocol", "shm")
               for source in (ROOT / package).glob("*.py")]
    for source in [*sources, ROOT / "streamasr" / "revive.py"]:  # the one program of streamasr/
        text = source.read_text()
        for level, event in LOG_CALL.findall(text):
            logged[event] = LEVELS.get(level, level)
        for program in RUN_CALL.findall(text):
            logged[f"{program}.crashed"] = "error"
        for event in THROTTLE.findall(text):
            logged[f"{event}_untold"] = "warning"
    assert len(logged) > 40
    for event, level in logged.items():
        assert event.split(".")[0] in {"broker", "worker", "ingest", "dashboard", "auth", "shm", "revive"}, event
        assert rows.get(event) == level, (event, level, rows.get(event))
    assert set(rows) == set(logged), set(rows) ^ set(logged)


def test_gpu_figures_come_from_nvml_when_it_is_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pynvml is optional, so its path is checked against a stand-in with the same calls."""
    import types

    nvml = types.ModuleType("pynvml")
    nvml.nvmlInit = lambda: None  # type: ignore[attr-defined]
    nvml.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetCount = lambda: 1  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetHandleByIndex = lambda i: f"gpu{i}"  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=37, memory=5)  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=2 << 30, total=80 << 30, free=78 << 30)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    cfg, _ = instance_config(tmp_path)
    collector = Collector(cfg)
    collector.refresh()
    assert collector.snapshot()["gpus"] == [{"gpu": "0", "utilization_percent": 37.0, "memory_used_bytes": 2 << 30,
                                             "memory_total_bytes": 80 << 30}]
    found = samples(collector.prometheus().decode())
    assert found[("streamasr_gpu_utilization_percent", (("gpu", "0"),))] == 37.0
    assert found[("streamasr_gpu_memory_total_bytes", (("gpu", "0"),))] == 80 << 30
    collector.close()


def test_a_gpu_nvml_cannot_read_is_left_out_and_the_others_are_still_shown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML counts GPUs it may not talk to (their handle is refused with NO_PERMISSION) and does
    not report the utilisation of a MIG-enabled GPU (NOT_SUPPORTED): the stand-in has one of each
    beside a GPU that answers."""
    import types

    class NVMLError(Exception):
        pass

    def handle(i: int) -> str:
        if i == 0:
            raise NVMLError("Insufficient Permissions")
        return f"gpu{i}"

    def utilization(h: str) -> types.SimpleNamespace:
        if h == "gpu1":
            raise NVMLError("Not Supported")
        return types.SimpleNamespace(gpu=37, memory=5)

    nvml = types.ModuleType("pynvml")
    nvml.nvmlInit = lambda: None  # type: ignore[attr-defined]
    nvml.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetCount = lambda: 3  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetHandleByIndex = handle  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetUtilizationRates = utilization  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=2 << 30, total=80 << 30, free=78 << 30)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    cfg, _ = instance_config(tmp_path)
    collector = Collector(cfg)
    collector.refresh()
    collector.refresh()
    assert collector.snapshot().get("gpus") == [{"gpu": "2", "utilization_percent": 37.0, "memory_used_bytes": 2 << 30,
                                                 "memory_total_bytes": 80 << 30}]
    assert samples(collector.prometheus().decode())[("streamasr_gpu_utilization_percent", (("gpu", "2"),))] == 37.0
    collector.close()


def test_no_gpu_figures_without_nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails, as where it is not installed
    cfg, _ = instance_config(tmp_path)
    collector = Collector(cfg)
    collector.refresh()
    assert "gpus" not in collector.snapshot() and "streamasr_gpu" not in collector.prometheus().decode()
    collector.close()
