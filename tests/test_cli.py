"""The command line as a shell uses it."""

from __future__ import annotations

import argparse
import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
import zmq
import zmq.auth
from conftest import ROOT

from config import settings
from shm import RingPool, pool
from speech import loader
from streamasr import cli, service, testdata
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


def _streamasr(*args: str, cwd: Path = ROOT, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "streamasr.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def _started(*args: str, cwd: Path = ROOT, stderr: int = subprocess.DEVNULL) -> subprocess.Popen[str]:
    """`streamasr ARGS` started, not waited for (`serve` in the foreground, a `stop` that waits)."""
    return subprocess.Popen([sys.executable, "-m", "streamasr.cli", *args], cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=stderr, text=True)


def test_serve_help_says_where_the_run_directory_is() -> None:
    """The run directory holds the logs, sockets and effective config an operator looks for; `--help`
    is where a new one looks first."""
    proc = _streamasr("serve", "--help")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "run_dir" in text and str(settings.Config(instance="<instance>").run_path) in text, text


@pytest.mark.parametrize(("args", "named"), [
    (["--instance", "prod.eu"], "instance must be 1 to 64 letters, digits, '_' or '-', not 'prod.eu'"),
    (["--instance", "a/b"], "instance must be 1 to 64 letters, digits, '_' or '-', not 'a/b'"),
])
def test_an_instance_name_that_could_clash_is_refused_before_anything_starts(tmp_path: Path, args: list[str], named: str) -> None:
    """`a/b` cannot name a shm segment (the ingest would fail at start over and over); with
    `prod.eu`, `serve --instance prod` would take the running `prod.eu`'s segments for leftovers."""
    config = tmp_path / "streamasr.toml"
    config.write_text(f'run_dir = "{tmp_path / "run"}"\n')
    done = _streamasr("serve", "--config", str(config), "--model", "null", *args)
    assert done.returncode == 2
    assert named in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()


def test_a_run_dir_too_long_for_its_sockets_is_refused_before_anything_starts(tmp_path: Path) -> None:
    run = tmp_path / ("r" * (120 - len(str(tmp_path))))
    config = tmp_path / "streamasr.toml"
    config.write_text(f'run_dir = "{run}"\n')
    done = _streamasr("serve", "--config", str(config), "--model", "null")
    assert done.returncode == 2
    assert f"run_dir '{run}' is too long" in done.stderr and "107-byte limit" in done.stderr, done.stderr
    assert not run.exists()


def test_transcribe_local_runs_the_configs_model(tmp_path: Path) -> None:
    config = tmp_path / "streamasr.toml"
    config.write_text(f'[model]\nname = "whisper-huge.xx"\ncache_dir = "{tmp_path / "cache"}"\n')
    audio = next(u.path for u in testdata.utterances() if u.name == "goforward")
    done = _streamasr("transcribe", "--local", "--config", str(config), audio)
    assert done.returncode == 2
    assert "cannot load model whisper-huge.xx: unknown model 'whisper-huge.xx'" in done.stderr, done.stderr


def test_transcribe_local_refuses_a_language_the_model_does_not_transcribe() -> None:
    """tiny.en would decode French speech as English words; asked for French, it says so instead."""
    audio = next(u.path for u in testdata.utterances() if u.name == "goforward")
    done = _streamasr("transcribe", "--local", "--language", "fr", audio)
    assert done.returncode == 2 and done.stdout == ""
    assert "error: language 'fr' is not one 'whisper-tiny.en' transcribes (en)" in done.stderr, done.stderr
    assert _streamasr("transcribe", "--local", "--language", "EN", audio).returncode == 0


@pytest.mark.parametrize("where", [["--local", "--model", "null"], ["--server", "tcp://127.0.0.1:1"]])
def test_transcribe_says_a_file_is_missing_or_a_directory(tmp_path: Path, where: list[str]) -> None:
    """A typo in a path, or a directory given for a file, is said as such with or without a
    service, not as a file that exists and is missing or one libsndfile cannot recognise."""
    (tmp_path / "calls.wav").mkdir()
    done = _streamasr("transcribe", *where, str(tmp_path / "missing.wav"), str(tmp_path / "calls.wav"), timeout=60)
    assert done.returncode == 1 and done.stdout == "", done.stdout
    lines = done.stderr.splitlines()
    assert len(lines) == 2 and "missing.wav" in lines[0] and lines[0].endswith("no such file"), done.stderr
    assert "calls.wav" in lines[1] and lines[1].endswith("a directory, not a file"), done.stderr


@pytest.mark.parametrize(("args", "said"), [
    (["status", "--wait", "nan"], "seconds must be 0 to 86400, not nan"),  # waited for ever
    (["status", "--wait", "-1"], "seconds must be 0 to 86400, not -1"),
    (["transcribe", "--local", "--threads", "3000000000", "x.wav"], "threads must be 0 to 1024, not 3000000000"),
    (["dashboard", "--port", "70000"], "port must be 0 to 65535, not 70000"),  # a traceback at bind, and a stale socket
])
def test_a_count_out_of_range_is_refused_with_the_usage(args: list[str], said: str) -> None:
    done = _streamasr(*args, timeout=60)
    assert done.returncode == 2 and said in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_stop_waits_as_long_as_supervisord_may_take(tmp_path: Path) -> None:
    """supervisord stops its programs one after another, each within its stopwaitsecs (42 s
    together): `stop` waits for that, not for a shorter time of its own, before it says the
    instance did not stop."""
    waits = service.stop_waits()
    assert waits["ingest"] == 12 and sum(waits.values()) == 42
    cfg = settings.load(None, {"run_dir": str(tmp_path / "run"), "instance": f"stop{uuid.uuid4().hex[:8]}"})
    cfg.run_path.mkdir()
    slow = _a_process(tmp_path / "supervisord", "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(32), sys.exit(0)))",
                      args=["-n", "-c", str(service.SUPERVISORD_CONF)], env={"STREAMASR_RUN_DIR": str(cfg.run_path)})
    try:
        threading.Thread(target=slow.wait, daemon=True).start()  # reaped once it exits, as supervisord's parent would
        (cfg.run_path / "supervisord.pid").write_text(str(slow.pid))
        config = tmp_path / "streamasr.toml"
        config.write_text(settings.dump(cfg))
        started = time.monotonic()
        done = _streamasr("stop", "--config", str(config))
        assert done.returncode == 0, done.stderr
        assert time.monotonic() - started > 30
    finally:
        if slow.poll() is None:
            slow.send_signal(signal.SIGKILL)
        slow.wait()


def _a_process(script: Path, setup: str, args: list[str] | None = None, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """A Python program at `script` that runs `setup`, then sleeps; started and ready once this returns."""
    script.write_text(f"import signal, sys, time\n{setup}\nprint('ready', flush=True)\ntime.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, str(script), *(args or [])], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def test_a_stale_pid_file_naming_another_program_is_not_taken_for_the_instance(tmp_path: Path) -> None:
    """A supervisord killed outright leaves its pid file, and the system may give that pid to any
    program later: `stop` must not signal it, `status` must not call the instance running, and
    `serve` must not refuse to start as if it were."""
    cfg = settings.load(None, {"run_dir": str(tmp_path / "run"), "instance": f"stale{uuid.uuid4().hex[:8]}"})
    cfg.run_path.mkdir()
    config = tmp_path / "streamasr.toml"
    config.write_text(settings.dump(cfg))
    # The instance's own variables do not make a program its supervisord; nor does another
    # instance's supervisord command line (its run directory is elsewhere).
    other = _a_process(tmp_path / "other.py", "", env={"STREAMASR_RUN_DIR": str(cfg.run_path)})
    elsewhere = _a_process(tmp_path / "supervisord", "", args=["-n", "-c", str(service.SUPERVISORD_CONF)],
                           env={"STREAMASR_RUN_DIR": str(tmp_path / "another-run")})
    try:
        for proc in (other, elsewhere):
            (cfg.run_path / "supervisord.pid").write_text(str(proc.pid))
            done = _streamasr("stop", "--config", str(config))
            assert done.returncode == 1 and "is not running" in done.stderr, done.stderr
            assert proc.poll() is None, "stop signalled a program that is not the instance's supervisord"
            report = json.loads(_streamasr("status", "--json", "--config", str(config)).stdout)
            assert report["running"] is False
            assert service.supervisord_pid(cfg) is None  # what `serve` refuses "already running" by
    finally:
        for proc in (other, elsewhere):
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("refused", ["run_dir", "signal"])
def test_stop_of_an_instance_run_by_another_user_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str], refused: str) -> None:
    """An operator who runs `stop` as the wrong user must hear whose instance it is, not get a
    traceback nor "not running". The system refusing (the run directory, which `serve` makes
    0700, or the signal) is faked: one user runs these tests, and root may do both. The
    instance's supervisord, found by its pid file, is a real process."""
    cfg = settings.load(None, {"run_dir": str(tmp_path / "run"), "instance": f"other{uuid.uuid4().hex[:8]}"})
    cfg.run_path.mkdir()
    config = tmp_path / "streamasr.toml"
    config.write_text(settings.dump(cfg))
    theirs = _a_process(tmp_path / "supervisord", "", args=["-n"], env={"STREAMASR_RUN_DIR": str(cfg.run_path)})
    signalled, accessible = os.kill, os.access

    def kill(pid: int, sig: int) -> None:
        if pid == theirs.pid and refused == "signal":
            raise PermissionError(errno.EPERM, "Operation not permitted")
        signalled(pid, sig)

    def access(path: str | Path, mode: int) -> bool:
        return not (Path(path) == cfg.run_path and refused == "run_dir") and accessible(path, mode)

    try:
        (cfg.run_path / "supervisord.pid").write_text(str(theirs.pid))
        with monkeypatch.context() as patched:
            patched.setattr(os, "kill", kill)
            patched.setattr(os, "access", access)
            assert cli.main(["stop", "--config", str(config)]) == 1
            assert capsys.readouterr().err == f"instance {cfg.instance!r} runs as another user, who may stop it: {cfg.run_path}\n"
            if refused == "run_dir":  # status cannot list its processes, and says why rather than "not running"
                assert cli.main(["status", "--config", str(config)]) == 1
                out = capsys.readouterr().out
                assert "not running" not in out and f"the run directory {cfg.run_path} is another user's" in out, out
        assert theirs.poll() is None
    finally:
        theirs.kill()
        theirs.wait()


def test_status_of_an_instance_whose_supervisor_socket_answers_no_http_says_so(tmp_path: Path) -> None:
    """Whatever answers on supervisord's socket other than its HTTP (another program bound there,
    a supervisord of another version gone wrong) must give `status` a supervisor error to print,
    as the dashboard shows one, not a traceback. The instance's supervisord, found by its pid
    file, is a real process that answers every request with a line that is not HTTP."""
    cfg = settings.load(None, {"run_dir": str(tmp_path / "run"), "instance": f"nohttp{uuid.uuid4().hex[:8]}"})
    cfg.run_path.mkdir()
    config = tmp_path / "streamasr.toml"
    config.write_text(settings.dump(cfg))
    answers = (  # the whole request read first: answering before it is all sent would make the error a broken pipe
        "import socket, threading\n"
        f"listener = socket.socket(socket.AF_UNIX)\nlistener.bind({str(cfg.run_path / 'supervisor.sock')!r})\nlistener.listen()\n"
        "def answer():\n"
        "    while True:\n"
        "        conn, request = listener.accept()[0], b''\n"
        "        while b'</methodCall>' not in request and (chunk := conn.recv(65536)):\n"
        "            request += chunk\n"
        "        conn.sendall(b'garbage, not HTTP\\r\\n\\r\\n')\n"
        "        conn.close()\n"
        "threading.Thread(target=answer, daemon=True).start()")
    theirs = _a_process(tmp_path / "supervisord", answers, args=["-n"], env={"STREAMASR_RUN_DIR": str(cfg.run_path)})
    try:
        (cfg.run_path / "supervisord.pid").write_text(str(theirs.pid))
        done = _streamasr("status", "--json", "--config", str(config))
        text = _streamasr("status", "--config", str(config))
    finally:
        theirs.kill()
        theirs.wait()
    assert "Traceback" not in done.stderr + text.stderr, done.stderr + text.stderr
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    assert report["running"] is True and report["processes"] == [], report
    assert "garbage, not HTTP" in report["supervisor_error"], report
    assert text.returncode == 1 and "supervisor error: garbage, not HTTP" in text.stdout, text.stdout


def test_ops_commands_follow_the_running_instance_from_anywhere(tmp_path: Path) -> None:
    """A config file's relative paths are its directory's, whatever directory `serve` is run
    from (its programs run from the source tree); `serve --address` is what `status` and
    `transcribe` use afterwards (the run directory's config); ingests bind the front door's host,
    here ZeroMQ's wildcard, which a client on this host reaches on loopback; and an instance whose supervisord is not running is not ready, whoever answers at its address."""
    base = free_ports(3)
    (tmp_path / "conf").mkdir()
    (tmp_path / "elsewhere").mkdir()
    instance = f"rel{uuid.uuid4().hex[:8]}"
    config = tmp_path / "conf" / "streamasr.toml"
    # a space and a quote in the run directory's name (short: socket paths are limited): supervisord
    # splits its command lines as a shell would
    config.write_text(f'instance = "{instance}"\nrun_dir = "r \'"\n[ingest]\nport_base = {base + 1}\n'
                      f"[metrics]\ndashboard_port = {base + 2}\n[workers]\nprocesses = 1\n")
    serve = _started("serve", "--config", "../conf/streamasr.toml", "--model", "null", "--address", f"tcp://*:{base}",
                     cwd=tmp_path / "elsewhere", stderr=subprocess.PIPE)
    reaper = threading.Thread(target=serve.wait, daemon=True)  # supervisord's exit seen by `stop`, as when run from a shell
    reaper.start()
    try:
        done = _streamasr("status", "--config", str(config), "--wait", "120", "--json", timeout=180)
        report = json.loads(done.stdout)
        assert done.returncode == 0 and report["ready"], (report, serve.stderr.read() if serve.poll() is not None and serve.stderr else "")
        assert (tmp_path / "conf" / "r '" / "config.toml").is_file()
        assert report["address"] == f"tcp://*:{base}"
        assert [i["endpoint"] for i in report["ingests"]] == [f"tcp://*:{base + 1}"]
        audio = next(u.path for u in testdata.utterances() if u.name == "goforward")
        done = _streamasr("transcribe", "--config", str(config), "--offline", audio)
        assert done.returncode == 0 and "null model" in done.stdout, done.stderr
        # the same instance name from another run directory: its shm segments are this one's
        elsewhere = free_ports(3)
        twin = tmp_path / "twin.toml"
        twin.write_text(f'instance = "{instance}"\nrun_dir = "{tmp_path / "twin"}"\n[ingest]\naddress = "tcp://127.0.0.1:{elsewhere}"\n'
                        f"port_base = {elsewhere + 1}\n[metrics]\ndashboard_port = {elsewhere + 2}\n")
        segments = {name: (pool.SHM_DIR / name).stat().st_ino for name in pool.segments(instance)}
        done = _streamasr("serve", "--config", str(twin), "--model", "null")
        assert done.returncode == 1 and "is running from another run directory" in done.stderr, done.stderr
        assert {name: (pool.SHM_DIR / name).stat().st_ino for name in pool.segments(instance)} == segments != {}
        assert _streamasr("status", "--config", str(config)).returncode == 0
        other = tmp_path / "other.toml"  # another instance's name, this one's address
        other.write_text(f'instance = "nosuch{uuid.uuid4().hex[:8]}"\nrun_dir = "{tmp_path / "nosuch"}"\n'
                         f'[ingest]\naddress = "tcp://127.0.0.1:{base}"\n')
        done = _streamasr("status", "--config", str(other))
        assert done.returncode == 1 and "not running" in done.stdout, done.stdout
        done = _streamasr("stop", "--config", str(config), cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        reaper.join(10)
        assert serve.returncode == 0
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            serve.wait(60)
    assert not pool.segments(instance)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root to run `serve` as another user")
def test_serve_of_an_instance_whose_segments_are_another_users_says_so() -> None:
    """Two users on one host, both with the instance name "default": the second `serve` cannot
    see the first's processes (their maps are private) nor unlink its segments (/dev/shm is
    sticky). It must say whose they are, not end in a traceback, and leave them in place."""
    instance = f"owned{uuid.uuid4().hex[:8]}"
    theirs = RingPool.create(f"streamasr.{instance}.ingest0", slots=1, capacity=16)  # mapped by this process, root's
    with tempfile.TemporaryDirectory() as shared:
        os.chmod(shared, 0o777)
        config = Path(shared) / "streamasr.toml"
        _one_worker_config(config, instance, Path(shared) / "run")
        try:
            def as_nobody(*args: str) -> subprocess.CompletedProcess:
                return subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", sys.executable, *args],
                                      cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})

            if as_nobody("-c", "import streamasr.cli").returncode != 0:
                pytest.skip("the source tree or its interpreter is not readable by other users here")
            done = as_nobody("-m", "streamasr.cli", "serve", "--config", str(config), "--model", "null")
            assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
            assert f"instance {instance!r} has shm segments of another user (uid 0)" in done.stderr, done.stderr
            assert theirs.is_current()
        finally:
            theirs.close()
            theirs.unlink()


