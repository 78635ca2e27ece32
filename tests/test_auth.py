"""CurveZMQ on the client-facing sockets, and the file modes that guard the local ones.

With keys configured, both the front door and the ingest ROUTER speak CURVE: a client whose
public key is in the authorized directory works as before; one with another key, or none, gets
no answer at all and the refusal is logged. Ops tools reach the front door with the key pair of
`ingest.curve_client_key`. The ipc sockets between processes are guarded by the run directory's
mode (0700) and the audio by the shm segments' (0600).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import shutil
import stat
import time
import urllib.request
from pathlib import Path
from typing import Callable, Iterator

import pytest
import zmq
import zmq.auth

from client import AsyncClient, Client
from config import settings
from conftest import Service, running, start_service
from protocol import messages as m
from protocol.auth import (REFUSED_LOG_INTERVAL_S, REFUSED_NEW_KEYS_PER_INTERVAL, apply_client_curve, read_key_pair,
                           read_public_key)
from shm import pool
from streamasr.logs import Throttle
from streaming import StreamClient, hello, read_wav, speech_files, wait_for

Curve = Callable[[zmq.Socket], None]


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """server key pair, an authorized client, the ops tools' key and an intruder; client and ops are listed."""
    root = tmp_path_factory.mktemp("keys")
    for name in ("server", "client", "ops", "intruder"):
        zmq.auth.create_certificates(root, name)
    (root / "authorized").mkdir()
    for name in ("client", "ops"):
        shutil.copy(root / f"{name}.key", root / "authorized" / f"{name}.key")
    return root


def curve_for(keys: Path, who: str) -> Curve:
    server_public = read_public_key(keys / "server.key")
    _, secret = read_key_pair(keys / f"{who}.key_secret")
    return lambda sock: apply_client_curve(sock, server_public, secret)


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory, keys: Path) -> Iterator[Service]:
    """A null-model service with CURVE on; its readiness is polled through the ops key."""
    service = start_service(tmp_path_factory.mktemp("auth"), model="null", workers=1, ingest={
        "curve_secret_key": str(keys / "server.key_secret"),
        "curve_authorized_keys": str(keys / "authorized"),
        "curve_client_key": str(keys / "ops.key_secret"),
    })
    yield service
    service.stop()
    assert pool.segments(service.cfg.instance) == []


def unanswered(endpoint: str, curve: Curve | None, wait_s: float = 3.0) -> bool:
    """True when a hello to `endpoint` gets no reply at all."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        curve(sock)
    sock.connect(endpoint)
    try:
        sock.send_multipart(m.encode(m.Hello()))
        return not sock.poll(int(wait_s * 1000))
    finally:
        sock.close()


def test_authorized_client_streams(secured: Service, keys: Path) -> None:
    curve = curve_for(keys, "client")
    pcm = read_wav(speech_files()[0])
    result = StreamClient(secured.address, pcm, "secret", speed=None, curve=curve).run()
    assert result.errors == [] and result.closed is not None and result.closed.reason == "end" and result.finals


def test_unauthorized_clients_refused_and_logged(secured: Service, keys: Path) -> None:
    ingest = hello(secured.address, curve=curve_for(keys, "client")).ingest
    intruder = curve_for(keys, "intruder")
    intruder_key = read_public_key(keys / "intruder.key").decode()
    for endpoint, program in ((secured.address, "broker"), (ingest, "ingest-0")):
        assert unanswered(endpoint, intruder), f"{program} answered an unauthorized key"
        assert unanswered(endpoint, None), f"{program} answered a client without CURVE"
        deadline = time.monotonic() + 30
        while intruder_key not in secured.logs(program) and time.monotonic() < deadline:
            time.sleep(0.1)
        refusals = [line for line in secured.logs(program).splitlines() if '"auth.refused"' in line]
        assert any(intruder_key in line for line in refusals), f"{program} did not log the refusal"


def status_with(service: Service, tmp: Path, client_key: str) -> tuple[int, dict]:
    """`streamasr status --json` with the service's config but `ingest.curve_client_key` = `client_key`."""
    cfg = service.cfg
    config_file = tmp / "ops.toml"
    config_file.write_text(settings.dump(dataclasses.replace(cfg, ingest=dataclasses.replace(cfg.ingest, curve_client_key=client_key))))
    done = service.cli("status", "--json", "--config", str(config_file))
    return done.returncode, json.loads(done.stdout)


