"""Service configuration: one TOML file, read into frozen dataclasses.

Every process (broker, ingest, worker, CLI) loads the same file so they agree on
endpoints, the shm namespace and limits without talking to each other first. `load` checks
every key's type and range: a setting that cannot work is refused by `streamasr serve` with its
name, instead of every process of the service failing on it at start, over and over.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import socket
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

DEFAULT_CONFIG = Path(__file__).with_name("default.toml")
CONFIG_ENV = "STREAMASR_CONFIG"
SAMPLE_RATE = 16_000
# Letters, digits, "_" and "-": an instance's shm segments are `streamasr.<instance>.ingest<N>`, so
# no name with a dot can pass for the prefix of another's (`prod` and `prod.eu`), and no "/".
INSTANCE_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_IPC_PATH = 107  # bytes of a Unix socket path (sun_path less its NUL); ZeroMQ refuses longer at bind
# Room a stream's ring needs beyond its longest segment (vad.max_segment_s), in samples: the
# ring keeps a segment's audio from its start until it is cut, and the cut is found by the VAD,
# which sees only whole chunks (512 samples) of audio the window let in; the window keeps 1024
# samples in hand (ingest/session.py, WINDOW_HEADROOM) besides what the resampler holds (up to
# ~1,900 samples at 8 kHz). Those come to ~3,400; an 8 kHz stream that never pauses was seen to
# jam with 4,000 and not with 5,600 (tests/test_client.py), hence 0.5 s. A ring without it fills
# before such a segment is cut: the stream's every frame, and its end, are refused for good.
RING_ROOM = 8_000
MODEL_NAMES = ("whisper-tiny.en", "whisper-base", "null")  # registered names: never taken for a directory
# The longest a stall or stuck limit may be: the processes arm faulthandler's timer with it, which
# takes no more than ~292 years in nanoseconds and fails at start beyond; a day is far past any decode.
MAX_WATCH_S = 86_400.0
MAX_THREADS = 1024  # ONNX Runtime takes an int32; far more than any machine's cores
# Worker or ingest processes: each worker holds a model in memory, each ingest its rings, so a
# typo of a few more zeros would fork until the machine runs out of memory.
MAX_PROCESSES = 256
MAX_DEADLINE_MS = 86_400_000
# What Whisper hears at once. A final longer than that has its audio past the window decoded only
# when the model stops with a segment left open; one ending its text at a pause just before
# 30 s would lose the rest, so a segment is cut before it grows longer.
MAX_SEGMENT_S = 30.0


class ConfigError(ValueError):
    """Settings that cannot be used: a missing or malformed file, an unknown key, a value of the
    wrong type or out of its range. The message names the key."""


def setting(default: float, lo: float = 0, hi: float | None = None) -> Any:
    """A number's default and the range `load` holds it to (numbers without one: 0 or more)."""
    return field(default=default, metadata={"range": (lo, hi)})


def flag_in_range(convert: Callable[[str], float], lo: float, hi: float, what: str) -> Callable[[str], Any]:
    """A command-line flag's argparse type, held to [lo, hi] as `load` holds a setting: refused
    with the usage rather than failing later (`--wait nan` was never reached, `--threads` past an
    int32 broke ONNX Runtime, `--port 70000` failed at bind)."""
    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a number, not {text!r}") from None
        if not lo <= value <= hi:  # NaN too
            raise argparse.ArgumentTypeError(f"{what} must be {lo:g} to {hi:g}, not {text}")
        return value
    return parse


def path_setting(default: str = "", existing: bool = False) -> Any:
    """A file or directory setting: `load` makes it absolute, since the service's processes run
    from elsewhere. `existing`: a path only when such a directory exists (else it is a name)."""
    return field(default=default, metadata={"path": "existing" if existing else "always"})