def test_an_ingest_shutting_down_does_not_count_as_registered() -> None:
    """`status --wait` after `supervisorctl restart ingest:ingest-0` must wait for the new process:
    the old one, still draining, is registered but on its way out."""
    report = {"expected": {"ingests": 2, "workers": 1}, "workers": [{"id": "w0"}],
              "ingests": [{"index": 0, "draining": True}, {"index": 1, "draining": False}]}
    assert not service.complete(report)
    report["ingests"][0]["draining"] = False
    assert service.complete(report)


def _one_worker_config(config: Path, instance: str, run_dir: Path) -> None:
    """A null-model service of one worker on free ports, its run directory at `run_dir`."""
    base = free_ports(3)
    config.write_text(f'instance = "{instance}"\nrun_dir = "{run_dir}"\n[ingest]\naddress = "tcp://127.0.0.1:{base}"\n'
                      f"port_base = {base + 1}\n[metrics]\ndashboard_port = {base + 2}\n[workers]\nprocesses = 1\n")


@contextmanager
def _serving(config: Path, instance: str, *args: str) -> Iterator[None]:
    """`streamasr serve --model null` as a shell runs it (its exit reaped, so that `stop` sees
    supervisord go), stopped with `streamasr stop` at the end; no shm may be left behind, nor
    the sockets in its run directory."""
    serve = _started("serve", "--config", str(config), "--model", "null", *args)
    reaper = threading.Thread(target=serve.wait, daemon=True)
    reaper.start()
    try:
        yield
        assert _streamasr("stop", "--config", str(config)).returncode == 0
        reaper.join(10)
        served = settings.load_started(settings.load(config).run_path / "config.toml")  # --ingest N included
        left = [path for path in served.ipc_paths if os.path.exists(path)]
        assert not left, left
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            serve.wait(60)
    assert not pool.segments(instance)


