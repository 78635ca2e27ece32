"""Fixtures that start the real service: supervisord, broker, ingest and worker processes.

Each service gets its own instance name, run directory and free loopback ports, so tests can
run several side by side and a leftover from one test cannot satisfy another.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xmlrpc.client
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from config import settings
from shm import pool
from streamasr.service import LocalService, launch

ROOT = Path(__file__).resolve().parents[1]


class Service(LocalService):
    def cli(self, *args: str, timeout: float = 60, **options: Any) -> subprocess.CompletedProcess:
        """Run the `streamasr` CLI against this instance; `options` go to subprocess.run (its output
        is captured unless they say where it goes)."""
        options.setdefault("stdout", subprocess.PIPE)
        options.setdefault("stderr", subprocess.PIPE)
        return subprocess.run([sys.executable, "-m", "streamasr.cli", *args], text=True, timeout=timeout,
                              env={**os.environ, "STREAMASR_CONFIG": str(self.config_file)}, **options)

    def supervisor(self) -> Any:
        """supervisord's XML-RPC namespace, with no timeout: stopping a program waits for it to end."""
        from supervisor.xmlrpc import SupervisorTransport

        return xmlrpc.client.ServerProxy("http://127.0.0.1", transport=SupervisorTransport(
            None, None, f"unix://{self.cfg.run_path / 'supervisor.sock'}")).supervisor

    def events(self, program: str) -> list[dict[str, Any]]:
        """Every JSON line of a program's log."""
        return [json.loads(line) for line in self.logs(program).splitlines() if line.startswith("{")]


def start_service(tmp: Path, model: str = "whisper-tiny.en", workers: int = 2, ingests: int = 1,
                  ready_timeout: float = 180, model_options: dict[str, Any] | None = None,
                  **sections: dict[str, Any]) -> Service:
    """`streamasr serve` on free ports; `sections` are config tables merged on top (e.g. vad={...})."""
    over: dict[str, Any] = {
        "model": {"name": model, "backend": "null" if model == "null" else "onnxruntime", **(model_options or {})},
        "workers": {"processes": workers},
        "ingest": {"processes": ingests},
        "broker": {"heartbeat_ms": 250},
    }
    for section, values in sections.items():
        over = settings.merge(over, {section: values})
    service = launch(tmp, over, ready_timeout, cls=Service)
    assert isinstance(service, Service)
    return service


@contextmanager
def running(tmp: Path, **kwargs: Any) -> Iterator[Service]:
    """A service for the block; afterwards it is stopped and must have removed its shm segments."""
    svc = start_service(tmp, **kwargs)
    try:
        yield svc
    finally:
        svc.stop()
    assert pool.segments(svc.cfg.instance) == [], "shm segments left after shutdown"


@pytest.fixture
def service_factory(tmp_path: Path) -> Iterator[Callable[..., Service]]:
    """Start services for one test; all are stopped and checked for leftover shm afterwards."""
    started: list[Service] = []

    def make(**kwargs: Any) -> Service:
        svc = start_service(tmp_path, **kwargs)
        started.append(svc)
        return svc

    yield make
    # every service is stopped even when stopping one fails, then each is checked
    errors: list[BaseException] = []
    for svc in started:
        try:
            svc.stop()
        except Exception as exc:  # reported below, once the others are stopped too
            errors.append(exc)
    assert not errors, f"stopping a service failed: {errors!r}"
    for svc in started:
        assert pool.segments(svc.cfg.instance) == [], f"shm segments of {svc.cfg.instance} left after shutdown"


@pytest.fixture(scope="session")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """One real service (Whisper tiny.en on ONNX Runtime, 2 workers) shared by the end-to-end tests.

    Several of them open more realtime streams at once than two cores serve, on purpose (finals
    stay accurate under overload, faults mid-load), on a service earlier tests have warmed: the
    busy figure, which cuts such a burst at one stream's measured share, is off here and tested
    on services of its own (test_overload.py)."""
    with running(tmp_path_factory.mktemp("svc"), model="whisper-tiny.en", workers=2, ingest={"admit_max_busy": 0}) as svc:
        yield svc


@pytest.fixture(scope="session")
def null_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """The pipeline with the model-free backend: fast tests of protocol and process behaviour."""
    with running(tmp_path_factory.mktemp("nullsvc"), model="null", workers=2) as svc:
        yield svc