@dataclass(frozen=True)
class ModelConfig:
    name: str = path_setting("whisper-tiny.en", existing=True)  # a registered name, "null", or a CTranslate2 model directory
    backend: Literal["onnxruntime", "tensorrt", "null"] = "onnxruntime"
    precision: Literal["fp32", "int8"] = "fp32"
    # Graphs for partial decodes: "" = `precision`. int8 partials with fp32 finals: partials (most
    # of the decodes) cost ~0.6x; finals are decoded on their own, so they stay as accurate as fp32
    # (docs/PERFORMANCE.md, "Whisper on the service").
    partial_precision: Literal["", "fp32", "int8"] = "int8"
    threads: int = setting(1, hi=MAX_THREADS)  # intra-op threads per worker process (0 counts as 1)
    arena: bool = True  # ONNX Runtime CPU memory arena (one per process, shared by its sessions)
    cache_dir: str = path_setting()  # exported graphs; "" = $XDG_CACHE_HOME/streamasr
    beam_size: int = setting(1, lo=1)
    # Whisper's temperature fallback: a long-form window that loops, or reads unsure, is decoded
    # again by sampling at this step, twice it, … up to 1.0; a final that loops at the first
    # speech.decoding.FALLBACK_ROUNDS of those temperatures only (0: never)
    temperature_increment: float = setting(0.2, hi=1)
    best_of: int = setting(5, lo=1)  # samples at each fallback temperature
    max_batch: int = setting(1, lo=1)  # dynamic batching: most requests per backend call (1: measured best for Whisper on CPU)
    max_wait_ms: float = 5.0  # dynamic batching: longest wait for a batch to fill
    # "short": partials encode the speech plus 2 s instead of 30 s (~0.4x the cost; first words are
    # dropped more often, which finals put right); "full": the 30 s window
    partial_window: Literal["short", "full"] = "short"
    quick_first_partial: bool = True  # a segment's first partial on the short window: text on screen sooner
    # each final's words with their times (Whisper's alignment heads): a decoder pass per final,
    # and the finals' encoded audio kept for it (docs/PERFORMANCE.md, "Word times")
    word_times: bool = True
    null_text: str = "null model"  # text the null backend returns

    @property
    def partials_precision(self) -> str:
        """The graphs partials decode on: `partial_precision`, "" meaning `precision`."""
        return self.partial_precision or self.precision


@dataclass(frozen=True)
class ShmConfig:
    ring_seconds: float = setting(60.0, lo=1, hi=MAX_WATCH_S)  # capacity of one stream's ring (counted in samples: finite there too)
    streams_per_ingest: int = setting(256, lo=1)  # rings preallocated per ingest process


@dataclass(frozen=True)
class VadConfig:
    threshold: float = setting(0.5, hi=1)
    min_silence_ms: int = 500  # a pause this long ends a segment
    min_speech_ms: int = 150  # shorter bursts are not segments
    max_segment_s: float = setting(25.0, lo=1, hi=MAX_SEGMENT_S)  # cut a segment that runs this long
    pad_ms: int = 400  # audio kept before speech starts and after it ends: Whisper misreads clipped onsets


