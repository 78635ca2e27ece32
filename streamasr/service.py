"""Start, inspect and stop a service instance under supervisord.

`serve` first refuses what would make the service's processes fail at start over and over
(unusable keys, addresses it cannot bind, an unknown model, no room in /dev/shm), exports the
model once (rather than in every worker at once), reclaims shm left by a crashed instance,
writes the effective config into the instance's run directory so that every process
supervisord starts reads exactly the same settings, then hands over to supervisord.
"""

from __future__ import annotations

import configparser
import contextlib
import errno
import fcntl
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil
import zmq

from config import settings
from config.settings import Config
from ingest import resume
from protocol import auth
from protocol.auth import Curve
from protocol import messages as m
from shm import pool
from streamasr import supervised

HOME = Path(__file__).resolve().parents[1]
SUPERVISORD_CONF = HOME / "supervisord.conf"
DRAIN_EXIT_S = 2.0  # an ingest's time to close its sockets and unlink its rings once a drain ends
STOP_SLACK_S = 5.0  # supervisord's own shutdown, beyond its programs' stop times
STARTING_WAIT_S = 600.0  # `stop` of an instance still starting: how long a model export may take before it is up
LAST_WORDS_BYTES = 65_536  # the end of a log read for its last line: one crash's traceback, JSON-escaped, fits
LAST_WORDS_CHARS = 300  # of that line, what `status` shows
FDS_CEILING = 1 << 20  # the most `serve` raises the soft limit on open files to
FDS_SPARE = 64  # an ingest's descriptors besides its clients' and workers' connections: sockets, shm, logs, threads (about 30 idle)
CLAIM_FD = 3  # where supervisord keeps the instance's claim: it closes 5 and up when SIGHUP reloads it, and 3 and up in its programs
BIND_GRACE_S = 10.0  # a program running this long has bound its sockets (they bind within seconds of starting)
UP_STATES = ("STARTING", "RUNNING")  # supervisord's states of a program that runs: STARTING until its `startsecs` have passed
# supervisord's states of a program whose start failed: retried after a backoff, or given up; `status` says why
FAILED_STATES = ("BACKOFF", "FATAL")
RUN_DIR_LOCK_WAIT_S = 5.0  # a cleaner holds its lock for a moment; anything longer is said, not waited on
RUN_DIR_LOCK_FD = 4  # where it keeps its lock on the run directory (`lock_run_dir`), which that reload keeps too


def stop_waits() -> dict[str, float]:
    """Each program's (and event listener's) `stopwaitsecs` in supervisord.conf: how long
    supervisord lets it stop before it SIGKILLs it (supervisord's default, 10 s, where none is set)."""
    conf = configparser.RawConfigParser()
    conf.read(SUPERVISORD_CONF)
    return {name.partition(":")[2]: conf.getfloat(name, "stopwaitsecs", fallback=10.0)
            for name in conf.sections() if name.startswith(("program:", "eventlistener:"))}


def stop_timeout() -> float:
    """The longest a stop can take: supervisord stops its programs one priority after another,
    each within its stopwaitsecs."""
    return sum(stop_waits().values()) + STOP_SLACK_S


def supervisord_pid(cfg: Config) -> int | None:
    """Pid of this instance's running supervisord, if any. The pid file alone does not say: one
    that a killed supervisord left behind (a crash, a reboot with the run directory kept) may
    name a pid the system has since given to another program, which `stop` would then signal
    and `serve` would take for this instance running. So the process must be a supervisord, and
    one for this run directory where its environment is readable (however it was started:
    `serve` from any directory or release, or by hand with the STREAMASR_* variables).

    With no pid file (deleted from under the running instance: `rm -rf /tmp/*`, a tmp cleaner)
    while the instance's claim is held, its supervisord is looked for among the processes, so
    that `status` does not call a serving instance not running and `stop` still stops it."""
    try:
        pid = int((cfg.run_path / "supervisord.pid").read_text())
    except (OSError, ValueError):
        return _find_supervisord(cfg) if starting(cfg) else None
    try:
        proc = psutil.Process(pid)
    except psutil.Error:
        return None
    return pid if _supervisord_of(proc, cfg) else None