def test_status_with_the_ops_key(secured: Service) -> None:
    done = secured.cli("status", "--json")
    report = json.loads(done.stdout)
    assert done.returncode == 0 and report["ready"] is True, report
    assert "broker_error" not in report and len(report["ingests"]) == 1 and len(report["workers"]) == 1


def test_status_without_an_authorized_key_is_refused(secured: Service, keys: Path, tmp_path: Path) -> None:
    code, report = status_with(secured, tmp_path, str(keys / "intruder.key_secret"))
    assert code == 1 and report["ready"] is False and "no answer" in report["broker_error"], report
    assert "ingests" not in report
    code, report = status_with(secured, tmp_path, "")
    assert code == 1 and report["ready"] is False and "curve_client_key" in report["broker_error"], report


def test_a_client_key_setting_that_is_not_a_key_pair_is_named_by_status_and_transcribe(secured: Service, keys: Path,
                                                                                        tmp_path: Path) -> None:
    """`ingest.curve_client_key` naming the public half (`ops.key`) or no file at all: the
    operator is told which setting to fix, not only a file name or a bare errno."""
    for wrong in (keys / "ops.key", keys / "missing.key_secret"):
        code, report = status_with(secured, tmp_path, str(wrong))
        assert code == 1 and report["broker_error"].startswith("ingest.curve_client_key: "), report
        done = secured.cli("transcribe", str(speech_files()[0]), "--config", str(tmp_path / "ops.toml"))
        assert done.returncode == 2 and "ingest.curve_client_key: " in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_transcribe_streams_with_the_config_s_client_key(secured: Service, tmp_path: Path) -> None:
    """`streamasr transcribe` to a service with CURVE on uses `ingest.curve_client_key`, as
    `status` does: without it the service would answer nothing and the command would wait out
    its timeouts. Without a key it says which setting is missing."""
    done = secured.cli("transcribe", str(speech_files()[0]), "--json", timeout=120)
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert done.returncode == 0, done.stderr
    assert [r["type"] for r in rows if r["type"] == "summary"] == ["summary"] and rows[-1]["text"], rows
    config_file = tmp_path / "nokey.toml"
    cfg = secured.cfg
    config_file.write_text(settings.dump(dataclasses.replace(cfg, ingest=dataclasses.replace(cfg.ingest, curve_client_key=""))))
    done = secured.cli("transcribe", str(speech_files()[0]), "--config", str(config_file))
    assert done.returncode == 2 and "curve_client_key" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_bench_streams_to_a_service_with_curve_on_with_the_config_s_client_key(secured: Service, tmp_path: Path) -> None:
    """docs/OPERATIONS.md has operators bench their own config: with CURVE on, the bench's clients
    spoke without keys, were answered by no one and waited out their timeouts. They use
    `ingest.curve_client_key`, as `status` and `transcribe` do."""
    out = tmp_path / "bench.json"
    done = secured.cli("bench", "--server", secured.address, "--streams", "2", "--duration", "2", "--json", str(out),
                       timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    streams = json.loads(out.read_text())["streams"]
    assert streams["opened"] == streams["closed"] == 2 and not streams["refused"], streams
    config_file = tmp_path / "nokey.toml"
    cfg = secured.cfg
    config_file.write_text(settings.dump(dataclasses.replace(cfg, ingest=dataclasses.replace(cfg.ingest, curve_client_key=""))))
    done = secured.cli("bench", "--server", secured.address, "--config", str(config_file), "--duration", "2")
    assert done.returncode == 2 and "curve_client_key" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_local_permissions(secured: Service) -> None:
    run = secured.cfg.run_path
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    assert {"broker-ingest.sock", "broker-workers.sock"} <= {p.name for p in run.glob("*.sock")}
    [name] = pool.segments(secured.cfg.instance)  # the one ingest's ring pool
    assert stat.S_IMODE((pool.SHM_DIR / name).stat().st_mode) == 0o600, name


def test_half_a_curve_configuration_is_refused() -> None:
    from protocol.auth import curve_settings

    with pytest.raises(ValueError):
        curve_settings("server.key_secret", "")
    assert curve_settings("", "") is False


def test_the_reference_clients_stream_with_the_client_s_keys(secured: Service, keys: Path) -> None:
    """`Client` and `AsyncClient` take the service's public key and their own secret key: the
    front door and the ingest then answer them; without the keys nothing does."""
    curve = (read_public_key(keys / "server.key"), read_key_pair(keys / "client.key_secret")[1])
    pcm = read_wav(speech_files()[0])
    with Client(secured.address, curve=curve) as client:
        stream = client.open()
        stream.send(pcm)
        stream.end()
        events = list(stream.events(timeout=60))
    assert isinstance(events[-1], m.Closed) and events[-1].reason == "end", events[-1]
    assert events[-1].audio_s == pytest.approx(len(pcm) / 2 / 16000, abs=0.01)  # 16-bit samples

    async def main() -> list[m.ServerMessage]:
        async with AsyncClient(secured.address, curve=curve) as aclient:
            astream = await aclient.open(priority="batch")
            await astream.send(pcm)
            await astream.end()
            return [ev async for ev in astream.events(timeout=60)]

    events = asyncio.run(main())
    assert isinstance(events[-1], m.Closed) and events[-1].reason == "end", events[-1]
    with pytest.raises(TimeoutError):
        Client(secured.address, timeout=2.0)


def refused_handshake(endpoint: str, curve: Curve) -> None:
    """One CURVE handshake with `curve`, waited for until the server refuses it."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RECONNECT_IVL, 60_000)  # no second try before the socket is closed
    curve(sock)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    try:
        sock.connect(endpoint)
        assert monitor.poll(30_000), "the handshake was neither refused nor taken"
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close()


def curve_service(tmp_path: Path, keys: Path) -> contextlib.AbstractContextManager[Service]:
    """A null-model service with CURVE on, for a test that reads its logs after it stopped."""
    return running(tmp_path, model="null", workers=1, ingest={
        "curve_secret_key": str(keys / "server.key_secret"),
        "curve_authorized_keys": str(keys / "authorized"),
        "curve_client_key": str(keys / "ops.key_secret"),
    })


def refusals_counted(service: Service, refused: int) -> float:
    """`auth_refusals_total` on the dashboard, once it counts `refused` handshakes."""
    metrics = f"http://127.0.0.1:{service.cfg.metrics.dashboard_port}/metrics"

    def counted() -> float | None:
        try:
            text = urllib.request.urlopen(metrics, timeout=10).read().decode()
        except OSError:  # the dashboard not listening yet
            return None
        found = re.search(r"^streamasr_auth_refusals_total (\S+)$", text, re.MULTILINE)
        return float(found[1]) if found and float(found[1]) >= refused else None

    return wait_for(counted, timeout=30, what="every refusal counted")


def refusals_told(events: list[dict]) -> int:
    """The refusals the `auth.refused` and `auth.refused_untold` lines tell, each line its own
    (if written) plus those it says were not written: its key's and other keys'."""
    return sum((e["event"] == "auth.refused") + e.get("suppressed", 0) + e.get("held_back", 0)
               for e in events if e["event"] in ("auth.refused", "auth.refused_untold"))


def test_a_client_refused_in_a_loop_writes_few_lines_that_count_every_refusal(tmp_path: Path, keys: Path) -> None:
    """A client with a key not listed retries its handshake every reconnect interval until it is
    fixed: a line for each refusal would fill the broker's log and rotate out everything else. The
    first refusal of a key is written at once, later ones at most a line a minute, each saying how
    many were not written; `auth_refusals_total` counts every one, and those no line told yet are
    written as the process stops."""
    _, secret = zmq.curve_keypair()
    looping = read_public_key(keys / "server.key"), secret
    looping_key = zmq.curve_public(secret).decode()
    tries = 200
    with curve_service(tmp_path, keys) as service:
        for _ in range(tries):
            refused_handshake(service.address, lambda sock: apply_client_curve(sock, *looping))
        assert refusals_counted(service, tries) == tries
        written = [e for e in service.events("broker") if e["event"] == "auth.refused" and e["client_key"] == looping_key]
        assert 1 <= len(written) <= 5 and written[0]["suppressed"] == 0, written  # a line a minute at most
    told = [e for e in service.events("broker")
            if e["event"] in ("auth.refused", "auth.refused_untold") and e.get("client_key") == looping_key]
    assert [e["event"] for e in told].count("auth.refused_untold") <= 1, told
    assert len(written) + sum(e["suppressed"] for e in told) == tries, told


def test_a_flood_of_new_keys_is_forgotten_oldest_first() -> None:
    """Refusals of a new random key on every handshake must not grow the table of keys whose lines
    are throttled without bound: past its size the key written longest ago is forgotten (its next
    refusal is a first line again), the newest are still throttled."""
    throttle = Throttle("auth.refused", REFUSED_LOG_INTERVAL_S, max_keys=100)
    flood = [zmq.curve_keypair()[0] for _ in range(1000)]
    assert [throttle(key) for key in flood] == [0] * len(flood)  # each a first refusal, written
    assert throttle(flood[-1]) is None  # refused again within the minute: not written
    assert throttle(flood[0]) == 0  # forgotten: written as a first refusal
    assert len(throttle.take_suppressed()) == 1


def test_a_flood_of_distinct_keys_writes_a_few_lines_a_minute_that_count_every_refusal(tmp_path: Path,
                                                                                        keys: Path) -> None:
    """A client with the server's public key can make up a new key pair for every handshake: a
    line for each new key would make the broker a log writer. A few new keys a minute get their
    line; the refusals of the others are held back, every one counted in `auth_refusals_total`
    and told as `held_back` by the next line written, the rest as the process stops."""
    server_public = read_public_key(keys / "server.key")
    tries = 200
    with curve_service(tmp_path, keys) as service:
        started = time.monotonic()
        for _ in range(tries):
            _, secret = zmq.curve_keypair()
            refused_handshake(service.address, lambda sock: apply_client_curve(sock, server_public, secret))
        minutes = 1 + int((time.monotonic() - started) // REFUSED_LOG_INTERVAL_S)  # those the flood spanned
        assert refusals_counted(service, tries) == tries
        written = [e for e in service.events("broker") if e["event"] == "auth.refused"]
        assert 1 <= len(written) <= REFUSED_NEW_KEYS_PER_INTERVAL * minutes, len(written)
    events = service.events("broker")
    untold = [e for e in events if e["event"] == "auth.refused_untold"]
    assert all("client_key" not in e for e in untold), untold  # each key written was refused once
    assert refusals_told(events) == tries


def test_the_refusals_of_a_key_forgotten_from_the_table_are_still_told() -> None:
    """A key pushed out of a full table takes the refusals it held back with it: they are counted
    for the next line and the last word as the process stops, so the lines still tell every one."""
    throttle = Throttle("auth.refused", REFUSED_LOG_INTERVAL_S, max_keys=100)
    flood = [zmq.curve_keypair()[0] for _ in range(300)]
    told = 0
    for key in flood:
        for _ in range(3):  # a line and two held back, until the key is forgotten
            if (suppressed := throttle(key)) is not None:
                told += 1 + suppressed + throttle.take_untold()
    assert told < len(flood) * 3  # the last keys' refusals are still held back
    last_word = sum(throttle.take_suppressed().values()) + throttle.take_untold()
    assert told + last_word == len(flood) * 3
    assert throttle.take_suppressed() == {} and throttle.take_untold() == 0  # counted as told