@pytest.mark.parametrize("when", ["serving", "starting"])
def test_a_killed_supervisord_takes_its_programs_with_it(tmp_path: Path, when: str) -> None:
    """Killed outright (SIGKILL, the OOM killer), supervisord cannot stop its programs; left
    serving, no `status` or `stop` would find them and a new `serve` could not bind. Each stops
    as on `stop`: the ingest drains and unlinks its shm. Killed while its programs are still
    importing, before each asks the kernel for a signal on its death (or while one restarts after
    a crash), a program would find no parent and serve on, unmanaged, and join the next run."""
    instance = f"orphan{uuid.uuid4().hex[:8]}"
    config = tmp_path / "streamasr.toml"
    _one_worker_config(config, instance, tmp_path / "run")
    serve = _started("serve", "--config", str(config), "--model", "null")
    programs: list[int] = []
    try:
        if when == "serving":
            done = _streamasr("status", "--config", str(config), "--wait", "120", "--json", timeout=180)
            programs = [p["pid"] for p in json.loads(done.stdout)["processes"]]
            assert done.returncode == 0 and len(programs) == 5 and all(programs), done.stdout
        else:
            supervisord = psutil.Process(serve.pid)  # `serve` becomes supervisord, under the same pid
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and len(programs) < 5:
                programs = [p.pid for p in supervisord.children()]
                time.sleep(0.01)
            assert len(programs) == 5, programs  # revive, the event listener, among them
        serve.kill()  # `serve` became supervisord
        serve.wait()
        deadline = time.monotonic() + service.stop_timeout()
        while time.monotonic() < deadline and not all(map(_gone, programs)):
            time.sleep(0.2)
        assert all(map(_gone, programs)), [" ".join(psutil.Process(p).cmdline()) for p in programs if not _gone(p)]
        if when == "serving":
            assert not pool.segments(instance)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
        for pid in programs:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        pool.reclaim(instance)  # one killed as it started cannot unlink its own


