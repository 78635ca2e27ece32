"""What one speaking stream costs the workers, kept in the run directory across restarts, and
what it is taken to cost before anything was measured.

Admission multiplies that share by the streams open. A broker that has just started has measured
nothing, and the clients of a restarted service come back at once: with the share of the last
run, that herd is cut where the last run's streams say instead of being admitted whole. The
share is kept only for the same model settings (another model or precision costs otherwise), the
same number of workers (it is a share of their time) and partial interval (partials are most of it), and
is measured anew as soon as streams speak. Where no run has measured it (a first start, other
model settings, a lost run directory), each part is priced from what the workers' decodes cost
when they started (`prior_share`), so a first burst is cut too; and a part measured only with
the workers to themselves counts at no less than that price.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass

import structlog

from config.settings import Config

log = structlog.get_logger()

FILE = "admission.json"
SAVE_EVERY_S = 1.0  # a broker killed mid-run leaves figures at most this old
# Seconds of speech one final covers, for the prior: what the bench's speech and the dev set
# measured. Longer segments ask for fewer finals, which makes the prior cautious; streams of
# one-word answers ask for more than it assumes.
PRIOR_SPEECH_PER_FINAL_S = 3.0


@dataclass(slots=True)
class Figures:
    share: list[float]  # of the workers' time, one speaking realtime stream's partials and finals ask for
    decode_cost: list[float]  # seconds per partial, per final
    loaded_cost: list[float]  # the same with the workers busy (0: not measured yet)

    @property
    def stream_share(self) -> float:
        return sum(self.share)

    @property
    def parts(self) -> tuple[list[float], list[float], list[float]]:
        return self.share, self.decode_cost, self.loaded_cost

    def usable(self) -> bool:
        """Every part finite and not negative: JSON may hold NaN and Infinity, and a cost or a
        share is never negative."""
        return all(math.isfinite(x) and x >= 0 for part in self.parts for x in part)

    def copy(self) -> Figures:
        return Figures(*(list(part) for part in self.parts))


def prior_share(costs: list[tuple[float, float]], workers: int, partial_interval_s: float, min_silence_s: float) -> list[float]:
    """The share of `workers` workers' time one speaking stream asks for, as `Figures.share`,
    from what a partial and a final decode cost the workers that reported it when they started:
    a segment of PRIOR_SPEECH_PER_FINAL_S asks for a partial every partial interval until the
    silence that ends it, and for one final."""
    if not costs or not workers:
        return [0.0, 0.0]
    partial_s, final_s = (sum(c[i] for c in costs) / len(costs) for i in (0, 1))
    speech_s = PRIOR_SPEECH_PER_FINAL_S
    partials_per_s = (speech_s + min_silence_s) / partial_interval_s / speech_s
    return [partials_per_s * partial_s / workers, final_s / speech_s / workers]


class SavedFigures:
    """The broker's admission figures in `run_path/admission.json`, keyed by the model settings
    and by what the share is a share of: the workers' time (their number) and the partials
    asked for (their interval)."""

    def __init__(self, cfg: Config) -> None:
        self._path = cfg.run_path / FILE
        self._model = json.loads(json.dumps(asdict(cfg.model)))  # as it reads back from the file
        self._pool = {"workers": cfg.worker_count, "partial_interval_ms": cfg.ingest.partial_interval_ms}
        self._saved: Figures | None = None
        self._saved_at = 0.0

    def load(self) -> Figures | None:
        """The last run's figures, if it served the same model settings with as many workers and partials."""
        try:
            data = json.loads(self._path.read_text())
            if not isinstance(data, dict):  # valid JSON of another shape is as unreadable as a torn file
                raise ValueError(f"a JSON {type(data).__name__}, not an object")
            if data.get("model") != self._model:
                return None
            lists = [data[key] for key in ("share", "decode_cost", "loaded_cost")]
            if not all(isinstance(x, list) for x in lists):  # a string would be read a character at a time
                raise ValueError("figures that are not lists")
            figures = Figures(*([float(x) for x in part] for part in lists))
            saved = float(data.get("saved", 0))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, OverflowError) as exc:  # float(10**400): OverflowError
            log.warning("broker.admission_figures_unreadable", path=str(self._path), error=repr(exc))
            return None
        if not figures.usable():
            log.warning("broker.admission_figures_unreadable", path=str(self._path), error="figures not finite or negative")
            return None
        if figures.stream_share <= 0 or any(len(x) != 2 for x in figures.parts) or data.get("pool") != self._pool:
            return None
        self._saved = figures.copy()  # the broker goes on to change the figures it is given in place
        log.info("broker.admission_figures_restored", stream_share=round(figures.stream_share, 4),
                 age_s=round(time.time() - saved, 1))
        return figures

    def save(self, figures: Figures, now: float, at_once: bool = False) -> None:
        """Written when they changed, at most every SAVE_EVERY_S unless `at_once`; atomically, so
        a crash leaves the old file."""
        if figures == self._saved or figures.stream_share <= 0 or (not at_once and now - self._saved_at < SAVE_EVERY_S):
            return
        if not figures.usable():  # keep the last good file
            return
        tmp = self._path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps({"model": self._model, "pool": self._pool, "share": figures.share,
                                       "decode_cost": figures.decode_cost, "loaded_cost": figures.loaded_cost,
                                       "saved": time.time()}, allow_nan=False))
            os.replace(tmp, self._path)
        except OSError as exc:
            log.warning("broker.admission_figures_unsaved", path=str(self._path), error=repr(exc))
        self._saved = figures.copy()
        self._saved_at = now
