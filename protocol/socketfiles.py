"""The Unix socket files a process binds in the run directory, kept there while it runs.

A socket file deleted while its process serves (`rm -rf /tmp/*`, tmpreaper) leaves the process
serving the connections it has, but a peer that connects afterwards (a worker supervisord
restarted) finds no file, and ZeroMQ retries it for ever without a word. So the binding process
checks its files once a second (a `stat` each) and binds one deleted or replaced again.

The old listener is not unbound first: unbinding an endpoint in libzmq also ends every connection
accepted through it, which would cut every live peer for a file nobody can reach any more. It
keeps one descriptor, on the deleted file, until the socket closes.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import zmq


def endpoint_in_use(address: str) -> bool:
    """Whether something is accepting connections on an ipc endpoint (another process)."""
    path = address.removeprefix("ipc://")
    if not os.path.exists(path):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
            return True
        except OSError:
            return False


def socket_file_state(address: str) -> str:
    """What a peer finds at an ipc endpoint's path: `exists` or `missing` (said in its logs)."""
    return "exists" if os.path.exists(address.removeprefix("ipc://")) else "missing"


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


@dataclass
class Lost:
    """A socket file found gone or not the process's own: `restored` when bound again, else `error` says why not."""

    path: str
    why: str  # `deleted`, or `replaced` (another file at the path)
    restored: bool
    error: str = ""


@dataclass
class _Bound:
    sock: zmq.Socket
    endpoint: str
    identity: tuple[int, int] | None
    told: bool = False  # a failure to restore it was reported: not again each second


class SocketFiles:
    """Binds sockets and restores the ipc files among them (`check`, from the process's own loop)."""

    def __init__(self) -> None:
        self._bound: list[_Bound] = []

    def bind(self, sock: zmq.Socket, endpoint: str) -> None:
        sock.bind(endpoint)
        if endpoint.startswith("ipc://"):
            self._bound.append(_Bound(sock, endpoint, _identity(endpoint.removeprefix("ipc://"))))

    def check(self) -> list[Lost]:
        """Bind again each file deleted or replaced since it was bound, except one another process
        listens on (taken back, its peers would be cut, and two such processes would take it from
        each other every second). What was found, to log; a bind that fails is said once and
        retried at each check."""
        found = []
        for bound in self._bound:
            path = bound.endpoint.removeprefix("ipc://")
            now = _identity(path)
            if now is not None and now == bound.identity:
                continue
            why = "deleted" if now is None else "replaced"
            if now is not None and endpoint_in_use(bound.endpoint):
                bound.identity = now  # not probed again each second, only once that file changes too
                found.append(Lost(path, why, restored=False, error="another process listens on it"))
                continue
            try:
                # not into a run directory made anew: without its config, logs and supervisord's
                # lock it serves nothing restarted, and its absence says more to `status`
                if not os.path.isdir(os.path.dirname(path)):
                    raise FileNotFoundError(f"its directory {os.path.dirname(path)} was deleted")
                bound.sock.bind(bound.endpoint)
            except (OSError, zmq.ZMQError) as exc:  # tried again at the next check, said once
                if not bound.told:
                    bound.told = True
                    found.append(Lost(path, why, restored=False, error=str(exc)))
                continue
            bound.identity, bound.told = _identity(path), False
            found.append(Lost(path, why, restored=True))
        return found