def test_a_sigterm_to_serve_as_its_programs_start_leaves_none_running_and_no_shm(tmp_path: Path) -> None:
    """SIGTERM to `serve` (an operator's `kill`, systemd stopping the unit, a container stopped) as
    soon as its supervisord is up: it starts its programs and stops them in the same instant, and
    the stop it sent the ingest, still between fork and exec, was lost: the ingest served on until
    supervisord SIGKILLed it 12 s later, and its shm segment stayed in /dev/shm (`streamasr stop`
    reclaims such a segment; a plain SIGTERM has no one to). Once `serve` has exited, no program of
    the instance runs, none had to be killed, and no segment is left."""
    instance = f"startstop{uuid.uuid4().hex[:8]}"
    config = tmp_path / "streamasr.toml"
    run = tmp_path / "run"
    _one_worker_config(config, instance, run)
    serve = _started("serve", "--config", str(config), "--model", "null")
    try:
        deadline = time.monotonic() + 120
        while not (run / "supervisord.pid").exists() and serve.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)
        assert (run / "supervisord.pid").exists(), "supervisord did not start"
        serve.send_signal(signal.SIGTERM)  # `serve` became supervisord
        assert serve.wait(service.stop_timeout()) == 0
        assert not pool.segments(instance)
        running = [" ".join(p.info["cmdline"]) for p in psutil.process_iter(["cmdline"])
                   if str(run / "config.toml") in " ".join(p.info["cmdline"] or [])]
        assert not running, running
        killed = [line for line in (run / "supervisord.log").read_text().splitlines() if "SIGKILL" in line]
        assert not killed, killed
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
        pool.reclaim(instance)


def test_stop_sees_supervisord_exit_before_its_parent_reaps_it(tmp_path: Path) -> None:
    """`serve` started by a program that reaps its children only when it next looks (a script's
    Popen, a process manager between its polls): supervisord stays a zombie until then. `stop`
    must report the instance stopped once it has exited, not wait its whole limit (47 s) and
    say it did not stop."""
    instance = f"unreaped{uuid.uuid4().hex[:8]}"
    config = tmp_path / "streamasr.toml"
    _one_worker_config(config, instance, tmp_path / "run")
    serve = _started("serve", "--config", str(config), "--model", "null")
    try:
        done = _streamasr("status", "--config", str(config), "--wait", "120", timeout=180)
        assert done.returncode == 0, done.stdout
        done = _streamasr("stop", "--config", str(config))
        assert done.returncode == 0, done.stderr
        assert serve.wait(10) == 0
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            serve.wait(60)
    assert not pool.segments(instance)


def test_stop_leaves_no_shm_of_an_ingest_supervisord_had_to_kill(tmp_path: Path) -> None:
    """An ingest that does not stop within its stopwaitsecs (frozen here; a hung drain) is SIGKILLed
    and cannot unlink its shm segment: its rings (983 MB of RAM with the defaults) stayed in
    /dev/shm until the instance was served again. `stop` leaves none behind."""
    instance = f"frozen{uuid.uuid4().hex[:8]}"
    config = tmp_path / "streamasr.toml"
    _one_worker_config(config, instance, tmp_path / "run")
    with _serving(config, instance):
        done = _streamasr("status", "--config", str(config), "--wait", "120", "--json", timeout=180)
        assert done.returncode == 0, done.stdout
        ingest = next(p["pid"] for p in json.loads(done.stdout)["processes"] if p["name"] == "ingest-0")
        assert pool.segments(instance)
        os.kill(ingest, signal.SIGSTOP)


