"""`streamasr bench --tracemalloc`: mark the service's processes three times under steady load and
read what each kept (metrics.allocwatch): growth between the second and third mark, per audio frame
and per job, is what the hot path keeps; the level at the second mark is what is in flight; the
peak between them is the most the work in that interval allocated at once."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

SERVING = ("broker", "ingest", "worker")  # the processes that arm allocwatch; others would die of SIGUSR1


@dataclass
class AllocationMarks:
    directory: Path
    pids: dict[str, int]
    jobs_done: Callable[[], int | None]  # the broker's count of answered jobs
    marks: list[tuple[float, int | None]] = field(default_factory=list)  # (time, jobs done)
    _timers: list[threading.Timer] = field(default_factory=list)

    @property
    def targets(self) -> dict[str, int]:
        return {name: pid for name, pid in self.pids.items() if name.startswith(SERVING)}

    def schedule(self, times: list[float]) -> None:
        """Mark at these monotonic times (the bench spreads three over the middle of its load)."""
        for old in self.directory.glob("*.json"):  # an earlier run's reports (a sweep runs several)
            old.unlink()
        for when in times:
            timer = threading.Timer(max(0.0, when - time.monotonic()), self._mark)
            timer.daemon = True
            timer.start()
            self._timers.append(timer)

    def _mark(self) -> None:
        self.marks.append((time.monotonic(), self.jobs_done()))
        for pid in self.targets.values():
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass

    def collect(self, streams: int, frame_ms: float, timeout: float = 30.0) -> dict[str, Any] | None:
        """Per process: blocks and bytes held at the second and third marks (against the first),
        and the growth between them per frame and per job."""
        for timer in self._timers:
            timer.join()
        if len(self.marks) < 3:
            return None
        files = {name: (self.directory / f"{name}-1.json", self.directory / f"{name}-2.json") for name in self.targets}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not all(p.exists() for pair in files.values() for p in pair):
            time.sleep(0.2)
        (_, _), (t2, jobs2), (t3, jobs3) = self.marks[:3]
        frames = round(streams * (t3 - t2) * 1000 / frame_ms)
        jobs = jobs3 - jobs2 if jobs2 is not None and jobs3 is not None else None
        per_process = {}
        for name, (second, third) in files.items():
            if not (second.exists() and third.exists()):
                continue
            a, b = json.loads(second.read_text()), json.loads(third.read_text())
            growth = b["blocks"] - a["blocks"]
            per_process[name] = {
                "held_blocks": [a["blocks"], b["blocks"]], "held_bytes": [a["bytes"], b["bytes"]],
                "growth_blocks": growth, "growth_bytes": b["bytes"] - a["bytes"],
                "growth_blocks_per_frame": round(growth / frames, 4) if frames else None,
                "growth_blocks_per_job": round(growth / jobs, 3) if jobs else None,
                "peak_bytes": b["peak_bytes"],
                "top": b["top"],
            }
        return {"interval_s": round(t3 - t2, 2), "frames": frames, "jobs": jobs, "per_process": per_process}
