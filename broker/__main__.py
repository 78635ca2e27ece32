"""`python -m broker [--config PATH]`: run the broker until SIGTERM."""

from __future__ import annotations

import argparse
import sys

from config import settings
from streamasr import logs
from streamasr.supervised import claim_port_early, end_with_parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m broker", description=__doc__)
    parser.add_argument("--config", help=f"TOML config (default: ${settings.CONFIG_ENV}, then built-in defaults)")
    args = parser.parse_args(argv)
    end_with_parent()
    cfg = settings.load(args.config)
    log = logs.configure("broker", cfg.log_level)
    try:
        claim_port_early(cfg.ingest.address)  # the front door
        from broker.broker import Broker  # after the port's check, as the ingest's (supervised.claim_port_early)

        Broker(cfg).run()
    except Exception:
        log.exception("broker.crashed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
