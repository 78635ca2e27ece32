"""The dashboard process over HTTP, and its page in real headless Chromium.

`check_dashboard` is the whole browser check for any running dashboard: give it the page's URL, the
processes the page must list, and optionally a load to run while it watches. The last test runs it
against the real service (supervisord's own dashboard) under `streamasr bench`.
"""

from __future__ import annotations

import http.client
import io
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from config import settings
from dashboard.server import MAX_EVENT_STREAMS, REQUEST_TIMEOUT_S
from metrics.collector import SILENT_AFTER_S, STALE_AFTER_S
from streamasr import top
from streamasr.service import UP_STATES
from streaming import wait_for
from test_metrics import ROOT, instance_config, start_publisher

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@contextmanager
def running_dashboard(config_file: Path, log: Path | None = None) -> Iterator[str]:
    """`python -m dashboard` for the instance on a free port (its log lines in `log`, if given);
    yields its URL, stops it with SIGTERM."""
    with open(log, "w") if log is not None else open(os.devnull, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "dashboard", "--config", str(config_file), "--port", "0"],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("dashboard http://"):
        proc.kill()
        raise AssertionError(f"dashboard did not start: {line!r} {log.read_text() if log else ''}")
    try:
        yield line.split()[1]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(10) == 0
        finally:
            if proc.poll() is None:
                proc.kill()


def get(url: str, timeout: float = 5.0) -> tuple[str, bytes]:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return reply.headers["Content-Type"], reply.read()


def check_page(url: str, processes: Iterable[str], screenshot: Path, watch_s: float = 6.0) -> None:
    """In headless Chromium: the page goes live, lists every process, its numbers move and charts draw."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(url)
            page.wait_for_function("document.querySelector('#connection').textContent === 'live'", timeout=10_000)
            for name in processes:
                page.wait_for_selector(f'#processes tr[data-process="{name}"]', timeout=10_000)
            numbers = "() => [...document.querySelectorAll('[data-metric], #processes td')].map(e => e.textContent).join('|')"
            jobs = "() => Number(document.querySelector('[data-metric=\"jobs-total\"]').textContent) || 0"
            first_numbers, first_jobs = page.evaluate(numbers), page.evaluate(jobs)
            deadline = time.monotonic() + watch_s
            while time.monotonic() < deadline and (page.evaluate(jobs) <= first_jobs or page.evaluate(numbers) == first_numbers):
                page.wait_for_timeout(250)
            assert page.evaluate(jobs) > first_jobs, "jobs in all did not grow on the page"
            assert page.evaluate(numbers) != first_numbers, "the page's numbers did not change"
            page.wait_for_timeout(1500)  # a few chart points
            inked = page.evaluate("""() => {
                const c = document.querySelector('#throughput-chart');
                const data = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                let n = 0; for (let i = 3; i < data.length; i += 4) if (data[i]) n++; return n; }""")
            assert inked > 500, "the throughput chart is blank"
            page.screenshot(path=str(screenshot), full_page=True)
            assert not errors, errors
        finally:
            browser.close()


def check_dashboard(url: str, processes: Iterable[str], out_dir: Path,
                    load: Callable[[], subprocess.Popen] | None = None, watch_s: float = 6.0) -> Path:
    """Check the page at `url` (with `load` running, if given; stopped after unless it finished); returns the screenshot."""
    screenshot = out_dir / "dashboard.png"
    loader = load() if load is not None else None
    try:
        check_page(url, processes, screenshot, watch_s)
    finally:
        if loader is not None and loader.poll() is None:
            loader.terminate()
            loader.wait(30)
    return screenshot


def exported(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """The dashboard's /metrics, parsed by prometheus_client (which checks the format): sample name -> labels -> value."""
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(get(url + "metrics")[1].decode()):
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


