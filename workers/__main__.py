"""`python -m workers --index N [--config PATH]`: run one worker process until SIGTERM."""

from __future__ import annotations

import sys

from streamasr import supervised
from workers.worker import Worker


def main(argv: list[str] | None = None) -> int:
    parser = supervised.arguments("workers", __doc__)
    parser.add_argument("--index", type=int, required=True, help="worker number, part of its identity")
    args = parser.parse_args(argv)
    return supervised.run("worker", args.config, lambda cfg, _log: Worker(cfg, args.index).run(), index=args.index)


if __name__ == "__main__":
    sys.exit(main())
