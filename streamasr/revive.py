"""`python -m streamasr.revive --config FILE`: supervisord's event listener that starts again the
programs supervisord gave up on.

supervisord puts a program that failed to start `startretries` times in a row (a minute of
backoff, and the tries themselves: each up to its `startsecs`) in FATAL and never starts it
again: an ingest whose port another process held for that minute, a worker whose model cache was
not mounted yet, would stay down until someone noticed, the instance serving with one process
fewer. This listener, woken by supervisord's TICK_5 events, starts each
program it has seen FATAL for `[supervisor] fatal_retry_s` again (supervisord then gives it its
`startretries` anew), logging `revive.restart` each time, for as long as it keeps failing.
"""

from __future__ import annotations

import sys
import time
import xmlrpc.client
from dataclasses import dataclass, field
from typing import Any, TextIO

from supervisor import childutils

from config.settings import Config
from streamasr import service, supervised


@dataclass
class Reviver:
    """When each FATAL process was first seen so, to start it again `fatal_retry_s` later."""

    cfg: Config
    log: Any
    fatal_since: dict[str, float] = field(default_factory=dict)

    def tick(self, now: float) -> None:
        """Start the processes FATAL for `fatal_retry_s`; forget those no longer FATAL."""
        retry_s = self.cfg.supervisor.fatal_retry_s
        with supervised.rpc(self.cfg.run_path / "supervisor.sock") as rpc:
            fatal = {f"{p['group']}:{p['name']}": p for p in rpc.getAllProcessInfo() if p["statename"] == "FATAL"}
            self.fatal_since = {name: self.fatal_since.get(name, now) for name in fatal}
            for name, since in list(self.fatal_since.items()):
                if now - since < retry_s:
                    continue
                self.log.warning("revive.restart", program=fatal[name]["name"], fatal_s=round(now - since, 1),
                                 why=service.start_failed_why(self.cfg, fatal[name]))
                try:
                    rpc.startProcess(name, False)  # not waiting: supervisord's own retries follow, as at its start
                except xmlrpc.client.Fault as exc:  # started meanwhile (by hand), or supervisord shutting down
                    self.log.info("revive.not_started", program=fatal[name]["name"], reason=exc.faultString)
                del self.fatal_since[name]


def listen(reviver: Reviver, stdin: TextIO, stdout: TextIO) -> None:
    """supervisord's event listener protocol: READY, an event, its result, for ever."""
    while True:
        childutils.listener.wait(stdin, stdout)  # the TICK's payload says nothing the tick needs
        if reviver.cfg.supervisor.fatal_retry_s:
            try:
                reviver.tick(time.monotonic())
            except supervised.RPC_ERRORS as exc:  # supervisord busy or going away: the next tick tries again
                reviver.log.warning("revive.unreachable", error=str(exc))
        childutils.listener.ok(stdout)


def main(argv: list[str] | None = None) -> int:
    args = supervised.arguments("streamasr.revive", __doc__).parse_args(argv)
    # stopped_first: the highest priority, supervisord stops it before the ingests; its log on
    # stderr, as every program's: stdout is supervisord's protocol
    return supervised.run("revive", args.config, lambda cfg, log: listen(Reviver(cfg, log), sys.stdin, sys.stdout),
                          stopped_first=True)


if __name__ == "__main__":
    sys.exit(main())
