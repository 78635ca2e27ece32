"""Fixtures that start the real service: supervisord, broker, ingest and worker processes.

Each service gets its own instance name, run directory and free loopback ports, so tests can
run several side by side and a leftover from one test cannot satisfy another.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from config import settings
from config.settings import Config
from shm import pool

ROOT = Path(__file__).resolve().parents[1]


def free_ports(count: int) -> int:
    """A base port with `count` consecutive free ports on loopback."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count >= 65535:
            continue
        ok = True
        for port in range(base + 1, base + count):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port range")


@dataclass
class Service:
    cfg: Config
    proc: subprocess.Popen
    config_file: Path

    @property
    def address(self) -> str:
        return self.cfg.ingest.address

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run the `streamasr` CLI against this instance."""
        return subprocess.run([sys.executable, "-m", "streamasr.cli", *args], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, "STREAMASR_CONFIG": str(self.config_file)})

    def logs(self, program: str) -> str:
        path = self.cfg.run_path / "logs" / f"{program}.log"
        return path.read_text() if path.exists() else ""

    def stop(self, timeout: float = 40) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_service(tmp: Path, model: str = "whisper-tiny.en", workers: int = 2, ingests: int = 1,
                  ready_timeout: float = 180, **sections: dict[str, Any]) -> Service:
    from streamasr import service as svc

    base = free_ports(ingests + 2)  # front door, ingest processes, dashboard
    instance = f"t{uuid.uuid4().hex[:8]}"
    over: dict[str, Any] = {
        "instance": instance,
        "run_dir": str(tmp / instance),
        "model": {"name": model, "backend": "null" if model == "null" else "onnxruntime"},
        "workers": {"processes": workers},
        "ingest": {"address": f"tcp://127.0.0.1:{base}", "port_base": base + 1, "processes": ingests},
        "broker": {"heartbeat_ms": 250},
        "metrics": {"dashboard_port": base + 1 + ingests},
    }
    for section, values in sections.items():
        over = settings.merge(over, {section: values})
    cfg = settings.load(None, over)
    config_file = tmp / f"{instance}.toml"
    config_file.write_text(settings.dump(cfg))
    env = {**os.environ, "STREAMASR_CONFIG": str(config_file)}
    env.pop("STREAMASR_RUN_DIR", None)
    proc = subprocess.Popen([sys.executable, "-m", "streamasr.cli", "serve"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    service = Service(cfg, proc, config_file)
    deadline = time.monotonic() + ready_timeout
    report: dict[str, Any] = {}
    while time.monotonic() < deadline and proc.poll() is None:
        report = svc.status(cfg)
        if report.get("ready") and len(report.get("ingests", [])) >= ingests and len(report.get("workers", [])) >= workers:
            return service
        time.sleep(0.25)
    service.stop()
    raise RuntimeError(f"service did not become ready: {report}\n{proc.stderr.read() if proc.stderr else ''}")


@pytest.fixture
def service_factory(tmp_path: Path) -> Iterator[Callable[..., Service]]:
    """Start services for one test; all are stopped and checked for leftover shm afterwards."""
    started: list[Service] = []

    def make(**kwargs: Any) -> Service:
        svc = start_service(tmp_path, **kwargs)
        started.append(svc)
        return svc

    yield make
    for svc in started:
        svc.stop()
        assert pool.segments(svc.cfg.instance) == [], "shm segments left after shutdown"


@pytest.fixture(scope="session")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """One real service (Whisper tiny.en on ONNX Runtime, 2 workers) shared by the end-to-end tests."""
    svc = start_service(tmp_path_factory.mktemp("svc"), model="whisper-tiny.en", workers=2)
    yield svc
    svc.stop()
    assert pool.segments(svc.cfg.instance) == []


@pytest.fixture(scope="session")
def null_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """The pipeline with the model-free backend: fast tests of protocol and process behaviour."""
    svc = start_service(tmp_path_factory.mktemp("nullsvc"), model="null", workers=2)
    yield svc
    svc.stop()
    assert pool.segments(svc.cfg.instance) == []
