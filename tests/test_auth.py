"""CurveZMQ on the client-facing sockets, and the file modes that guard the local ones.

With keys configured, both the front door and the ingest ROUTER speak CURVE: a client whose
public key is in the authorized directory works as before; one with another key, or none, gets
no answer at all and the refusal is logged. The ipc sockets between processes are guarded by the
run directory's mode (0700) and the audio by the shm segments' (0600).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator

import pytest
import zmq
import zmq.auth

from config import settings
from conftest import ROOT, Service
from streamasr.service import free_ports
from protocol import messages as m
from protocol.auth import apply_client_curve, read_key_pair, read_public_key
from shm import pool
from streaming import StreamClient, hello, read_wav, speech_files

Curve = Callable[[zmq.Socket], None]


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """server key pair, an authorized client and an intruder; only the client's public key is listed."""
    root = tmp_path_factory.mktemp("keys")
    for name in ("server", "client", "intruder"):
        zmq.auth.create_certificates(root, name)
    (root / "authorized").mkdir()
    shutil.copy(root / "client.key", root / "authorized" / "client.key")
    return root


def curve_for(keys: Path, who: str) -> Curve:
    server_public = read_public_key(keys / "server.key")
    _, secret = read_key_pair(keys / f"{who}.key_secret")
    return lambda sock: apply_client_curve(sock, server_public, secret)


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory, keys: Path) -> Iterator[Service]:
    """A null-model service with CURVE on; ready when an authorized hello is welcomed (the plain
    status query of the test harness cannot get through, which is the point)."""
    tmp = tmp_path_factory.mktemp("auth")
    base = free_ports(2)
    instance = f"t{uuid.uuid4().hex[:8]}"
    cfg = settings.load(None, {
        "instance": instance, "run_dir": str(tmp / instance),
        "model": {"name": "null", "backend": "null"}, "workers": {"processes": 1},
        "ingest": {"address": f"tcp://127.0.0.1:{base}", "port_base": base + 1, "processes": 1,
                   "curve_secret_key": str(keys / "server.key_secret"),
                   "curve_authorized_keys": str(keys / "authorized")},
        "broker": {"heartbeat_ms": 250},
    })
    config_file = tmp / f"{instance}.toml"
    config_file.write_text(settings.dump(cfg))
    env = {**os.environ, "STREAMASR_CONFIG": str(config_file)}
    env.pop("STREAMASR_RUN_DIR", None)
    proc = subprocess.Popen([sys.executable, "-m", "streamasr.cli", "serve"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    service = Service(cfg, proc, config_file)
    try:
        hello(cfg.ingest.address, timeout=120, curve=curve_for(keys, "client"))
    except BaseException:
        service.stop()
        raise
    yield service
    service.stop()
    assert pool.segments(instance) == []


def unanswered(endpoint: str, curve: Curve | None, wait_s: float = 3.0) -> bool:
    """True when a hello to `endpoint` gets no reply at all."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        curve(sock)
    sock.connect(endpoint)
    try:
        sock.send_multipart(m.encode(m.Hello()))
        return not sock.poll(int(wait_s * 1000))
    finally:
        sock.close()


def test_authorized_client_streams(secured: Service, keys: Path) -> None:
    curve = curve_for(keys, "client")
    pcm = read_wav(speech_files()[0])
    result = StreamClient(secured.address, pcm, "secret", speed=None, curve=curve).run()
    assert result.errors == [] and result.closed is not None and result.closed.reason == "end" and result.finals


def test_unauthorized_clients_refused_and_logged(secured: Service, keys: Path) -> None:
    ingest = hello(secured.address, curve=curve_for(keys, "client")).ingest
    intruder = curve_for(keys, "intruder")
    intruder_key = read_public_key(keys / "intruder.key").decode()
    for endpoint, program in ((secured.address, "broker"), (ingest, "ingest-0")):
        assert unanswered(endpoint, intruder), f"{program} answered an unauthorized key"
        assert unanswered(endpoint, None), f"{program} answered a client without CURVE"
        deadline = time.monotonic() + 30
        while intruder_key not in secured.logs(program) and time.monotonic() < deadline:
            time.sleep(0.1)
        refusals = [line for line in secured.logs(program).splitlines() if '"auth.refused"' in line]
        assert any(intruder_key in line for line in refusals), f"{program} did not log the refusal"


def test_local_permissions(secured: Service) -> None:
    run = secured.cfg.run_path
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    assert {"broker-ingest.sock", "broker-workers.sock"} <= {p.name for p in run.glob("*.sock")}
    for name in pool.segments(secured.cfg.instance):
        assert stat.S_IMODE((pool.SHM_DIR / name).stat().st_mode) == 0o600, name


def test_half_a_curve_configuration_is_refused() -> None:
    from protocol.auth import curve_settings

    with pytest.raises(ValueError):
        curve_settings("server.key_secret", "")
    assert curve_settings("", "") is False
