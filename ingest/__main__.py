"""`python -m ingest --index N`: one ingest process (supervisord runs `numprocs` of them)."""

from __future__ import annotations

import sys
from typing import Any

from config.settings import Config
from streamasr import supervised


def main(argv: list[str] | None = None) -> int:
    parser = supervised.arguments("ingest", __doc__)
    parser.add_argument("--index", type=int, default=0, help="this process's index: picks its port and shm segment")
    args = parser.parse_args(argv)

    def serve(cfg: Config, _log: Any) -> None:
        supervised.claim_port_early(cfg.ingest_endpoint(args.index))
        from ingest.server import main as serve_ingest  # after the port's check: its imports take a second (ONNX Runtime)

        serve_ingest(cfg, args.index)

    # stopped first by supervisord as it shuts down, after only the revive listener (supervisord.conf)
    return supervised.run("ingest", args.config, serve, index=args.index, stopped_first=True, ingest=args.index)


if __name__ == "__main__":
    sys.exit(main())
