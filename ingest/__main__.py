"""`python -m ingest --index N`: one ingest process (supervisord runs `numprocs` of them)."""

import argparse
import sys

from config import settings
from streamasr.logs import configure
from streamasr.supervised import claim_port_early, end_with_parent

parser = argparse.ArgumentParser(prog="python -m ingest")
parser.add_argument("--config", default=None, help="TOML config (default: $STREAMASR_CONFIG or the embedded default)")
parser.add_argument("--index", type=int, default=0, help="this process's index: picks its port and shm segment")
args = parser.parse_args()
end_with_parent(stopped_first=True)
cfg = settings.load(args.config)
log = configure(f"ingest-{args.index}", cfg.log_level, ingest=args.index)
try:
    claim_port_early(cfg.ingest_endpoint(args.index))
    from ingest.server import main  # after the port's check: its imports take a second (ONNX Runtime)

    main(cfg, args.index)
except Exception:
    log.exception("ingest.crashed")  # one JSON line with the traceback, as the broker's and workers' crashes
    sys.exit(1)