def _supervisord_of(proc: psutil.Process, cfg: Config) -> bool:
    """`proc` is a supervisord of this instance's run directory (one of another user, whose
    environment cannot be read, is taken at its command line's word)."""
    try:
        cmdline = proc.cmdline()
    except psutil.Error:
        return False
    if not any(Path(arg).name == "supervisord" for arg in cmdline[:2]):  # the program, or the script its interpreter runs
        return False
    try:
        run_dir = proc.environ().get("STREAMASR_RUN_DIR")
    except psutil.AccessDenied:  # another user's supervisord: its command line is all there is to go on
        return True
    except psutil.Error:
        return False
    return run_dir is not None and Path(run_dir).resolve() == cfg.run_path.resolve()


def _find_supervisord(cfg: Config) -> int | None:
    """The instance's supervisord among this user's processes (another user's are not taken at
    their word here: any supervisord would pass)."""
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.uids().real == os.getuid() and _supervisord_of(proc, cfg):
                return proc.pid
    return None


def unbindable_addresses(cfg: Config) -> list[str]:
    """The TCP addresses the service binds (front door, ingest processes, dashboard) that it
    could not bind now, each with why: another program or instance holds it, or no interface of
    this machine has its host. Bound the way the service binds them, by ZeroMQ, and let go at
    once: a process that could not bind would fail at start over and over under supervisord
    while `serve` said nothing."""
    ctx = zmq.Context()
    taken = []
    try:
        for address in dict.fromkeys(address for _, address in cfg.tcp_binds):
            sock = ctx.socket(zmq.ROUTER)
            try:
                sock.bind(address)
            except zmq.ZMQError as exc:
                taken.append(f"{address} ({os.strerror(exc.errno)})")
            finally:
                sock.close(linger=0)
    finally:
        ctx.term()  # returns once every socket is closed: the ports are free again
    return taken


# What supervisord's command lines cannot carry: it splits them as a shell would, and the paths
# are written into them in double quotes.
UNQUOTABLE = '"\\%\n'
# What the instance's own collector (`streamasr dashboard` started by hand, before a first `serve`)
# leaves in the run directory it makes for its metrics socket.
COLLECTOR_FILES = frozenset({"metrics.sock", "metrics-state.msgpack", "metrics-state.msgpack.tmp"})


def _check_run_dir(run: Path) -> None:
    """`serve` makes the run directory private and clears its sockets: it must be this
    instance's own (or new), and it and the interpreter must fit supervisord's command lines."""
    if run.exists() and not run.is_dir():
        raise SystemExit(f"run_dir {run} is not a directory: give the instance a directory of its own")
    if run.is_dir() and not os.access(run, os.R_OK | os.W_OK | os.X_OK):
        if os.statvfs(run).f_flag & os.ST_RDONLY:  # the instance's own, on a file system mounted read-only
            raise SystemExit(f"run_dir {run} is on a read-only file system: give this instance a writable directory")
        if run.stat().st_uid == os.geteuid():
            raise SystemExit(f"run_dir {run} is not writable by its owner (mode {run.stat().st_mode & 0o777:o}): "
                             "make it so, or give this instance a directory of its own")
        raise SystemExit(f"run_dir {run} is another user's: serve as that user, or give this instance a directory of its own")
    if run.is_dir() and any(p.name not in COLLECTOR_FILES for p in run.iterdir()) and not (run / "config.toml").is_file():
        raise SystemExit(f"run_dir {run} holds files of something else: give the instance a directory of its own "
                         "(serve makes it private to its user and clears its sockets)")
    for what, path in (("run_dir", str(run)), ("the Python interpreter", sys.executable), ("the installation", str(HOME))):
        if bad := sorted(set(path) & set(UNQUOTABLE)):
            raise SystemExit(f"{what} {path!r} has {''.join(bad)!r} in it, which supervisord's command lines cannot carry")


