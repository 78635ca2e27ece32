"""metrics.gcwatch: the start-up heap is frozen and every later collection lands in `gc_pause_seconds`
and `gc_cpu_seconds` by generation. In a child process: freezing and GC callbacks are process-wide and must not leak
into the test runner. No timing thresholds: only that pauses are counted and non-negative."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

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
