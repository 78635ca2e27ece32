"""`python -m broker [--config PATH]`: run the broker until SIGTERM."""

from __future__ import annotations

import sys
from typing import Any

from config.settings import Config
from streamasr import supervised


def main(argv: list[str] | None = None) -> int:
    args = supervised.arguments("broker", __doc__).parse_args(argv)
    return supervised.run("broker", args.config, serve)


def serve(cfg: Config, _log: Any) -> None:
    supervised.claim_port_early(cfg.ingest.address)  # the front door
    from broker.broker import Broker  # after the port's check, as the ingest's (supervised.claim_port_early)

    Broker(cfg).run()


if __name__ == "__main__":
    sys.exit(main())
