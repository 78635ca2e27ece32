"""CurveZMQ on the client-facing sockets: encryption plus a list of authorized client keys.

Keys are pyzmq certificate files (`zmq.auth.create_certificates`): the server holds its secret
key file, and a directory with one public key file per authorized client. A client needs the
server's public key and its own key pair. The server side authenticates through ZAP in a thread
of the same ZeroMQ context, so refusals are counted and logged where the process logs everything else.
"""

from __future__ import annotations

import glob
import os
from typing import TYPE_CHECKING

import structlog
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.z85 import Z85CHARS

from streamasr.logs import Throttle

if TYPE_CHECKING:  # the clients import this module, and need none of the service's metrics
    from metrics.registry import ProcessMetrics

log = structlog.get_logger()


def _load_certificate(path: str | os.PathLike[str]) -> tuple[bytes, bytes | None]:
    """zmq.auth.load_certificate, with a key line that has no `=` a ValueError (pyzmq raises IndexError)."""
    try:
        return zmq.auth.load_certificate(path)
    except IndexError:
        raise ValueError(f"{path} has a key line without '='") from None


def _is_key(key: bytes) -> bool:
    """A CURVE key in z85: a value cut short or mistyped would never match, or stop the socket taking it."""
    return len(key) == 40 and all(c in Z85CHARS for c in key)


def read_public_key(path: str | os.PathLike[str]) -> bytes:
    """The z85 public key of a certificate file (public or secret)."""
    public, _ = _load_certificate(path)
    if not _is_key(public):
        raise ValueError(f"{path}: its public key is not a 40-character z85 CURVE key")
    return public


def read_key_pair(path: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """(public, secret) z85 keys of a secret certificate file; the public key must be the secret one's."""
    public, secret = _load_certificate(path)
    if secret is None:
        raise ValueError(f"{path} holds no secret key")
    try:
        derived = zmq.curve_public(secret) if _is_key(secret) else None
    except zmq.ZMQError:  # z85 characters, but not a value libzmq decodes
        derived = None
    if derived is None:
        raise ValueError(f"{path}: its secret key is not a 40-character z85 CURVE key")
    if derived != public:
        raise ValueError(f"{path}: its public key is not the one of its secret key")
    return public, secret


def authorized_keys(directory: str) -> set[bytes]:
    """The public keys of the `*.key` files in `directory`; ValueError naming a file whose key is
    not a CURVE key: it would match no client, and that client would be refused."""
    if not os.path.isdir(directory):
        raise OSError(f"Invalid certificate directory: {directory}")
    return {read_public_key(path) for path in sorted(glob.glob(os.path.join(directory, "*.key")))}


Curve = tuple[bytes, bytes]  # what a client needs: (the server's public key, its own secret key), z85


def apply_client_curve(sock: zmq.Socket, server_public: bytes, client_secret: bytes) -> None:
    """Make `sock` a CURVE client of a server with `server_public`; call before connect.

    Keys are z85 bytes; the client's public key is derived from its secret one.
    """
    sock.curve_serverkey = server_public
    sock.curve_secretkey = client_secret
    sock.curve_publickey = zmq.curve_public(client_secret)


def apply_server_curve(sock: zmq.Socket, secret_key_file: str) -> None:
    """Make `sock` a CURVE server with the key pair in `secret_key_file`; call before bind."""
    public, secret = read_key_pair(secret_key_file)
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_server = True


# A key refused is refused on every try until the process restarts with another list, and a
# client retries each reconnect interval (0.1 s by default): a line a minute per key tells the
# operator as much as ten a second would, and the first refusal of each key is written at once.
REFUSED_LOG_INTERVAL_S = 60.0
# Anyone with the server's public key can make up a new client key for every handshake: past this
# many keys first refused in a minute, their lines are held back and counted on the next line
# written. Clients left on a key no longer listed are still each named, this many a minute.
REFUSED_NEW_KEYS_PER_INTERVAL = 10


class _AuthorizedKeys:
    """ZAP credentials callback: a key is in the directory, or the handshake is refused, counted
    and logged (at most a line a minute per key, and a few a minute for keys not seen before).
    Runs on the authenticator's thread only."""

    def __init__(self, directory: str, process: str, metrics: ProcessMetrics) -> None:
        self.keys = authorized_keys(directory)
        self.process = process
        self.metrics = metrics
        self.throttle = Throttle("auth.refused", REFUSED_LOG_INTERVAL_S, new_keys=REFUSED_NEW_KEYS_PER_INTERVAL)
        if not self.keys:
            log.warning("auth.no_authorized_keys", directory=directory)

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        self.metrics.inc("auth_refusals_total")
        if (suppressed := self.throttle(key)) is not None:
            log.warning("auth.refused", process=self.process, client_key=key.decode(errors="replace"), domain=domain,
                        reason="client public key not authorized", suppressed=suppressed,
                        held_back=self.throttle.take_untold())
        return False

    def log_suppressed(self) -> None:
        """The refusals no line has told yet, one line per key and one for those of keys no line
        names (held back, or forgotten): else a flood's last minute goes untold."""
        self.throttle.tell_untold(log, lambda key: {"client_key": key.decode(errors="replace")}, process=self.process)


class Authenticator(ThreadAuthenticator):
    """The ZAP handler's thread, which on stop tells the refusals its throttled lines have not."""

    def __init__(self, ctx: zmq.Context, keys: _AuthorizedKeys) -> None:
        super().__init__(ctx)
        self.authorized = keys

    def stop(self) -> None:
        super().stop()  # the thread is joined: the callback no longer runs
        self.authorized.log_suppressed()


def start_authenticator(ctx: zmq.Context, authorized_dir: str, process: str, metrics: ProcessMetrics) -> Authenticator:
    """ZAP handler for every CURVE server socket of `ctx`; start it before binding them."""
    keys = _AuthorizedKeys(authorized_dir, process, metrics)
    auth = Authenticator(ctx, keys)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=keys)
    log.info("auth.curve_enabled", process=process, authorized=authorized_dir)
    return auth


def curve_settings(secret_key_file: str, authorized_dir: str) -> bool:
    """True when CURVE is configured; half a configuration is refused rather than run in the clear."""
    if bool(secret_key_file) != bool(authorized_dir):
        raise ValueError("ingest.curve_secret_key and ingest.curve_authorized_keys must be set together")
    return bool(secret_key_file)


def check_server_keys(secret_key_file: str, authorized_dir: str) -> None:
    """Raise ValueError, naming the file, unless the server's keys are usable as configured:
    checked before the service starts, since the broker and each ingest read them at start."""
    if not curve_settings(secret_key_file, authorized_dir):
        return
    try:
        read_key_pair(secret_key_file)
    except (OSError, ValueError) as exc:
        raise ValueError(f"ingest.curve_secret_key: {exc}") from None
    if not os.path.isdir(authorized_dir):
        raise ValueError(f"ingest.curve_authorized_keys: {authorized_dir} is not a directory")
    try:  # every process loads each key file there at start: one it cannot read stops it
        authorized_keys(authorized_dir)
    except (OSError, ValueError) as exc:
        raise ValueError(f"ingest.curve_authorized_keys: {exc}") from None