def prepare(cfg: Config) -> dict[str, str]:
    """Model export, shm reclaim, run directory and config file; returns supervisord's
    environment. What cannot start is found first (the CURVE keys, the addresses, the model,
    room in /dev/shm) and leaves nothing behind."""
    refuse_running(cfg)
    _check_run_dir(cfg.run_path)
    try:
        auth.check_server_keys(cfg.ingest.curve_secret_key, cfg.ingest.curve_authorized_keys)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    try:
        shared_key = resume.shared_key(cfg.ingest.resume_key_file) if cfg.ingest.resume_key_file else None
    except ValueError as exc:  # a setting that cannot work
        raise settings.ConfigError(str(exc)) from None
    if cfg.model.backend == "tensorrt":
        # Every worker would fail to load it, over and over under supervisord.
        raise settings.ConfigError('model.backend "tensorrt" is not available in this release: the TensorRT backend '
                                   'is not built yet; use "onnxruntime" (the same exported graphs on CPU)')
    if cfg.ingest.drain_timeout_s + DRAIN_EXIT_S > (wait := stop_waits()["ingest"]):
        raise settings.ConfigError(f"ingest.drain_timeout_s ({cfg.ingest.drain_timeout_s:g} s) and {DRAIN_EXIT_S:g} s to exit "
                                   f"do not fit in the ingest's stopwaitsecs ({wait:g} s, {SUPERVISORD_CONF.name}): "
                                   "supervisord would kill it mid-drain")
    if taken := unbindable_addresses(cfg):
        raise SystemExit(f"cannot bind {', '.join(taken)}: choose other addresses (ingest.address, ingest.host, "
                         "ingest.port_base, metrics.dashboard_port)")
    if cfg.model.backend != "null" and cfg.model.name != "null":
        from speech.loader import ensure_all_exported, served_languages

        served_languages(cfg.model)  # the ingest and every worker read the tokenizer at start
        ensure_all_exported(cfg.model)
    for name in pool.reclaim(cfg.instance):
        print(f"reclaimed shm segment {name} left by a previous run", file=sys.stderr)
    need = cfg.ingest.processes * pool.segment_size(cfg.shm.streams_per_ingest, pool.ring_capacity(cfg.shm.ring_seconds))
    if need > (free := pool.free_bytes()):
        # Each ingest process would fail to allocate its rings at start, over and over.
        raise SystemExit(f"{pool.SHM_DIR} has {free / 2**20:,.0f} MiB free; {cfg.ingest.processes} ingest process(es) of "
                         f"{cfg.shm.streams_per_ingest} streams of {cfg.shm.ring_seconds:g} s need {need / 2**20:,.0f} MiB: "
                         "lower shm.streams_per_ingest or shm.ring_seconds, or give it more room (a container's --shm-size)")
    run = cfg.run_path
    created = not run.exists()
    try:
        run.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:  # a file on its path, a read-only file system
        raise SystemExit(f"cannot make run_dir {run}: {exc.strerror or exc}") from None
    config_file = run / "config.toml"
    partial = run / "config.toml.tmp"
    try:
        os.chmod(run, 0o700)
        for leftover in cfg.ipc_paths:  # this instance's own sockets, left by a crash: nothing else in the directory
            Path(leftover).unlink(missing_ok=True)
        cfg.metrics_state_path.unlink(missing_ok=True)  # a new service's counters start from zero
        # whole or not at all, and first: a full disk leaves neither an empty config.toml nor a
        # directory that the next serve would take for another program's
        partial.write_text(settings.dump(cfg))
        os.replace(partial, config_file)
        (run / "logs").mkdir(mode=0o700, exist_ok=True)
        resume_key = shared_key or resume.instance_key(run)
    except OSError as exc:  # a full or read-only file system
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
            if created:
                run.rmdir()
        raise SystemExit(f"cannot write run_dir {run}: {exc.strerror or exc}") from None
    env = dict(os.environ)
    env.update(
        STREAMASR_CONFIG=str(config_file),
        STREAMASR_RUN_DIR=str(run),
        STREAMASR_INSTANCE=cfg.instance,
        STREAMASR_PYTHON=sys.executable,
        STREAMASR_HOME=str(HOME),
        STREAMASR_WORKERS=str(cfg.worker_count),
        STREAMASR_INGEST_PROCS=str(cfg.ingest.processes),
        STREAMASR_RESUME_KEY=resume_key,  # the same for every ingest, and every start: see ingest/resume.py
        PYTHONUNBUFFERED="1",
    )
    return env