@dataclass(frozen=True)
class IngestConfig:
    address: str = "tcp://127.0.0.1:7700"  # the one address clients know (front door)
    # interface the ingest processes bind; "" = the front door's host (`address`), so a service
    # that clients reach from elsewhere is reachable on its ingest ports there too
    host: str = ""
    port_base: int = setting(7701, lo=1, hi=65535)  # ingest process N binds port_base + N
    processes: int = setting(1, lo=1, hi=MAX_PROCESSES)
    partial_interval_ms: int = setting(500, lo=1)  # a partial decode per this much new speech
    max_frame_bytes: int = setting(262_144, lo=32)  # at least one frame of 8 channels of f32
    max_message_bytes: int = setting(1_048_576, lo=16_384)  # an open with its longest strings fits
    max_streams_per_client: int = setting(64, lo=1)
    # Total over the service; 0 = as many as the rings hold (processes x shm.streams_per_ingest).
    # Each ingest process takes its share, rounded up.
    max_streams: int = setting(0, lo=0)
    idle_timeout_s: float = setting(30.0, lo=0.1)  # a stream sent no audio this long, with room in its window, is closed (vanished client)
    drain_timeout_s: float = 8.0  # on SIGTERM, time to finish open streams (below supervisord's stopwaitsecs)
    # ... of which a stream speaking waits this long for a pause to end at: ended mid-utterance,
    # the words either side of the cut come out worse. 0 = end every stream at once.
    drain_pause_s: float = 5.0
    # Admission: a realtime open is refused (`overloaded`) while the broker's load figure — how
    # long realtime streams wait for a model, in seconds, smoothed — is above this. 0 = never.
    # 0.5 s: where partials start to come less often than every partial_interval_ms (measured).
    admit_max_load_s: float = 0.5
    # ... and refused when the realtime streams open and the new one, each asking for the share of
    # the workers' time a speaking stream asks for now (measured by the broker), would keep
    # the workers busier than this (0..1): it counts the streams before their jobs queue. Applied
    # while the workers are at least half this busy. 0 = never.
    admit_max_busy: float = setting(0.8, hi=1)
    # ... and refused while this many realtime streams are open over the service (0 = no cap):
    # the largest N `streamasr bench --sweep` kept within the latency bounds on this machine. The
    # two figures above need load to have been seen; the cap does not, so a first burst after a
    # start or a change of model is cut at it. Other ingests' streams are counted as of the
    # broker's last heartbeat.
    admit_max_realtime_streams: int = 0
    # CurveZMQ on the client-facing sockets (front door and ingest): both empty = plain TCP.
    curve_secret_key: str = path_setting()  # the server's secret key file (zmq.auth certificate format)
    curve_authorized_keys: str = path_setting()  # directory of authorized clients' public key files (*.key)
    # Ops tools (`streamasr status`, the service's readiness wait) are clients of the front door
    # too: with CURVE on they use this key pair file (a *.key_secret), whose public key must be authorized.
    curve_client_key: str = path_setting()
    # A key file (64 hexadecimal characters) services on several hosts share, so that a stream
    # whose service was lost outright resumes on another with its resume token, as within one
    # service; empty = the instance's own, kept in its run directory.
    resume_key_file: str = path_setting()
    # An ingest whose loop has not turned for this long is stuck (it wakes every half heartbeat):
    # it exits with every thread's stack in its log, and supervisord starts it again. 0 = never.
    stall_after_s: float = setting(60.0, hi=MAX_WATCH_S)


@dataclass(frozen=True)
class BrokerConfig:
    heartbeat_ms: int = setting(1000, lo=10, hi=60_000)
    liveness: int = setting(3, lo=1)  # missed heartbeats before a peer is declared dead
    # at most a day: the broker refuses a job whose times are further than that from its clock (broker.jobs)
    partial_deadline_ms: int = setting(2000, lo=1, hi=MAX_DEADLINE_MS)  # a queued partial older than this is skipped
    final_deadline_ms: int = setting(10000, lo=1, hi=MAX_DEADLINE_MS)  # finals are never dropped; past this they are logged late
    stall_after_s: float = setting(60.0, hi=MAX_WATCH_S)  # as [ingest] stall_after_s, for the broker's loop
    # A job a worker has held this long unanswered while it heartbeats (a JOBS message it could
    # not read) is taken back: its credit returns and it is re-queued, or answered FAILED once
    # two workers were lost or timed out holding it. More than twice [workers] stuck_after_s: a
    # job that comes while a batch runs waits for that batch and its own, each up to
    # stuck_after_s, and a hung call is the watchdog's. 0 = never, as while stuck_after_s is 0
    # (a model call may then run any length, and no limit can tell it from a job never answered).
    job_timeout_s: float = setting(150.0, hi=MAX_WATCH_S)


