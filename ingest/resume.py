"""Resume tokens: what shows that a realtime stream resuming at an offset was admitted before.

A stream whose ingest died is resumed by its client on another ingest, or on the same one
restarted, while the service's figures may still count it where it was. It is held to twice the
admission limits there, not refused as new load. An `offset` alone cannot be that proof: any
client may send one (by mistake, to carry its own times), and would pass the limits that protect
the streams already admitted. So the `ready` of an admitted realtime stream carries a token, an
HMAC of the stream's id under a key every ingest of the instance shares, and only a resume that
brings its stream's token back gets the headroom. The key comes from `serve`
(STREAMASR_RESUME_KEY, new for each start of the instance); an ingest started without it makes
one of its own, so tokens of other ingests are not taken there, and their resumes are admitted
as new streams are (refused only while the service is at its limits, and retried by the client).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

KEY_VARIABLE = "STREAMASR_RESUME_KEY"
TOKEN_BYTES = 16  # of the HMAC kept: 128 bits, 32 hex characters on the wire


def new_key() -> str:
    """A key for an instance's ingests: `serve` sets it in their environment."""
    return secrets.token_hex(32)


class ResumeTokens:
    """Issues and checks the tokens of one instance's ingests."""

    def __init__(self, key: str | None = None) -> None:
        key = key if key is not None else os.environ.get(KEY_VARIABLE)
        self._key = key.encode() if key else secrets.token_bytes(32)

    def issue(self, stream: str) -> str:
        return hmac.new(self._key, stream.encode(), hashlib.sha256).digest()[:TOKEN_BYTES].hex()

    def valid(self, stream: str, token: str | None) -> bool:
        # compare_digest takes ASCII text only: a client's other characters are simply no token
        return token is not None and token.isascii() and hmac.compare_digest(self.issue(stream), token)
