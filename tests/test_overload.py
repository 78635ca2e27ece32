"""Past its capacity the service says so: new realtime streams are refused with `overloaded`,
admitted ones finish, batch streams are still taken and slowed by credits; stream limits hold.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import zmq

from broker import figures
from config import settings
from metrics import allocwatch
from protocol import messages as m
from shm import pool
from streamasr import service as svc
from streaming import CARDS, StreamClient, StreamResult, hello, pid_of, read_wav, speech_files, stream_many, wait_for

GAP = np.zeros(8_000, np.int16).tobytes()


class Opener:
    """Realtime streams of `pcm`, opened one after another until one is refused."""

    def __init__(self, service: Any, pcm: bytes) -> None:
        self.service = service
        self.pcm = pcm
        self.results: list[StreamResult] = []
        self.threads: list[threading.Thread] = []
        self.refused: StreamResult | None = None

    def open_until_refused(self, pause_s: float, figure: str, most: int = 40) -> float:
        """Opens streams `pause_s` apart; returns the peak of status `figure` seen meanwhile."""
        peak = 0.0
        for i in range(most):
            client = StreamClient(self.service.address, self.pcm, f"rt{i}", speed=1.0, timeout=300)
            thread = threading.Thread(target=lambda c=client: self.results.append(c.run()), daemon=True)
            thread.start()
            assert client.answered.wait(60), f"rt{i}: open not answered"
            peak = max(peak, svc.status(self.service.cfg).get(figure, 0.0))
            if client.result.refused is not None:
                thread.join(10)
                self.refused = self.results.pop(self.results.index(client.result))
                return peak
            self.threads.append(thread)
            time.sleep(pause_s)
        raise AssertionError(f"{most} realtime streams admitted on 2 cores (peak {figure} {peak})")

    def admitted_finish(self) -> None:
        """Every admitted stream finished with its finals and no error."""
        for t in self.threads:
            t.join(300)
        assert len(self.results) == len(self.threads)
        for r in self.results:
            assert r.refused is None and r.errors == [], (r.stream, r.refused, r.errors)
            assert r.closed is not None and r.closed.reason == "end" and r.finals, r


@pytest.mark.parametrize("figure", ["load", "busy"])
def test_realtime_admission_control(service_factory: Any, figure: str) -> None:
    """tiny.en on 2 workers, more realtime streams than 2 cores can serve, one more every 0.3 s.

    Each admission figure alone, at its default limit: the broker's queue wait (`load`) and the
    workers' busy share with one more stream's (`busy`).
    """
    off = {"load": "admit_max_busy", "busy": "admit_max_load_s"}[figure]
    service = service_factory(model="whisper-tiny.en", workers=2, ingest={off: 0})
    pcm = GAP.join(read_wav(p) for p in speech_files()[:3])  # ~16 s of speech with pauses
    opener = Opener(service, pcm)
    peak = opener.open_until_refused(0.3, figure)
    assert opener.refused is not None and opener.refused.refused == m.OVERLOADED
    admitted = len(opener.threads)
    assert admitted >= 1
    # the client is told which figure refused it, and what it can do instead
    refusal = opener.refused.refusal
    assert refusal is not None and refusal.stream == opener.refused.stream, refusal
    assert {"load": "realtime streams wait", "busy": "% busy"}[figure] in refusal.message, refusal.message
    assert "priority batch" in refusal.message, refusal.message
    logs = service.logs("ingest-0")
    assert "ingest.open_refused" in logs
    assert {"load": "realtime streams wait", "busy": "% busy"}[figure] in logs  # and the operator, in the log

    # a batch stream is still taken while realtime ones are refused; credits pace it: sent as
    # fast as its window allows, none of its audio is refused for room
    batch = StreamClient(service.address, pcm, "batch", speed=None, priority="batch", timeout=300).run()
    assert batch.refused is None and batch.errors == [] and batch.closed is not None and batch.finals
    assert batch.closed.reason == "end" and batch.overloaded == 0, batch

    opener.admitted_finish()
    print(f"admitted {admitted} realtime streams, refused the next at {figure} {peak:.2f}")

    # once the backlog is worked off, realtime streams are admitted again
    wait_for(lambda: svc.status(service.cfg).get(figure, 99) < 0.1, 120, f"the {figure} figure to fall")
    again = StreamClient(service.address, pcm[: 3 * 16_000], "again", speed=None, timeout=120).run()
    assert again.refused is None and again.closed is not None


def test_a_burst_is_cut_where_one_stream_s_share_says(service_factory: Any) -> None:
    """Streams opened at once on idle workers that have served before: the figures cannot show
    the burst yet, so the streams just admitted count at the measured share of one stream (no
    less than the workers' start-up price, since that stream had them to itself), and the burst
    is cut where a slow ramp would be. A restarted broker has measured nothing: it starts from
    the share the last one saved, so the herd of a restart is cut the same way."""
    service = service_factory(model="whisper-tiny.en", workers=2, ingest={"admit_max_load_s": 0})
    pcm = GAP.join(read_wav(p) for p in speech_files()[:2])
    first = StreamClient(service.address, pcm, "first", speed=1.0, timeout=120).run()
    assert first.refused is None and first.finals
    saved_file = service.cfg.run_path / figures.FILE
    wait_for(lambda: saved_file.exists() and min(json.loads(saved_file.read_text())["share"]) > 0, 10, "one stream's share measured")

    [broker] = [p["pid"] for p in svc.processes(service.cfg) if p["name"] == "broker"]
    os.kill(broker, signal.SIGKILL)

    def broker_restarted() -> dict[str, Any] | None:
        status = svc.status(service.cfg)
        pids = [p["pid"] for p in status["processes"] if p["name"] == "broker"]
        return status if pids not in ([], [0], [broker]) and status.get("ready") and len(status["workers"]) == 2 else None

    restarted = wait_for(broker_restarted, 60, "the broker restarted, with its workers")
    saved = json.loads(saved_file.read_text())
    share, prior = restarted["stream_share"], restarted["stream_share_prior"]
    # each part as saved, or the start-up price where that is more and the part was measured
    # with the workers to themselves
    assert round(sum(saved["share"]), 4) - 1e-4 <= share <= round(sum(saved["share"]), 4) + prior + 1e-4, (restarted, saved)
    assert "broker.admission_figures_restored" in service.logs("broker")

    opener = Opener(service, pcm)
    opener.open_until_refused(0.0, "busy")
    assert opener.refused is not None and opener.refused.refused == m.OVERLOADED
    admitted = len(opener.threads)
    # cut no later than the share measured before the burst says (the next stream would pass
    # admit_max_busy, 0.8), earlier when the burst's own streams are measured dearer meanwhile;
    # one more may pass if they were measured cheaper
    assert 1 <= admitted <= 0.8 / share + 1, (admitted, share)
    assert opener.refused.refusal is not None and "% busy" in opener.refused.refusal.message, opener.refused.refusal
    assert "% busy" in service.logs("ingest-0")
    opener.admitted_finish()
    print(f"burst: admitted {admitted} realtime streams at a share of {share:.3f} per stream "
          f"(measured {sum(saved['share']):.3f}, start-up price {prior:.3f})")


def test_a_fresh_service_cuts_a_burst_at_its_workers_start_up_price(service_factory: Any) -> None:
    """A service that has measured nothing (first start, a new run directory) prices a stream
    from the decodes its workers timed when they started, and cuts a burst there instead of
    admitting it whole; the streams' own figures then replace that price and are saved."""
    service = service_factory(model="whisper-tiny.en", workers=2, ingest={"admit_max_load_s": 0})

    def both_workers_ready() -> dict[str, Any] | None:
        status = svc.status(service.cfg)
        return status if len(status.get("workers", [])) == 2 else None

    status = wait_for(both_workers_ready, 60, "both workers ready")
    prior = status["stream_share_prior"]
    assert prior > 0 and status["stream_share"] == prior, status
    assert not (service.cfg.run_path / figures.FILE).exists()  # nothing measured, nothing restored
    ready = [e for e in map(json.loads, service.logs("broker").splitlines()) if e["event"] == "broker.worker_ready"]
    assert len(ready) == 2 and all(len(e["decode_cost"]) == 2 and min(e["decode_cost"]) > 0 for e in ready), ready

    pcm = GAP.join(read_wav(p) for p in speech_files()[:2])
    opener = Opener(service, pcm)
    opener.open_until_refused(0.0, "busy")
    assert opener.refused is not None and opener.refused.refused == m.OVERLOADED
    admitted = len(opener.threads)
    # the next stream would pass admit_max_busy (0.8) at the prior; one more may pass if the
    # burst's first seconds were measured cheaper meanwhile
    assert 1 <= admitted <= 0.8 / prior + 1, (admitted, prior)
    assert opener.refused.refusal is not None and "% busy" in opener.refused.refusal.message, opener.refused.refusal
    opener.admitted_finish()
    saved_file = service.cfg.run_path / figures.FILE
    wait_for(lambda: saved_file.exists() and min(json.loads(saved_file.read_text())["share"]) > 0, 10, "the streams' own figures saved")
    print(f"fresh burst: admitted {admitted} realtime streams at a prior share of {prior:.3f} per stream")


def _dealer(endpoint: str) -> zmq.Socket:
    """A client's socket on an ingest, dropped at once when closed."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def _open(sock: zmq.Socket, stream: str, **fields: Any) -> m.ServerMessage:
    sock.send_multipart(m.encode(m.Open(stream=stream, **fields)))
    assert sock.poll(10_000), "no answer to open"
    return m.decode_server(sock.recv_multipart())


def _end(sock: zmq.Socket, stream: str) -> None:
    """End `stream` and wait until it is closed: its place is free then."""
    sock.send_multipart(m.encode(m.End(stream=stream)))
    wait_for(lambda: sock.poll(100) and isinstance(m.decode_server(sock.recv_multipart()), m.Closed), 30, "closed")


def _admitted_token(sock: zmq.Socket, stream: str) -> str:
    """Open `stream` (realtime), end it, and return the resume token its `ready` gave: what its
    client holds when the ingest it was admitted on dies."""
    ready = _open(sock, stream)
    assert isinstance(ready, m.Ready) and ready.resume_token, ready
    _end(sock, stream)
    return ready.resume_token


def test_stream_limits(service_factory: Any) -> None:
    service = service_factory(model="null", workers=1, ingest={"max_streams_per_client": 2, "max_streams": 3})
    welcome = hello(service.address)
    assert welcome.limits["max_streams_per_client"] == 2
    a, b = _dealer(welcome.ingest), _dealer(welcome.ingest)
    try:
        assert isinstance(_open(a, "one"), m.Ready)
        assert isinstance(_open(a, "two"), m.Ready)
        dup = _open(a, "two")
        assert isinstance(dup, m.ErrorMsg) and dup.code == m.DUPLICATE_STREAM
        per_client = _open(a, "three")
        assert isinstance(per_client, m.ErrorMsg) and per_client.code == m.TOO_MANY_STREAMS, per_client
        assert isinstance(_open(b, "one"), m.Ready)
        total = _open(b, "two")
        assert isinstance(total, m.ErrorMsg) and total.code == m.TOO_MANY_STREAMS, total
        # ending a stream frees its place
        _end(a, "one")
        assert isinstance(_open(b, "two"), m.Ready)
    finally:
        a.close()
        b.close()


def _answer(sock: zmq.Socket, timeout_s: float = 10.0) -> m.ServerMessage:
    assert sock.poll(timeout_s * 1000), "no answer"
    return m.decode_server(sock.recv_multipart())


def _after_waiting(sock: zmq.Socket) -> m.ServerMessage:
    """The answer to an open held for room: what comes after its `waiting`s."""
    while isinstance(answer := _answer(sock), m.Waiting):
        pass
    return answer


def _gauge(service: Any, name: str) -> float | None:
    """A gauge of the service's Prometheus text, summed over its processes; None while the dashboard is not up."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{service.cfg.metrics.dashboard_port}/metrics", timeout=10).read().decode()
    except OSError:
        return None
    return sum(float(v) for v in re.findall(rf"^streamasr_{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


def test_opens_held_for_room_are_admitted_first_come_first_served(service_factory: Any) -> None:
    """Calls that come while the service is full and ask to wait (`open.wait`) are held by the
    ingest and admitted in the order they came as places free: a call that waited a minute is
    not passed by one that asked a moment ago, as it was by whichever client happened to ask
    again first. Each held open hears `waiting` (its place in line) at once and every 2 s; one
    that does not wait, or whose wait runs out, is refused as before; one its client ends is
    answered, then the `end`; one whose client goes away is forgotten."""
    service = service_factory(model="null", workers=1, ingest={"admit_max_realtime_streams": 1, "idle_timeout_s": 600})
    ingest = hello(service.address).ingest
    first, second, gone, third, other = socks = [_dealer(ingest) for _ in range(5)]
    try:
        assert isinstance(_open(first, "one"), m.Ready)
        held = _open(second, "b", wait=60)
        assert isinstance(held, m.Waiting) and (held.stream, held.position, held.code) == ("b", 1, m.OVERLOADED), held
        assert "admit_max_realtime_streams" in held.message, held
        assert isinstance(_open(gone, "g", wait=60), m.Waiting)
        held = _open(third, "c", wait=60)
        assert isinstance(held, m.Waiting) and held.position == 3, held
        assert wait_for(lambda: _gauge(service, "opens_waiting") == 3, 30, "three opens waiting in the metrics")
        snapshot = f"http://127.0.0.1:{service.cfg.metrics.dashboard_port}/api/snapshot"  # what the page and `top` show
        assert wait_for(lambda: json.loads(urllib.request.urlopen(snapshot, timeout=10).read())["admission"]["opens_waiting"] == 3,
                        10, "three opens waiting on the dashboard")
        # one that does not wait is refused at once, and says how many wait before it
        refused = _open(other, "now")
        assert isinstance(refused, m.ErrorMsg) and refused.code == m.OVERLOADED, refused
        assert "(3 opens wait for room before it)" in refused.message, refused
        # a batch stream needs no realtime room: it passes them
        assert isinstance(_open(other, "batch", priority="batch", wait=60), m.Ready)
        # one whose wait runs out is refused as it would have been at once
        asked = time.monotonic()
        assert isinstance(_open(other, "short", wait=1), m.Waiting)
        late = _answer(other)
        assert isinstance(late, m.ErrorMsg) and late.code == m.OVERLOADED and late.stream == "short", late
        assert time.monotonic() - asked >= 0.9
        # one its client ends: the open is answered, then the end
        assert isinstance(_open(other, "ended", wait=60), m.Waiting)
        other.send_multipart(m.encode(m.End(stream="ended")))
        answers = [_answer(other), _answer(other)]
        assert [(a.type, a.code) for a in answers] == [("error", m.OVERLOADED), ("error", m.UNKNOWN_STREAM)], answers
        assert "ended while it waited for room" in answers[0].message, answers
        gone.close()  # forgotten once a `waiting` finds its connection closed
        # still waiting: told so again within 2 s, in the same place
        again = _answer(third, 5)
        assert isinstance(again, m.Waiting) and again.stream == "c" and again.position in (2, 3), again
        _end(first, "one")  # the place goes to the first in line
        assert isinstance(_after_waiting(second), m.Ready)
        time.sleep(0.5)
        assert all(isinstance(_answer(third), m.Waiting) for _ in range(third.poll(0)))  # not yet
        _end(second, "b")  # and the next to the next, the client gone passed over
        opened = _after_waiting(third)
        assert isinstance(opened, m.Ready) and opened.stream == "c", opened
        events = service.events("ingest-0")
        waited = {e["stream"]: e["waited_s"] for e in events if e["event"] == "ingest.stream_opened" and "waited_s" in e}
        # the client gone may be admitted before a `waiting` finds it gone: its `ready` does, and it is dropped
        assert list(waited) in (["b", "c"], ["b", "g", "c"]) and waited["c"] > waited["b"] > 0, waited
        dropped = [e["stream"] for e in events if e["event"] == "ingest.stream_dropped"]
        assert dropped == ["g"] if "g" in waited else not dropped, dropped
        assert [e["stream"] for e in events if e["event"] == "ingest.open_waiting"] == ["b", "g", "c", "short", "ended"]
        assert wait_for(lambda: _gauge(service, "opens_waiting") == 0, 30, "no open waiting on the dashboard")
    finally:
        for sock in socks:
            sock.close()


def test_opens_held_on_several_ingests_are_admitted_in_the_order_they_came(service_factory: Any) -> None:
    """Admission is the service's, over every ingest process, and so is the line: a place that
    frees on one ingest goes to the open held longest on any of them, not to the one held where
    it freed, and a new open on either does not pass it. Each ingest tells the broker at once
    when its longest-held open or its realtime streams change, and the broker tells the others."""
    service = service_factory(model="null", workers=1, ingests=2, ingest={"admit_max_realtime_streams": 1, "idle_timeout_s": 600})
    holder, other, later = (_dealer(service.cfg.ingest_endpoint(0)) for _ in range(3))
    first = _dealer(service.cfg.ingest_endpoint(1))
    socks = [holder, other, later, first]

    def held_on_the_other_ingest() -> bool:
        """Ingest 1 hears of the place taken on ingest 0 within a heartbeat: an open admitted
        before that is ended and asked again."""
        answer = _open(first, "first", wait=60)
        if isinstance(answer, m.Ready):
            _end(first, "first")
            return False
        assert isinstance(answer, m.Waiting) and answer.code == m.OVERLOADED, answer
        return True

    def refused_for_it() -> bool:
        refused = _open(other, "new")
        assert isinstance(refused, m.ErrorMsg) and refused.code == m.OVERLOADED, refused
        return "held for room on another ingest process come before it" in refused.message

    try:
        assert isinstance(_open(holder, "place"), m.Ready)  # the one place, on ingest 0
        wait_for(held_on_the_other_ingest, 30, "an open held on ingest 1")
        assert wait_for(refused_for_it, 10), "ingest 0 hears of the open held on ingest 1"
        assert isinstance(_open(later, "second", wait=60), m.Waiting)  # on ingest 0, after it
        _end(holder, "place")  # the place frees on ingest 0
        opened = _after_waiting(first)
        assert isinstance(opened, m.Ready) and opened.stream == "first", opened
        time.sleep(1.0)
        assert all(isinstance(_answer(later), m.Waiting) for _ in range(later.poll(0))), "ingest 0's open passed"
        _end(first, "first")
        opened = _after_waiting(later)
        assert isinstance(opened, m.Ready) and opened.stream == "second", opened
    finally:
        for sock in socks:
            sock.close()


def test_realtime_stream_cap(service_factory: Any) -> None:
    """The cap needs no load to have been seen: on idle workers the realtime open past it is
    refused, batch streams are still taken, and resumed ones up to twice the cap (they were
    admitted before their ingest died, and may still be counted there), and a realtime stream
    that ends frees its place. Only a resume that brings back the token its stream's `ready`
    gave is such a resume: an `offset` alone, or another stream's token, is no pass past the cap."""
    with pytest.raises(ValueError, match="admit_max_realtime_streams"):
        settings.load(None, {"ingest": {"admit_max_realtime_streams": -1}})  # not "refuse every realtime stream"
    service = service_factory(model="null", workers=1, ingest={"admit_max_realtime_streams": 2})
    sock = _dealer(hello(service.address).ingest)
    try:
        tokens = {stream: _admitted_token(sock, stream) for stream in ("resumed", "resumed-2", "resumed-3")}
        assert isinstance(_open(sock, "one"), m.Ready)
        assert isinstance(_open(sock, "two"), m.Ready)
        refused = _open(sock, "three")
        assert isinstance(refused, m.ErrorMsg) and refused.code == m.OVERLOADED, refused
        assert "admit_max_realtime_streams" in refused.message and refused.stream == "three"
        assert isinstance(_open(sock, "batch", priority="batch"), m.Ready)
        for token in (None, tokens["resumed"], "é" * 32):  # no token of its own: none, another stream's, garbage
            refused = _open(sock, "stranger", offset=16_000, resume_token=token)
            assert isinstance(refused, m.ErrorMsg) and refused.code == m.OVERLOADED, refused
            assert "twice that resuming" not in refused.message, refused
        # admitted before their ingest died
        assert isinstance(_open(sock, "resumed", offset=16_000, resume_token=tokens["resumed"]), m.Ready)
        assert isinstance(_open(sock, "resumed-2", offset=16_000, resume_token=tokens["resumed-2"]), m.Ready)
        refused = _open(sock, "resumed-3", offset=16_000, resume_token=tokens["resumed-3"])
        assert isinstance(refused, m.ErrorMsg) and refused.code == m.OVERLOADED, refused
        assert "twice that resuming" in refused.message and refused.stream == "resumed-3"
        # status counts them (as of the ingest's next heartbeat) against the cap
        wait_for(lambda: svc.status(service.cfg)["realtime"] == 4, 10, "four realtime streams in the status")
        printed = service.cli("status").stdout
        assert "admission: 4 realtime streams (cap 2)" in printed, printed
        _end(sock, "one")
        _end(sock, "resumed-2")
        # "resumed" counts now: two realtime streams are open again
        refused = _open(sock, "three")
        assert isinstance(refused, m.ErrorMsg) and refused.code == m.OVERLOADED, refused
        _end(sock, "two")
        assert isinstance(_open(sock, "three"), m.Ready)
    finally:
        sock.close()


def test_a_stream_served_before_the_service_restarted_resumes_with_its_token(service_factory: Any) -> None:
    """An upgrade stops the whole service and starts it again while its calls go on: the streams
    it served resume on the new start with the tokens the old one gave, and are held to twice
    the admission limits as after a lost ingest, so the new streams that came first do not take
    their places. The key is kept in the run directory; without it, the first start's tokens
    were void and such a resume was refused as a new stream."""
    service = service_factory(model="null", workers=1, ingest={"admit_max_realtime_streams": 1})
    sock = _dealer(hello(service.address).ingest)
    try:
        token = _admitted_token(sock, "resumed")
    finally:
        sock.close()
    key_file = service.cfg.run_path / "resume.key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert service.stop() == 0
    again = svc.start(service.cfg, service.config_file, cls=type(service))
    sock = _dealer(hello(again.address).ingest)
    try:
        assert isinstance(_open(sock, "one"), m.Ready)  # a new stream came first, and takes the cap
        refused = _open(sock, "stranger", offset=16_000)
        assert isinstance(refused, m.ErrorMsg) and refused.code == m.OVERLOADED, refused
        assert isinstance(_open(sock, "resumed", offset=16_000, resume_token=token), m.Ready)
    finally:
        sock.close()
        assert again.stop() == 0
    # a key file that holds no key is replaced, and the tokens given under it are void
    key_file.write_text("not a key\n")
    again = svc.start(service.cfg, service.config_file, cls=type(service))
    sock = _dealer(hello(again.address).ingest)
    try:
        assert isinstance(_open(sock, "one"), m.Ready)
        refused = _open(sock, "resumed", offset=16_000, resume_token=token)
        assert isinstance(refused, m.ErrorMsg) and refused.code == m.OVERLOADED, refused
    finally:
        sock.close()
        assert again.stop() == 0
    assert len(key_file.read_text().strip()) == 64
    assert pool.segments(service.cfg.instance) == []


def test_a_burst_of_resuming_streams_is_cut_at_twice_the_busy_limit(service_factory: Any) -> None:
    """Streams resuming at an offset, all at once on idle workers (the herd of a lost ingest,
    each with its token): each counts as admitted within the figures' window, as a new stream
    does, so the burst is cut where twice `admit_max_busy` says at the share the last run
    measured, not admitted whole."""
    service = service_factory(model="null", workers=1, ingest={"admit_max_load_s": 0})
    cfg = service.cfg
    sock = _dealer(hello(service.address).ingest)
    try:
        tokens = [_admitted_token(sock, f"resumed-{i}") for i in range(12)]
    finally:
        sock.close()
    share = 0.25  # of the worker's time per speaking stream: 0.8 / share = 3.2 streams, twice that 6.4
    (cfg.run_path / figures.FILE).write_text(json.dumps({
        "model": json.loads(json.dumps(dataclasses.asdict(cfg.model))),
        "pool": {"workers": cfg.worker_count, "partial_interval_ms": cfg.ingest.partial_interval_ms},
        "share": [0.2, 0.05], "decode_cost": [0.01, 0.01], "loaded_cost": [0.0, 0.0], "saved": time.time()}))
    for program in ("broker", "ingest-0"):  # the restarted broker takes the saved share; the ingest, lost, its streams
        os.kill(pid_of(service, program), signal.SIGKILL)

    def restored() -> dict[str, Any] | None:
        status = svc.status(cfg)
        return status if status.get("ready") and status.get("workers") and status.get("ingests") \
            and status.get("stream_share") == share else None

    wait_for(restored, 60, "the broker restarted with the saved share")
    sock = _dealer(hello(service.address).ingest)
    try:
        answers = [_open(sock, f"resumed-{i}", offset=16_000, resume_token=token) for i, token in enumerate(tokens)]
    finally:
        sock.close()
    admitted = sum(isinstance(a, m.Ready) for a in answers)
    assert 0.8 / share < admitted <= 2 * 0.8 / share, answers  # past the limit a new stream has, within twice it
    refused = answers[admitted]
    assert isinstance(refused, m.ErrorMsg) and refused.code == m.OVERLOADED and "% busy" in refused.message, refused


def test_realtime_stream_cap_counts_the_streams_of_every_ingest(service_factory: Any) -> None:
    """With two ingests the cap is over the service: each counts the other's realtime streams, as
    the broker's heartbeats tell it."""
    service = service_factory(model="null", workers=1, ingests=2, ingest={"admit_max_realtime_streams": 2})
    socks = [_dealer(service.cfg.ingest_endpoint(index)) for index in (0, 1)]
    first, second = socks

    def refused(sock: zmq.Socket, stream: str) -> m.ErrorMsg:
        """Open `stream` until the cap refuses it: the ingest learns of the other's streams from
        the broker's next heartbeat, and an open admitted before that is ended and tried again."""
        def attempt() -> m.ErrorMsg | None:
            reply = _open(sock, stream)
            if isinstance(reply, m.Ready):
                _end(sock, stream)
                return None
            assert isinstance(reply, m.ErrorMsg) and reply.code == m.OVERLOADED, reply
            assert "admit_max_realtime_streams" in reply.message, reply
            return reply
        return wait_for(attempt, 30, f"{stream} refused at the cap")

    def admitted(sock: zmq.Socket, stream: str) -> m.Ready:
        """Open `stream` until it is admitted; a refused open leaves nothing open."""
        def attempt() -> m.Ready | None:
            reply = _open(sock, stream)
            if isinstance(reply, m.Ready):
                return reply
            assert isinstance(reply, m.ErrorMsg) and reply.code == m.OVERLOADED, reply
            return None
        return wait_for(attempt, 30, f"{stream} admitted")

    try:
        assert isinstance(_open(first, "a1"), m.Ready)
        assert isinstance(_open(second, "b1"), m.Ready)  # two over the service: the cap
        refused(second, "b2")  # one open here, one on the other ingest
        refused(first, "a2")
        _end(second, "b1")
        admitted(first, "a2")
    finally:
        for sock in socks:
            sock.close()


def _serving(service: Any) -> dict[str, int]:
    """The pids of the processes that mark what they hold on SIGUSR1 (metrics.allocwatch)."""
    return {p["name"]: p["pid"] for p in svc.processes(service.cfg) if p["name"].startswith(("broker", "ingest", "worker"))}


def _mark(pids: dict[str, int]) -> None:
    for pid in pids.values():
        os.kill(pid, signal.SIGUSR1)


def _held_growth(directory: Path, pids: dict[str, int]) -> dict[str, tuple[int, list[dict]]]:
    """Per process, the blocks it held more at its third mark than at its second, and the lines
    holding most of what it kept since its first."""
    reports = {name: [directory / f"{name}-{k}.json" for k in (1, 2)] for name in pids}
    wait_for(lambda: all(f.exists() for files in reports.values() for f in files), 30, "the marks' reports")
    growth = {}
    for name, files in reports.items():
        second, third = (json.loads(f.read_text()) for f in files)
        growth[name] = (third["blocks"] - second["blocks"], third["top"])
    return growth


def test_a_long_stream_leaves_nothing_behind_per_segment(service_factory: Any, monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    """A broadcast stream runs for days, one segment every few seconds: what the broker, the
    ingest and the worker hold must not grow with its segments (its finals, partials, jobs,
    acks). One batch stream of 900 short utterances, each followed by a pause the VAD ends it at;
    each serving process marks what it holds three times along it. Between the last two marks
    hundreds of segments pass: what grows there is in flight (a VAD round, a batch), or numpy's
    cache of the small buffers it freed (which tracemalloc counts held where they were first
    allocated: 45 blocks in 20,000 calls of a few small temporaries alone), below three quarters
    of a block per segment (72-243 blocks in 450 segments measured); anything kept per segment,
    job or ack costs a block or more each."""
    monkeypatch.setenv(allocwatch.ENV, str(tmp_path))  # before the start: the processes inherit it
    service = service_factory(model="null", workers=1)
    pids = _serving(service)
    unit = read_wav(CARDS / "001.wav") + np.zeros(11_200, np.int16).tobytes()  # 0.7 s of silence ends each one
    pcm = unit * 900
    marks = [len(pcm) // 2 * k // 100 for k in (15, 45, 95)]
    finals_at: list[int] = []

    def mark(client: StreamClient, sent: int) -> None:
        if len(finals_at) < len(marks) and sent >= marks[len(finals_at)]:
            finals_at.append(len(client.result.finals))
            _mark(pids)

    result = StreamClient(service.address, pcm, priority="batch", speed=None, timeout=600, on_progress=mark).run()
    assert result.errors == [] and len(result.finals) == 900, (result.errors, len(result.finals))
    segments = finals_at[2] - finals_at[1]
    assert segments >= 300, finals_at
    for name, (growth, top) in _held_growth(tmp_path, pids).items():
        assert growth < 3 * segments / 4, (name, segments, growth, top)


def test_connections_that_come_and_go_leave_nothing_behind(service_factory: Any, monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
    """A call centre opens thousands of short connections an hour, each a hello at the front door
    and a stream on an ingest: what the broker, the ingest and the worker hold must not grow with
    them (per client counts, sessions, job owners, VAD rows). 1,100 connections, each one call
    transcribed and closed; growth between the marks at the 300th and the last is in flight (a
    VAD round), far below a block a connection."""
    monkeypatch.setenv(allocwatch.ENV, str(tmp_path))
    service = service_factory(model="null", workers=1)
    pids = _serving(service)
    call = read_wav(CARDS / "001.wav") + np.zeros(11_200, np.int16).tobytes()
    for i in range(1, 1101):
        sock = _dealer(hello(service.address).ingest)
        assert isinstance(_open(sock, "call", priority="batch"), m.Ready)
        for seq, at in enumerate(range(0, len(call), 3200)):
            sock.send_multipart(m.encode(m.Audio(stream="call", seq=seq, data=call[at:at + 3200])))
        sock.send_multipart(m.encode(m.End(stream="call")))
        msg: m.ServerMessage | None = None
        while sock.poll(30_000) and not isinstance(msg := m.decode_server(sock.recv_multipart()), m.Closed):
            assert not isinstance(msg, m.ErrorMsg), msg
        assert isinstance(msg, m.Closed), f"call {i} not closed: {msg}"
        sock.close()
        if i in (100, 300, 1100):
            _mark(pids)
    for name, (growth, top) in _held_growth(tmp_path, pids).items():
        assert growth < 800 / 2, (name, growth, top)


def test_soak_returns_to_baseline(service_factory: Any) -> None:
    """Rounds of streams, some abandoned mid-way: fds, shm and rings come back to where they were.

    Counts only; memory growth is printed for the record (a short run cannot tell a leak from
    warm-up). The long soak is `streamasr bench --duration 3600` (docs/RELIABILITY.md).
    """
    service = service_factory(model="null", workers=2, ingest={"idle_timeout_s": 2.0})
    pcm = read_wav(speech_files()[1])
    buffers = {f"w{i}": pcm for i in range(4)}
    stream_many(service.address, buffers, speed=None)  # warm-up: lazy imports, pools, sockets

    def procs() -> dict[str, psutil.Process]:
        return {p["name"]: psutil.Process(p["pid"]) for p in svc.processes(service.cfg) if p["group"] != "dashboard"}

    def idle() -> bool:
        ingest = svc.status(service.cfg)["ingests"][0]
        return ingest["rings"] == 0 and ingest["streams"] == 0

    wait_for(idle, 30, "the warm-up streams to release their rings")
    before = procs()
    fds = {name: p.num_fds() for name, p in before.items()}
    rss = {name: p.memory_info().rss for name, p in before.items()}
    segments = pool.segments(service.cfg.instance)

    welcome = hello(service.address)
    for round_ in range(10):
        results = stream_many(service.address, {f"r{round_}-{i}": pcm for i in range(8)}, speed=None)
        for r in results.values():
            assert r.errors == [] and r.closed is not None and r.closed.reason == "end" and r.finals, r
        # a client that vanishes mid-stream: the idle sweep must give its ring back
        gone = _dealer(welcome.ingest)
        gone.send_multipart(m.encode(m.Open(stream="gone")))
        gone.send_multipart(m.encode(m.Audio(stream="gone", seq=0, data=pcm[:32_000])))
        assert gone.poll(10_000)
        gone.close()

    wait_for(idle, 60, "every ring back in the pool")
    after = procs()
    assert {n: p.pid for n, p in after.items()} == {n: p.pid for n, p in before.items()}
    wait_for(lambda: all(after[n].num_fds() <= fds[n] for n in fds), 30,
             f"fds back to {fds}: {({n: p.num_fds() for n, p in after.items()})}")
    assert pool.segments(service.cfg.instance) == segments
    growth = {n: round((after[n].memory_info().rss - rss[n]) / 2**20, 1) for n in rss}
    print(f"soak: 80 streams + 10 abandoned; RSS growth MiB {growth}")


def _ingest_idle(proc: psutil.Process) -> bool:
    """The ingest spent under a tenth of the last second on the CPU: what was sent to it is read."""
    before = proc.cpu_times()
    time.sleep(1.0)
    after = proc.cpu_times()
    return (after.user + after.system) - (before.user + before.system) < 0.1


def test_clients_that_never_read_their_refusals_hold_a_bounded_share_of_the_ingest_s_memory(service_factory: Any) -> None:
    """Every refused message is answered, and the answers wait in the ingest for a connection
    that does not read them, up to the queue it is allowed (CLIENT_QUEUE), until the connection
    closes. A few connections that flood refused messages (a rate no stream has, each answered
    `bad_format`) and never read must leave the ingest, which serves every other stream, within a
    small multiple of its memory before them, and a stream transcribed meanwhile must not notice."""
    service = service_factory(model="null", workers=2)
    pcm = read_wav(speech_files()[1])
    stream_many(service.address, {f"w{i}": pcm for i in range(2)}, speed=None)  # warm-up: lazy imports, pools, sockets
    [ingest] = [psutil.Process(p["pid"]) for p in svc.processes(service.cfg) if p["group"] == "ingest"]
    wait_for(lambda: _ingest_idle(ingest), 30, "the ingest idle")
    baseline = ingest.memory_info().rss

    good: dict[str, StreamResult] = {}
    runner = threading.Thread(target=lambda: good.update(r=StreamClient(service.address, pcm, "good", speed=1.0).run()))
    runner.start()
    welcome = hello(service.address)
    bad = m.encode(m.Open(stream="b", rate="r" * 100))  # answered `bad_format`, in as many bytes
    flooders: list[zmq.Socket] = []
    try:
        for _ in range(8):
            sock = _dealer(welcome.ingest)
            sock.setsockopt(zmq.RCVHWM, 1)  # it reads nothing: the answers queue in the ingest
            sock.setsockopt(zmq.RCVBUF, 4096)
            sock.setsockopt(zmq.SNDTIMEO, 60_000)
            flooders.append(sock)
        for _ in range(600):
            for sock in flooders:
                for _ in range(100):
                    sock.send_multipart(bad)
        wait_for(lambda: _ingest_idle(ingest), 120, "the ingest done with the flood")
        grown = ingest.memory_info().rss / baseline
        runner.join(120)
    finally:
        for sock in flooders:
            sock.close()
    print(f"8 connections x 60,000 refused messages, never read: ingest RSS {baseline / 2**20:.0f} MiB -> x{grown:.2f}")
    # 480,000 answers of 168 bytes, all queued (60,000 a connection, under the 100,000 once allowed),
    # took the ingest to 1.8 times its memory; at most 10,000 a connection, 1.1-1.2 times
    assert grown < 1.4, f"the ingest grew to {grown:.1f} times its memory for 8 connections' unread refusals"
    result = good["r"]
    assert result.errors == [] and result.closed is not None and result.closed.reason == "end" and result.finals, result


def test_a_client_that_pauses_its_reads_for_seconds_keeps_its_streams(service_factory: Any) -> None:
    """A client with as many streams as it may open on a connection, each sent 100 ms of audio
    every 100 ms, reads nothing for 8 s (a stall of its receiving thread): the answers owed to it
    meanwhile (acks, partials) must fit in what the ingest queues for it, so that its streams go
    on and end as asked, with nothing missing. Its socket holds one message and its receive
    buffer 4 kB: what it leaves unread waits in the ingest (its queue, and the kernel's send buffer)."""
    service = service_factory(model="null", workers=2)
    welcome = hello(service.address)
    streams = [f"p{i}" for i in range(welcome.limits["max_streams_per_client"])]
    sock = _dealer(welcome.ingest)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    frame = read_wav(speech_files()[1])[:3200]
    try:
        for sid in streams:
            assert isinstance(_open(sock, sid, priority="batch"), m.Ready), sid
        got: list[m.ServerMessage] = []
        start = time.monotonic()
        for seq in range(80):  # 8 s of audio on each stream, read by no one
            for sid in streams:
                sock.send_multipart(m.encode(m.Audio(stream=sid, seq=seq, data=frame)))
            time.sleep(max(0.0, start + (seq + 1) * 0.1 - time.monotonic()))
        for sid in streams:
            sock.send_multipart(m.encode(m.End(stream=sid)))
        while sum(isinstance(a, m.Closed) for a in got) < len(streams):
            assert sock.poll(30_000), f"{len(streams) - sum(isinstance(a, m.Closed) for a in got)} streams never closed"
            got.append(m.decode_server(sock.recv_multipart()))
    finally:
        sock.close()
    print(f"{len(streams)} streams, reads paused 8 s: {len(got)} answers")
    assert [a for a in got if isinstance(a, m.ErrorMsg)] == []
    assert {a.stream: a.reason for a in got if isinstance(a, m.Closed)} == dict.fromkeys(streams, "end")
    heard = {a.stream: round(a.audio_s, 3) for a in got if isinstance(a, m.Closed)}
    assert heard == dict.fromkeys(streams, 8.0), heard  # every frame taken
