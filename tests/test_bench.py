"""`streamasr bench` end to end against the real service with the null model: the report is
well formed. No timing thresholds: these machines are shared, the numbers belong in the docs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import ROOT, Service
from streaming import wait_for

from config import settings
from streamasr import bench as streamasr_bench

LATENCY_KEYS = ("count", "p50", "p90", "p99", "p99_9", "max", "mean", "stdev")


def bench(tmp_path: Path, *args: str) -> dict[str, Any]:
    return bench_run(tmp_path, *args)[0]


def bench_run(tmp_path: Path, *args: str) -> tuple[dict[str, Any], str]:
    """The JSON summary and the printed report."""
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "-m", "streamasr.cli", "bench", *args, "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "latency (ms)" in proc.stdout
    return json.loads(out.read_text()), proc.stdout


def check_latency(stats: dict[str, Any]) -> None:
    assert set(LATENCY_KEYS) <= set(stats)
    assert stats["count"] > 0
    for key in LATENCY_KEYS[1:]:
        assert math.isfinite(stats[key]) and stats[key] >= 0, (key, stats)
    assert stats["p50"] <= stats["p90"] <= stats["p99"] <= stats["p99_9"] <= stats["max"]


def test_help_states_each_default_once_and_none_that_is_not_one() -> None:
    """An operator reads the defaults off `--help`: "(default)" after --realtime must not be followed
    by "(default: False)", nor an option unset unless given say "(default: None)"."""
    proc = subprocess.run([sys.executable, "-m", "streamasr.cli", "bench", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "(default: False)" not in text and "(default: None)" not in text, text
    assert "(default: 2)" in text and "(default: 0.0)" in text  # --workers, --ramp: a default of 0 is still one


def test_realtime_report_is_well_formed(tmp_path: Path) -> None:
    settings = tmp_path / "null.toml"
    # The model comes from --config when --model is not given; the cap is not applied: without a
    # ramp the bench's own service admits every stream, since the run measures what N streams get.
    settings.write_text('[model]\nname = "null"\n[ingest]\nadmit_max_realtime_streams = 1\n')
    s = bench(tmp_path, "--streams", "2", "--duration", "5", "--config", str(settings))
    assert s["config"]["model"] == "null"
    for key in ("config", "streams", "partial_latency_ms", "final_latency_ms", "jitter_ms", "throughput", "errors",
                "refused_frames", "batches", "jobs", "processes", "generator", "wer", "command", "machine", "date"):
        assert key in s, key
    assert s["streams"] == {"requested": 2, "opened": 2, "refused": {}, "closed": 2, "cut": {}, "unfinished": 0, "with_finals": 2}
    assert s["partials"] > 0 and s["finals"] >= 2
    assert s["finals_revised"] == 0  # the null model's finals say what its partials said
    check_latency(s["partial_latency_ms"])
    check_latency(s["first_partial_latency_ms"])  # one per segment that had a partial, each with its final
    assert s["first_partial_latency_ms"]["count"] <= min(s["partials"], s["finals"])
    check_latency(s["final_latency_ms"])
    check_latency(s["generator"]["send_lag_ms"])
    assert s["throughput"]["audio_s"] >= 2 * 5 and s["throughput"]["audio_s_per_s"] > 0
    assert s["batches"]["count"] > 0 and sum(s["batches"]["histogram"].values()) == s["batches"]["count"]
    assert s["jobs"]["done"] > 0
    names = {p["name"] for p in s["processes"]}
    assert {"broker", "ingest-0", "worker-0", "worker-1", "bench-client-0", "bench-client-1"} <= names
    for p in s["processes"]:
        assert p["cpu_pct"] >= 0 and p["rss_mb"] > 0
    assert s["wer"] is None  # the null model's fixed text is not a transcript
    assert s["admission_load_s"]["samples"] > 0 and s["admission_load_s"]["max"] >= 0
    for name, g in s["gc_pauses"].items():  # which processes collect during 5 s is up to the allocator
        assert name in names and g["count"] >= 0 and g["total_ms"] >= 0, (name, g)
        assert g["count"] == 0 or g["over_largest_bucket"] or g["max_ms_at_most"] > 0, (name, g)
        assert sum(h["count"] for h in g["by_generation"].values()) == g["count"], (name, g)
        assert set(g["by_generation"]) <= {"0", "1", "2"}, (name, g)
        if g["count"]:  # the collector's CPU time is recorded for the same collections
            assert g["cpu_max_ms_at_most"] is None or g["cpu_max_ms_at_most"] > 0, (name, g)
    # each decoded job's two legs outside the model, as the ingest measured them
    assert set(s["job_transit_ms"]) == {"to_worker", "to_ingest"}
    for leg, t in s["job_transit_ms"].items():
        assert 0 < t["count"] <= s["jobs"]["done"], (leg, t)
        assert 0 < t["p50_ms"] <= t["p90_ms"] <= t["p99_ms"], (leg, t)


def test_sweep_reports_each_run_and_the_largest_within_the_bounds(tmp_path: Path) -> None:
    """Bounds no served run can miss, and 100 ms frames so a busy machine does not make the
    generator late: every run is within, and the largest N is the one reported."""
    s, printed = bench_run(tmp_path, "--sweep", "1,2", "--duration", "3", "--model", "null", "--frame-ms", "100",
                           "--p99-bound-ms", "1e9", "--interval-bound-ms", "1e9")
    assert [r["streams"]["requested"] for r in s["sweep"]] == [1, 2]
    for r in s["sweep"]:
        check_latency(r["partial_latency_ms"])
        assert r["streams"]["unfinished"] == 0 and r["within_bounds"] is True, (r["streams"], r["generator"])
    assert s["best_streams"] == 2
    # the cap that keeps a service at what was measured, ready to paste
    assert "admit_max_realtime_streams = 2" in printed
    # the jobs of each run, not the workers' counts since the service started (run 1's jobs are in run 2's)
    for r in s["sweep"]:
        assert r["jobs"]["done"] > 0 and sum(r["jobs"]["per_worker"].values()) == r["jobs"]["done"], r["jobs"]


def test_an_offline_sweep_reports_the_largest_n_within_the_bound_on_finals(tmp_path: Path) -> None:
    """Offline streams get finals only, no partials: a sweep of them is judged by its finals, or no
    N is ever within the bounds, however wide."""
    s, printed = bench_run(tmp_path, "--sweep", "1,2", "--offline", "--duration", "3", "--model", "null",
                           "--p99-bound-ms", "1e9", "--interval-bound-ms", "1e9")
    for r in s["sweep"]:
        assert r["partials"] == 0 and r["final_latency_ms"]["count"] > 0, r
        assert r["streams"]["unfinished"] == 0 and r["within_bounds"] is True, r["streams"]
    assert s["best_streams"] == 2
    assert "admit_max_realtime_streams" not in printed  # batch streams are never refused for load


def run_report(partial_p99: float | None = 500.0, final_p99: float | None = 700.0, interval_p90: float | None = 300.0,
            opened: int = 2, unfinished: int = 0, behind: bool = False, mode: str = "realtime") -> dict[str, Any]:
    """The parts of a run's report that `within_bounds` judges, for a 2-stream run."""
    return {"config": {"mode": mode}, "partial_latency_ms": {"p99": partial_p99}, "final_latency_ms": {"p99": final_p99},
            "jitter_ms": {"partial_interval": {"p90": interval_p90}},
            "streams": {"requested": 2, "opened": opened, "unfinished": unfinished}, "generator": {"behind": behind}}