def counters(url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples of counter `name` (without `_total`), by labels."""
    return exported(url).get(name + "_total", {})


@pytest.fixture
def fake_instance(tmp_path: Path) -> Iterator[tuple[Path, list[str]]]:
    """An instance whose 'processes' are three publishers of made-up figures."""
    cfg, config_file = instance_config(tmp_path)
    cfg.run_path.mkdir(mode=0o700)  # as `serve` prepares it
    pubs = [start_publisher(config_file, name) for name in ("broker", "ingest-0", "worker-0")]
    yield config_file, [p.name for p in pubs]
    for p in pubs:
        p.kill()


def test_http_endpoints(fake_instance) -> None:
    config_file, names = fake_instance
    with running_dashboard(config_file) as url:
        snap = wait_for(lambda: (s := json.loads(get(url + "api/snapshot")[1])) and len(s["processes"]) == 3 and s,
                        what="all publishers in the snapshot")
        assert sorted(p["name"] for p in snap["processes"]) == sorted(names)
        assert snap["admission"]["realtime_cap"] is None  # no cap set
        assert set(snap["admission"]) == {"realtime_cap", "wait_s", "busy", "stream_share", "opens_waiting"}
        content_type, body = get(url + "metrics")
        assert content_type.startswith("text/plain")
        assert "streamasr_jobs" in {f.name for f in text_string_to_metric_families(body.decode())}
        content_type, body = get(url)
        assert content_type.startswith("text/html") and b"/static/dashboard.js" in body
        for asset in ("", "static/dashboard.js", "static/dashboard.css"):  # nothing is loaded from elsewhere
            assert b"http:" not in get(url + asset)[1] and b"https:" not in get(url + asset)[1]
        with urllib.request.urlopen(url + "events", timeout=5) as events:
            assert events.headers["Content-Type"] == "text/event-stream"
            pushed = [line for line in (events.readline() for _ in range(8)) if line.startswith(b"data: ")]
        assert pushed and json.loads(pushed[0][6:])["instance"] == settings.load(config_file).instance
        for missing in ("nope", "static/../server.py", "static/%2e%2e/server.py"):
            with pytest.raises(urllib.error.HTTPError) as err:
                get(url + missing)
            assert err.value.code == 404
        # a page elsewhere that points its own name at 127.0.0.1 (DNS rebinding) is not answered
        host, port = url.removeprefix("http://").rstrip("/").split(":")
        for name, status in ((f"evil.example:{port}", 421), (f"localhost:{port}", 200), (f"127.0.0.1:{port}", 200)):
            conn = http.client.HTTPConnection(host, int(port), timeout=5)
            try:
                conn.request("GET", "/api/snapshot", headers={"Host": name})
                assert conn.getresponse().status == status, name
            finally:
                conn.close()
        # uptime checks probe with HEAD: the GET's status and headers, and no body after them
        for path, status in (("/", 200), ("/api/snapshot", 200), ("/metrics", 200), ("/events", 200), ("/nope", 404)):
            with socket.create_connection((host, int(port)), timeout=10) as raw:
                raw.sendall(f"HEAD {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n".encode())
                answer = b"".join(iter(lambda: raw.recv(65536), b""))  # to the server's close
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.split(b" ", 2)[1] == str(status).encode() and body == b"", (path, answer[:300])
            length = re.search(rb"Content-Length: (\d+)", head)
            assert path == "/events" or (length and int(length[1]) > 0), (path, head)
        # a connection that never sends its request does not hold its thread for ever
        host, port = url.removeprefix("http://").rstrip("/").split(":")
        with socket.create_connection((host, int(port)), timeout=REQUEST_TIMEOUT_S + 10) as idle:
            started = time.monotonic()
            assert idle.recv(1) == b"" and time.monotonic() - started >= REQUEST_TIMEOUT_S - 1


def http_request(url: str, method: str, path: str) -> socket.socket:
    """A connection to the dashboard at `url` that has sent `method path` and nothing more."""
    host, port = url.removeprefix("http://").rstrip("/").split(":")
    conn = socket.create_connection((host, int(port)), timeout=REQUEST_TIMEOUT_S + 10)
    conn.sendall(f"{method} {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n".encode())
    return conn


def open_events(url: str) -> tuple[socket.socket, bytes]:
    """An /events stream, read up to its first event when it is served, else to the server's
    close: (connection, what was read)."""
    conn = http_request(url, "GET", "/events")
    answer = b""
    while b"\ndata: " not in answer:
        chunk = conn.recv(65536)
        if not chunk:
            break
        answer += chunk
    return conn, answer


def test_event_streams_past_the_cap_are_refused_and_a_page_that_goes_frees_its_place(fake_instance, tmp_path: Path) -> None:
    """Each event stream holds a thread, and a page that stops reading is found out only when the
    socket buffers are full: past MAX_EVENT_STREAMS at once a new one is answered 503 (which the
    page retries), the rest of the dashboard still answers, and a stream that ends gives its place.
    The refusals' lines, at most one a second, and what they and the last word as the dashboard
    stops say were not written, add up to the refusals."""
    config_file, _ = fake_instance
    log = tmp_path / "dashboard.log"
    streams: list[tuple[socket.socket, bytes]] = []
    refusals = 0

    def served() -> bool:
        nonlocal refusals
        conn, answer = open_events(url)
        if answer.startswith(b"HTTP/1.0 200"):
            streams.append((conn, answer))
            return True
        refusals += 1
        conn.close()
        return False

    with running_dashboard(config_file, log) as url:
        streams += [open_events(url) for _ in range(MAX_EVENT_STREAMS)]
        try:
            assert all(answer.startswith(b"HTTP/1.0 200") for _, answer in streams)
            for _ in range(20):  # a page asking again and again
                extra, answer = open_events(url)
                extra.close()
                refusals += 1
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.0 503") and b"Retry-After: 5" in head, answer[:300]
            assert f"{MAX_EVENT_STREAMS} event streams are open".encode() in body
            assert json.loads(get(url + "api/snapshot")[1])["instance"] == settings.load(config_file).instance
            assert get(url + "metrics")[0].startswith("text/plain")
            streams.pop()[0].close()  # a page closed: its place is free once the server finds it gone
            wait_for(served, what="a stream served after another one ended")
        finally:
            for conn, _ in streams:
                conn.close()
    events = list(map(json.loads, log.read_text().splitlines()))
    refused = [e for e in events if e["event"] == "dashboard.events_refused"]
    assert refused and refused[0]["open"] == MAX_EVENT_STREAMS and refused[0]["level"] == "warning", refused
    untold = [e for e in events if e["event"] == "dashboard.events_refused_untold"]
    assert len(refused) + sum(e["suppressed"] for e in refused + untold) == refusals, (refused, untold)


def test_a_client_gone_mid_answer_leaves_no_traceback_in_the_log(fake_instance, tmp_path: Path) -> None:
    """A scraper past its timeout, a tab closed while the page loads: the connection is reset before
    the answer is written. The log must stay JSON lines, not a traceback per request."""
    config_file, _ = fake_instance
    log = tmp_path / "dashboard.log"
    with running_dashboard(config_file, log) as url:
        for path in ("/metrics", "/api/snapshot", "/", "/static/dashboard.js") * 5:
            conn = http_request(url, "GET", path)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close by reset
            conn.close()
        assert get(url + "metrics")[0].startswith("text/plain")  # and it serves on
    lines = log.read_text().splitlines()
    assert "Traceback" not in "\n".join(lines), "\n".join(lines)[:3000]
    assert [json.loads(line)["event"] for line in lines] == ["dashboard.started", "dashboard.stopped"], lines


def test_top_prints_one_frame_from_the_dashboard_or_its_own_collector(fake_instance, capsys) -> None:
    config_file, names = fake_instance
    cfg = settings.load(config_file)
    assert top.main(cfg, once=True, url="http://127.0.0.1:9/") == 0  # no dashboard there: a collector of its own
    frame = capsys.readouterr().out
    assert "via collector" in frame and all(name in frame for name in names)
    assert "per stream" in frame and "opens held" in frame  # the admission rows
    with running_dashboard(config_file) as url:
        wait_for(lambda: len(json.loads(get(url + "api/snapshot")[1])["processes"]) == 3, what="the dashboard's view")
        assert top.main(cfg, once=True, url=url) == 0
        frame = capsys.readouterr().out
        assert "via dashboard" in frame and all(name in frame for name in names)
        assert top.main(cfg, once=True, url="http://127.0.0.1:9/") == 1  # the dashboard holds the endpoint
        said = " ".join(capsys.readouterr().out.split())
        # the address it was given, not to give one
        assert "already bound" in said and "no dashboard answers at http://127.0.0.1:9/" in said, said
        snap = json.loads(get(url + "api/snapshot")[1])
    # the widest figures a busy host shows still leave every row's name, state and pid whole in the 80
    # columns a pipe or a small terminal gets
    for p in snap["processes"]:
        p.update(state="STARTING", pid=4194304, cpu_percent=199.9, rss_bytes=3 << 30, threads=123, open_fds=1234,
                 restarts=123, last_seen_s=123.4)
    # and what a snapshot names is shown as it is: `[/]` in an error code is no markup that ends `top`
    snap["recent_errors"] = [{"time": snap["time"], "process": "ingest-0", "kind": "error", "code": "[/]odd[b]", "count": 1}]
    console = Console(width=80, record=True, file=io.StringIO())
    console.print(top.render(snap, f"dashboard {url}"))
    frame = console.export_text()
    rows = [line.split()[:3] for line in frame.splitlines()]
    assert all([name, "STARTING", "4194304"] in rows for name in names), frame
    # its memory whole on its line too, and the restarts said once, not a column of every program's
    assert all(any(line.split()[:1] == [name] and "3.0 GiB" in line for line in frame.splitlines()) for name in names), frame
    snap["restarts"] = {name: 0 for name in names}
    console = Console(width=80, record=True, file=io.StringIO())
    console.print(top.render(snap, f"dashboard {url}"))
    assert any(line.split()[-2:] == ["restarts", "none"] for line in console.export_text().splitlines()), console.export_text()
    assert "[/]odd[b]" in frame, frame


def test_top_says_when_a_dashboard_s_snapshot_is_not_one_it_can_read(tmp_path: Path, capsys) -> None:
    """A dashboard of another version (during an upgrade, or reached with `--url`) may serve a
    snapshot of another shape: `top` says so in its frame rather than end in a traceback."""
    import http.server
    import threading

    served: list[bytes] = []

    class Old(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # the name http.server calls
            body = served[0]
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Old)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    cfg = settings.load(None, {"run_dir": str(tmp_path / "run")})
    try:
        # a view from before the admission figures were in it
        served[:] = [json.dumps({"time": time.time(), "instance": cfg.instance, "processes": []}).encode()]
        assert top.main(cfg, once=True, url=url) == 0
        frame = capsys.readouterr().out
        assert "cannot read" in frame and "KeyError" in frame and "Traceback" not in frame, frame
        served[:] = [b"[1, 2]"]  # JSON, but no view at all: as if nothing answered, and a collector of its own
        assert top.main(cfg, once=True, url=url) == 1
        assert "not running" in capsys.readouterr().out
    finally:
        server.shutdown()
        server.server_close()


def test_top_takes_a_port_that_answers_no_http_or_closes_mid_answer_for_no_dashboard(tmp_path: Path, capsys) -> None:
    """Another program on the dashboard's port, or a dashboard restarted while it answers: `top`
    shows the instance through a collector of its own, as when nothing answers, not a traceback."""
    cfg = instance_config(tmp_path)[0]
    cfg.run_path.mkdir(mode=0o700)
    for answer in (b"SSH-2.0-OpenSSH_9.6\r\n",  # no HTTP at all
                   b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"time\": "):  # cut short
        with socket.create_server(("127.0.0.1", 0)) as server:
            def answer_one(answer: bytes = answer) -> None:
                conn, _ = server.accept()
                with conn:
                    conn.recv(65536)
                    conn.sendall(answer)
            threading.Thread(target=answer_one, daemon=True).start()
            assert top.main(cfg, once=True, url=f"http://127.0.0.1:{server.getsockname()[1]}/") == 0
        frame = capsys.readouterr().out
        assert "via collector" in frame and cfg.instance in frame, frame


def test_top_does_not_take_another_instances_dashboard_for_its_own(fake_instance, tmp_path: Path, capsys) -> None:
    """Two instances' configs may name one dashboard port, which only a running one holds: `top` of
    the other must not show the running one's figures as its own."""
    config_file, names = fake_instance
    with running_dashboard(config_file) as url:
        port = int(url.rstrip("/").rsplit(":", 1)[1])
        own = settings.load(config_file, {"metrics": {"dashboard_port": port}})
        other = settings.load(instance_config(tmp_path)[1], {"metrics": {"dashboard_port": port}})
        other.run_path.mkdir()  # it ran once, and is not running now
        wait_for(lambda: len(json.loads(get(url + "api/snapshot")[1])["processes"]) == 3, what="the dashboard's view")
        assert top.main(own, once=True) == 0
        assert "via dashboard" in capsys.readouterr().out  # its own, at the config's port
        assert top.main(other, once=True) == 0
        frame = capsys.readouterr().out
        assert "via collector" in frame and other.instance in frame and not any(name in frame for name in names), frame


def test_top_of_an_instance_that_never_started_says_so_and_creates_nothing(tmp_path: Path, capsys) -> None:
    """`top --instance typo` must not leave a run directory behind that later looks like an instance."""
    cfg = instance_config(tmp_path)[0]
    assert top.main(cfg, once=True, url="http://127.0.0.1:9/") == 1
    assert f"instance {cfg.instance!r} is not running" in capsys.readouterr().out
    assert not cfg.run_path.exists()


def test_a_dashboard_whose_port_is_taken_says_so_and_exits(tmp_path: Path) -> None:
    """A port taken since `serve` checked it: supervisord restarts the dashboard over and over, so
    each try must say why in its log, as a `dashboard.refused` line, not a traceback."""
    config_file = instance_config(tmp_path)[1]
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "dashboard", "--config", str(config_file), "--port", str(port)],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr, done.stderr
    event = json.loads(done.stderr.strip().splitlines()[-1])
    assert event["event"] == "dashboard.refused" and f"127.0.0.1:{port}" in event["reason"], event