@dataclass(frozen=True)
class WorkerConfig:
    processes: int = setting(0, hi=MAX_PROCESSES)  # 0 = one per CPU core
    # A backend call running this long is taken as hung (a native deadlock, a GPU hang): the
    # worker logs `worker.stuck` and exits, so its jobs go to another worker and supervisord
    # starts a new one. Far above any real batch (a tiny.en final takes ~0.35 s on CPU); 0 = never.
    # The worker's main loop not turning this long outside a call (a deadlock, a blocking call)
    # ends it too, with every thread's stack in its log: one timer watches both (workers/worker.py).
    stuck_after_s: float = setting(60.0, hi=MAX_WATCH_S)


@dataclass(frozen=True)
class SupervisorConfig:
    # supervisord gives a program up (FATAL) once it failed to start `startretries` times in a row,
    # about a minute; the causes are often passing (a port held for a while, a mount not yet up), so
    # the `revive` event listener starts it again this long after, for as long as it fails; 0 = never.
    fatal_retry_s: float = setting(30.0, hi=MAX_WATCH_S)


@dataclass(frozen=True)
class MetricsConfig:
    dashboard_port: int = setting(7780, hi=65535)  # the ops page and /metrics, on localhost


@dataclass(frozen=True)
class Config:
    instance: str = "default"  # namespaces shm segments and the run directory (see INSTANCE_NAME)
    run_dir: str = path_setting()  # ipc sockets, supervisord files, logs; "" = /tmp/streamasr-<instance>
    log_level: Literal["debug", "info", "warning", "error", "critical"] = "info"
    model: ModelConfig = field(default_factory=ModelConfig)
    shm: ShmConfig = field(default_factory=ShmConfig)
    vad: VadConfig = field(default_factory=VadConfig)
    ingest: IngestConfig = field(default_factory=IngestConfig)
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    workers: WorkerConfig = field(default_factory=WorkerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir or f"/tmp/streamasr-{self.instance}")

    @property
    def broker_ingest_endpoint(self) -> str:
        return f"ipc://{self.run_path}/broker-ingest.sock"

    @property
    def broker_worker_endpoint(self) -> str:
        return f"ipc://{self.run_path}/broker-workers.sock"

    @property
    def metrics_endpoint(self) -> str:
        return f"ipc://{self.run_path}/metrics.sock"

    @property
    def metrics_state_path(self) -> Path:
        """Where the dashboard's collector keeps its carried totals across its own restarts."""
        return self.run_path / "metrics-state.msgpack"

    @property
    def worker_count(self) -> int:
        return self.workers.processes or (os.cpu_count() or 1)

    @property
    def front_door(self) -> str:
        """Where a client on this host reaches the front door: `ingest.address`, with ZeroMQ's
        wildcard host, which binds every interface but cannot be connected to, as loopback."""
        front = _tcp_host_port(self.ingest.address)
        return f"tcp://127.0.0.1:{front[1]}" if front and front[0] == "*" else self.ingest.address

    @property
    def ingest_host(self) -> str:
        """The interface the ingest processes bind: `[ingest] host`, else the front door's."""
        return self.ingest.host or (_tcp_host_port(self.ingest.address) or ("127.0.0.1", 0))[0]

    @property
    def ipc_paths(self) -> list[str]:
        """The Unix socket paths the service binds in its run directory (supervisord's included)."""
        endpoints = [self.broker_ingest_endpoint, self.broker_worker_endpoint, self.metrics_endpoint,
                     *(self.ingest_results_endpoint(i) for i in range(self.ingest.processes))]
        return [str(self.run_path / "supervisor.sock"), *(e.removeprefix("ipc://") for e in endpoints)]

    @property
    def tcp_binds(self) -> list[tuple[str, str]]:
        """The TCP addresses the service binds, each with what sets it: the front door, each
        ingest process and the dashboard (unless it takes any free port)."""
        binds = [("ingest.address", self.ingest.address),
                 *((f"ingest process {i} (ingest.port_base + {i})", self.ingest_endpoint(i)) for i in range(self.ingest.processes))]
        if self.metrics.dashboard_port:  # 0: any free port
            binds.append(("metrics.dashboard_port", f"tcp://127.0.0.1:{self.metrics.dashboard_port}"))
        return binds

    def ingest_endpoint(self, index: int) -> str:
        return f"tcp://{self.ingest_host}:{self.ingest.port_base + index}"

    def ingest_results_endpoint(self, index: int) -> str:
        """Where workers send ingest process `index` the results of its jobs."""
        return f"ipc://{self.run_path}/ingest-{index}-results.sock"

    def shm_name(self, index: int) -> str:
        return f"streamasr.{self.instance}.ingest{index}"


