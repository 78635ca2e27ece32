"""`streamasr`: serve, status, stop, transcribe, export, bench."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from config import settings
from config.settings import MAX_THREADS, MAX_WATCH_S, Config, ConfigError, flag_in_range
from protocol.messages import ENCODINGS, MAX_PROMPT_CHARS
from speech.loader import ModelError


MAX_RAW_RATE = 384_000  # standard input's rate at most: what sound cards record at most
MAX_SPEAKER = 64  # characters of a speaker's name (--speakers)
MAX_RAW_CHANNELS = 64


def speaker_names(value: str) -> tuple[str, ...]:
    """`--speakers`: names by channel, comma-separated, each on one line of a transcript."""
    names = tuple(name.strip() for name in value.split(","))
    for name in names:
        if not name or not name.isprintable() or len(name) > MAX_SPEAKER:
            raise argparse.ArgumentTypeError(f"{value!r}: each name is 1 to {MAX_SPEAKER} printable characters, "
                                             "the names separated by commas")
    if len(names) > MAX_RAW_CHANNELS:
        raise argparse.ArgumentTypeError(f"{value!r}: at most {MAX_RAW_CHANNELS} names, one per channel")
    return names


def prompt_text(value: str) -> str:
    """`--prompt`: at most what an open carries."""
    if not value.strip() or len(value) > MAX_PROMPT_CHARS:
        raise argparse.ArgumentTypeError(f"the prompt is 1 to {MAX_PROMPT_CHARS} characters")
    return value


def _config(args: argparse.Namespace) -> Config:
    """The config file plus whatever the command line overrides."""
    over: dict[str, Any] = {}

    def put(section: str | None, key: str, value: Any) -> None:
        if value is not None:
            (over.setdefault(section, {}) if section else over)[key] = value

    put(None, "instance", getattr(args, "instance", None))
    put("model", "name", getattr(args, "model", None))
    put("model", "backend", "null" if getattr(args, "model", None) == "null" else None)
    put("model", "precision", getattr(args, "precision", None))
    put("workers", "processes", getattr(args, "workers", None))
    put("ingest", "processes", getattr(args, "ingest", None))
    put("ingest", "address", getattr(args, "address", None))
    cfg = settings.load(getattr(args, "config", None), over)
    if getattr(args, "model", None) not in (None, "null") and cfg.model.backend == "null":
        # a config's null backend runs no model at all: a model named here runs on the default backend
        put("model", "backend", Config().model.backend)
        cfg = settings.load(getattr(args, "config", None), over)
    return cfg


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML config file over the embedded default (default: $STREAMASR_CONFIG); its "
                                    "relative paths are taken from its own directory")
    p.add_argument("--instance", help="instance name (default: the config's, \"default\"): namespaces shm segments and "
                                      "the run directory (the config's run_dir, else /tmp/streamasr-<instance>)")


def cmd_serve(args: argparse.Namespace) -> int:
    from streamasr import service

    service.serve(_config(args))
    return 0  # not reached: supervisord replaced this process


def cmd_status(args: argparse.Namespace) -> int:
    from streamasr import service

    cfg = _config(args)
    report = service.wait_ready(cfg, args.wait) if args.wait else service.status(cfg)
    if args.json:
        print(json.dumps(report))
    else:
        state = "ready: yes" if report.get("ready") else "not running" if report.get("running") is False else "ready: no"
        print(f"instance {report['instance']}  address {report['address']}  {state}")
        for p in report.get("processes", []):
            print(f"  {p['name']:<12} {p['state']:<9} pid {p['pid']:<7} up {p['uptime_s']} s")
            if "why" in p:
                print(f"    {p['why']}")
        for w in report.get("workers", []):
            print(f"  worker {w.get('id')}: model {w.get('model')}, in flight {w.get('inflight')}, done {w.get('jobs_done')}")
        for i in report.get("ingests", []):
            print(f"  ingest {i.get('index')}: {i.get('endpoint')}, streams {i.get('streams')}{', draining' if i.get('draining') else ''}")
        if report.get("ready") and not service.complete(report):
            expected = report["expected"]
            print(f"  registered: {len(service.serving_ingests(report))} of {expected['ingests']} ingest processes serving, "
                  f"{len(report.get('workers', []))} of {expected['workers']} workers")
        if "realtime" in report:
            cap = f" (cap {report['realtime_cap']})" if report.get("realtime_cap") else ""
            prior = " (the workers' start-up price: nothing measured above it yet)" \
                if report["stream_share"] and report["stream_share"] == report.get("stream_share_prior") else ""
            print(f"  admission: {report['realtime']} realtime streams{cap}, realtime wait {report['load']:.2f} s, "
                  f"workers {100 * report['busy']:.0f} % busy, {100 * report['stream_share']:.0f} % per speaking stream{prior}")
        if given_up := service.given_up(report):
            retry_s = service.saved_config(cfg).supervisor.fatal_retry_s
            print(f"  degraded: supervisord gave up starting {', '.join(given_up)} (FATAL); "
                  + (f"started again every {retry_s:g} s ([supervisor] fatal_retry_s)" if retry_s else
                     "not started again ([supervisor] fatal_retry_s = 0): `supervisorctl start` it once its cause is gone"))
        for key in ("supervisor_error", "run_dir_error", "broker_error"):
            if key in report:
                print(f"  {key.replace('_', ' ')}: {report[key]}")
    return 0 if report.get("ready") and not service.given_up(report) else 1


def cmd_stop(args: argparse.Namespace) -> int:
    from streamasr import service

    cfg = _config(args)
    try:
        stopped = service.stop(cfg)
    except PermissionError:
        print(f"instance {cfg.instance!r} runs as another user, who may stop it: {cfg.run_path}", file=sys.stderr)
        return 1
    if not stopped:
        print(f"instance {cfg.instance!r} is not running or did not stop", file=sys.stderr)
        return 1
    return 0


def cmd_transcribe(args: argparse.Namespace) -> int:
    if args.subtitles and len(args.files) > 1 and args.out_dir is None:
        print("streamasr transcribe: error: --subtitles takes one file (with --out-dir, many: a cue file each)",
              file=sys.stderr)
        return 2
    if args.out_dir is not None:
        from streamasr import outdir

        if why := ("- (standard input) is transcribed to standard output, not --out-dir" if "-" in args.files
                   else outdir.prepare(args.files, args.out_dir)):
            print(f"streamasr transcribe: error: {why}", file=sys.stderr)
            return 2
    if args.split_channels and args.local:
        print("streamasr transcribe: error: --split-channels streams a call's channels to a service (not with --local)",
              file=sys.stderr)
        return 2
    if args.split_channels and "-" in args.files and len(args.files) > 1:
        print("streamasr transcribe: error: --split-channels streams standard input's channels at once: give - alone",
              file=sys.stderr)
        return 2
    if args.speakers is not None and not args.split_channels:
        print("streamasr transcribe: error: --speakers names the channels --split-channels streams", file=sys.stderr)
        return 2
    told = [flag for flag in ("rate", "encoding", "channels") if getattr(args, flag) is not None]
    if told and "-" not in args.files:
        print(f"streamasr transcribe: error: --{told[0]} says what standard input holds; give - among the files",
              file=sys.stderr)
        return 2
    if args.local:
        from streamasr import local

        if "-" in args.files:
            print("streamasr transcribe: error: - (standard input) is streamed to a service, not read with --local",
                  file=sys.stderr)
            return 2

        model = _config(args).model  # --model and --precision over the config's [model]
        return local.run(args.files, model, language=args.language, as_json=args.json, threads=args.threads,
                         subtitles=args.subtitles, prompt=args.prompt, out_dir=args.out_dir)
    from streamasr import remote, service

    stdin = remote.RawFormat(**{flag: getattr(args, flag) for flag in told})
    cfg = _config(args)
    if not args.server:
        cfg = service.saved_config(cfg)  # the running instance's address and CURVE keys
    try:
        curve = service.ops_curve(cfg)  # a service with CURVE on answers no one without keys
    except (OSError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    return remote.run(args.files, server=args.server or cfg.front_door, offline=args.offline, as_json=args.json,
                      language=args.language, curve=curve, parallel=args.parallel, subtitles=args.subtitles,
                      open_timeout=remote.OPEN_TIMEOUT_S if args.open_timeout is None else args.open_timeout, stdin=stdin,
                      speakers=remote.Speakers(args.speakers or ()) if args.split_channels else None, prompt=args.prompt,
                      out_dir=args.out_dir)


def cmd_top(args: argparse.Namespace) -> int:
    from streamasr import service, top

    return top.main(service.saved_config(_config(args)), once=args.once, url=args.url)


def cmd_dashboard(args: argparse.Namespace) -> int:
    from dashboard.__main__ import main as dashboard_main

    return dashboard_main([*(["--config", args.config] if args.config else []), *(["--port", str(args.port)] if args.port is not None else [])])


def cmd_export(args: argparse.Namespace) -> int:
    from speech.loader import ensure_all_exported

    cfg = _config(args)
    if cfg.model.backend == "null":
        print("the null model has no graphs to export", file=sys.stderr)
        return 0
    for path in ensure_all_exported(cfg.model):
        print(path)
    return 0


def interrupted(command: str) -> int:
    """Ctrl-C: said as such, not as a traceback; the status a shell gives a command SIGINT ended."""
    print(f"streamasr {command}: interrupted", file=sys.stderr)
    return 128 + signal.SIGINT


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("bench", "bench-model"):  # their own parsers
        import importlib

        try:
            return importlib.import_module(f"streamasr.{argv[0].replace('-', '_')}").main(argv[1:])
        except KeyboardInterrupt:  # a service the bench started is stopped on the way out
            return interrupted(argv[0])

    parser = argparse.ArgumentParser(prog="streamasr", description="Real-time streaming speech recognition over ZeroMQ.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="start the service under supervisord (foreground)")
    _common(p)
    p.add_argument("--model", help="whisper-tiny.en (default), whisper-base, null, or a CTranslate2 model directory")
    p.add_argument("--precision", choices=["fp32", "int8"])
    p.add_argument("--workers", type=int, help="worker processes (default: one per CPU core)")
    p.add_argument("--ingest", type=int, help="ingest processes (default 1)")
    p.add_argument("--address", help="the address clients connect to, e.g. tcp://0.0.0.0:7700 (the ingest processes bind "
                                      "its host too, unless [ingest] host is set)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("status", help="each process and whether the service is ready")
    _common(p)
    p.add_argument("--json", action="store_true")
    p.add_argument("--wait", type=flag_in_range(float, 0, MAX_WATCH_S, "seconds"), default=0, metavar="SECONDS", help="wait up to this long for readiness")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("stop", help="stop a running instance (open streams are ended first, what they sent transcribed)")
    _common(p)
    p.set_defaults(func=cmd_stop)

    p = sub.add_parser("transcribe", help="transcribe files, in-process (--local) or by streaming them to a service")
    _common(p)
    p.add_argument("files", nargs="+", help="audio files; - is standard input, headerless audio as --rate, --encoding and "
                                            "--channels say (a live source: sent as it comes, each final printed as it comes, "
                                            "partials in place on a terminal; Ctrl-C ends it)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--local", action="store_true", help="run the model in this process")
    where.add_argument("--server", metavar="ADDR", help="the service's address (default: the config's), or several services' "
                       "comma-separated: a stream whose service is lost outright resumes on the next")
    pace = p.add_mutually_exclusive_group()
    pace.add_argument("--realtime", action="store_true", help="stream at the speed of speech (default)")
    pace.add_argument("--offline", action="store_true", help="stream as fast as the service takes it (priority batch)")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json", action="store_true", help="one JSON object per line")
    shape.add_argument("--subtitles", choices=["srt", "vtt"],
                       help="one file's captions (with --out-dir, each file's) as SubRip or WebVTT cues (two lines of 42 "
                            "characters, 7 s at most)")
    p.add_argument("--out-dir", type=Path, metavar="DIR",
                   help="each file's transcript (text, JSON or cues) in DIR, named after the file (call.wav: call.txt, "
                        ".jsonl, .json with --local, .srt or .vtt), put in place once the file is transcribed")
    p.add_argument("--parallel", type=flag_in_range(int, 1, MAX_THREADS, "files"), metavar="N",
                   help="without --local: files streamed at once, the others as those end (default and most: the "
                        "streams the service lets a client open, [ingest] max_streams_per_client)")
    p.add_argument("--open-timeout", type=flag_in_range(float, 0, MAX_WATCH_S, "seconds"),
                   metavar="SECONDS", help="without --local: how long a file the service has no room for (its open refused "
                                           "overloaded or too_many_streams) waits for room before it fails (default 300; "
                                           "0: fails at once)")
    p.add_argument("--split-channels", action="store_true",
                   help="each channel of a file, or of standard input given alone, its own stream, as a call with each "
                        "party on its own channel: its transcript is the channels' finals in the order they were spoken (a "
                        "live source's as they come), each line its time and speaker (with --subtitles, each cue its speaker)")
    p.add_argument("--speakers", type=speaker_names, metavar="NAME,NAME",
                   help="with --split-channels: who each channel carries, in channel order (e.g. agent,caller), as "
                        "the lines, cues and JSON rows name them (default: channel 1, channel 2, ...)")
    raw = p.add_argument_group("standard input (-)")
    raw.add_argument("--rate", type=flag_in_range(int, 1000, MAX_RAW_RATE, "Hz"), metavar="HZ",
                     help="its sample rate (default 16000; other than 8000, 16000, 22050, 44100 or 48000 is resampled)")
    raw.add_argument("--encoding", choices=ENCODINGS, help="its samples: 16-bit, 32-bit float, G.711 mu-law or A-law "
                                                          "(default pcm_s16le, little-endian)")
    raw.add_argument("--channels", type=flag_in_range(int, 1, MAX_RAW_CHANNELS, "channels"), metavar="N",
                     help="its channels, interleaved (default 1; more than 8 are mixed to mono)")
    p.add_argument("--model", help="with --local: whisper-tiny.en, whisper-base or a model directory (default: the config's)")
    p.add_argument("--language", help="language code, e.g. en, zh, EN-us (default: detect, or English for .en models; one the model lacks is refused)")
    p.add_argument("--prompt", type=prompt_text, metavar="TEXT",
                   help="names and words the speech holds, written as they should be (e.g. \"Acme Corp. Go forward ten "
                        "meters.\"): the model spells and styles its text after them (Whisper's prompt)")
    p.add_argument("--precision", choices=["fp32", "int8"], help="with --local (default: the config's)")
    p.add_argument("--threads", type=flag_in_range(int, 0, MAX_THREADS, "threads"), default=2, help="with --local: ONNX Runtime threads")
    p.set_defaults(func=cmd_transcribe)

    p = sub.add_parser("top", help="live figures of a running instance in the terminal")
    _common(p)
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--url", help="the dashboard's address (default http://127.0.0.1:<metrics.dashboard_port>/)")
    p.set_defaults(func=cmd_top)

    p = sub.add_parser("dashboard", help="the ops web page and Prometheus /metrics (serve runs it under supervisord)")
    p.add_argument("--config", help="TOML config file of the instance (default: $STREAMASR_CONFIG, else the embedded default)")
    p.add_argument("--port", type=flag_in_range(int, 0, 65535, "port"), help="port on 127.0.0.1 (default: the config's metrics.dashboard_port)")
    p.set_defaults(func=cmd_dashboard)

    p = sub.add_parser("export", help="build (or find cached) ONNX graphs for a model")
    _common(p)
    p.add_argument("--model")
    p.add_argument("--precision", choices=["fp32", "int8"])
    p.set_defaults(func=cmd_export)

    sub.add_parser("bench", help="load generator for the running service (see `streamasr bench --help`)")
    sub.add_parser("bench-model", help="our ONNX Runtime Whisper against faster-whisper (see `streamasr bench-model --help`)")

    args = parser.parse_args(argv)
    try:
        code = args.func(args)
        sys.stdout.flush()
        return code
    except KeyboardInterrupt:  # `transcribe` ends its streams first
        return interrupted(args.command)
    except (ConfigError, ModelError) as exc:  # before any process started: the operator's to fix
        print(f"streamasr {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # what cannot start here and now (a port taken, no room in /dev/shm): said the same way
        if not isinstance(exc.code, str):
            raise
        print(f"streamasr {args.command}: error: {exc.code}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader went away (`streamasr status | head`): nothing left to tell it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush does not raise again
        return 1


if __name__ == "__main__":
    sys.exit(main())