@pytest.mark.parametrize("run, within", [
    (run_report(), True),
    (run_report(partial_p99=1000.0, final_p99=1500.0, interval_p90=800.0), True),  # at the bounds is within
    (run_report(final_p99=1400.0), True),  # finals get half as much again
    (run_report(partial_p99=1000.1), False),
    (run_report(final_p99=1500.1), False),
    (run_report(interval_p90=800.1), False),
    (run_report(opened=1), False),  # a refused open: the latencies are of fewer streams
    (run_report(unfinished=1), False),
    (run_report(behind=True), False),  # the generator's late receive times make the latencies invalid
    (run_report(partial_p99=None), False),  # nothing measured is no measure
    (run_report(final_p99=None), False),
    (run_report(interval_p90=None), False),
    # offline streams get finals only: their bound is the finals'
    (run_report(partial_p99=None, interval_p90=None, mode="offline"), True),
    (run_report(partial_p99=None, interval_p90=None, final_p99=1500.1, mode="offline"), False),
    (run_report(partial_p99=None, interval_p90=None, final_p99=None, mode="offline"), False),
    (run_report(partial_p99=None, interval_p90=None, opened=1, mode="offline"), False),
])
def test_within_bounds_takes_only_a_run_that_served_every_stream_within_each_bound(run: dict[str, Any],
                                                                                  within: bool) -> None:
    assert streamasr_bench.within_bounds(run, 1000.0, 800.0) is within


