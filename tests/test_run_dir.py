"""The run directory of a serving instance under what cleans /tmp: systemd-tmpfiles' aging, and
files deleted from under it (`rm -rf /tmp/*`, tmpreaper). Real cleaners and real deletions."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest

from config import settings
from shm import pool
from streamasr import service as svc
from streamasr.service import free_ports
from streaming import read_wav, speech_files, stream_many, wait_for

ROOT = Path(__file__).resolve().parents[1]


def _report(service: Any) -> dict[str, Any]:
    return json.loads(service.cli("status", "--json").stdout)


def _programs_of(instance: str) -> list[str]:
    """Command lines of the processes serving `instance` (its run directory is in each)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        line = " ".join(proc.info["cmdline"] or [])
        if instance in line and "pytest" not in line:
            found.append(line)
    return found


def _since(service: Any, program: str, logged: int, event: str) -> list[dict[str, Any]]:
    return [e for e in service.events(program)[logged:] if e["event"] == event]


def _dashboard_row(service: Any, name: str) -> dict[str, Any] | None:
    url = f"http://127.0.0.1:{service.cfg.metrics.dashboard_port}/api/snapshot"
    with urllib.request.urlopen(url, timeout=10) as reply:
        return next((p for p in json.load(reply)["processes"] if p["name"] == name), None)


@pytest.mark.skipif(shutil.which("systemd-tmpfiles") is None, reason="systemd-tmpfiles is not installed")
def test_systemd_tmpfiles_ages_out_nothing_of_a_serving_instance(service_factory: Any, tmp_path: Path) -> None:
    """Most distributions age /tmp out (`q /tmp 1777 root root 10d`). The files the instance
    writes once at start were removed while it served (its config, supervisord's pid file and
    socket, a quiet program's log): `status` could not list its processes and a program
    restarted could not start. supervisord holds a lock on the run directory, which the cleaner
    skips. Age 0 stands for ten days without a write: the cleaner takes everything as old."""
    service = service_factory(model="null", workers=1)
    run = service.cfg.run_path

    def files() -> list[str]:  # the collector's state is rewritten every second through a .tmp
        return sorted(str(p.relative_to(run)) for p in run.rglob("*") if not p.name.endswith(".tmp"))

    before = files()
    rules = tmp_path.parent / f"{service.cfg.instance}-tmpfiles.conf"  # outside the directory it cleans
    rules.write_text(f"d {run.parent} - - - 0\nx {service.config_file}\n")
    try:
        subprocess.run(["systemd-tmpfiles", "--clean", str(rules)], check=True, capture_output=True, timeout=60)
    finally:
        rules.unlink()
    assert files() == before
    report = _report(service)
    assert {p["name"] for p in report["processes"]} == {"broker", "dashboard", "ingest-0", "revive", "worker-0"}, report
    assert "run_dir_error" not in report and "supervisor_error" not in report, report


