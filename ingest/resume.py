"""Resume tokens: what shows that a realtime stream resuming at an offset was admitted before.

A stream whose ingest died is resumed by its client on another ingest, or on the same one
restarted, while the service's figures may still count it where it was. It is held to twice the
admission limits there, not refused as new load. An `offset` alone cannot be that proof: any
client may send one (by mistake, to carry its own times), and would pass the limits that protect
the streams already admitted. So the `ready` of an admitted realtime stream carries a token, an
HMAC of the stream's id under a key every ingest of the instance shares, and only a resume that
brings its stream's token back gets the headroom. The key comes from `serve`
(STREAMASR_RESUME_KEY), which reads it from `[ingest] resume_key_file` when services on several
hosts share one (a client given their front doors resumes the streams of a service lost outright
on another), or else keeps the instance's own in the run directory: the streams of a stopped instance
resume with their tokens on its next start (an upgrade restarts the whole service while its
calls go on; its new streams must not take the places of those it served). An ingest started
without it makes one of its own, so tokens of other ingests are not taken there, and their
resumes are admitted as new streams are (refused only while the service is at its limits, and
retried by the client).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import string
from pathlib import Path

KEY_VARIABLE = "STREAMASR_RESUME_KEY"
KEY_FILE = "resume.key"  # in the run directory, readable by the service's user only
KEY_BYTES = 32
TOKEN_BYTES = 16  # of the HMAC kept: 128 bits, 32 hex characters on the wire


def shared_key(path: str) -> str:
    """The key of `[ingest] resume_key_file`, which services on several hosts share so that a
    stream whose service was lost outright resumes on another with its token; ValueError, said
    before anything starts, when it holds no key."""
    try:
        key = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"ingest.resume_key_file {path}: cannot read it: {getattr(exc, 'strerror', None) or exc}") from None
    if not _is_key(key):
        raise ValueError(f"ingest.resume_key_file {path}: holds no key ({2 * KEY_BYTES} hexadecimal characters, "
                         f"as `openssl rand -hex {KEY_BYTES}` writes)")
    return key


def _is_key(text: str) -> bool:
    return len(text) == 2 * KEY_BYTES and all(c in string.hexdigits for c in text)


def instance_key(run: Path) -> str:
    """The key for an instance's ingests, `serve` sets it in their environment: the one its run
    directory keeps, or a new one kept there (a file that holds no key is replaced). Deleting
    the file voids every token given so far, at the next start."""
    path = run / KEY_FILE
    try:
        key = path.read_text().strip()
    except (FileNotFoundError, UnicodeDecodeError):
        key = ""
    if _is_key(key):
        return key
    key = secrets.token_hex(KEY_BYTES)
    partial = path.with_suffix(".tmp")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(key + "\n")
    os.replace(partial, path)  # whole or not at all: a torn key would void the tokens at the next start
    return key


class ResumeTokens:
    """Issues and checks the tokens of one instance's ingests."""

    def __init__(self, key: str | None = None) -> None:
        key = key if key is not None else os.environ.get(KEY_VARIABLE)
        self._key = key.encode() if key else secrets.token_bytes(KEY_BYTES)

    def issue(self, stream: str) -> str:
        return hmac.new(self._key, stream.encode(), hashlib.sha256).digest()[:TOKEN_BYTES].hex()

    def valid(self, stream: str, token: str | None) -> bool:
        # compare_digest takes ASCII text only: a client's other characters are simply no token
        return token is not None and token.isascii() and hmac.compare_digest(self.issue(stream), token)
