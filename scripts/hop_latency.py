"""One ZeroMQ hop between two processes (ipc PUSH -> PULL), one-way latency against the gap
between messages: the floor under every hop of the service's pipeline.

The receiver either blocks in poll, as the service's processes do, or spins on poll(0), which
keeps its own thread awake but not the ZeroMQ I/O threads on either side. Both processes stamp
with the machine-wide monotonic clock.

    python scripts/hop_latency.py [--gaps 0.2,1,5,20,100] [--seconds 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import time
from pathlib import Path

import zmq


def receive(endpoint: str, count: int, spin: bool, out: mp.Queue) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind(endpoint)
    out.put("bound")
    latencies = []
    while len(latencies) < count:
        if spin:
            while not sock.poll(0):
                pass
        else:
            sock.poll(None)
        now = time.monotonic_ns()
        latencies.append((now - int(sock.recv())) / 1000)
    out.put(latencies)
    sock.close()
    ctx.term()


def measure(endpoint: str, gap_ms: float, count: int, spin: bool) -> list[float]:
    out: mp.Queue = mp.Queue()
    receiver = mp.Process(target=receive, args=(endpoint, count, spin, out))
    receiver.start()
    assert out.get(timeout=10) == "bound"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(endpoint)
    time.sleep(0.2)
    for _ in range(count):
        time.sleep(gap_ms / 1000)
        sock.send(str(time.monotonic_ns()).encode())
    latencies = sorted(out.get(timeout=60))
    receiver.join()
    sock.close()
    ctx.term()
    return latencies


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gaps", default="0.2,1,5,20,100", help="milliseconds between messages, comma-separated")
    p.add_argument("--seconds", type=float, default=3.0, help="per gap (at least 30 messages, at most 400)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        endpoint = f"ipc://{Path(tmp) / 'hop.sock'}"
        print("receiver  gap ms  messages  p50 us  p90 us")
        for spin in (False, True):
            for gap_ms in (float(g) for g in args.gaps.split(",")):
                count = max(30, min(400, int(args.seconds * 1000 / gap_ms)))
                lat = measure(endpoint, gap_ms, count, spin)
                print(f"{'spins' if spin else 'blocks':8}  {gap_ms:6g}  {count:8}  {lat[len(lat) // 2]:6.0f}  {lat[int(len(lat) * 0.9)]:6.0f}",
                      flush=True)


if __name__ == "__main__":
    main()