def test_an_instance_starting_has_nothing_deleted(service_factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """While its programs start, the sockets they will bind are not there yet: that is no file
    deleted, in any report `status` gives from supervisord's start to the instance's readiness."""
    reports: list[dict[str, Any]] = []

    def recorded(cfg: Any) -> dict[str, Any]:
        reports.append(report := real_status(cfg))
        return report

    real_status = svc.status
    monkeypatch.setattr(svc, "status", recorded)  # what launch() polls, every 0.25 s, from the start
    service_factory(model="null", workers=1)
    running = [r for r in reports if r.get("running")]
    assert running and not any("run_dir_error" in r for r in running), [r.get("run_dir_error") for r in running]


def test_a_supervisord_that_has_not_bound_its_socket_yet_is_starting_not_robbed(tmp_path: Path) -> None:
    """`serve` becomes supervisord, which binds its socket a moment later and then writes its pid
    file. A `status` in between finds it by its run directory (the claim held, no pid file): its
    socket is not bound yet, which is no file deleted from under the instance. supervisord here is
    a process by that name that never gets as far, so the moment lasts."""
    base = free_ports(3)
    cfg = settings.load(None, {"instance": f"b{uuid.uuid4().hex[:8]}", "run_dir": str(tmp_path / "run"),
                               "ingest": {"address": f"tcp://127.0.0.1:{base}", "port_base": base + 1},
                               "metrics": {"dashboard_port": base + 2}})
    cfg.run_path.mkdir(mode=0o700)
    (cfg.run_path / "config.toml").write_text(settings.dump(cfg))
    (cfg.run_path / "logs").mkdir()
    supervisord = tmp_path / "bin" / "supervisord"
    supervisord.parent.mkdir()
    supervisord.write_text("import time\ntime.sleep(120)\n")
    held = svc.claim(cfg)
    proc = subprocess.Popen([sys.executable, str(supervisord)], env={**os.environ, "STREAMASR_RUN_DIR": str(cfg.run_path)})
    try:
        wait_for(lambda: svc.supervisord_pid(cfg) == proc.pid, 30, "supervisord found by its run directory")
        report = svc.status(cfg)
    finally:
        proc.kill()
        proc.wait()
        held.close()
    assert report["running"] is True, report
    assert "run_dir_error" not in report, report
    assert "is starting" in report["supervisor_error"] and "deleted" not in report["supervisor_error"], report


def _bound(service: Any) -> None:
    """Wait until every program has run long enough to have bound its sockets."""
    wait_for(lambda: all(p["uptime_s"] >= svc.BIND_GRACE_S for p in _report(service)["processes"]),
             3 * svc.BIND_GRACE_S, "the programs to have bound their sockets")


def test_deleted_files_are_named_by_status(service_factory: Any) -> None:
    """supervisord's socket and the config deleted while the instance serves: `status` said
    only `[Errno 2] No such file or directory`. It names what is gone and what still stops the
    instance, and not a ZeroMQ socket deleted with them that its program has bound again."""
    service = service_factory(model="null", workers=1)
    _bound(service)
    run = service.cfg.run_path
    logged = len(service.events("broker"))
    for name in ("supervisor.sock", "config.toml", "broker-workers.sock"):
        (run / name).unlink()
    wait_for(lambda: _since(service, "broker", logged, "broker.socket_restored"), 30, "the broker to bind its socket again")
    report = _report(service)
    assert report["running"] is True and report["ready"] is True, report
    assert "supervisor.sock was deleted" in report["supervisor_error"] and "streamasr stop" in report["supervisor_error"]
    assert "instance: config.toml, supervisor.sock. A program" in report["run_dir_error"], report
    text = service.cli("status").stdout
    assert "run dir error: deleted from under the running instance: config.toml, supervisor.sock." in text, text

    def dashboard_says() -> str | None:  # it showed an empty process table without a word
        url = f"http://127.0.0.1:{service.cfg.metrics.dashboard_port}/api/snapshot"
        with urllib.request.urlopen(url, timeout=10) as reply:
            return json.load(reply).get("supervisor_error")
    assert "supervisor.sock was deleted" in wait_for(dashboard_says, 30, "the dashboard to name the deleted socket")


def test_a_run_directory_deleted_under_a_serving_instance_is_reported_and_stop_stops_it(service_factory: Any) -> None:
    """`rm -rf /tmp/*` while the instance serves took its pid file with it: `status` called the
    serving instance not running, and `stop` waited ten minutes for it to start (its claim was
    still held) and then left every program and shm segment behind. supervisord is found among
    the processes; `status` says what is gone and `stop` stops the instance cleanly."""
    service = service_factory(model="null", workers=1)
    shutil.rmtree(service.cfg.run_path)
    report = _report(service)  # the programs bind no socket again in a run directory made anew: it stays gone
    assert report["running"] is True and report["ready"] is True, report
    assert f"the run directory {service.cfg.run_path}" in report["run_dir_error"], report
    assert "was deleted" in report["supervisor_error"], report
    done = service.cli("stop", timeout=120)
    assert done.returncode == 0, done.stderr
    assert service.proc.wait(timeout=60) == 0  # supervisord
    assert _programs_of(service.cfg.instance) == []
    assert pool.segments(service.cfg.instance) == []


def test_a_run_directory_another_process_keeps_locked_is_refused_not_waited_on(tmp_path: Path) -> None:
    """supervisord locks the run directory against tmp cleaners. A lock someone else holds (a
    backup or a cleaner that hangs) must not make `serve` hang without a word."""
    base = free_ports(3)
    run = tmp_path / "run"
    config = tmp_path / "streamasr.toml"
    config.write_text(f'run_dir = "{run}"\ninstance = "locked"\n[workers]\nprocesses = 1\n[ingest]\n'
                      f'address = "tcp://127.0.0.1:{base}"\nport_base = {base + 1}\n[metrics]\ndashboard_port = {base + 2}\n')
    run.mkdir(mode=0o700)
    holder = os.open(run, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(holder, fcntl.LOCK_SH)
    try:
        done = subprocess.run([sys.executable, "-m", "streamasr.cli", "serve", "--config", str(config), "--model", "null"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    finally:
        os.close(holder)
    assert done.returncode == 1, done.stderr
    assert f"the run directory {run} is locked by another process" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert _programs_of("locked") == [] and pool.segments("locked") == []


def test_sockets_deleted_under_a_serving_instance_are_bound_again_and_a_restarted_worker_serves(service_factory: Any) -> None:
    """`rm -rf /tmp/*` or tmpreaper took the ZeroMQ socket files of a serving instance: its
    processes kept the connections they had, but a worker supervisord restarted after a crash
    waited for ever, without a word, for a broker it could not reach (its results, its figures
    had no file to go to either). Each process binds its deleted files again and says so once:
    the new worker registers, its results reach the ingest and the dashboard hears it."""
    service = service_factory(model="null", workers=1)
    run = service.cfg.run_path
    files = {"broker": ["broker-ingest.sock", "broker-workers.sock"], "ingest-0": ["ingest-0-results.sock"],
             "dashboard": ["metrics.sock"]}
    logged = {program: len(service.events(program)) for program in files}
    rpc = service.supervisor()
    old_pid = rpc.getProcessInfo("worker:worker-0")["pid"]
    for names in files.values():
        for name in names:
            (run / name).unlink()
    os.kill(old_pid, signal.SIGKILL)
    wait_for(lambda: _since(service, "broker", logged["broker"], "broker.worker_ready"), 120, "the restarted worker's READY")
    for program, names in files.items():
        event = f"{program.split('-')[0]}.socket_restored"
        restored = wait_for(lambda: len(found := _since(service, program, logged[program], event)) >= len(names) and found,
                            30, event)  # within its next check
        assert sorted(Path(e["path"]).name for e in restored) == sorted(names), (program, restored)
        assert all(e["level"] == "warning" and e["why"] == "deleted" for e in restored), restored
        assert all((run / name).is_socket() for name in names)
    results = stream_many(service.address, {"s": read_wav(speech_files()[0])}, speed=None)
    assert results["s"].finals and results["s"].errors == [], results["s"]
    assert all(f.text.strip() == "null model" for f in results["s"].finals), results["s"].finals
    new_pid = rpc.getProcessInfo("worker:worker-0")["pid"]
    wait_for(lambda: (row := _dashboard_row(service, "worker-0")) and row["pid"] == new_pid and row["last_seen_s"] is not None,
             30, "the dashboard to hear the restarted worker")
    report = _report(service)
    assert "run_dir_error" not in report, report


def test_a_worker_that_cannot_reach_the_broker_says_why(service_factory: Any) -> None:
    """The broker stopped and its socket file deleted: a worker started then waited for ever
    without a word, its broker warning written only once it had been connected. It names the
    endpoint and the missing file, and registers when the broker is back."""
    service = service_factory(model="null", workers=1)
    rpc = service.supervisor()
    rpc.stopProcess("broker")
    (service.cfg.run_path / "broker-workers.sock").unlink()  # ZeroMQ leaves the file of a socket it closes
    logged = {program: len(service.events(program)) for program in ("worker-0", "ingest-0", "broker")}
    os.kill(rpc.getProcessInfo("worker:worker-0")["pid"], signal.SIGKILL)
    told = wait_for(lambda: _since(service, "worker-0", logged["worker-0"], "worker.broker_unreachable"), 120,
                    "the restarted worker to say the broker is unreachable")
    assert told[0]["level"] == "warning" and told[0]["socket_file"] == "missing", told
    assert told[0]["endpoint"] == service.cfg.broker_worker_endpoint, told
    lost = wait_for(lambda: _since(service, "ingest-0", logged["ingest-0"], "ingest.broker_lost"), 60, "the ingest's broker_lost")
    assert lost[-1]["endpoint"] == service.cfg.broker_ingest_endpoint and lost[-1]["socket_file"] == "exists", lost
    rpc.startProcess("broker")
    wait_for(lambda: _since(service, "broker", logged["broker"], "broker.worker_ready"), 120, "the worker to register")
