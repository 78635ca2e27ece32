"""What every service program does first under its supervisor, and how one talks to supervisord."""

from __future__ import annotations

import argparse
import ctypes
import http.client
import os
import signal
import socket
import xmlrpc.client
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from supervisor.xmlrpc import Faults, SupervisorTransport, UnixStreamHTTPConnection

from config import settings
from config.settings import Config
from streamasr import logs

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
SUPERVISORD_PID = "STREAMASR_SUPERVISORD_PID"  # set by `serve` for the programs of the supervisord it becomes
SUPERVISOR_TIMEOUT_S = 2.0  # supervisord answers at once; longer is a supervisord that will not
# What asking supervisord can fail with: its socket gone or refusing, a timeout, an unknown name
# (Fault), and something not HTTP at all listening there.
RPC_ERRORS = (OSError, xmlrpc.client.Error, http.client.HTTPException)


def arguments(module: str, description: str | None) -> argparse.ArgumentParser:
    """The command line of `python -m <module>`: the `--config` every program takes, to which
    a program adds its own flags."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
    parser.add_argument("--config", help=f"TOML config (default: ${settings.CONFIG_ENV}, then built-in defaults)")
    return parser


def run(name: str, config: str | None, serve: Callable[[Config, Any], int | None], *, index: int | None = None,
        stopped_first: bool = False, **tags: Any) -> int:
    """What every program does under supervisord around `serve(cfg, log)`, its own part (which
    claims its TCP port, if it has one, before its heavy imports: `claim_port_early`): it ends
    with its parent (`end_with_parent`), loads its config and logs JSON lines as `name`
    (`name-index` with an index), tagged with `tags`. The exit status is `serve`'s (None: 0), or
    1 for an exception, logged `<name>.crashed` with its traceback in one JSON line: the logs
    are read as JSON lines, and a bare traceback would stop `jq` at its first line."""
    end_with_parent(stopped_first)
    cfg = settings.load(config)
    log = logs.configure(name if index is None else f"{name}-{index}", cfg.log_level, **tags)
    try:
        return serve(cfg, log) or 0
    except Exception:
        log.exception(f"{name}.crashed")
        return 1


def end_with_parent(stopped_first: bool = False) -> None:
    """Have the kernel send SIGTERM when the parent (supervisord) dies, so the program stops as
    on `streamasr stop` (the ingest drains, shm is unlinked). Killed outright, supervisord would
    otherwise leave its programs serving with no one to stop them: `status` and `stop` find no
    instance, and `serve` cannot bind its addresses. Stop at once, too, where the stop signal
    supervisord sent came before this program was running to take it (`_stop_missed`;
    `stopped_first`: those supervisord stops first when it shuts down, the revive listener and the ingests)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    # Asked too late to be told: a supervisord killed while this program started (its imports
    # take seconds) is gone already, and the program is another's child now. `serve` names the
    # supervisord it becomes; a program started otherwise (by hand) has only the kernel's word.
    parent = os.environ.get(SUPERVISORD_PID)
    if (parent and os.getppid() != int(parent)) or _stop_missed(stopped_first):
        os.kill(os.getpid(), signal.SIGTERM)


def _stop_missed(stopped_first: bool) -> bool:
    """The stop signal supervisord sent this process went astray: sent in the instant between
    supervisord's fork and the exec of the program (a SIGTERM to supervisord just as it starts its
    programs, or restarts one that crashed; a `supervisorctl stop` then), it reached supervisord's
    own handler, still installed in the child, and the exec dropped it. The program would serve on
    until supervisord SIGKILLs it at its stopwaitsecs, and an ingest killed so leaves its shm
    segment behind. Asked once this process runs: a stop signal sent from here on reaches it.

    A supervisord shutting down answers nothing, this process's state included: it has sent, or
    is about to send, its stop to the program it stops first (`stopped_first`), which stops now;
    the others wait for theirs, an ingest's drain may need them. False where supervisord cannot
    be asked (a program started by hand, its socket deleted): only its signal will tell."""
    url, group, name = (os.environ.get(var) for var in ("SUPERVISOR_SERVER_URL", "SUPERVISOR_GROUP_NAME", "SUPERVISOR_PROCESS_NAME"))
    if not (url and url.startswith("unix://") and group and name):
        return False
    try:
        with rpc(Path(url.removeprefix("unix://"))) as supervisor:
            info = supervisor.getProcessInfo(f"{group}:{name}")
    except xmlrpc.client.Fault as fault:
        return stopped_first and fault.faultCode == Faults.SHUTDOWN_STATE
    except RPC_ERRORS:
        return False
    return info["pid"] == os.getpid() and info["statename"] == "STOPPING"


class _UnixConnection(UnixStreamHTTPConnection):
    """supervisor's HTTP over a unix socket, with the connection's timeout: its own waits forever."""

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.socketfile)


def claim_port_early(endpoint: str) -> None:
    """Raise OSError (EADDRINUSE, naming `endpoint`) when another process holds `endpoint`'s TCP
    port, before a program's heavy imports: an ingest's take a second or more (ONNX Runtime), and
    a program that fails later than its `startsecs` counts as started, so supervisord starts it
    again at once, for ever, a core spent on imports, and never gives it up for `revive`
    (streamasr/revive.py) to start again once the port is free. Failing first, its start fails,
    retried with supervisord's backoff. The port is bound as ZeroMQ binds it (SO_REUSEADDR: a
    port in TIME_WAIT is free) and let go at once; one taken after this is the bind's to find."""
    if not endpoint.startswith("tcp://"):
        return
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("" if host == "*" else host, int(port)))
        except OSError as exc:
            raise OSError(exc.errno, f"cannot bind {endpoint}: {exc.strerror}") from None


@contextmanager
def rpc(sock: Path) -> Iterator[Any]:
    """supervisord's `supervisor` XML-RPC namespace over its unix socket `sock`. A call it does not
    answer within SUPERVISOR_TIMEOUT_S raises TimeoutError, rather than hold the caller (the
    dashboard's one collecting thread, `status`, a program starting) for as long as it says nothing."""
    transport = SupervisorTransport(None, None, f"unix://{sock}")

    def connection() -> _UnixConnection:
        conn = _UnixConnection("localhost", timeout=SUPERVISOR_TIMEOUT_S)
        conn.socketfile = str(sock)
        return conn

    transport._get_connection = connection
    try:
        yield xmlrpc.client.ServerProxy("http://127.0.0.1", transport=transport).supervisor
    finally:
        transport.close()
