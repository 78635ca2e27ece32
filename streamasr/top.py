"""`streamasr top`: the dashboard's figures in a terminal, refreshed every second.

An instance has one collector (it binds the metrics endpoint). When the dashboard is up, `top` reads
its snapshot over HTTP; otherwise it runs a collector itself for as long as it runs, in the
instance's run directory: an instance without one has never started, and `top` leaves it so.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from datetime import datetime
from typing import Any, Callable

from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from config.settings import Config
from metrics.collector import Collector

REFRESH_S = 1.0
FIRST_FRAME_WAIT_S = 2.5  # a local collector hears every process within one publish interval, plus slack


def main(cfg: Config, once: bool = False, url: str | None = None) -> int:
    """Show the instance's figures (one frame with `once`); `url` is the dashboard's, default on 127.0.0.1
    at the config's port, where only this instance's own dashboard counts: another instance's may
    hold that port while this one is not running."""
    console = Console()
    given = url is not None
    url = url or f"http://127.0.0.1:{cfg.metrics.dashboard_port}/"
    snap = _fetch(url)
    if snap is not None and (given or snap.get("instance") == cfg.instance):
        return _show(console, lambda: _fetch(url), f"dashboard {url}", once)
    if not cfg.run_path.is_dir():  # nothing of the instance publishes there; a collector would make it
        console.print(f"[red]instance {cfg.instance!r} is not running[/red] (no run directory {cfg.run_path})")
        return 1
    collector = Collector(cfg)
    try:
        collector.start()
    except RuntimeError as exc:
        hint = f"and no dashboard answers at {url}" if given else "is the dashboard running on another port? pass its address"
        console.print(Text(f"{exc}: ", style="red") + Text(hint))
        return 1
    try:
        time.sleep(FIRST_FRAME_WAIT_S)
        collector.refresh()  # a view with what was heard, without waiting for the next scheduled one
        return _show(console, collector.snapshot, f"collector {collector.endpoint}", once)
    finally:
        collector.close()


def _show(console: Console, read: Callable[[], dict[str, Any] | None], source: str, once: bool) -> int:
    if once:
        console.print(render(read(), source))
        return 0
    try:
        with Live(render(read(), source), console=console, refresh_per_second=1 / REFRESH_S) as live:
            while True:
                time.sleep(REFRESH_S)
                live.update(render(read(), source))
    except KeyboardInterrupt:
        return 0


def _fetch(url: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/api/snapshot", timeout=1.0) as reply:
            snap = json.loads(reply.read())
    # HTTPException: what answers is no HTTP server (another program on the port), or the dashboard
    # closed the connection mid-answer (restarted): as if nothing answered, not a traceback
    except (OSError, urllib.error.URLError, ValueError, http.client.HTTPException):
        return None
    return snap if isinstance(snap, dict) else None


def _num(value: float | None, digits: int = 0) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _seconds(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def _bytes(value: float | None) -> str:
    if value is None:
        return "–"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _table(title: str) -> Table:
    """No edges and light rules: nine columns fit the 80 that a pipe or a small terminal gets."""
    return Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)


def render(snap: dict[str, Any] | None, source: str) -> Group:
    """One frame: summary, processes, workers, GPUs and recent errors. A snapshot this version
    cannot read (a dashboard of another version, reached during an upgrade or with `--url`) is
    said in the frame, and `top` goes on reading."""
    if snap is None:
        return Group(Text(f"no snapshot from {source}", style="red"))
    try:
        return _frame(snap, source)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError, OSError) as exc:  # OSError: a time out of range
        return Group(Text(f"a snapshot from {source} this version cannot read: {type(exc).__name__}: {exc}", style="red"))


def _frame(snap: dict[str, Any], source: str) -> Group:
    """Names and codes from the snapshot go in as Text, not markup: `[` in one is no style."""
    when = datetime.fromtimestamp(snap["time"]).strftime("%H:%M:%S")
    header = Text.assemble(("streamasr ", "bold"), (snap["instance"], "bold cyan"), f"  {when}  via {source}")

    summary = Table(box=None, show_header=False, pad_edge=False)
    for _ in range(4):
        summary.add_column(style="dim")
        summary.add_column(justify="right")
    lat, thr = snap["latency"], snap["throughput"]
    summary.add_row("streams realtime", _num(snap["streams"].get("realtime", 0)), "queued realtime", _num(snap["queued"].get("realtime", 0)),
                    "jobs/s", _num(thr["jobs_per_s"], 1), "partial p50/p95",
                    f"{_seconds(lat['partial']['p50'])} / {_seconds(lat['partial']['p95'])}")
    summary.add_row("streams batch", _num(snap["streams"].get("batch", 0)), "queued batch", _num(snap["queued"].get("batch", 0)),
                    "jobs in all", _num(snap["totals"]["jobs"]), "final p50/p95",
                    f"{_seconds(lat['final']['p50'])} / {_seconds(lat['final']['p95'])}")
    summary.add_row("audio rings", f"{_num(snap['rings']['used'])}/{_num(snap['rings']['total'])}", "in flight", _num(snap["inflight"]),
                    "batch mean", _num(snap["batch"]["mean"], 2), "restarts",
                    Text(", ".join(f"{p} {n}" for p, n in snap["restarts"].items() if n) or "none"))  # the programs that did
    adm = snap["admission"]
    summary.add_row("realtime cap", _num(adm["realtime_cap"]) if adm["realtime_cap"] else "none",
                    "realtime wait", _seconds(adm["wait_s"]), "workers busy", f"{100 * adm['busy']:.0f} %",
                    "per stream", f"{100 * adm['stream_share']:.0f} %")
    summary.add_row("opens held", _num(adm.get("opens_waiting", 0)), "", "", "", "", "", "")  # waiting for room; none from an older dashboard

    procs = _table("processes")  # what names a row (name, state, pid) and its memory are never cut; the other figures wrap
    for name, justify in (("name", "left"), ("state", "left"), ("pid", "right"), ("CPU %", "right"), ("RSS", "right"),
                          ("threads", "right"), ("fds", "right"), ("restarts", "right"), ("heard", "right")):
        procs.add_column(name, justify=justify, no_wrap=name in ("name", "state", "pid", "RSS"))  # type: ignore[arg-type]
    for p in snap["processes"]:
        state_style = "green" if p["state"] == "RUNNING" else "yellow" if p["state"] in ("SILENT", "STARTING", "BACKOFF") else "red"
        procs.add_row(Text(p["name"]), Text(p["state"], style=state_style), _num(p["pid"]), _num(p["cpu_percent"], 1), _bytes(p["rss_bytes"]),
                      _num(p["threads"]), _num(p["open_fds"]), _num(p["restarts"]),
                      "–" if p.get("last_seen_s") is None else f"{p['last_seen_s']:.1f} s")
    parts: list[Any] = [header, summary, procs]

    if snap["workers"]:
        workers = _table("workers")
        workers.add_column("worker")
        workers.add_column("busy", justify="right")
        for w in snap["workers"]:
            workers.add_row(Text(w["name"]), "–" if w["busy_ratio"] is None else f"{100 * w['busy_ratio']:.0f} %")
        parts.append(workers)
    if snap.get("gpus"):
        gpus = _table("GPUs")
        for name in ("gpu", "utilisation", "memory"):
            gpus.add_column(name, justify="right")
        for g in snap["gpus"]:
            gpus.add_row(Text(str(g["gpu"])), f"{g['utilization_percent']:.0f} %", f"{_bytes(g['memory_used_bytes'])} / {_bytes(g['memory_total_bytes'])}")
        parts.append(gpus)
    if snap["recent_errors"]:
        errors = _table("recent errors and refusals")
        for name in ("time", "process", "kind", "code", "count"):
            errors.add_column(name)
        for e in snap["recent_errors"][:8]:
            errors.add_row(datetime.fromtimestamp(e["time"]).strftime("%H:%M:%S"), *(Text(e[k]) for k in ("process", "kind", "code")),
                           _num(e["count"]))
        parts.append(errors)
    if snap.get("supervisor_error"):
        parts.append(Text(f"supervisord: {snap['supervisor_error']}", style="yellow"))
    if snap.get("state_error"):
        parts.append(Text(f"dashboard: {snap['state_error']}", style="yellow"))
    return Group(*parts)