def test_two_serves_of_one_instance_at_once_start_it_once(tmp_path: Path) -> None:
    """A second `serve` of an instance that is starting (exporting its model, supervisord not up
    yet: no pid file, nothing bound) finds nothing running, so it went on to clear the first's
    sockets and start a supervisord of its own: it failed with supervisord's usage error, or
    both ran, the first one's socket gone and so out of reach of `status` and `stop`. The second
    is refused as the instance already running or starting, and one `stop` stops the one that runs."""
    instance = f"twice{uuid.uuid4().hex[:8]}"
    config = tmp_path / "streamasr.toml"
    _one_worker_config(config, instance, tmp_path / "run")
    serves = [_started("serve", "--config", str(config), "--model", "null", stderr=subprocess.PIPE) for _ in range(2)]
    try:
        deadline = time.monotonic() + 60
        while all(s.poll() is None for s in serves) and time.monotonic() < deadline:
            time.sleep(0.1)
        refused = [s for s in serves if s.poll() is not None]
        assert len(refused) == 1, "both serves run"
        stderr = refused[0].stderr.read() if refused[0].stderr else ""
        assert refused[0].returncode == 1 and f"instance {instance!r} is already " in stderr, stderr
        done = _streamasr("status", "--config", str(config), "--wait", "120", timeout=180)
        assert done.returncode == 0, done.stdout
        assert _streamasr("stop", "--config", str(config)).returncode == 0
        assert all(s.wait(10) is not None for s in serves)
    finally:
        for s in serves:
            if s.poll() is None:
                s.send_signal(signal.SIGTERM)
                s.wait(60)
    assert not pool.segments(instance)


def test_stop_of_an_instance_still_starting_waits_for_it(tmp_path: Path) -> None:
    """`stop` while `serve` still exports the model (no supervisord yet, no pid file) said "not
    running", and the instance came up after it. It waits for the instance while its `serve` holds
    it (played here by the test holding the claim), and says so; a `serve` that gives up without
    starting leaves nothing to stop."""
    instance = f"starting{uuid.uuid4().hex[:8]}"
    config = tmp_path / "streamasr.toml"
    _one_worker_config(config, instance, tmp_path / "run")
    held = service.claim(settings.load(config))
    stop = _started("stop", "--config", str(config), stderr=subprocess.PIPE)
    try:
        time.sleep(3)
        assert stop.poll() is None, "stop did not wait for the instance starting"
    finally:
        held.close()
    _, err = stop.communicate(timeout=10)
    assert stop.returncode == 1 and f"instance {instance!r} is starting: waiting" in err, err
    assert f"instance {instance!r} is not running" in err, err