def test_a_dashboard_that_crashes_says_so_in_one_json_line_with_its_traceback(tmp_path: Path) -> None:
    """Its log is read as JSON lines (`jq` over the run directory's logs): an error the dashboard
    does not handle must end it as one more such line, `dashboard.crashed` with the traceback, as
    the other programs' crashes do, not a bare Python traceback. Here its run directory is a file."""
    cfg = settings.load(None, {"instance": f"m{uuid.uuid4().hex[:8]}", "run_dir": str(tmp_path / "run")})
    cfg.run_path.write_text("")
    config_file = tmp_path / "dashboard.toml"
    config_file.write_text(settings.dump(cfg))
    done = subprocess.run([sys.executable, "-m", "dashboard", "--config", str(config_file), "--port", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr[-2000:]
    events = [json.loads(line) for line in done.stderr.splitlines()]  # every line is JSON
    [crash] = [e for e in events if e["event"] == "dashboard.crashed"]
    assert crash["level"] == "error" and crash["process"] == "dashboard"
    assert "Traceback" in crash["exception"] and "File exists" in crash["exception"], crash


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium)")
def test_page_in_headless_chromium(fake_instance, tmp_path: Path) -> None:
    config_file, names = fake_instance
    with running_dashboard(config_file) as url:
        screenshot = check_dashboard(url, names, tmp_path)
    assert screenshot.stat().st_size > 10_000


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium)")
def test_the_page_says_it_is_stale_while_the_dashboard_does_not_answer_and_goes_live_again_after(fake_instance) -> None:
    """A dashboard that hangs (or a tunnel to it that dropped) closes no connection: the page must
    not go on saying `live` over figures that no longer move."""
    from playwright.sync_api import sync_playwright

    config_file, _ = fake_instance
    badge = "() => document.querySelector('#connection').textContent"
    with running_dashboard(config_file) as url, sync_playwright() as pw:
        pid = next(p.pid for p in psutil.Process().children() if "dashboard" in p.cmdline())  # `-m dashboard`
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(url)
            page.wait_for_function(f"({badge})() === 'live'", timeout=10_000)
            os.kill(pid, signal.SIGSTOP)
            try:
                page.wait_for_timeout(8_000)
                assert "stale" in page.evaluate(badge), page.evaluate(badge)
            finally:
                os.kill(pid, signal.SIGCONT)
            page.wait_for_function(f"({badge})() === 'live'", timeout=10_000)
        finally:
            browser.close()


