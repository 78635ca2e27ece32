"""What a serving process allocates and keeps, for `streamasr bench --tracemalloc`.

With $STREAMASR_TRACEMALLOC naming a directory, a process traces its Python allocations
(tracemalloc) once start-up is done. SIGUSR1 marks: the first takes a baseline snapshot (so does the
first after the bench removed the reports: a sweep's next run); each later one takes another and
writes its difference from the baseline to <directory>/<process>-<k>.json —
the blocks and bytes allocated since the baseline and still held, and the source lines that hold
most of them. Under steady load what is in flight (queued messages, a decode's arrays) is about
the same at every mark, so the bench compares two later marks: a hot path that keeps nothing per
frame or per job shows no growth between them, whatever it allocates and frees on the way.
Each report also gives the peak: the most the process traced between the previous mark and this
one above what it traced when the previous mark was done. Snapshots show only what is held; the
peak shows what the work in between allocated and freed at its largest (a decode's arrays).
Without the variable nothing is traced and SIGUSR1 keeps its default meaning.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sysconfig
import tracemalloc
from pathlib import Path
from typing import Any

ENV = "STREAMASR_TRACEMALLOC"
ROOT = Path(__file__).resolve().parents[1]
STDLIB = Path(sysconfig.get_paths()["stdlib"])
FRAMES = 8  # traceback depth: enough to tell the caller of a shared helper
TOP = 12  # source lines listed per report


def _snapshot() -> tracemalloc.Snapshot:
    """What is held now: cyclic garbage collected first (it is not kept, only not yet freed), and
    neither tracing's own objects nor imports counted."""
    gc.collect()
    return tracemalloc.take_snapshot().filter_traces((
        tracemalloc.Filter(False, tracemalloc.__file__),
        tracemalloc.Filter(False, __file__),
        tracemalloc.Filter(False, "<frozen importlib._bootstrap>"),
        tracemalloc.Filter(False, "<frozen importlib._bootstrap_external>"),
    ))


def _where(frame: tracemalloc.Frame) -> str:
    """file:line, relative to site-packages, the source tree or the standard library."""
    path = Path(frame.filename)
    if "site-packages" in path.parts:
        name = frame.filename.rpartition("site-packages/")[2]
    elif path.is_relative_to(ROOT):
        name = str(path.relative_to(ROOT))
    elif path.is_relative_to(STDLIB):
        name = f"<stdlib>/{path.relative_to(STDLIB)}"
    else:
        name = path.name
    return f"{name}:{frame.lineno}"


def report(process: str, base: tracemalloc.Snapshot, now: tracemalloc.Snapshot, peak_bytes: int = 0) -> dict[str, Any]:
    """Held-allocation difference between two snapshots, totals and the largest source lines."""
    diff = now.compare_to(base, "lineno")
    top = sorted(diff, key=lambda d: (-abs(d.count_diff), -abs(d.size_diff)))[:TOP]
    return {
        "process": process,
        "blocks": sum(d.count_diff for d in diff),
        "bytes": sum(d.size_diff for d in diff),
        "traced_bytes": tracemalloc.get_traced_memory()[0],
        "peak_bytes": peak_bytes,
        "top": [{"where": _where(d.traceback[0]), "blocks": d.count_diff, "bytes": d.size_diff}
                for d in top if d.count_diff or d.size_diff],
    }


def arm(process: str) -> None:
    """Start tracing and answer SIGUSR1 marks when the bench asked for it; call from the main thread."""
    directory = os.environ.get(ENV)
    if not directory:
        return
    out = Path(directory)
    tracemalloc.start(FRAMES)
    report(process, _snapshot(), _snapshot())  # imports what comparing and reporting need, before any mark
    baseline: list[tracemalloc.Snapshot] = []
    marks = 0
    level = 0  # traced when the last mark was done

    def mark(_signum: int, _frame: Any) -> None:
        nonlocal marks, level
        peak = tracemalloc.get_traced_memory()[1] - level  # before the snapshot: it is traced too
        snap = _snapshot()
        if marks and not (out / f"{process}-{marks}.json").exists():
            # the bench cleared the reports: another run of a sweep, whose first mark is its own baseline
            baseline.clear()
            marks = 0
        if not baseline:
            baseline.append(snap)
        else:
            marks += 1
            tmp = out / f".{process}-{marks}.json.tmp"
            tmp.write_text(json.dumps(report(process, baseline[0], snap, peak), indent=1))
            tmp.replace(out / f"{process}-{marks}.json")  # the bench never reads half a file
        del snap
        level = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()

    signal.signal(signal.SIGUSR1, mark)