def _gone(pid: int) -> bool:
    """Exited: a zombie no one has reaped yet counts (its parent was killed)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_status_wait_waits_for_every_ingest_and_worker_the_instance_runs(tmp_path: Path) -> None:
    """The front door is ready with one ingest and one worker; `status --wait` is what a script
    runs before it sends load, which should find every ingest process registered to spread over.
    Until then it waits, and at its end it says what is missing."""
    base = free_ports(4)
    instance = f"pool{uuid.uuid4().hex[:8]}"
    config = tmp_path / "streamasr.toml"
    config.write_text(f'instance = "{instance}"\nrun_dir = "{tmp_path / "run"}"\n[ingest]\naddress = "tcp://127.0.0.1:{base}"\n'
                      f"port_base = {base + 1}\nprocesses = 2\n[metrics]\ndashboard_port = {base + 3}\n[workers]\nprocesses = 1\n")
    cfg = settings.load(config)

    def pid_of(name: str) -> int | None:
        try:
            return next((p["pid"] for p in service.processes(cfg) if p["name"] == name and p["pid"]), None)
        except OSError:  # supervisord's socket not there yet
            return None

    with _serving(config, instance):
        deadline = time.monotonic() + 60
        while (held := pid_of("ingest-1")) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert held is not None, "ingest-1 never started"
        os.kill(held, signal.SIGSTOP)  # started, not registered yet: it takes a second to load
        try:
            while not ((report := service.status(cfg)).get("ready")) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert [i["index"] for i in report["ingests"]] == [0], report
            done = _streamasr("status", "--config", str(config), "--wait", "2")
            assert done.returncode == 0, done.stdout  # ready: the front door serves
            assert "registered: 1 of 2 ingest processes serving, 1 of 1 workers" in done.stdout, done.stdout
        finally:
            os.kill(held, signal.SIGCONT)
        done = _streamasr("status", "--config", str(config), "--wait", "60", "--json")
        report = json.loads(done.stdout)
        assert done.returncode == 0 and report["expected"] == {"ingests": 2, "workers": 1}, report
        assert sorted(i["index"] for i in report["ingests"]) == [0, 1] and len(report["workers"]) == 1, report


def test_status_counts_the_processes_serve_was_told_to_run_and_reads_another_versions_run_dir(tmp_path: Path) -> None:
    """`serve --ingest 2 --workers 1` runs what its command line says, not what the config file
    does: `status --wait` must wait for those (not return before the second ingest, nor wait in
    vain for workers that were never started). And an instance started by another version of
    streamasr (a key this one does not know in its run directory's config) is still reported,
    not refused as if the operator's own config were wrong."""
    base = free_ports(4)
    instance = f"cnt{uuid.uuid4().hex[:8]}"
    config = tmp_path / "streamasr.toml"
    config.write_text(f'instance = "{instance}"\nrun_dir = "{tmp_path / "run"}"\n[ingest]\naddress = "tcp://127.0.0.1:{base}"\n'
                      f"port_base = {base + 1}\n[metrics]\ndashboard_port = {base + 3}\n[workers]\nprocesses = 3\n")
    with _serving(config, instance, "--ingest", "2", "--workers", "1"):
        started = tmp_path / "run" / "config.toml"
        deadline = time.monotonic() + 60
        while not started.is_file() and time.monotonic() < deadline:
            time.sleep(0.1)
        done = _streamasr("status", "--config", str(started), "--wait", "120", timeout=180)  # the counts serve wrote
        assert done.returncode == 0, done.stdout
        done = _streamasr("status", "--config", str(config), "--json")
        report = json.loads(done.stdout)
        assert done.returncode == 0 and report["expected"] == {"ingests": 2, "workers": 1}, report
        assert "registered:" not in _streamasr("status", "--config", str(config)).stdout  # nothing missing

        with started.open("a") as f:  # what a release that has one more setting wrote
            f.write("\n[tracing]\nsample = 0.1\n")
        done = _streamasr("status", "--config", str(config))
        assert done.returncode == 0 and "ready: yes" in done.stdout and "Traceback" not in done.stderr, done.stderr


def test_ops_commands_take_the_servers_curve_keys_from_the_running_instance(tmp_path: Path) -> None:
    """With CURVE on, the front door answers only an authorized key: an operator's config that
    holds the client key pair and where the instance runs is enough for `status` and
    `transcribe`, the server's keys are the instance's. One without a client key is told so,
    rather than waiting for an answer that cannot come and reading the service as dead."""
    (tmp_path / "clients").mkdir()
    zmq.auth.create_certificates(str(tmp_path), "server")
    zmq.auth.create_certificates(str(tmp_path / "clients"), "ops")
    base = free_ports(3)
    instance = f"curve{uuid.uuid4().hex[:8]}"
    where = f'instance = "{instance}"\nrun_dir = "{tmp_path / "run"}"\n'
    config = tmp_path / "service.toml"
    config.write_text(f'{where}[ingest]\naddress = "tcp://127.0.0.1:{base}"\nport_base = {base + 1}\n'
                      f'curve_secret_key = "server.key_secret"\ncurve_authorized_keys = "clients"\n'
                      f"[metrics]\ndashboard_port = {base + 2}\n[workers]\nprocesses = 1\n")
    operator = tmp_path / "operator.toml"
    operator.write_text(f'{where}[ingest]\ncurve_client_key = "{tmp_path / "clients" / "ops.key_secret"}"\n')
    keyless = tmp_path / "keyless.toml"
    keyless.write_text(where)
    with _serving(config, instance):
        done = _streamasr("status", "--config", str(operator), "--wait", "120", timeout=180)
        assert done.returncode == 0 and "ready: yes" in done.stdout, done.stdout
        audio = next(u.path for u in testdata.utterances() if u.name == "goforward")
        done = _streamasr("transcribe", "--config", str(operator), "--offline", audio)
        assert done.returncode == 0 and "null model" in done.stdout, done.stderr
        done = _streamasr("status", "--config", str(keyless))
        assert done.returncode == 1 and "ingest.curve_client_key" in done.stdout, done.stdout
        done = _streamasr("transcribe", "--config", str(keyless), "--offline", audio)
        assert done.returncode == 2 and "ingest.curve_client_key" in done.stderr, done.stderr


@pytest.mark.parametrize(("setting", "named"), [
    ('[model]\nmax_batch = "4"\n', "model.max_batch must be an integer, not '4'"),
    ('[model]\nprecision = "fp16"\n', "model.precision must be one of 'fp32', 'int8', not 'fp16'"),
    ("[broker]\nliveness = 0\n", "broker.liveness must be 1 or more, not 0"),
    ('log_level = "verbose"\n', "log_level must be one of"),
    ("[ingest]\nmax_frame_byte = 100\n", "unknown config key ingest.max_frame_byte"),
    ("[vad\n", "config file"),
    ("[ingest]\nport_base = 7700\n", "ingest.address tcp://127.0.0.1:7700 and ingest process 0 (ingest.port_base + 0) "
                                      "tcp://127.0.0.1:7700 are the same port"),
    ("[shm]\nring_seconds = 25\n", "shm.ring_seconds (25) must be at least vad.max_segment_s (25)"),
    ("[ingest]\ndrain_timeout_s = 11\n", "ingest.drain_timeout_s (11 s) and 2 s to exit do not fit in the ingest's stopwaitsecs (12 s"),
    ("[ingest]\nstall_after_s = inf\n", "ingest.stall_after_s must be a finite number, not inf"),
    ("[shm]\nring_seconds = inf\n", "shm.ring_seconds must be a finite number, not inf"),
    ('[ingest]\nresume_key_file = "/nonexistent/resume.key"\n',
     "ingest.resume_key_file /nonexistent/resume.key: cannot read it: No such file or directory"),
    ('[ingest]\nresume_key_file = "/dev/null"\n', "ingest.resume_key_file /dev/null: holds no key (64 hexadecimal characters"),
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


def test_a_run_dir_that_is_not_the_instance_s_own_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """serve makes its run directory private and clears its sockets: pointed at a directory of
    other files (`/run`, say) it would break them. A path supervisord cannot quote is refused too."""
    base = free_ports(3)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o755)
    (shared / "other.sock").write_text("")
    quoted = tmp_path / 'say "hi"'
    for run_dir, named in ((shared, "holds files of something else"), (quoted, "which supervisord's command lines cannot carry")):
        config = tmp_path / "streamasr.toml"
        config.write_text(f"run_dir = '{run_dir}'\ninstance = \"foreign\"\n[ingest]\naddress = \"tcp://127.0.0.1:{base}\"\n"
                          f"port_base = {base + 1}\n[metrics]\ndashboard_port = {base + 2}\n")
        done = _streamasr("serve", "--config", str(config), "--model", "null")
        assert done.returncode == 1 and named in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert (shared / "other.sock").exists() and shared.stat().st_mode & 0o777 == 0o755
    assert not quoted.exists()


def test_serve_starts_the_metrics_from_zero(tmp_path: Path) -> None:
    """The dashboard carries its totals across its own restarts in the run directory; a new
    service must not take up the last one's."""
    base = free_ports(3)
    cfg = settings.load(None, {"instance": f"z{uuid.uuid4().hex[:8]}", "run_dir": str(tmp_path / "run"),
                               "ingest": {"address": f"tcp://127.0.0.1:{base}", "port_base": base + 1},
                               "metrics": {"dashboard_port": base + 2}, "model": {"name": "null", "backend": "null"}})
    cfg.run_path.mkdir(mode=0o700)
    (cfg.run_path / "config.toml").write_text(settings.dump(cfg))
    cfg.metrics_state_path.write_bytes(b"a previous run's totals")
    service.prepare(cfg)
    assert not cfg.metrics_state_path.exists()


def test_a_model_named_on_the_command_line_runs_where_the_config_s_backend_is_null(tmp_path: Path) -> None:
    config = tmp_path / "streamasr.toml"
    config.write_text('[model]\nname = "null"\nbackend = "null"\n')
    named = cli._config(argparse.Namespace(config=str(config), model="whisper-tiny.en"))
    assert (named.model.name, named.model.backend) == ("whisper-tiny.en", "onnxruntime")
    assert cli._config(argparse.Namespace(config=str(config), model=None)).model.backend == "null"


def test_an_unknown_model_is_refused_before_anything_starts(tmp_path: Path) -> None:
    base = free_ports(3)  # ports another instance holds would be refused first
    config = tmp_path / "streamasr.toml"
    config.write_text(f'run_dir = "{tmp_path / "run"}"\ninstance = "badmodel"\n[ingest]\naddress = "tcp://127.0.0.1:{base}"\n'
                      f'port_base = {base + 1}\n[metrics]\ndashboard_port = {base + 2}\n')
    for command in ("serve", "export"):
        done = _streamasr(command, "--config", str(config), "--model", "whisper-huge.xx")
        assert done.returncode == 2
        assert "unknown model 'whisper-huge.xx'" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()
    done = _streamasr("status", "--config", str(tmp_path / "missing.toml"))
    assert done.returncode == 2 and "missing.toml" in done.stderr and "Traceback" not in done.stderr, done.stderr



def test_a_backend_this_release_cannot_load_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """Every worker would fail to load it and be restarted over and over, with nothing said
    where `serve` was run."""
    config = tmp_path / "streamasr.toml"
    config.write_text(f'run_dir = "{tmp_path / "run"}"\ninstance = "trt"\n[model]\nbackend = "tensorrt"\n')
    done = _streamasr("serve", "--config", str(config))
    assert done.returncode == 2
    assert 'model.backend "tensorrt" is not available' in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()

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
    assert f"streamasr serve: error: cannot bind tcp://127.0.0.1:{base + 1} (Address already in use)" in done.stderr \
        and "Traceback" not in done.stderr, done.stderr  # said as the settings' refusals are
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


def test_a_hard_limit_on_open_files_too_low_for_the_streams_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """Each client connection is a descriptor of an ingest's: at the limit libzmq spins on accept
    and new clients hang unanswered. A hard limit (a container's `--ulimit`, a unit's
    `LimitNOFILE=`) below one ingest's streams is refused by name rather than met under load."""
    base = free_ports(3)
    config = tmp_path / "streamasr.toml"
    config.write_text(f'run_dir = "{tmp_path / "run"}"\ninstance = "fewfds"\n[workers]\nprocesses = 2\n[ingest]\n'
                      f'address = "tcp://127.0.0.1:{base}"\nport_base = {base + 1}\n[metrics]\ndashboard_port = {base + 2}\n')
    done = subprocess.run([sys.executable, "-m", "streamasr.cli", "serve", "--config", str(config), "--model", "null"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200)))
    assert done.returncode == 1
    assert "the limit on open files (ulimit -Hn) is 200" in done.stderr and "shm.streams_per_ingest (256)" in done.stderr \
        and "needs 322" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("secret", "authorized", "named"), [
    ("missing.key_secret", "clients", "ingest.curve_secret_key: Invalid certificate file"),
    ("server.key", "clients", "ingest.curve_secret_key: "),  # the public half only
    ("server.key_secret", "no-such-dir", "is not a directory"),
    ("server.key_secret", "", "must be set together"),
    ("server.key_secret", "half-written", "ingest.curve_authorized_keys: No public key found in"),
    ("cut-short.key_secret", "clients", "ingest.curve_secret_key: "),  # the secret key's last character lost
    ("mismatched.key_secret", "clients", "ingest.curve_secret_key: "),  # another pair's public key
    ("server.key_secret", "cut-short", "ingest.curve_authorized_keys: "),  # would match no client
    ("server.key_secret", "no-equals", "ingest.curve_authorized_keys: "),
])
def test_curve_keys_that_cannot_be_used_are_refused_before_anything_starts(tmp_path: Path, secret: str, authorized: str,
                                                                            named: str) -> None:
    """The broker and the ingest read the server's keys at start, and every client key in the
    authorized directory: a key file that is not there, or one that holds no key (an operator's
    copy cut short), would stop both, over and over, with the front door unanswered."""
    (tmp_path / "clients").mkdir()
    (tmp_path / "half-written").mkdir()
    (tmp_path / "half-written" / "client.key").write_text("#   ZeroMQ CURVE Public Certificate\n")
    zmq.auth.create_certificates(str(tmp_path), "server")
    zmq.auth.create_certificates(str(tmp_path), "other")
    server = (tmp_path / "server.key_secret").read_text()
    server_public, server_secret = (line.split('"')[1] for line in server.splitlines() if "-key" in line)
    (tmp_path / "cut-short.key_secret").write_text(server.replace(server_secret, server_secret[:-1]))
    other_public = next(line.split('"')[1] for line in (tmp_path / "other.key").read_text().splitlines() if "-key" in line)
    (tmp_path / "mismatched.key_secret").write_text(server.replace(server_public, other_public))
    for directory, text in (("cut-short", (tmp_path / "other.key").read_text().replace(other_public, other_public[:-1])),
                            ("no-equals", "curve\n    public-key\n")):
        (tmp_path / directory).mkdir()
        (tmp_path / directory / "client.key").write_text(text)
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