def raise_open_files_limit(cfg: Config) -> None:
    """Raise the soft limit on open files to the hard one (at most FDS_CEILING), for supervisord and every program it
    starts; SystemExit when even the hard limit leaves an ingest process too few for its streams.

    Every client connection is a descriptor. At the limit libzmq cannot accept a connection, and
    its IO thread retries at once, for ever: the process spins a core while new clients hang
    unanswered. The usual soft limit (1024) guards programs that still use select(), which none
    here does (libzmq polls with epoll and poll); servers raise it to the hard limit themselves."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = cfg.shm.streams_per_ingest + cfg.worker_count + FDS_SPARE
    if hard != resource.RLIM_INFINITY and hard < need:
        raise SystemExit(f"the limit on open files (ulimit -Hn) is {hard}; an ingest process of shm.streams_per_ingest "
                         f"({cfg.shm.streams_per_ingest}) streams and {cfg.worker_count} workers needs {need}: raise it "
                         "(LimitNOFILE= in a systemd unit, nofile in limits.conf, docker run --ulimit nofile=) "
                         "or lower shm.streams_per_ingest")
    # no higher than Linux's default ceiling (fs.nr_open): some libraries size tables by the limit
    target = FDS_CEILING if hard == resource.RLIM_INFINITY else min(hard, FDS_CEILING)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def _claim_name(cfg: Config) -> str:
    return f"streamasr-serve.{cfg.instance}"


def starting(cfg: Config) -> bool:
    """Whether a `serve` of the instance holds its claim (read from the kernel's list of Unix
    sockets, not by binding it, which would refuse a `serve` starting meanwhile)."""
    try:
        with open("/proc/net/unix") as table:
            return any(line.split()[-1] == "@" + _claim_name(cfg) for line in table if len(line.split()) == 8)
    except OSError:
        return False


def claim(cfg: Config) -> socket.socket:
    """An abstract Unix socket named by the instance, which one `serve` at a time can bind. A
    second `serve` while the first is still starting (exporting the model; its supervisord not
    up, so no pid file and nothing bound yet) would find nothing running, clear the first's
    sockets and start a supervisord of its own. The kernel lets it go with the last process
    holding it, however that ends; the instance, not the run directory, names the shm segments."""
    held = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        held.bind("\0" + _claim_name(cfg))
    except OSError as exc:
        held.close()
        if exc.errno != errno.EADDRINUSE:
            raise
        refuse_running(cfg)  # where it runs, when it is up
        raise SystemExit(f"instance {cfg.instance!r} is already starting: another `streamasr serve` of it holds it") from None
    return held


def refuse_running(cfg: Config) -> None:
    """SystemExit when the instance runs: from this run directory, or from another (its shm
    segments are named by the instance alone), or as processes that outlived their supervisord."""
    if supervisord_pid(cfg) is not None:
        raise SystemExit(f"instance {cfg.instance!r} is already running (run dir {cfg.run_path})")
    if users := pool.users(cfg.instance):
        # its segments are named by the instance alone: reclaiming them would pull the rings from under it
        raise SystemExit(f"instance {cfg.instance!r} is running from another run directory, or its processes outlived "
                         f"their supervisord: pid(s) {', '.join(map(str, users))} map its shm segments. Stop it, or give "
                         "this one another instance name (--instance)")
    # Another user's processes are not in `users` (their maps are private to them), and /dev/shm
    # is sticky: `reclaim` could not unlink their segments. Root sees and may do both.
    if os.geteuid() != 0 and (theirs := {n: uid for n, uid in pool.owners(cfg.instance).items() if uid != os.geteuid()}):
        raise SystemExit(f"instance {cfg.instance!r} has shm segments of another user (uid "
                         f"{', '.join(sorted({str(uid) for uid in theirs.values()}))}): {', '.join(theirs)}. That user runs "
                         "it or left them behind: give this one another instance name (--instance)")


def lock_run_dir(run: Path) -> int:
    """A descriptor of the run directory holding a BSD lock on it. systemd-tmpfiles, which ages
    out /tmp on most distributions (`q /tmp 1777 root root 10d`), skips a locked directory and
    everything below it; unlocked, it removed the files the instance wrote once at start
    (config.toml, supervisord.pid, supervisor.sock, a quiet program's log) while it served,
    keeping only the sockets ZeroMQ listens on."""
    fd = os.open(run, os.O_RDONLY | os.O_DIRECTORY)
    # exclusive: tmpfiles.d(5) says the cleaner takes a shared lock (systemd 252 takes an exclusive
    # one); either is refused while this is held, and the cleaner then skips the directory. Not
    # waited on for ever: a cleaner holds it for a moment, and a file system without locks has none.
    deadline = time.monotonic() + RUN_DIR_LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise SystemExit(f"the run directory {run} is locked by another process (lsof +D {run} names it)") from None
            time.sleep(0.1)
        except OSError as exc:  # ENOLCK: NFS without a lock manager, say
            print(f"warning: cannot lock the run directory {run} ({exc.strerror}): a tmp cleaner may age out its files",
                  file=sys.stderr, flush=True)
            return fd


def serve(cfg: Config) -> None:
    """Replace this process with supervisord in the foreground (signals go straight to it), which
    holds the instance's `claim` and the lock on its run directory for as long as it runs."""
    held = claim(cfg)
    raise_open_files_limit(cfg)
    env = prepare(cfg)
    print(f"streamasr {cfg.instance}: {cfg.worker_count} workers, {cfg.ingest.processes} ingest, model "
          f"{cfg.model.name} ({cfg.model.backend}), clients connect to {cfg.ingest.address}", file=sys.stderr, flush=True)
    os.dup2(held.fileno(), CLAIM_FD)
    os.set_inheritable(CLAIM_FD, True)
    os.dup2(lock_run_dir(cfg.run_path), RUN_DIR_LOCK_FD)
    os.set_inheritable(RUN_DIR_LOCK_FD, True)
    env[supervised.SUPERVISORD_PID] = str(os.getpid())  # supervisord's pid once this process becomes it
    supervisord = Path(sys.executable).with_name("supervisord")
    os.execve(str(supervisord), [str(supervisord), "-n", "-c", str(SUPERVISORD_CONF)], env)




def ops_curve(cfg: Config) -> Curve | None:
    """The keys `status` and `transcribe` talk to the service with; None when CURVE is off.

    Raises ValueError when CURVE is on but `ingest.curve_client_key` is not set: a plain query
    would only go unanswered, which reads as a dead service. The server's public key comes from
    its key file, so the service's own config file is all an operator needs. A key file that
    cannot be read raises ValueError naming the setting to fix.
    """
    if not auth.curve_settings(cfg.ingest.curve_secret_key, cfg.ingest.curve_authorized_keys):
        return None
    if not cfg.ingest.curve_client_key:
        raise ValueError("CURVE is on and ingest.curve_client_key (an authorized client key pair) is not set")
    try:
        _, secret = auth.read_key_pair(cfg.ingest.curve_client_key)
    except (OSError, ValueError) as exc:
        raise ValueError(f"ingest.curve_client_key: {exc}") from None
    try:
        return auth.read_public_key(cfg.ingest.curve_secret_key), secret
    except (OSError, ValueError) as exc:
        raise ValueError(f"ingest.curve_secret_key: {exc}") from None


def front_door(address: str, msg: m.ClientMessage, timeout: float = 2.0, curve: Curve | None = None) -> m.ServerMessage:
    """One request/reply with the broker's front door; `curve` when it is a CURVE server (see `ops_curve`)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        auth.apply_client_curve(sock, *curve)
    sock.connect(address)
    try:
        sock.send_multipart(m.encode(msg))
        if not sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"no answer from {address} within {timeout} s")
        return m.decode_server(sock.recv_multipart())
    finally:
        sock.close()


def processes(cfg: Config) -> list[dict[str, Any]]:
    """supervisord's view of each program, over its unix socket (TimeoutError: one that does not
    answer, see `supervised.rpc`)."""
    with supervised.rpc(cfg.run_path / "supervisor.sock") as supervisor:
        return supervisor.getAllProcessInfo()


def last_words(cfg: Config, name: str) -> str:
    """What process `name` said last in its log: a JSON line's event and its reason, error or the
    last line of its traceback (a program that failed at start said why there); "" for no log."""
    try:
        with open(cfg.run_path / "logs" / f"{name}.log", "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - LAST_WORDS_BYTES))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    line = next((line for line in reversed(lines) if line.strip()), "")
    try:
        event = json.loads(line)
    except ValueError:  # not a log line of ours: an interpreter that failed before logging, say
        return line[:LAST_WORDS_CHARS]
    if not isinstance(event, dict):
        return line[:LAST_WORDS_CHARS]
    said = event.get("reason") or event.get("error") or str(event.get("exception", "")).strip().rpartition("\n")[2]
    name = str(event.get("event", ""))
    return (f"{name}: {said}" if said else name or line)[:LAST_WORDS_CHARS]


def start_failed_why(cfg: Config, info: dict[str, Any]) -> str:
    """Why process `info` (a row of supervisord's list) failed to start, while supervisord backs
    off before its next try (a minute or more of them, with startsecs up to a minute) or after it
    gave up: its own words, the last exit status, and the process's last words in its log."""
    why = info.get("spawnerr") or info.get("description") or "failed to start"
    if info.get("exitstatus"):
        why += f", exit status {info['exitstatus']}"
    said = last_words(cfg, info["name"])
    return f"{why}; its log ends: {said}" if said else why


def _age_s(pid: int | None) -> float:
    """How long process `pid` has run; 0 when it cannot be said."""
    try:
        return time.time() - psutil.Process(pid).create_time() if pid is not None else 0.0
    except psutil.Error:
        return 0.0


def _socket_bound(pid: int | None) -> bool:
    """Whether supervisord `pid` has bound its socket: it does before it starts any program, a
    moment after `serve` becomes it (found by its run directory then, its pid file not written
    yet). One without programs that has run BIND_GRACE_S has bound it too (they all ended)."""
    try:
        return pid is not None and (bool(psutil.Process(pid).children()) or _age_s(pid) >= BIND_GRACE_S)
    except psutil.Error:
        return False


def socket_gone(cfg: Config, pid: int) -> str:
    """What to say when the socket of supervisord `pid` (the instance's) is not there while it runs."""
    if not _socket_bound(pid):
        return f"supervisord is starting: its socket {cfg.run_path / 'supervisor.sock'} is not bound yet"
    return (f"its socket {cfg.run_path / 'supervisor.sock'} was deleted while it runs: its processes cannot be listed "
            "nor restarted one by one; `streamasr stop` stops the instance all the same")


def deleted_files(cfg: Config, uptimes: dict[str, float], supervisord_bound: bool, unlisted_s: float = 0.0) -> list[str]:
    """What the running instance `cfg` describes needs in its run directory and no longer has
    there: its config and logs directory, which a program supervisord starts again opens, and
    the sockets, which a program starting connects to (ZeroMQ retries a socket file that is not
    there for ever; each program binds its own again within a second, so one named here could
    not be: its directory gone, say). Removed by `rm -rf /tmp/*`, tmpreaper, or a tmp cleaner
    while supervisord's lock on the directory was not held. A socket counts as deleted only once
    the program that binds it has run BIND_GRACE_S (`uptimes`, by program; `unlisted_s` for one
    not in it), and supervisord's once it has bound it (`supervisord_bound`): before, it is still
    starting, not robbed."""
    if not cfg.run_path.is_dir():
        return [f"the run directory {cfg.run_path}"]
    binders = {cfg.broker_ingest_endpoint: "broker", cfg.broker_worker_endpoint: "broker", cfg.metrics_endpoint: "dashboard",
               **{cfg.ingest_results_endpoint(i): f"ingest-{i}" for i in range(cfg.ingest.processes)}}
    bound = [Path(e.removeprefix("ipc://")) for e, program in binders.items() if uptimes.get(program, unlisted_s) >= BIND_GRACE_S]
    needed = [cfg.run_path / "config.toml", cfg.run_path / "logs", *([cfg.run_path / "supervisor.sock"] if supervisord_bound else []),
              *bound]
    return [path.name for path in needed if not path.exists()]


def saved_config(cfg: Config) -> Config:
    """`cfg`, describing its running instance as that was started, from its run directory: its
    `[ingest]` (the front door `serve --address` sets, its ingest processes, the server's CURVE
    keys), its workers, its dashboard port and how often it starts a program given up on again.
    The rest is the caller's own, its client key included: that is the caller's identity, not the
    service's."""
    saved = cfg.run_path / "config.toml"
    if supervisord_pid(cfg) is None or not saved.is_file():
        return cfg
    try:
        started = settings.load_started(saved)
    except settings.ConfigError:  # not TOML: the caller's own settings are the best guess left
        return cfg
    return replace(cfg, ingest=replace(started.ingest, curve_client_key=cfg.ingest.curve_client_key),
                   workers=started.workers, metrics=started.metrics, supervisor=started.supervisor)


def status(cfg: Config) -> dict[str, Any]:
    """Processes (supervisord) and readiness (the broker's front door) in one report, by the
    running instance's own config (`saved_config`). An instance whose supervisord is not running
    is not ready, whatever answers at its address (another instance, or a leftover process).
    Another user's run directory (`serve` makes it private) hides its processes: `running` is
    then None, and readiness is the front door's answer at the caller's address."""
    foreign = cfg.run_path.is_dir() and not os.access(cfg.run_path, os.R_OK | os.X_OK)
    pid = supervisord_pid(cfg)  # once: without its pid file, supervisord is looked for among every process
    if pid is None and not foreign:
        return {"instance": cfg.instance, "address": cfg.ingest.address, "running": False, "ready": False, "processes": [],
                "supervisor_error": f"not running (no supervisord of this instance in {cfg.run_path})"}
    cfg = saved_config(cfg)
    report: dict[str, Any] = {"instance": cfg.instance, "address": cfg.ingest.address, "running": None if foreign else True,
                              "expected": {"ingests": cfg.ingest.processes, "workers": cfg.worker_count}}
    report["processes"] = []
    if foreign:
        report["supervisor_error"] = f"the run directory {cfg.run_path} is another user's: its processes are theirs to list"
    else:
        try:
            report["processes"] = [
                {"name": p["name"], "group": p["group"], "state": p["statename"], "pid": p["pid"], "uptime_s": p["now"] - p["start"] if p["pid"] else 0,
                 **({"why": start_failed_why(cfg, p)} if p["statename"] in FAILED_STATES else {})}
                for p in processes(cfg)
            ]
        except FileNotFoundError:
            assert pid is not None  # not foreign: supervisord was found
            report["supervisor_error"] = socket_gone(cfg, pid)
        except supervised.RPC_ERRORS as exc:  # something not supervisord's HTTP listening there too
            report["supervisor_error"] = str(exc)
        # STARTING too: supervisord counts a program started only its `startsecs` (up to a minute)
        # after it began, long after it bound its sockets
        uptimes = {p["name"]: p["uptime_s"] for p in report["processes"] if p["state"] in UP_STATES}
        # no list of programs: supervisord's own age stands for theirs
        unlisted_s = _age_s(pid) if "supervisor_error" in report else 0.0
        if gone := deleted_files(cfg, uptimes, _socket_bound(pid), unlisted_s):
            report["run_dir_error"] = (
                f"deleted from under the running instance: {', '.join(gone)}. A program supervisord starts again "
                "cannot start without config.toml or logs/, nor reach a socket its program could not bind again "
                "(see that program's `socket_unrestored` line); `streamasr stop` stops the instance all the same, "
                "and `serve` makes them anew")
    try:
        reply = front_door(cfg.front_door, m.Status(), curve=ops_curve(cfg))
        report.update(m.as_dict(reply))
        report.pop("type", None)
    except (TimeoutError, zmq.ZMQError, m.ProtocolError, ValueError, OSError) as exc:  # OSError: a key file unreadable
        report["ready"] = False
        report["broker_error"] = str(exc)
    return report


def given_up(report: dict[str, Any]) -> list[str]:
    """The processes supervisord gave up starting (FATAL): the instance serves without them until
    `revive` starts them again (`[supervisor] fatal_retry_s`)."""
    return [p["name"] for p in report.get("processes", []) if p["state"] == "FATAL"]


def complete(report: dict[str, Any]) -> bool:
    """Every ingest process and worker the instance runs has registered with the broker, and no
    ingest is shutting down: one that drains is on its way out (a restart), not serving."""
    expected = report.get("expected", {})
    return len(serving_ingests(report)) >= expected.get("ingests", 0) and len(report.get("workers", [])) >= expected.get("workers", 0)


def serving_ingests(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The report's ingest processes not shutting down."""
    return [i for i in report.get("ingests", []) if not i.get("draining")]


def wait_ready(cfg: Config, timeout: float) -> dict[str, Any]:
    """The report once the service is ready with its whole pool registered and no program given
    up on, or at `timeout`: the front door is ready with one ingest and one worker, and a script
    that waits to send load wants it spread over all of them."""
    deadline = time.monotonic() + timeout
    while True:
        report = status(cfg)
        if (report.get("ready") and complete(report) and not given_up(report)) or time.monotonic() > deadline:
            return report
        time.sleep(0.25)


def stop(cfg: Config, timeout: float | None = None) -> bool:
    """SIGTERM to supervisord, which stops ingest (draining), workers, then the broker; waits
    up to `timeout` (default: the longest the programs' stop times allow) for it to exit, then
    unlinks the shm segments a program killed on its way out left behind.
    PermissionError: the caller may not read its run directory or signal it (another user's instance)."""
    if cfg.run_path.is_dir() and not os.access(cfg.run_path, os.R_OK | os.X_OK):  # `serve` makes it 0700
        raise PermissionError(errno.EACCES, "the run directory is another user's", str(cfg.run_path))
    pid = supervisord_pid(cfg)
    if pid is None and starting(cfg):  # a `serve` exporting the model, or its supervisord not up yet
        print(f"instance {cfg.instance!r} is starting: waiting up to {STARTING_WAIT_S:g} s for it to be up to stop it",
              file=sys.stderr, flush=True)
        up_by = time.monotonic() + STARTING_WAIT_S
        while (pid := supervisord_pid(cfg)) is None and starting(cfg) and time.monotonic() < up_by:
            time.sleep(0.1)
    if pid is None:
        return False
    sockets = saved_config(cfg).ipc_paths  # as started: `serve --ingest N` binds N results sockets
    try:
        os.kill(pid, 15)
    except ProcessLookupError:  # it exited since its pid was read (another `stop`): stopped all the same
        return True
    deadline = time.monotonic() + (stop_timeout() if timeout is None else timeout)
    while time.monotonic() < deadline:
        if _exited(pid):
            # An ingest supervisord had to SIGKILL (it did not stop within its stopwaitsecs) could
            # not unlink its segment: its rings would hold /dev/shm until this instance's next serve.
            if not pool.users(cfg.instance):
                for name in pool.reclaim(cfg.instance):
                    print(f"reclaimed shm segment {name} left by a program killed as it stopped", file=sys.stderr)
            for path in sockets:  # ZeroMQ leaves its socket files behind when it closes them
                if _unbound(path):
                    Path(path).unlink(missing_ok=True)
            return True
        time.sleep(0.1)
    return False


def _unbound(path: str) -> bool:
    """A Unix socket file that nothing listens on any more (one still bound accepts a connection)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            return True
        except OSError:  # not there, not a socket
            return False
    return False


def _exited(pid: int) -> bool:
    """The process has exited: gone, or a zombie its parent has not reaped yet (`serve` started by
    a program that reaps its children only when it next looks), which still answers signals."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:  # gone
        return True


# ------------------------------------------------------------------ private instances (bench, tests)


def free_ports(count: int) -> int:
    """A base port with `count` consecutive free ports on loopback."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count >= 65535:
            continue
        try:
            for port in range(base + 1, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free port range")


class Refused(RuntimeError):
    """`serve` refused to start an instance (a model or setting it cannot run): its message, and
    its exit status as `code`."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class LocalService:
    """An instance this process started with `streamasr serve` (supervisord in the foreground)."""

    cfg: Config
    proc: subprocess.Popen
    config_file: Path

    @property
    def address(self) -> str:
        return self.cfg.front_door

    def logs(self, program: str) -> str:
        """The program's log up to its last whole line: a line being written may be half there."""
        path = self.cfg.run_path / "logs" / f"{program}.log"
        text = path.read_text() if path.exists() else ""
        return text[: text.rfind("\n") + 1]

    def stop(self, timeout: float | None = None) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(stop_timeout() if timeout is None else timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def launch(root: Path, overrides: dict[str, Any] | None = None, ready_timeout: float = 300.0,
           cls: type[LocalService] = LocalService) -> LocalService:
    """Start an instance of its own — name, run directory under `root`, free loopback ports — and
    wait until the broker reports every ingest and worker of the config."""
    overrides = overrides or {}
    ingests = settings.load(None, overrides).ingest.processes
    base = free_ports(ingests + 2)  # front door, ingest processes, dashboard
    instance = f"s{uuid.uuid4().hex[:8]}"
    own = {
        "instance": instance,
        "run_dir": str(root / instance),
        "ingest": {"address": f"tcp://127.0.0.1:{base}", "port_base": base + 1},
        "metrics": {"dashboard_port": base + 1 + ingests},
    }
    cfg = settings.load(None, settings.merge(overrides, own))
    config_file = root / f"{instance}.toml"
    config_file.write_text(settings.dump(cfg))
    return start(cfg, config_file, ready_timeout, cls)


def start(cfg: Config, config_file: Path, ready_timeout: float = 300.0,
          cls: type[LocalService] = LocalService) -> LocalService:
    """`streamasr serve` of the instance `config_file` sets up, waited for as `launch` does: a
    stopped one starts again as it would for its operator."""
    env = {**os.environ, "STREAMASR_CONFIG": str(config_file)}
    proc = subprocess.Popen([sys.executable, "-m", "streamasr.cli", "serve"], cwd=HOME, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    service = cls(cfg, proc, config_file)
    deadline = time.monotonic() + ready_timeout
    report: dict[str, Any] = {}
    while time.monotonic() < deadline and proc.poll() is None:
        report = status(cfg)
        if report.get("ready") and complete(report):
            return service
        time.sleep(0.25)
    refused = proc.poll()  # `serve` exited on its own: it said why, as it does on the command line
    service.stop()
    stderr = proc.stderr.read() if proc.stderr else ""
    if refused:
        raise Refused(stderr.strip() or f"streamasr serve exited with status {refused}", refused)
    raise RuntimeError(f"service did not become ready: {report}\n{stderr}")