SERVICE_PROCESSES = ("broker", "ingest-0", "worker-0", "worker-1")


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium)")
def test_full_service_dashboard_under_bench(service_factory, tmp_path: Path) -> None:
    """The real processes publish what the page shows: every one is listed, its figures move under
    `streamasr bench`, and the exported counters grow."""
    svc = service_factory(model="null", workers=2, ingest={"admit_max_realtime_streams": 64})
    url = f"http://127.0.0.1:{svc.cfg.metrics.dashboard_port}/"
    def listed() -> dict | None:
        """The snapshot once it lists every service process; the dashboard may still be starting."""
        try:
            snapshot = json.loads(get(url + "api/snapshot")[1])
        except OSError:
            return None
        return snapshot if set(SERVICE_PROCESSES) <= {p["name"] for p in snapshot["processes"]} else None

    snap = wait_for(listed, timeout=30, what="every service process in the dashboard's snapshot")
    assert snap["admission"]["realtime_cap"] == 64
    names = [p["name"] for p in snap["processes"] if p["name"] in (*SERVICE_PROCESSES, "dashboard")]
    before = counters(url, "streamasr_jobs")
    assert counters(url, "streamasr_refusals") == {} and counters(url, "streamasr_errors") == {}

    bench = subprocess.Popen([sys.executable, "-m", "streamasr.cli", "bench", "--server", svc.address,
                              # long enough to be still running once a slowly starting Chromium reads its first figures
                              "--streams", "8", "--duration", "15", "--model", "null"],
                             cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        screenshot = check_dashboard(url, names, tmp_path, watch_s=20)
        during = counters(url, "streamasr_jobs")
        _, stderr = bench.communicate(timeout=120)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert bench.returncode == 0, stderr
    assert screenshot.stat().st_size > 10_000

    def done(sample: dict[tuple[tuple[str, str], ...], float], kind: str) -> float:
        return sample.get((("kind", kind), ("status", "done")), 0)

    assert done(during, "partial") > done(before, "partial"), (before, during)
    after = wait_for(lambda: (a := counters(url, "streamasr_jobs")) and done(a, "final") > done(before, "final") and a,
                     what="finals counted in streamasr_jobs_total")
    assert all(after[labels] >= value for labels, value in during.items()), (during, after)
    figures = exported(url)
    assert figures["streamasr_shm_rings_total"][()] == svc.cfg.shm.streams_per_ingest
    for name in ("streamasr_streams_active", "streamasr_shm_rings_used", "streamasr_jobs_queued", "streamasr_jobs_inflight",
                 "streamasr_busy_seconds_total", "streamasr_admission_wait_seconds", "streamasr_admission_busy_ratio",
                 "streamasr_admission_stream_share", "streamasr_opens_waiting"):
        assert name in figures, name
    for name in ("streamasr_partial_latency_seconds", "streamasr_final_latency_seconds", "streamasr_batch_size"):
        assert figures[name + "_count"][()] > 0, name
    for leg in ("to_worker", "to_ingest"):
        assert figures["streamasr_job_transit_seconds_count"][(("leg", leg),)] > 0, leg
    decoded = counters(url, "streamasr_worker_jobs")
    # kept per worker, not summed; an idle-fast null model may leave one worker with all the jobs
    assert decoded and {dict(labels)["worker"] for labels in decoded} <= {"worker-0", "worker-1"}, decoded


def test_a_supervised_process_that_stops_publishing_is_shown_silent(service_factory) -> None:
    """supervisord still calls a hung process RUNNING (or STARTING, within its `startsecs`): the page must say it has gone quiet."""
    svc = service_factory(model="null", workers=1, ingest={"stall_after_s": 0})  # no stall watch to end it
    url = f"http://127.0.0.1:{svc.cfg.metrics.dashboard_port}/"

    def ingest_row() -> dict | None:
        try:
            rows = json.loads(get(url + "api/snapshot")[1])["processes"]
        except OSError:
            return None
        return next((p for p in rows if p["name"] == "ingest-0" and p["last_seen_s"] is not None), None)

    pid = wait_for(ingest_row, timeout=30, what="the ingest in the dashboard's snapshot")["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        # shown SILENT once it has not published for 3 s, and still SILENT past the 10 s after which
        # the collector drops a process it hears no more: supervisord still runs this one
        silent = wait_for(lambda: (row := ingest_row()) and row["state"] == "SILENT" and row, timeout=30,
                          what="the stopped ingest shown SILENT")
        assert silent["pid"] == pid and silent["last_seen_s"] >= SILENT_AFTER_S  # shown rounded to 0.1 s
        later = wait_for(lambda: (row := ingest_row()) and row["last_seen_s"] > STALE_AFTER_S + 1 and row, timeout=30,
                         what="the stopped ingest silent past the collector's limit")
        assert later["state"] == "SILENT" and later["pid"] == pid, later
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(lambda: (row := ingest_row()) and row["state"] in UP_STATES and row["last_seen_s"] < 3,
             timeout=10, what="the resumed ingest shown running")


def test_restarts_count_a_process_that_crashed_before_it_published_and_the_dashboard_itself(service_factory) -> None:
    """An operator alerts on `process_restarts_total`. A worker that crashes before it sends its
    first snapshot (a crash loop while it loads) is seen only in supervisord's list, and the
    dashboard sends no snapshot at all: both count, and a restarted dashboard goes on from
    its predecessor's counts."""
    svc = service_factory(model="null", workers=1)
    url = f"http://127.0.0.1:{svc.cfg.metrics.dashboard_port}/"
    rpc = svc.supervisor()

    def restarts() -> dict[str, float] | None:
        try:
            return {dict(labels)["program"]: v for labels, v in counters(url, "streamasr_process_restarts").items()}
        except OSError:  # the dashboard between two lives
            return None

    def running(name: str, old_pid: int) -> int | None:
        info = rpc.getProcessInfo(name)
        return info["pid"] if info["statename"] in UP_STATES and info["pid"] != old_pid else None

    wait_for(lambda: (r := restarts()) and r.get("worker") == 0 and r.get("dashboard") == 0, timeout=30,
             what="the worker and the dashboard counted, neither restarted")
    first_pid = rpc.getProcessInfo("worker:worker-0")["pid"]
    rpc.stopProcess("worker:worker-0")
    rpc.startProcess("worker:worker-0", False)
    pid = wait_for(lambda: rpc.getProcessInfo("worker:worker-0")["pid"] or None, timeout=10, what="the worker's new pid")
    os.kill(pid, signal.SIGKILL)  # long before the interpreter has loaded what it needs to publish
    rpc.stopProcess("worker:worker-0")  # no automatic retry: the collector has only supervisord's word for it
    wait_for(lambda: (r := restarts()) and r["worker"] == 1 and r, timeout=10, what="the crashed worker's start counted")
    rpc.startProcess("worker:worker-0", False)  # not waiting out its `startsecs`
    wait_for(lambda: running("worker:worker-0", first_pid), timeout=30, what="the worker running again")
    wait_for(lambda: (r := restarts()) and r["worker"] == 2 and r, timeout=10, what="its next start counted")

    dashboard = rpc.getProcessInfo("dashboard:dashboard")["pid"]
    time.sleep(1.5)  # a refresh that saved what the dashboard has counted
    os.kill(dashboard, signal.SIGKILL)
    wait_for(lambda: running("dashboard:dashboard", dashboard), timeout=30, what="supervisord to restart the dashboard")
    counted = wait_for(lambda: (r := restarts()) and "dashboard" in r and r, timeout=30, what="the new dashboard's count")
    assert counted == {"broker": 0, "dashboard": 1, "ingest": 0, "revive": 0, "worker": 2}


def test_a_dashboard_started_after_a_restart_it_missed_counts_it_in_its_first_answer(service_factory) -> None:
    """A scrape can come at once after the dashboard starts. A worker restarted while no dashboard
    ran must already count in the first figures served: the predecessor's saved state alone
    would read one restart short, and the counter would jump later."""
    from metrics.collector import Collector

    svc = service_factory(model="null", workers=1)
    url = f"http://127.0.0.1:{svc.cfg.metrics.dashboard_port}/"
    rpc = svc.supervisor()
    wait_for(lambda: (r := counters(url, "streamasr_process_restarts")) and len(r) == 5, timeout=30,
             what="every program counted")
    time.sleep(1.5)  # a refresh that saved what the dashboard has counted
    rpc.stopProcess("dashboard:dashboard")
    old = rpc.getProcessInfo("worker:worker-0")["pid"]
    rpc.stopProcess("worker:worker-0")
    rpc.startProcess("worker:worker-0", False)
    assert rpc.getProcessInfo("worker:worker-0")["pid"] not in (0, old)
    collector = Collector(svc.cfg, state_file=svc.cfg.metrics_state_path).start()
    try:
        first = {dict(s.labels)["program"]: s.value for f in text_string_to_metric_families(collector.prometheus().decode())
                 if f.name == "streamasr_process_restarts" for s in f.samples}
    finally:
        collector.close()
    assert first == {"broker": 0, "dashboard": 0, "ingest": 0, "revive": 0, "worker": 1}