def test_a_run_dir_that_is_a_file_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """A run_dir naming a file (or a path under one) cannot be made a directory: said by name, no traceback."""
    (tmp_path / "afile").write_text("")
    for run_dir in (tmp_path / "afile", tmp_path / "afile" / "run"):
        config = tmp_path / "streamasr.toml"
        _one_worker_config(config, f"file{uuid.uuid4().hex[:8]}", run_dir)
        done = _streamasr("serve", "--config", str(config), "--model", "null", timeout=60)
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.startswith("streamasr serve: error: ") and str(run_dir) in done.stderr, done.stderr


def test_a_run_dir_its_own_dashboard_made_before_the_first_serve_is_the_instance_s(tmp_path: Path) -> None:
    """`streamasr dashboard` of an instance not served yet makes its run directory for the metrics
    socket and keeps its carried totals there: that is the instance's own, not another program's."""
    instance = f"dash{uuid.uuid4().hex[:8]}"
    config = tmp_path / "streamasr.toml"
    _one_worker_config(config, instance, tmp_path / "run")
    dashboard = subprocess.Popen([sys.executable, "-m", "streamasr.cli", "dashboard", "--config", str(config), "--port", "0"],
                                 cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True)
    try:
        assert dashboard.stdout is not None and dashboard.stdout.readline().startswith("dashboard http://")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (tmp_path / "run" / "metrics-state.msgpack").exists():
            time.sleep(0.1)
    finally:
        dashboard.send_signal(signal.SIGTERM)
        assert dashboard.wait(30) == 0
    with _serving(config, instance):
        done = _streamasr("status", "--config", str(config), "--wait", "120", timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("server", ["foo", "tcp://127.0.0.1:notaport", "7700"])
def test_transcribe_to_an_address_zeromq_refuses_says_so(server: str) -> None:
    """`--server` is typed by hand: one ZeroMQ refuses to connect to gave a ZMQError traceback."""
    audio = next(u.path for u in testdata.utterances() if u.name == "goforward")
    done = _streamasr("transcribe", "--server", server, audio, timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert f"cannot connect to {server}" in done.stderr and "Traceback" not in done.stderr, done.stderr


@contextmanager
def _small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs to hold a run directory (mounting needs root), unmounted at the end."""
    mount = tmp_path / "fs"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=True)


def test_a_run_dir_on_a_full_file_system_is_refused_not_a_traceback(tmp_path: Path) -> None:
    """/tmp full (logs, a core dump): serve cannot write the run directory's config.toml. It must
    say so as its other refusals do, and leave no run directory (nor an empty config.toml) behind."""
    with _small_tmpfs(tmp_path) as fs:
        (fs / "fill").write_bytes(b"\0" * 64 * 1024)  # the whole file system
        config = tmp_path / "streamasr.toml"
        _one_worker_config(config, f"full{uuid.uuid4().hex[:8]}", fs / "run")
        done = _streamasr("serve", "--config", str(config), "--model", "null", timeout=60)
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.startswith("streamasr serve: error: ") and str(fs / "run") in done.stderr, done.stderr
        assert not (fs / "run").exists()  # made by this serve: nothing left behind


def test_a_run_dir_on_a_read_only_file_system_is_not_said_to_be_another_users(tmp_path: Path) -> None:
    """The instance's own run directory, on a file system mounted read-only since its last run:
    serve must not send the operator looking for another user."""
    with _small_tmpfs(tmp_path) as fs:
        config = tmp_path / "streamasr.toml"
        _one_worker_config(config, f"ro{uuid.uuid4().hex[:8]}", fs / "run")
        (fs / "run").mkdir(mode=0o700)
        (fs / "run" / "config.toml").write_text("")  # a previous run's
        subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
        done = _streamasr("serve", "--config", str(config), "--model", "null", timeout=60)
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
        assert "another user's" not in done.stderr and "read-only" in done.stderr, done.stderr


def _model_dir(tmp_path: Path, model_bin: bytes | None = None, tokenizer: str | None = None) -> Path:
    """A CTranslate2 model directory: whisper-tiny.en's files, or the model.bin or tokenizer.json given."""
    tiny = loader.resolve_model(settings.ModelConfig(name="whisper-tiny.en")).dir
    model = tmp_path / "mine"
    model.mkdir()
    for name, given in (("model.bin", model_bin), ("tokenizer.json", tokenizer)):
        if given is None:
            (model / name).symlink_to(tiny / name)
        else:
            (model / name).write_bytes(given if isinstance(given, bytes) else given.encode())
    return model


def _model_config(tmp_path: Path, cache_dir: Path) -> Path:
    """A one-worker service on free ports whose graphs go to `cache_dir`."""
    config = tmp_path / "streamasr.toml"
    _one_worker_config(config, f"model{uuid.uuid4().hex[:8]}", tmp_path / "run")
    config.write_text(config.read_text() + f'[model]\ncache_dir = "{cache_dir}"\n')
    return config


def test_a_model_bin_cut_short_is_refused_by_its_path_not_a_traceback(tmp_path: Path) -> None:
    """A model directory whose model.bin is damaged (a copy that stopped midway): `export` and
    `serve` must say which file is wrong, as they do for an unknown model."""
    tiny = loader.resolve_model(settings.ModelConfig(name="whisper-tiny.en")).model_bin
    with open(tiny, "rb") as fh:
        model = _model_dir(tmp_path, model_bin=fh.read(1 << 20))
    config = _model_config(tmp_path, tmp_path / "cache")
    for command in ("export", "serve"):
        done = _streamasr(command, "--config", str(config), "--model", str(model), timeout=60)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.splitlines()[-1].startswith(f"streamasr {command}: error: {model / 'model.bin'}"), done.stderr
    assert not (tmp_path / "run").exists()
    assert not list((tmp_path / "cache" / "onnx").glob(".*tmp*"))


def test_a_tokenizer_json_that_cannot_be_read_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """The ingest and every worker read the model's tokenizer.json as they start: one that is not a
    tokenizer had them fail over and over under supervisord while `serve` said nothing."""
    model = _model_dir(tmp_path, tokenizer='{"model": ')
    config = _model_config(tmp_path, tmp_path / "cache")
    serve = _started("serve", "--config", str(config), "--model", str(model), stderr=subprocess.PIPE)
    try:
        _, err = serve.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        _streamasr("stop", "--config", str(config))
        serve.communicate(timeout=60)
        pytest.fail("serve started processes that cannot read tokenizer.json")
    assert serve.returncode == 2 and "Traceback" not in err, err
    assert err.startswith(f"streamasr serve: error: {model / 'tokenizer.json'}"), err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("fault", "said"), [("full", "No space left on device"), ("read-only", "Read-only file system")])
def test_a_cache_dir_that_cannot_take_the_graphs_is_refused_not_a_traceback(tmp_path: Path, fault: str, said: str) -> None:
    """`export` (and `serve`'s export) into a cache_dir on a full or read-only file system must say
    where it could not write, as the other refusals do, and leave no half-written graphs."""
    with _small_tmpfs(tmp_path) as fs:
        if fault == "full":
            (fs / "fill").write_bytes(b"\0" * 64 * 1024)
        else:
            subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
        config = _model_config(tmp_path, fs / "cache")
        done = _streamasr("export", "--config", str(config), "--model", "whisper-tiny.en", timeout=120)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        last = done.stderr.splitlines()[-1]
        assert last.startswith("streamasr export: error: ") and str(fs / "cache") in last and said in last, done.stderr
        assert not list(fs.glob("cache/onnx/*/*.onnx")) and not list(fs.glob("cache/onnx/.*tmp*"))


@pytest.mark.base
def test_whisper_base_loads_from_a_read_only_cache_it_was_exported_to(tmp_path: Path) -> None:
    """A cache exported ahead of time (an image's build step) and mounted read-only where the
    service runs: whisper-tiny.en's graphs load from it, and so must whisper-base's, whose weights
    the export assembled into that cache."""
    model = settings.ModelConfig(name="whisper-base")
    exported = loader.ensure_all_exported(model, quiet=True)
    mount = tmp_path / "cache"
    mount.mkdir()
    if subprocess.run(["mount", "--bind", str(loader.cache_root(model)), str(mount)], capture_output=True).returncode:
        pytest.skip("cannot bind-mount here")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(mount)], check=True)
        done = _streamasr("export", "--config", str(_model_config(tmp_path, mount)), "--model", "whisper-base", timeout=120)
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
        assert done.stdout.split() == [str(mount / path.relative_to(loader.cache_root(model))) for path in exported]
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=True)