def _build(cls: type, data: dict[str, Any], where: str, lenient: bool = False) -> Any:
    """Construct dataclass `cls` from a TOML table, refusing unknown keys (typos) and values
    that do not fit their field; `lenient` leaves those out instead (their defaults stand)."""
    known = {f.name: f for f in dataclasses.fields(cls)}
    hints = get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        try:
            if key not in known:
                raise ConfigError(f"unknown config key {where}{key}")
            hint = hints[key]
            if dataclasses.is_dataclass(hint):
                if not isinstance(value, dict):
                    raise ConfigError(f"{where}{key} must be a table ([{where}{key}])")
                kwargs[key] = _build(hint, value, f"{where}{key}.", lenient)
            else:
                kwargs[key] = _checked(f"{where}{key}", value, hint, known[key].metadata.get("range", (0, None)))
        except ConfigError:
            if not lenient:
                raise
    return cls(**kwargs)


def _checked(key: str, value: Any, hint: Any, bounds: tuple[float, float | None]) -> Any:
    """`value` if it is of type `hint` (an int where a float is asked for too) and within bounds."""
    if get_origin(hint) is Literal:
        if value not in get_args(hint):
            raise ConfigError(f"{key} must be one of {', '.join(repr(c) for c in get_args(hint))}, not {value!r}")
        return value
    if hint is str or hint is bool:
        if not isinstance(value, hint):
            raise ConfigError(f"{key} must be {'a string' if hint is str else 'true or false'}, not {value!r}")
        return value
    numeric = (int,) if hint is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, numeric):
        raise ConfigError(f"{key} must be {'an integer' if hint is int else 'a number'}, not {value!r}")
    if isinstance(value, float) and math.isinf(value):  # TOML's inf: no ring is that long, no timer can be armed with it
        raise ConfigError(f"{key} must be a finite number, not {value!r}")
    lo, hi = bounds
    if not lo <= value <= (math.inf if hi is None else hi):  # NaN fails both
        raise ConfigError(f"{key} must be {f'between {lo} and {hi}' if hi is not None else f'{lo} or more'}, not {value!r}")
    return value


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def read(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A config file's tables as written, before defaults and checks."""
    try:
        return tomllib.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {path}: {exc}") from None


def read_absolute(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A config file's tables as written, its relative paths made absolute from its directory as
    `load` takes them: for a caller that layers the file under settings of its own."""
    return _absolute(read(path), Config, Path(path).absolute().parent)


def load(path: str | os.PathLike[str] | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Load the default config, then `path` (or $STREAMASR_CONFIG) on top, then `overrides`.

    Relative paths are made absolute: a file's from the file's directory, overrides' (the
    command line's) from the working directory."""
    data = tomllib.loads(DEFAULT_CONFIG.read_text())
    path = path or os.environ.get(CONFIG_ENV)
    if path:
        data = merge(data, read_absolute(path))
    if overrides:
        data = merge(data, _absolute(overrides, Config, Path.cwd()))
    cfg = _build(Config, data, "")
    _check_together(cfg)
    return cfg


def load_started(path: str | os.PathLike[str]) -> Config:
    """The config `serve` wrote into an instance's run directory (its `config.toml`), for the ops
    tools. That instance may have been started by another version of streamasr: a key this one
    does not know, or a value it would not take, is left out (its default stands) rather than
    refused, for the tools read only how the instance listens and what it runs. Raises
    ConfigError only for a file that cannot be read as TOML."""
    return _build(Config, read(path), "", lenient=True)


def _absolute(data: dict[str, Any], cls: type, base: Path, where: str = "") -> dict[str, Any]:
    """`data` with the relative paths among `cls`'s path settings made absolute from `base`."""
    out = dict(data)
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        value = out.get(f.name)
        if dataclasses.is_dataclass(hints[f.name]) and isinstance(value, dict):
            out[f.name] = _absolute(value, hints[f.name], base, f"{where}{f.name}.")
        elif isinstance(value, str) and value and (kind := f.metadata.get("path")):
            try:
                full = base / Path(value).expanduser()
            except RuntimeError:  # `~user` of a user this machine does not have
                raise ConfigError(f"{where}{f.name} {value!r}: no home directory for "
                                  f"{value.split('/', 1)[0]!r}") from None
            if kind == "always" or (value not in MODEL_NAMES and full.is_dir()):
                out[f.name] = str(full)
    return out


def _tcp_host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a `tcp://host:port` endpoint; None for other transports or a port by name."""
    scheme, _, rest = address.partition("://")
    host, _, port = rest.rpartition(":")
    # isdigit() alone takes "²" for a digit, which int() refuses
    return (host, int(port)) if scheme == "tcp" and host and port.isascii() and port.isdigit() else None


def _check_together(cfg: Config) -> None:
    """Refuse settings that are each in range but cannot work together or on this system."""
    if not INSTANCE_NAME.fullmatch(cfg.instance):
        raise ConfigError(f"instance must be 1 to 64 letters, digits, '_' or '-', not {cfg.instance!r}")
    longest = max(cfg.ipc_paths, key=lambda p: len(os.fsencode(p)))
    if len(os.fsencode(longest)) > MAX_IPC_PATH:  # binding it would fail in every process, over and over
        raise ConfigError(f"run_dir {str(cfg.run_path)!r} is too long: the socket path {longest} is "
                          f"{len(os.fsencode(longest))} bytes, over the {MAX_IPC_PATH}-byte limit of Unix socket paths")
    segment = int(cfg.vad.max_segment_s * SAMPLE_RATE)
    if cfg.vad.pad_ms + cfg.vad.min_speech_ms >= cfg.vad.max_segment_s * 1000:
        raise ConfigError(f"vad.pad_ms ({cfg.vad.pad_ms}) and vad.min_speech_ms ({cfg.vad.min_speech_ms}) must add up to "
                          f"less than vad.max_segment_s ({cfg.vad.max_segment_s:g} s): a segment opens with them and "
                          "would be cut as it opens")
    if cfg.model.max_wait_ms >= cfg.broker.partial_deadline_ms:
        raise ConfigError(f"model.max_wait_ms ({cfg.model.max_wait_ms:g}) must be less than broker.partial_deadline_ms "
                          f"({cfg.broker.partial_deadline_ms}): a partial waiting that long for a batch to fill is "
                          "past its deadline, and a batch that never fills would never leave")
    if cfg.broker.job_timeout_s and cfg.workers.stuck_after_s and cfg.broker.job_timeout_s <= 2 * cfg.workers.stuck_after_s:
        raise ConfigError(f"broker.job_timeout_s ({cfg.broker.job_timeout_s:g}) must be more than twice "
                          f"workers.stuck_after_s ({cfg.workers.stuck_after_s:g}): a job that comes to a worker while "
                          "a batch runs waits for that batch and then its own, each up to stuck_after_s, and would be "
                          "taken from a worker that is only busy")
    if cfg.ingest.drain_pause_s and cfg.ingest.drain_pause_s >= cfg.ingest.drain_timeout_s:
        raise ConfigError(f"ingest.drain_pause_s ({cfg.ingest.drain_pause_s:g}) must be less than ingest.drain_timeout_s "
                          f"({cfg.ingest.drain_timeout_s:g}): a stream that waits for a pause that long has no time "
                          "left for its finals")
    if cfg.ingest.max_frame_bytes > cfg.ingest.max_message_bytes:
        raise ConfigError(f"ingest.max_frame_bytes ({cfg.ingest.max_frame_bytes}) is more than ingest.max_message_bytes "
                          f"({cfg.ingest.max_message_bytes}): a frame within the one would be dropped by the other, "
                          "and the client's connection with it")
    if int(cfg.shm.ring_seconds * SAMPLE_RATE) < segment + RING_ROOM:
        raise ConfigError(f"shm.ring_seconds ({cfg.shm.ring_seconds:g}) must be at least vad.max_segment_s "
                          f"({cfg.vad.max_segment_s:g}) + {RING_ROOM / SAMPLE_RATE:g} s: a ring that fills before a "
                          "segment is cut jams its stream")
    rings = cfg.ingest.processes * cfg.shm.streams_per_ingest
    if cfg.ingest.max_streams > rings:  # a limit that can never be reached misleads whoever sizes by it
        raise ConfigError(f"ingest.max_streams ({cfg.ingest.max_streams}) is more than the {rings} streams "
                          f"{cfg.ingest.processes} ingest process(es) of shm.streams_per_ingest ({cfg.shm.streams_per_ingest}) "
                          "rings can hold: raise one of those, or lower it (0 = as many as the rings hold)")
    front = _tcp_host_port(cfg.ingest.address)
    if cfg.ingest.address.startswith("tcp://") and (front is None or not 1 <= front[1] <= 65535):
        # a wildcard or ephemeral port binds, to a port no client can know, and one out of range fails at start
        raise ConfigError(f"ingest.address {cfg.ingest.address}: the front door needs a fixed port, 1 to 65535 "
                          "(tcp://host:port): it is the one address clients know")
    own = cfg.tcp_binds
    for name, address in own:
        host = (_tcp_host_port(address) or ("", 0))[0]
        if "[" in host or ":" in host:
            raise ConfigError(f"{name} {address}: IPv6 addresses are not supported; use an IPv4 address or a host name")
    for i, (name, address) in enumerate(own):
        for other, other_address in own[i + 1:]:
            if _same_port(address, other_address):
                raise ConfigError(f"{name} {address} and {other} {other_address} are the same port: the service "
                                  "binds each once")


def _same_port(a: str, b: str) -> bool:
    """Whether binding both TCP endpoints would collide: one port, and one host or a wildcard."""
    ha, hb = _tcp_host_port(a), _tcp_host_port(b)
    if ha is None or hb is None or ha[1] != hb[1]:
        return False
    wildcards = ("*", "0.0.0.0", "::", "[::]")
    if ha[0] == hb[0] or ha[0] in wildcards or hb[0] in wildcards:
        return True
    return _address_of(ha[0]) == _address_of(hb[0])  # "localhost" and 127.0.0.1 are one host


def _address_of(host: str) -> str:
    """The IPv4 address a host name binds to (the name itself where it does not resolve)."""
    try:
        return socket.gethostbyname(host)
    except (OSError, UnicodeError):
        return host


def dump(cfg: Config) -> str:
    """Render `cfg` as TOML so `serve` can hand every process the exact same settings."""
    lines: list[str] = []
    tables: list[tuple[str, Any]] = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            tables.append((f.name, value))
        else:
            lines.append(f"{f.name} = {_toml_value(value)}")
    for name, table in tables:
        lines.append(f"\n[{name}]")
        for f in dataclasses.fields(table):
            lines.append(f"{f.name} = {_toml_value(getattr(table, f.name))}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + "".join(_toml_char(c) for c in str(value)) + '"'


_TOML_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_char(c: str) -> str:
    """`c` as a TOML basic string holds it: quote, backslash and control characters escaped."""
    if c in _TOML_ESCAPES:
        return _TOML_ESCAPES[c]
    return f"\\u{ord(c):04X}" if c < " " or c == "\x7f" else c
