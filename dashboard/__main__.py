"""`python -m dashboard --config FILE [--port N]`: collector and web dashboard of one instance."""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType
from typing import Any

from config import settings
from streamasr import supervised


def main(argv: list[str] | None = None) -> int:
    parser = supervised.arguments("dashboard", __doc__)
    parser.add_argument("--port", type=settings.flag_in_range(int, 0, 65535, "port"), default=None, help="port on 127.0.0.1 (default: the config's metrics.dashboard_port; 0 = any free)")
    args = parser.parse_args(argv)

    def claim_and_serve(cfg: settings.Config, log: Any) -> int:
        port = cfg.metrics.dashboard_port if args.port is None else args.port
        try:
            if port:  # 0: any free port
                supervised.claim_port_early(f"tcp://127.0.0.1:{port}")
        except OSError as exc:
            log.error("dashboard.refused", reason=str(exc))
            return 1
        return serve(cfg, port, log)

    return supervised.run("dashboard", args.config, claim_and_serve)


def serve(cfg: settings.Config, port: int, log: Any) -> int:
    """Collect and serve until SIGTERM, SIGINT or SIGHUP; 1 when the collector or the port is refused."""
    # imported once the port is checked (supervised.claim_port_early)
    from dashboard.server import Dashboard
    from metrics.collector import Collector
    from protocol.socketfiles import Lost

    def socket_lost(lost: Lost) -> None:  # on the collector's thread
        if lost.restored:
            log.warning("dashboard.socket_restored", path=lost.path, why=lost.why)
        else:
            log.warning("dashboard.socket_unrestored", path=lost.path, why=lost.why, error=lost.error)

    collector = Collector(cfg, state_file=cfg.metrics_state_path, on_socket_lost=socket_lost)
    try:
        collector.start()
    except RuntimeError as exc:
        log.error("dashboard.refused", reason=str(exc))
        return 1
    if collector.state_unreadable:  # counters that restarted processes carried start again from their live values
        log.warning("dashboard.state_ignored", path=str(cfg.metrics_state_path), reason=collector.state_unreadable)
    try:
        dashboard = Dashboard(collector, port=port)
    except OSError as exc:  # the port taken since `serve` checked it: said, not a traceback
        collector.close()
        log.error("dashboard.refused", reason=f"cannot listen on 127.0.0.1:{port}: {exc.strerror or exc}")
        return 1

    def stop(signum: int, _frame: FrameType | None) -> None:
        # shutdown() waits for serve_forever, which runs on this (the signalled) thread
        threading.Thread(target=dashboard.shutdown, daemon=True).start()

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # SIGHUP too, as the other programs (broker.signals)
        signal.signal(signum, stop)
    print(f"dashboard {dashboard.url}", flush=True)  # the first stdout line: where to point a browser
    log.info("dashboard.started", url=dashboard.url, endpoint=collector.endpoint)
    try:
        dashboard.serve_forever()
    finally:
        collector.close()
    log.info("dashboard.stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
