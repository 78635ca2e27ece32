"""`streamasr bench-model` runs the dev set and reports well-formed figures (no speed asserted)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_model_reports_each_engine(tmp_path):
    out = tmp_path / "bm.json"
    proc = subprocess.run([sys.executable, "-m", "streamasr.cli", "bench-model", "--engines", "ours-int8", "--threads", "1",
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    [run] = report["runs"]
    assert run["engine"] == "ours-int8" and report["utterances"] == len(run["latency_s"]) >= 10
    assert 0 < run["rtf"] and run["wer"] <= 0.10
    peak = run["traced_peak_kib"]
    assert 0 < peak["median"] <= peak["max"]
    assert "ours-int8" in proc.stdout and "traced peak KiB" in proc.stdout