def test_sweep_counts_a_refused_stream_as_outside_the_bounds(tmp_path: Path,
                                                              service_factory: Callable[..., Service]) -> None:
    """A service that takes one stream: the sweep's 2-stream run measured one, so 2 is not within the bounds."""
    svc = service_factory(model="null", workers=1, ingest={"max_streams": 1})
    s = bench(tmp_path, "--server", svc.address, "--sweep", "1,2", "--duration", "3", "--model", "null")
    one, two = s["sweep"]
    assert two["streams"]["opened"] == 1 and two["streams"]["refused"] == {"too_many_streams": 1}
    assert not two["within_bounds"]
    assert s["best_streams"] == (1 if one["within_bounds"] else None)


def test_streams_the_service_cuts_are_not_counted_as_finished(tmp_path: Path,
                                                               service_factory: Callable[..., Service]) -> None:
    """A service stopped in the middle of a run ends its streams (`closed` "shutdown"): they were
    not served to their end, so the report counts them unfinished, by reason, and a sweep would
    not take the run as within the bounds."""
    from streamasr.bench import within_bounds

    svc = service_factory(model="null", workers=1)
    out = tmp_path / "out.json"
    proc = subprocess.Popen([sys.executable, "-m", "streamasr.cli", "bench", "--server", svc.address, "--streams", "2",
                             "--duration", "20", "--model", "null", "--json", str(out)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # opened at the ingest, not only admitted (the broker's count may run ahead of the opens)
        wait_for(lambda: svc.logs("ingest-0").count('"ingest.stream_opened"') == 2, 60, "both streams open")
        assert svc.stop() == 0
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-4000:]
    s = json.loads(out.read_text())
    assert s["streams"]["cut"] == {"shutdown": 2} and s["streams"]["unfinished"] == 2 and s["streams"]["closed"] == 0
    assert "cut by the service: {'shutdown': 2}" in stdout
    assert not within_bounds(s, 1e9, 1e9)


def test_tracemalloc_reports_what_each_serving_process_kept(tmp_path: Path) -> None:
    s = bench(tmp_path, "--streams", "2", "--duration", "8", "--model", "null", "--tracemalloc")
    a = s["allocations"]
    assert a["interval_s"] > 0 and a["frames"] > 0 and a["jobs"] > 0
    assert set(a["per_process"]) == {"broker", "ingest-0", "worker-0", "worker-1"}  # not the dashboard: it is not marked
    for name, p in a["per_process"].items():
        assert len(p["held_blocks"]) == 2 and p["growth_blocks"] == p["held_blocks"][1] - p["held_blocks"][0], name
        assert p["growth_blocks_per_frame"] == round(p["growth_blocks"] / a["frames"], 4)
        assert p["peak_bytes"] > 0, name  # every serving process handled messages between the marks
        for top in p["top"]:  # source lines, relative: reports are shared
            where, _, line = top["where"].rpartition(":")
            assert where and not where.startswith("/") and line.isdigit(), top
    assert s["streams"]["unfinished"] == 0 and not s["errors"]


def test_offline_receives_every_final(tmp_path: Path, null_service: Service) -> None:
    """Against a running service the report names the model its workers serve, whatever --model says."""
    s = bench(tmp_path, "--server", null_service.address, "--offline", "--streams", "3", "--duration", "5",
              "--model", "whisper-tiny.en")
    assert s["config"]["mode"] == "offline"
    assert s["config"]["model"] == "null" and s["config"]["workers"] == 2
    assert s["wer"] is None
    assert s["streams"]["opened"] == s["streams"]["closed"] == s["streams"]["with_finals"] == 3
    assert s["finals"] >= 3
    check_latency(s["final_latency_ms"])
    assert s["throughput"]["rtf"] > 0


def test_streams_at_another_rate_or_encoding_go_through_the_resampler_and_decoder(tmp_path: Path,
                                                                                 null_service: Service) -> None:
    """--rate 8000: the clients send the same playlists as telephone-rate audio, the ingest
    resamples it; --encoding pcm_mulaw / pcm_alaw: as G.711 bytes too, one a sample, which the
    ingest decodes. The report says what was sent and counts the seconds of audio the ingest
    took, the same as 16 kHz 16-bit streams: bytes counted at the wrong width would halve them."""
    formats = (("16000", "pcm_s16le"), ("8000", "pcm_s16le"), ("8000", "pcm_mulaw"), ("8000", "pcm_alaw"))
    runs = {}
    for rate, encoding in formats:
        seen = len(null_service.events("ingest-0"))
        s, printed = runs[rate, encoding] = bench_run(tmp_path, "--server", null_service.address, "--rate", rate,
                                                      "--encoding", encoding, "--streams", "2", "--duration", "3",
                                                      "--model", "null")
        assert (s["config"]["rate"], s["config"]["encoding"]) == (int(rate), encoding)
        assert f"at {int(rate) / 1000:g} kHz {encoding}," in printed
        assert s["streams"]["opened"] == s["streams"]["closed"] == s["streams"]["with_finals"] == 2, s["streams"]
        assert s["streams"]["unfinished"] == 0 and not s["errors"] and s["refused_frames"] == 0
        check_latency(s["partial_latency_ms"])
        check_latency(s["final_latency_ms"])
        check_latency(s["ack_latency_ms"])
        t = s["throughput"]
        assert t["audio_s"] >= 2 * 3, t  # each stream plays at least --duration
        # Sent in real time, a stream takes as long as its audio (less its last 20 ms frame) whatever
        # the machine's load: frames carrying more audio than --frame-ms would finish it sooner.
        assert t["wall_s"] >= t["audio_s"] / 2 - 0.1, t
        # What the ingest was told, and the audio it counted (its log reaches the file through
        # supervisord's pipe; the service is shared, so only this run's streams count).
        def logged(event: str, seen: int = seen) -> list[dict[str, Any]]:
            return [e for e in null_service.events("ingest-0")[seen:] if e["event"] == event]

        opened = logged("ingest.stream_opened")
        assert [(e["rate"], e["encoding"]) for e in opened] == [(int(rate), encoding)] * 2, opened
        ours = {e["stream"] for e in opened}
        closed = wait_for(lambda: len(c := [e for e in logged("ingest.stream_closed") if e["stream"] in ours]) == 2 and c,
                          10, "both streams' close logged")
        assert math.isclose(sum(e["audio_s"] for e in closed), t["audio_s"], abs_tol=0.01), (closed, t)
    for s, _ in runs.values():
        assert math.isclose(s["throughput"]["audio_s"], runs["16000", "pcm_s16le"][0]["throughput"]["audio_s"], abs_tol=0.05)


def test_ramp_counts_refused_opens_and_measures_the_admitted(tmp_path: Path,
                                                              service_factory: Callable[..., Service]) -> None:
    """Opens spread over a ramp meet the service's limits one by one: the stream over the limit is refused
    with its code and not retried, and latencies come from the admitted streams alone. (The total stream
    limit stands in for `overloaded`, which the null model never reaches.)"""
    svc = service_factory(model="null", workers=1, ingest={"max_streams": 2})
    s = bench(tmp_path, "--server", svc.address, "--streams", "3", "--ramp", "1", "--duration", "3", "--model", "null")
    assert s["config"]["ramp_s"] == 1
    assert s["streams"]["opened"] == s["streams"]["closed"] == 2
    assert s["streams"]["refused"] == {"too_many_streams": 1}
    check_latency(s["partial_latency_ms"])
    check_latency(s["final_latency_ms"])


def test_the_started_services_config_takes_relative_paths_from_the_files_directory(tmp_path: Path,
                                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench --config` gives the service it starts that file's settings as `serve --config` would:
    a relative `cache_dir` is the file's directory's, not wherever the bench is run (where the
    model would be exported all over again)."""
    (tmp_path / "conf").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "conf" / "bench.toml").write_text('[model]\ncache_dir = "cache"\n')
    monkeypatch.chdir(tmp_path / "elsewhere")
    args = streamasr_bench.parse(["--config", "../conf/bench.toml", "--model", "null"])
    started = settings.load(None, streamasr_bench.started_settings(args, [1]))
    assert Path(started.model.cache_dir).resolve() == (tmp_path / "conf" / "cache").resolve()
    assert Path(started.model.cache_dir).resolve() == Path(settings.load(tmp_path / "conf" / "bench.toml").model.cache_dir).resolve()


@pytest.mark.parametrize("argv, counts, per_ingest", [
    (["--streams", "300"], [300], 300),
    (["--sweep", "100,600"], [100, 600], 600),
    (["--streams", "300", "--config", "TWO_INGESTS"], [300], 256),  # 2 × 256 hold them already
    (["--streams", "10"], [10], 256),  # never fewer than the config's
])
def test_the_started_service_has_a_ring_for_every_stream(tmp_path: Path, argv: list[str], counts: list[int],
                                                         per_ingest: int) -> None:
    """The service the bench starts admits every stream: with more than its rings (256 per
    ingest) the run measured `too_many_streams` refusals instead of N streams."""
    config = tmp_path / "two.toml"
    config.write_text("[ingest]\nprocesses = 2\n")
    args = streamasr_bench.parse([str(config) if a == "TWO_INGESTS" else a for a in argv] + ["--model", "null"])
    started = settings.load(None, streamasr_bench.started_settings(args, counts))
    assert started.shm.streams_per_ingest == per_ingest
    assert started.ingest.processes * started.shm.streams_per_ingest >= max(counts)


def test_throughput_of_a_run_that_ended_nothing_counts_the_audio_sent_not_the_drain() -> None:
    """A stream that never closed and had no final (a service that stopped answering) must not
    have its throughput divided by the time the bench then waited for a drain."""
    from array import array

    def packed(rows: list[tuple[float, ...]]) -> bytes:
        return array("d", [v for row in rows for v in row]).tobytes()

    stream = {"sid": "s0", "ready": True, "open_error": None, "closed_at": None, "closed_reason": None, "end_sent": 103.0,
              "audio_s": 3.0, "refs": [], "texts": [], "revised": 0, "errors": {},
              "partials": packed([(101.0, 0.01, 0, 1.0)]), "finals": packed([]), "acks": packed([(100.6, 0.001)])}
    spec = streamasr_bench.RunSpec(1, 3.0, False, 20.0, None, "null", 1, 1, 60.0)
    summary, _ = streamasr_bench.summarize(spec, [{"lag": packed([(0.001,)]), "streams": [stream]}], 100.0, 165.0,
                                           streamasr_bench.Sampler({}), None, (None, None), 1, {}, {})
    assert summary["throughput"]["wall_s"] == 3.0 and summary["streams"]["unfinished"] == 1


def test_tracemalloc_marks_of_every_run_of_a_sweep_are_read(tmp_path: Path) -> None:
    """A sweep with --tracemalloc marks the same serving processes in every run: each run's first
    mark must be that run's baseline and its second and third its reports, or every run after the
    first waits out the timeout and reports no process at all."""
    import os
    import time

    from metrics import allocwatch
    from streamasr.allocmarks import AllocationMarks

    script = ("import time\nfrom metrics import allocwatch\nallocwatch.arm('worker-0')\nprint('armed', flush=True)\n"
              "while True:\n    time.sleep(0.05)\n")
    child = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=os.environ | {allocwatch.ENV: str(tmp_path)},
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "armed"
        for run in range(2):  # what run_load does for each N of a sweep
            marks = AllocationMarks(tmp_path, {"worker-0": child.pid}, lambda: 0)
            now = time.monotonic()
            marks.schedule([now + 0.3 * k for k in (1, 2, 3)])
            a = marks.collect(1, 20.0, timeout=5.0)
            assert a is not None and set(a["per_process"]) == {"worker-0"}, (run, a, sorted(os.listdir(tmp_path)))
    finally:
        child.kill()
        child.wait()


def test_against_a_server_the_report_names_its_max_batch_not_the_option(tmp_path: Path,
                                                                       service_factory: Callable[..., Service]) -> None:
    """--max-batch sets the started service's model.max_batch; a running service's own settings
    hold, so its report must say how many requests its workers batch, not the option it ignored."""
    svc = service_factory(model="null", workers=1, model_options={"max_batch": 2})
    s = bench(tmp_path, "--server", svc.address, "--streams", "1", "--duration", "2", "--model", "null",
              "--max-batch", "8")
    assert s["config"]["max_batch"] == 2, s["config"]


@pytest.mark.parametrize("sweep", ["1,x", "0,2", "2,-4", ""])
def test_a_sweep_that_is_not_stream_counts_is_refused_with_the_usage(sweep: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`--sweep 1,x` gave a traceback once the service had started; 0 or fewer streams measure nothing."""
    with pytest.raises(SystemExit) as refused:
        streamasr_bench.parse(["--sweep", sweep])
    assert refused.value.code == 2 and "--sweep: stream counts must be" in capsys.readouterr().err


def test_a_model_the_service_refuses_is_said_as_serve_says_it_without_a_traceback(tmp_path: Path) -> None:
    """A typo in --model (or a --config that `serve` refuses) is the operator's to fix: the bench
    says what `serve` said, with its exit status, not a traceback of its own."""
    proc = subprocess.run([sys.executable, "-m", "streamasr.cli", "bench", "--streams", "1", "--duration", "2",
                           "--model", "whisper-huge"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert "error: unknown model 'whisper-huge'" in proc.stderr


def test_workers_0_starts_and_reports_one_worker_per_core(tmp_path: Path) -> None:
    """`--workers 0` is the service's own default, a worker per CPU core: the report must count the
    workers that served, not the 0 it was given."""
    s = bench(tmp_path, "--workers", "0", "--streams", "1", "--duration", "2", "--model", "null")
    cores = os.cpu_count() or 1
    assert s["config"]["workers"] == cores, s["config"]
    assert {f"worker-{i}" for i in range(cores)} <= {p["name"] for p in s["processes"]}


@pytest.mark.parametrize("flag, value", [("--duration", "inf"), ("--duration", "nan"), ("--frame-ms", "nan"),
                                         ("--frame-ms", "inf"), ("--ramp", "nan"), ("--drain", "nan")])
def test_a_time_that_is_not_a_finite_number_is_refused_with_the_usage(flag: str, value: str,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """`--duration inf` had every client build an endless playlist once the service had started, and
    `--frame-ms nan` ended the clients with a traceback: refused before anything starts."""
    with pytest.raises(SystemExit) as refused:
        streamasr_bench.parse([flag, value])
    assert refused.value.code == 2 and "must be finite numbers" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--max-batch", "0"), ("--max-batch", "-2"), ("--clients", "0")])
def test_a_count_below_one_is_refused_with_the_usage(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`--max-batch 0` ran with the config's batch and `--clients 0` with the default number of
    client processes, without a word: refused before anything starts."""
    with pytest.raises(SystemExit) as refused:
        streamasr_bench.parse([flag, value])
    assert refused.value.code == 2 and "--max-batch and --clients must be 1 or more" in capsys.readouterr().err
