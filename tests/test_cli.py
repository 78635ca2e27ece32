"""The command line as a shell uses it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import zmq
import zmq.auth
from conftest import ROOT

from shm import pool
from streamasr.service import free_ports


def test_a_reader_that_goes_away_ends_the_command_quietly() -> None:
    """`streamasr status | head -1`: once the reader has closed the pipe, the command stops without a
    traceback on stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "streamasr.cli", "status", "--instance", "nosuchinstance"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1
    assert stderr == ""


def _streamasr(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "streamasr.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("setting", "named"), [
    ('[model]\nmax_batch = "4"\n', "model.max_batch must be an integer, not '4'"),
    ('[model]\nprecision = "fp16"\n', "model.precision must be one of 'fp32', 'int8', not 'fp16'"),
    ("[broker]\nliveness = 0\n", "broker.liveness must be 1 or more, not 0"),
    ('log_level = "verbose"\n', "log_level must be one of"),
    ("[ingest]\nmax_frame_byte = 100\n", "unknown config key ingest.max_frame_byte"),
    ("[vad\n", "config file"),
])
def test_a_setting_that_cannot_work_is_refused_before_anything_starts(tmp_path: Path, setting: str, named: str) -> None:
    """Each process of the service reads the same file: one that fails at start is a service
    whose processes fail over and over. `serve` names the setting and starts nothing."""
    config = tmp_path / "streamasr.toml"
    config.write_text(f'run_dir = "{tmp_path / "run"}"\ninstance = "badconfig"\n{setting}')
    done = _streamasr("serve", "--config", str(config), "--model", "null")
    assert done.returncode == 2
    assert named in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()


def test_an_unknown_model_is_refused_before_anything_starts(tmp_path: Path) -> None:
    config = tmp_path / "streamasr.toml"
    config.write_text(f'run_dir = "{tmp_path / "run"}"\ninstance = "badmodel"\n')
    for command in ("serve", "export"):
        done = _streamasr(command, "--config", str(config), "--model", "whisper-huge.xx")
        assert done.returncode == 2
        assert "unknown model 'whisper-huge.xx'" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()
    done = _streamasr("status", "--config", str(tmp_path / "missing.toml"))
    assert done.returncode == 2 and "missing.toml" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_an_address_in_use_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """A process whose port is taken would fail at start over and over under supervisord, with
    nothing said where `serve` was run: serve names the address instead, and starts nothing."""
    base = free_ports(3)
    holder = zmq.Context.instance().socket(zmq.ROUTER)
    holder.bind(f"tcp://127.0.0.1:{base + 1}")  # the ingest process's
    try:
        config = tmp_path / "streamasr.toml"
        config.write_text(f'run_dir = "{tmp_path / "run"}"\ninstance = "portbusy"\n[ingest]\n'
                          f'address = "tcp://127.0.0.1:{base}"\nport_base = {base + 1}\n[metrics]\ndashboard_port = {base + 2}\n')
        done = _streamasr("serve", "--config", str(config), "--model", "null")
    finally:
        holder.close(linger=0)
    assert done.returncode == 1
    assert f"cannot bind tcp://127.0.0.1:{base + 1} (Address already in use)" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()


def test_rings_that_do_not_fit_in_shared_memory_are_refused_before_anything_starts(tmp_path: Path) -> None:
    """Each ingest process allocates all its rings at start (a page that tmpfs could not give
    later would be SIGBUS mid-stream): rings that /dev/shm has no room for would fail every
    ingest start under supervisord. 4,000 streams of 10 minutes are 143 GiB of rings."""
    base = free_ports(3)
    config = tmp_path / "streamasr.toml"
    config.write_text(f'run_dir = "{tmp_path / "run"}"\ninstance = "shmfull"\n[shm]\nstreams_per_ingest = 4000\nring_seconds = 600\n'
                      f'[ingest]\naddress = "tcp://127.0.0.1:{base}"\nport_base = {base + 1}\n[metrics]\ndashboard_port = {base + 2}\n')
    need = pool.segment_size(4000, pool.ring_capacity(600))
    if pool.free_bytes() > need:
        pytest.skip("/dev/shm has room for 143 GiB here")
    done = _streamasr("serve", "--config", str(config), "--model", "null")
    assert done.returncode == 1
    assert "shm.streams_per_ingest" in done.stderr and f"need {need / 2**20:,.0f} MiB" in done.stderr, done.stderr
    assert not (tmp_path / "run").exists() and not pool.segments("shmfull")


@pytest.mark.parametrize(("secret", "authorized", "named"), [
    ("missing.key_secret", "clients", "ingest.curve_secret_key: Invalid certificate file"),
    ("server.key", "clients", "ingest.curve_secret_key: "),  # the public half only
    ("server.key_secret", "no-such-dir", "is not a directory"),
    ("server.key_secret", "", "must be set together"),
])
def test_curve_keys_that_cannot_be_used_are_refused_before_anything_starts(tmp_path: Path, secret: str, authorized: str,
                                                                            named: str) -> None:
    """The broker and the ingest read the server's keys at start: a key file that is not there
    would stop both, over and over, with the front door unanswered."""
    (tmp_path / "clients").mkdir()
    zmq.auth.create_certificates(str(tmp_path), "server")
    base = free_ports(3)
    config = tmp_path / "streamasr.toml"
    config.write_text(f'run_dir = "{tmp_path / "run"}"\ninstance = "badkeys"\n[ingest]\naddress = "tcp://127.0.0.1:{base}"\n'
                      f'port_base = {base + 1}\ncurve_secret_key = "{tmp_path / secret}"\n'
                      f'curve_authorized_keys = "{tmp_path / authorized if authorized else ""}"\n'
                      f"[metrics]\ndashboard_port = {base + 2}\n")
    done = _streamasr("serve", "--config", str(config), "--model", "null")
    assert done.returncode == 1
    assert named in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()
