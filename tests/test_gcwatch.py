"""metrics.gcwatch: the start-up heap is frozen and every later collection lands in `gc_pause_seconds`
and `gc_cpu_seconds` by generation. In a child process: freezing and GC callbacks are process-wide and must not leak
into the test runner. No timing thresholds: only that pauses are counted and non-negative."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import zmq

from config import settings
from conftest import ROOT
from metrics.registry import endpoint

CHILD = """
import gc, json, sys
from config import settings
from metrics.gcwatch import freeze_and_watch
from metrics.registry import ProcessMetrics

cfg = settings.load(None, {"instance": "gcwatch", "run_dir": sys.argv[1]})
metrics = ProcessMetrics(cfg, "worker-0")  # not started: nothing is published, the snapshot is read here
freeze_and_watch(metrics)
frozen = gc.get_freeze_count()
gc.collect(0)
gc.collect(2)
hists = [h for h in metrics.snapshot()["histograms"] if h[0] in ("gc_pause_seconds", "gc_cpu_seconds")]
print(json.dumps({"frozen": frozen, "hists": hists}))
"""


def test_collections_after_freeze_are_timed_by_generation(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    assert out["frozen"] > 0  # the start-up heap is out of the collector's reach
    for name in ("gc_pause_seconds", "gc_cpu_seconds"):
        assert {"0", "2"} <= {h[1]["generation"] for h in out["hists"] if h[0] == name}, name
    for _, _, bounds, counts, total in out["hists"]:
        assert len(counts) == len(bounds) + 1 and sum(counts) >= 1 and total >= 0


# Publishes every 20 ms while collections run at every allocation, so that some land while the
# publisher thread copies its own store (where gcwatch's callback records them); then says whether
# the collector still frees a cycle.
PUBLISHING_CHILD = """
import gc, json, sys, time, weakref
from config import settings
from metrics.gcwatch import freeze_and_watch
from metrics.registry import ProcessMetrics

class Node:
    pass

cfg = settings.load(None, {"instance": "gcwatch", "run_dir": sys.argv[1]})
metrics = ProcessMetrics(cfg, "worker-0", interval=0.02)
freeze_and_watch(metrics)
gc.set_threshold(1)
metrics.start()
time.sleep(1.5)
node = Node()
node.self = node
gone = weakref.ref(node)
del node
gc.collect()
print(json.dumps({"cycle_freed": gone() is None}))
"""


def test_collections_while_the_publisher_copies_its_own_figures_neither_stop_publishing_nor_the_collector(
        tmp_path: Path) -> None:
    cfg = settings.load(None, {"instance": "gcwatch", "run_dir": str(tmp_path)})
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(endpoint(cfg))
    proc = subprocess.Popen([sys.executable, "-c", PUBLISHING_CHILD, str(tmp_path)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seqs = []
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            if sub.poll(100):
                seqs.append(msgpack.unpackb(sub.recv())["seq"])
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        sub.close()
    assert proc.returncode == 0, err[-4000:]
    assert json.loads(out)["cycle_freed"]  # a process whose collector is stuck keeps all its cyclic garbage
    assert len(seqs) >= 10, seqs  # about 75 in 1.5 s: publishing went on
