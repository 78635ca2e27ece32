"""Settings as an operator writes them: every value is held to its type and range on load."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import Any

import pytest

from config import settings
from config.settings import Config, ConfigError


def test_the_embedded_default_and_its_file_agree() -> None:
    """config/default.toml is what `serve` runs with; it must hold every key to the same values
    as the dataclasses' defaults, or the documented defaults and the running ones differ."""
    assert settings.load() == Config()


@pytest.mark.parametrize(("overrides", "message"), [
    ({"model": {"beam_size": 0}}, "model.beam_size must be 1 or more, not 0"),
    ({"model": {"max_wait_ms": "5"}}, "model.max_wait_ms must be a number, not '5'"),
    ({"model": {"arena": 1}}, "model.arena must be true or false, not 1"),
    ({"model": {"partial_window": "half"}}, "model.partial_window must be one of 'short', 'full', not 'half'"),
    ({"model": {"backend": "cuda"}}, "model.backend must be one of 'onnxruntime', 'tensorrt', 'null', not 'cuda'"),
    ({"ingest": {"processes": True}}, "ingest.processes must be an integer, not True"),
    ({"ingest": {"port_base": 70000}}, "ingest.port_base must be between 1 and 65535, not 70000"),
    ({"ingest": {"admit_max_busy": 1.5}}, "ingest.admit_max_busy must be between 0 and 1, not 1.5"),
    ({"ingest": {"admit_max_realtime_streams": -1}}, "ingest.admit_max_realtime_streams must be 0 or more, not -1"),
    ({"vad": {"threshold": math.nan}}, "vad.threshold must be between 0 and 1, not nan"),
    ({"workers": {"stuck_after_s": -1}}, "workers.stuck_after_s must be 0 or more, not -1"),
    ({"shm": 60}, "shm must be a table ([shm])"),
    ({"run_dir": 3}, "run_dir must be a string, not 3"),
    ({"ingest": {"adress": "tcp://127.0.0.1:7700"}}, "unknown config key ingest.adress"),
])
def test_a_value_that_cannot_work_names_its_key(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        settings.load(None, overrides)
    assert str(refused.value) == message


def test_values_within_their_ranges_load_as_written(tmp_path: Path) -> None:
    path = tmp_path / "streamasr.toml"
    path.write_text('[model]\nmax_wait_ms = 2\nprecision = "int8"\npartial_precision = ""\n'
                    "[vad]\nthreshold = 1.0\n[ingest]\nadmit_max_busy = 0\n[workers]\nprocesses = 0\nstuck_after_s = 0\n")
    cfg = settings.load(path)
    assert cfg.model.max_wait_ms == 2 and cfg.model.partials_precision == "int8"  # an integer where a number is asked
    assert (cfg.vad.threshold, cfg.ingest.admit_max_busy, cfg.workers.processes) == (1.0, 0, 0)
    assert cfg.workers.stuck_after_s == 0 and Config().workers.stuck_after_s == 60.0  # 0: the watchdog is off


def test_a_dumped_config_loads_back_the_same() -> None:
    """`serve` hands every process the settings it checked, as the file it dumped."""
    cfg = settings.load(None, {"model": {"name": "null", "backend": "null"}, "ingest": {"admit_max_realtime_streams": 4}})
    assert settings.load(None, tomllib.loads(settings.dump(cfg))) == cfg
