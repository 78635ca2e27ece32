"""Settings as an operator writes them: every value is held to its type and range on load."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import Any

import pytest

from config import settings
from config.settings import Config, ConfigError


def test_the_embedded_default_and_its_file_agree() -> None:
    """config/default.toml is what `serve` runs with; it must hold every key to the same values
    as the dataclasses' defaults, or the documented defaults and the running ones differ."""
    assert settings.load() == Config()


@pytest.mark.parametrize(("overrides", "message"), [
    ({"model": {"beam_size": 0}}, "model.beam_size must be 1 or more, not 0"),
    # ONNX Runtime takes an int32: every worker failed at start, over and over
    ({"model": {"threads": 2**31}}, "model.threads must be between 0 and 1024, not 2147483648"),
    ({"model": {"max_wait_ms": "5"}}, "model.max_wait_ms must be a number, not '5'"),
    ({"model": {"arena": 1}}, "model.arena must be true or false, not 1"),
    ({"model": {"partial_window": "half"}}, "model.partial_window must be one of 'short', 'full', not 'half'"),
    ({"model": {"backend": "cuda"}}, "model.backend must be one of 'onnxruntime', 'tensorrt', 'null', not 'cuda'"),
    ({"ingest": {"processes": True}}, "ingest.processes must be an integer, not True"),
    ({"ingest": {"port_base": 70000}}, "ingest.port_base must be between 1 and 65535, not 70000"),
    ({"ingest": {"admit_max_busy": 1.5}}, "ingest.admit_max_busy must be between 0 and 1, not 1.5"),
    ({"ingest": {"admit_max_realtime_streams": -1}}, "ingest.admit_max_realtime_streams must be 0 or more, not -1"),
    ({"vad": {"threshold": math.nan}}, "vad.threshold must be between 0 and 1, not nan"),
    ({"workers": {"stuck_after_s": -1}}, "workers.stuck_after_s must be between 0 and 86400.0, not -1"),
    # TOML's inf: `serve` cannot size a ring of it, and a loop's stall watch cannot arm its timer
    # with it (the process fails at start, over and over), nor with ~300 years
    ({"shm": {"ring_seconds": math.inf}}, "shm.ring_seconds must be a finite number, not inf"),
    ({"vad": {"max_segment_s": math.inf}}, "vad.max_segment_s must be a finite number, not inf"),
    ({"ingest": {"stall_after_s": math.inf}}, "ingest.stall_after_s must be a finite number, not inf"),
    ({"broker": {"stall_after_s": 1e10}}, "broker.stall_after_s must be between 0 and 86400.0, not 10000000000.0"),
    ({"workers": {"stuck_after_s": 1e10}}, "workers.stuck_after_s must be between 0 and 86400.0, not 10000000000.0"),
    # a job that comes to a worker while a batch runs waits for it and then its own: taken back from a busy worker
    ({"broker": {"job_timeout_s": 120}}, "broker.job_timeout_s (120) must be more than twice workers.stuck_after_s (60)"),
    # finite, so past the inf check, but a second of it at 16 kHz is not: sizing the ring raised OverflowError
    ({"vad": {"max_segment_s": 1e305}}, "vad.max_segment_s must be between 1 and 30.0, not 1e+305"),
    # Whisper hears 30 s at once: a longer final could lose its end
    ({"vad": {"max_segment_s": 30.5}}, "vad.max_segment_s must be between 1 and 30.0, not 30.5"),
    # a few zeros too many forked workers until the machine ran out of memory
    ({"workers": {"processes": 100_000}}, "workers.processes must be between 0 and 256, not 100000"),
    ({"ingest": {"processes": 1000}}, "ingest.processes must be between 1 and 256, not 1000"),
    # a batch that waits for ever to fill never leaves: its jobs unanswered while the worker looks alive
    ({"model": {"max_wait_ms": 1e9}}, "model.max_wait_ms (1e+09) must be less than broker.partial_deadline_ms (2000)"),
    ({"shm": {"ring_seconds": 1e305}}, "shm.ring_seconds must be between 1 and 86400.0, not 1e+305"),
    ({"shm": 60}, "shm must be a table ([shm])"),
    # pyzmq takes a poll's timeout as a C int of milliseconds: the worker could not wait half of this
    ({"broker": {"heartbeat_ms": 5_000_000_000}}, "broker.heartbeat_ms must be between 10 and 60000, not 5000000000"),
    ({"ingest": {"max_frame_bytes": 16}}, "ingest.max_frame_bytes must be 32 or more, not 16"),
    ({"ingest": {"max_message_bytes": 1000}}, "ingest.max_message_bytes must be 16384 or more, not 1000"),
    # ZeroMQ drops a message over max_message_bytes with the connection, without a reply
    ({"ingest": {"max_frame_bytes": 2_000_000}}, "ingest.max_frame_bytes (2000000) is more than ingest.max_message_bytes (1048576)"),
    # a stream waiting that long for a pause would leave its finals no time in the drain
    ({"ingest": {"drain_pause_s": 8}}, "ingest.drain_pause_s (8) must be less than ingest.drain_timeout_s (8)"),
    # the ring cannot free the pad before a segment that cannot open without being cut
    ({"vad": {"pad_ms": 70_000}}, "vad.pad_ms (70000) and vad.min_speech_ms (150) must add up to less than vad.max_segment_s (25 s)"),
    ({"ingest": {"address": "tcp://[::1]:7700"}}, "ingest.address tcp://[::1]:7700: IPv6 addresses are not supported"),
    ({"ingest": {"address": "tcp://127.0.0.1:*"}}, "ingest.address tcp://127.0.0.1:*: the front door needs a fixed port, 1 to 65535"),
    ({"ingest": {"address": "tcp://127.0.0.1:0"}}, "ingest.address tcp://127.0.0.1:0: the front door needs a fixed port, 1 to 65535"),
    ({"ingest": {"address": "tcp://127.0.0.1:99999"}}, "ingest.address tcp://127.0.0.1:99999: the front door needs a fixed port, 1 to 65535"),
    ({"ingest": {"address": "tcp://127.0.0.1"}}, "ingest.address tcp://127.0.0.1: the front door needs a fixed port, 1 to 65535"),
    ({"ingest": {"host": "::1"}}, "ingest process 0 (ingest.port_base + 0) tcp://::1:7701: IPv6 addresses are not supported"),
    ({"run_dir": 3}, "run_dir must be a string, not 3"),
    ({"ingest": {"adress": "tcp://127.0.0.1:7700"}}, "unknown config key ingest.adress"),
    # a "/" cannot name a shm segment; a dot would make `prod` a prefix of `prod.eu`'s segments
    ({"instance": "a/b"}, "instance must be 1 to 64 letters, digits, '_' or '-', not 'a/b'"),
    ({"instance": "prod.eu"}, "instance must be 1 to 64 letters, digits, '_' or '-', not 'prod.eu'"),
    ({"instance": ""}, "instance must be 1 to 64 letters, digits, '_' or '-', not ''"),
    ({"instance": "x" * 65}, f"instance must be 1 to 64 letters, digits, '_' or '-', not '{'x' * 65}'"),
    ({"shm": {"ring_seconds": 25.0}}, "shm.ring_seconds (25) must be at least vad.max_segment_s (25) + 0.5 s"),
    ({"shm": {"ring_seconds": 10}, "vad": {"max_segment_s": 9.6}}, "shm.ring_seconds (10) must be at least vad.max_segment_s (9.6)"),
    ({"ingest": {"max_streams": 1000}}, "ingest.max_streams (1000) is more than the 256 streams 1 ingest process(es) of "
                                        "shm.streams_per_ingest (256) rings can hold"),
    ({"ingest": {"port_base": 7700}}, "ingest.address tcp://127.0.0.1:7700 and ingest process 0 (ingest.port_base + 0) "
                                      "tcp://127.0.0.1:7700 are the same port"),
    ({"ingest": {"processes": 3}, "metrics": {"dashboard_port": 7703}},
     "ingest process 2 (ingest.port_base + 2) tcp://127.0.0.1:7703 and metrics.dashboard_port tcp://127.0.0.1:7703"),
    ({"ingest": {"address": "tcp://0.0.0.0:7780"}}, "ingest.address tcp://0.0.0.0:7780 and metrics.dashboard_port tcp://127.0.0.1:7780"),
    # "localhost" is 127.0.0.1, where the dashboard listens: its program would fail at start, over and over
    ({"ingest": {"address": "tcp://localhost:7780"}}, "ingest.address tcp://localhost:7780 and metrics.dashboard_port "
                                                     "tcp://127.0.0.1:7780 are the same port"),
    ({"ingest": {"address": "tcp://localhost:7700", "host": "127.0.0.1", "port_base": 7700}},
     "ingest.address tcp://localhost:7700 and ingest process 0 (ingest.port_base + 0) tcp://127.0.0.1:7700 are the same port"),
    ({"run_dir": "/tmp/" + "r" * 90}, "run_dir '/tmp/" + "r" * 90 + "' is too long: the socket path /tmp/" + "r" * 90
                                      + "/ingest-0-results.sock is 117 bytes, over the 107-byte limit of Unix socket paths"),
    ({"run_dir": "/tmp/" + "r" * 80, "ingest": {"processes": 11}},  # ingest 9's socket fits; the eleventh's does not
     "run_dir '/tmp/" + "r" * 80 + "' is too long: the socket path /tmp/" + "r" * 80 + "/ingest-10-results.sock is 108 bytes"),
    # `~user` of a user this machine lacks: pathlib raised RuntimeError, a traceback from every command
    ({"run_dir": "~nosuchuser/run"}, "run_dir '~nosuchuser/run': no home directory for '~nosuchuser'"),
    ({"model": {"cache_dir": "~nosuchuser/cache"}}, "model.cache_dir '~nosuchuser/cache': no home directory for '~nosuchuser'"),
    ({"model": {"name": "~nosuchuser/ct2"}}, "model.name '~nosuchuser/ct2': no home directory for '~nosuchuser'"),
    # str.isdigit() takes "²" for a digit, int() does not: ValueError out of the port check
    ({"ingest": {"address": "tcp://127.0.0.1:77²"}}, "ingest.address tcp://127.0.0.1:77²: the front door needs a fixed port"),
])
def test_a_value_that_cannot_work_names_its_key(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        settings.load(None, overrides)
    assert str(refused.value).startswith(message)  # the rest says why


def test_values_within_their_ranges_load_as_written(tmp_path: Path) -> None:
    path = tmp_path / "streamasr.toml"
    path.write_text('[model]\nmax_wait_ms = 2\nprecision = "int8"\npartial_precision = ""\n'
                    "[vad]\nthreshold = 1.0\n[ingest]\nadmit_max_busy = 0\n[workers]\nprocesses = 0\nstuck_after_s = 0\n")
    cfg = settings.load(path)
    assert cfg.model.max_wait_ms == 2 and cfg.model.partials_precision == "int8"  # an integer where a number is asked
    assert (cfg.vad.threshold, cfg.ingest.admit_max_busy, cfg.workers.processes) == (1.0, 0, 0)
    assert cfg.workers.stuck_after_s == 0 and Config().workers.stuck_after_s == 60.0  # 0: the watchdog is off


def test_a_dumped_config_loads_back_the_same() -> None:
    """`serve` hands every process the settings it checked, as the file it dumped."""
    cfg = settings.load(None, {"model": {"name": "null", "backend": "null"}, "ingest": {"admit_max_realtime_streams": 4}})
    assert settings.load(None, tomllib.loads(settings.dump(cfg))) == cfg


@pytest.mark.parametrize("instance", ["prod", "prod-eu", "prod_eu2", "A" * 64])
def test_instance_names_of_letters_digits_dash_and_underscore_load(instance: str) -> None:
    assert settings.load(None, {"instance": instance}).shm_name(0) == f"streamasr.{instance}.ingest0"


def test_a_ring_just_longer_than_a_segment_and_its_room_loads() -> None:
    cfg = settings.load(None, {"shm": {"ring_seconds": 4.0}, "vad": {"max_segment_s": 3.5}})
    assert cfg.shm.ring_seconds == 4.0


def test_relative_paths_are_taken_from_the_config_files_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The service's processes run from the source tree, not from where `serve` was run: each
    path reaches them absolute, from the file that set it (or, set on the command line, the
    working directory)."""
    (tmp_path / "conf" / "ct2dir").mkdir(parents=True)
    (tmp_path / "cwd" / "ct2dir").mkdir(parents=True)
    path = tmp_path / "conf" / "streamasr.toml"
    path.write_text('run_dir = "run"\n[model]\nname = "ct2dir"\ncache_dir = "cache"\n[ingest]\n'
                    'curve_secret_key = "keys/server.key_secret"\ncurve_authorized_keys = "keys/clients"\n'
                    'curve_client_key = "../ops.key_secret"\n')
    monkeypatch.chdir(tmp_path / "cwd")
    cfg = settings.load(path)
    conf = tmp_path / "conf"
    assert (cfg.run_dir, cfg.model.name, cfg.model.cache_dir) == (str(conf / "run"), str(conf / "ct2dir"), str(conf / "cache"))
    assert (cfg.ingest.curve_secret_key, cfg.ingest.curve_authorized_keys, cfg.ingest.curve_client_key) == (
        str(conf / "keys/server.key_secret"), str(conf / "keys/clients"), str(conf / "../ops.key_secret"))
    over = settings.load(path, {"model": {"name": "./ct2dir", "cache_dir": "c"}, "run_dir": "r"})
    assert (over.model.name, over.model.cache_dir, over.run_dir) == (
        str(tmp_path / "cwd" / "ct2dir"), str(tmp_path / "cwd" / "c"), str(tmp_path / "cwd" / "r"))
    named = settings.load(None, {"model": {"name": "whisper-huge.xx"}})  # no such directory: a name, reported as written
    assert named.model.name == "whisper-huge.xx" and settings.load().model.cache_dir == ""


def test_the_front_doors_host_is_the_ingests_unless_set() -> None:
    """A front door on every interface is no use if the ingests a client is sent to listen on
    loopback only."""
    cfg = settings.load(None, {"ingest": {"address": "tcp://0.0.0.0:7700", "processes": 2}})
    assert [cfg.ingest_endpoint(i) for i in range(2)] == ["tcp://0.0.0.0:7701", "tcp://0.0.0.0:7702"]
    assert settings.load().ingest_endpoint(0) == "tcp://127.0.0.1:7701"
    pinned = settings.load(None, {"ingest": {"address": "tcp://0.0.0.0:7700", "host": "10.1.2.3"}})
    assert pinned.ingest_endpoint(0) == "tcp://10.1.2.3:7701"


def test_strings_with_control_characters_dump_as_toml_reads_them() -> None:
    """Every process reads the dumped file: a raw newline or control character in a string
    would leave it unreadable, and the service with it."""
    text = 'line1\nline2\t"quoted" \\ back\r\x00\x1f\x7f é'
    cfg = settings.load(None, {"model": {"null_text": text}})
    assert settings.load(None, tomllib.loads(settings.dump(cfg))).model.null_text == text


def test_every_setting_is_in_the_operations_reference() -> None:
    """docs/OPERATIONS.md's "Settings" tables are where an operator looks a key up: each key of
    the config must have its row under its table's heading, with the default `serve` runs with
    (the embedded file, which the test above holds to `Config()`) and the range `load` holds it
    to, and no row may name a key the config no longer has (a file that set it would be
    refused as unknown)."""
    import dataclasses
    import re
    from typing import Literal, get_args, get_origin, get_type_hints

    guide = (Path(__file__).resolve().parents[1] / "docs" / "OPERATIONS.md").read_text()
    start = guide.index("\n## Settings\n") + 1
    end = guide.find("\n## ", start)
    documented: dict[str, dict[str, list[str]]] = {}
    table: str | None = None
    for line in guide[start:end if end >= 0 else None].splitlines():
        if line.startswith("### "):
            heading = re.fullmatch(r"### (?:Top level|`\[(\w+)\]`)", line)
            assert heading, f"a settings heading names no table: {line!r}"
            table = heading.group(1) or ""
            assert table not in documented, f"two headings for [{table}]"
            documented[table] = {}
        elif line.startswith("| `"):
            assert table is not None, f"a settings row before any table's heading: {line!r}"
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            key = cells[0].strip("`")
            assert len(cells) == 4 and key not in documented[table], (table, line)
            documented[table][key] = cells

    def number(x: float) -> str:
        return f"{int(x):,}" if float(x).is_integer() else f"{x:g}"

    def bounds(f: dataclasses.Field[Any], hint: Any) -> str:
        """The range column as the guide writes it."""
        if get_origin(hint) is Literal:
            return ", ".join(f'`"{choice}"`' for choice in get_args(hint))
        if hint is bool:
            return "`true`, `false`"
        if hint is str:
            return "—"
        lo, hi = f.metadata.get("range", (0, None))
        return f"{number(lo)} or more" if hi is None else f"{number(lo)} to {number(hi)}"

    cfg = Config()
    expected: dict[str, dict[str, tuple[Any, str]]] = {"": {}}
    for f in dataclasses.fields(Config):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            hints = get_type_hints(type(value))
            expected[f.name] = {g.name: (getattr(value, g.name), bounds(g, hints[g.name])) for g in dataclasses.fields(value)}
        else:
            expected[""][f.name] = (value, bounds(f, get_type_hints(Config)[f.name]))

    assert set(documented) == set(expected), ("tables missing", set(expected) - set(documented),
                                              "tables the config lacks", set(documented) - set(expected))
    for table, keys in expected.items():
        where = f"[{table}]" if table else "top level"
        rows = documented[table]
        assert set(rows) == set(keys), (where, "missing", set(keys) - set(rows), "stale", set(rows) - set(keys))
        for key, (default, limits) in keys.items():
            _, shown, shown_limits, _ = rows[key]
            value = tomllib.loads(f"v = {shown.strip('`')}")["v"]  # the default as TOML would read it
            assert value == default and type(value) is type(default), (where, key, shown, default)
            assert shown_limits == limits, (where, key, shown_limits, limits)
