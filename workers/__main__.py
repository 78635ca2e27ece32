"""`python -m workers --index N [--config PATH]`: run one worker process until SIGTERM."""

from __future__ import annotations

import argparse
import sys

from config import settings
from streamasr import logs
from streamasr.supervised import end_with_parent
from workers.worker import Worker


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers", description=__doc__)
    parser.add_argument("--index", type=int, required=True, help="worker number, part of its identity")
    parser.add_argument("--config", help=f"TOML config (default: ${settings.CONFIG_ENV}, then built-in defaults)")
    args = parser.parse_args(argv)
    end_with_parent()
    cfg = settings.load(args.config)
    log = logs.configure(f"worker-{args.index}", cfg.log_level)
    try:
        return Worker(cfg, args.index).run()
    except Exception:
        log.exception("worker.crashed")
        return 1


if __name__ == "__main__":
    sys.exit(main())
