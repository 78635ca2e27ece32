"""Streams through a running service while its processes are killed (or frozen) at random, then
a check of every stream: what a fault-tolerance claim looks like under many faults at once.

Client threads (the blocking client, with resume) stream dev-set speech in real time, 100 ms
frames, one stream after another; an open refused as `overloaded` is retried after 0.5 s. Every
6-14 s one process of the instance (a worker, the broker or an ingest, chosen from those supervisord
lists as running or starting: one still loading may be hit again) is sent SIGKILL (`--mode kill`; supervisord starts it again) or SIGSTOP for 1-6 s and then
SIGCONT (`--mode stop`). A stream passes when it was closed by its `end`, with at least one
final and no error; an open refused `overloaded` is counted apart (explicit refusal, no audio
taken). Exit status 1 if any admitted stream failed.

    streamasr serve --model null --instance chaos &
    python scripts/chaos.py --instance chaos --duration 150 [--mode stop] [--streams 12]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from client import Client, StreamError
from config import settings
from protocol.messages import OVERLOADED, Closed, ErrorMsg, Final
from streamasr import service, testdata
from streamasr.loadgen import Clip, load_clips

RATE = 16_000
FRAME = RATE // 10
ROLES = {"worker": "workers", "broker": "broker", "ingest": "ingest"}  # supervisord program name prefix -> role


@dataclass
class Outcome:
    stream: str
    finals: int = 0
    errors: list[str] = field(default_factory=list)
    closed: str | None = None  # the `closed` reason
    failure: str | None = None  # what the client raised
    resumes: int = 0

    @property
    def refused(self) -> bool:
        return self.failure is not None and self.failure.startswith(OVERLOADED)

    @property
    def passed(self) -> bool:
        return self.failure is None and self.closed == "end" and self.finals > 0 and not self.errors


def stream_until(address: str, index: int, speech: list[np.ndarray], until: float, outcomes: list[Outcome], lock: threading.Lock) -> None:
    rnd = random.Random(index)
    pause = np.zeros(12_000, np.int16)  # 0.75 s: a segment ends
    with Client(address, timeout=20, resume_timeout=60) as client:
        n = 0
        while time.monotonic() < until:
            n += 1
            pcm = np.concatenate([part for _ in range(rnd.randint(1, 3)) for part in (speech[rnd.randrange(len(speech))], pause)])
            outcome = Outcome(f"c{index}-{n}")
            try:
                stream = client.open(outcome.stream)
                started = time.monotonic()
                for i in range(0, len(pcm), FRAME):
                    stream.send(pcm[i:i + FRAME])
                    time.sleep(max(0.0, started + (i + FRAME) / RATE - time.monotonic()))
                stream.end()
                for ev in stream.events(timeout=60):
                    if isinstance(ev, Final):
                        outcome.finals += 1
                    elif isinstance(ev, ErrorMsg):
                        outcome.errors.append(f"{ev.code}: {ev.message}")
                    elif isinstance(ev, Closed):
                        outcome.closed = ev.reason
                outcome.resumes = len(stream.resumes)
            except (StreamError, TimeoutError) as exc:
                outcome.failure = str(exc)
                if isinstance(exc, StreamError) and exc.code == OVERLOADED:
                    time.sleep(0.5)
            with lock:
                outcomes.append(outcome)


def faults(cfg: settings.Config, mode: str, until: float, seed: int, log: list[str]) -> None:
    rnd = random.Random(seed)
    time.sleep(10)
    while time.monotonic() < until - 15:
        running = [p for p in service.processes(cfg) if p["statename"] in service.UP_STATES and p["pid"]
                   and any(p["name"].startswith(prefix) for prefix in ROLES)]
        if running:
            target = rnd.choice(running)
            try:
                if mode == "stop":
                    frozen = rnd.uniform(1, 6)
                    os.kill(target["pid"], signal.SIGSTOP)
                    try:
                        time.sleep(frozen)
                    finally:  # interrupted or not, nothing is left frozen
                        os.kill(target["pid"], signal.SIGCONT)
                    log.append(f"{target['name']} (pid {target['pid']}) frozen {frozen:.1f} s")
                else:
                    os.kill(target["pid"], signal.SIGKILL)
                    log.append(f"{target['name']} (pid {target['pid']}) killed")
            except ProcessLookupError:  # it exited since supervisord listed it: pick another next time
                continue
        time.sleep(rnd.uniform(6, 14))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="the instance's TOML config file")
    p.add_argument("--instance", help="the instance's name")
    p.add_argument("--duration", type=float, default=150.0, help="seconds of streaming (default 150)")
    p.add_argument("--streams", type=int, default=12, help="concurrent streams (default 12)")
    p.add_argument("--mode", choices=("kill", "stop"), default="kill", help="SIGKILL, or SIGSTOP for 1-6 s (default kill)")
    p.add_argument("--seed", type=int, default=99)
    args = p.parse_args()
    cfg = service.saved_config(settings.load(args.config, {"instance": args.instance} if args.instance else None))
    if not service.status(cfg).get("ready"):
        raise SystemExit(f"instance {cfg.instance!r} is not running or not ready")
    speech = load_clips([Clip(u.name, u.path, u.reference) for u in testdata.utterances()], RATE)
    if not speech:
        raise SystemExit(f"no dev-set speech under {testdata.data_dir()} (apt-get install pocketsphinx-testdata)")
    until = time.monotonic() + args.duration
    outcomes: list[Outcome] = []
    log: list[str] = []
    lock = threading.Lock()
    threads = [threading.Thread(target=stream_until, args=(cfg.ingest.address, i, speech, until, outcomes, lock))
               for i in range(args.streams)]
    threads.append(threading.Thread(target=faults, args=(cfg, args.mode, until, args.seed, log)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [o for o in outcomes if not o.passed and not o.refused]
    print(f"faults: {len(log)}")
    for line in log:
        print(f"  {line}")
    print(f"streams: {len(outcomes)}, passed {sum(o.passed for o in outcomes)}, refused overloaded {sum(o.refused for o in outcomes)}, "
          f"failed {len(failed)}; resumed {sum(o.resumes > 0 for o in outcomes)}")
    for why, count in Counter(o.failure or o.closed or "no closed" for o in failed).most_common():
        print(f"  {count} x {why}")
    for o in failed[:10]:
        print(f"  {o}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
