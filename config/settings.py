"""Service configuration: one TOML file, read into frozen dataclasses.

Every process (broker, ingest, worker, CLI) loads the same file so they agree on
endpoints, the shm namespace and limits without talking to each other first. `load` checks
every key's type and range: a setting that cannot work is refused by `streamasr serve` with its
name, instead of every process of the service failing on it at start, over and over.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

DEFAULT_CONFIG = Path(__file__).with_name("default.toml")
CONFIG_ENV = "STREAMASR_CONFIG"


class ConfigError(ValueError):
    """Settings that cannot be used: a missing or malformed file, an unknown key, a value of the
    wrong type or out of its range. The message names the key."""


def setting(default: float, lo: float = 0, hi: float | None = None) -> Any:
    """A number's default and the range `load` holds it to (numbers without one: 0 or more)."""
    return field(default=default, metadata={"range": (lo, hi)})


@dataclass(frozen=True)
class ModelConfig:
    name: str = "whisper-tiny.en"  # a registered name, "null", or a CTranslate2 model directory
    backend: Literal["onnxruntime", "tensorrt", "null"] = "onnxruntime"
    precision: Literal["fp32", "int8"] = "fp32"
    # Graphs for partial decodes: "" = `precision`. int8 partials with fp32 finals: partials (most
    # of the decodes) cost ~0.6x; finals are decoded on their own, so they stay as accurate as fp32
    # (docs/PERFORMANCE.md, "Whisper on the service").
    partial_precision: Literal["", "fp32", "int8"] = "int8"
    threads: int = 1  # intra-op threads per worker process
    arena: bool = True  # ONNX Runtime CPU memory arena (one per process, shared by its sessions)
    cache_dir: str = ""  # exported graphs; "" = $XDG_CACHE_HOME/streamasr
    beam_size: int = setting(1, lo=1)
    max_batch: int = setting(1, lo=1)  # dynamic batching: most requests per backend call (1: measured best for Whisper on CPU)
    max_wait_ms: float = 5.0  # dynamic batching: longest wait for a batch to fill
    # "short": partials encode the speech plus 2 s instead of 30 s (~0.4x the cost; first words are
    # dropped more often, which finals put right); "full": the 30 s window
    partial_window: Literal["short", "full"] = "short"
    quick_first_partial: bool = True  # a segment's first partial on the short window: text on screen sooner
    null_text: str = "null model"  # text the null backend returns

    @property
    def partials_precision(self) -> str:
        """The graphs partials decode on: `partial_precision`, "" meaning `precision`."""
        return self.partial_precision or self.precision


@dataclass(frozen=True)
class ShmConfig:
    ring_seconds: float = setting(60.0, lo=1)  # capacity of one stream's ring
    streams_per_ingest: int = setting(256, lo=1)  # rings preallocated per ingest process


@dataclass(frozen=True)
class VadConfig:
    threshold: float = setting(0.5, hi=1)
    min_silence_ms: int = 500  # a pause this long ends a segment
    min_speech_ms: int = 150  # shorter bursts are not segments
    max_segment_s: float = setting(25.0, lo=1)  # cut a segment that runs this long
    pad_ms: int = 400  # audio kept before speech starts and after it ends: Whisper misreads clipped onsets


@dataclass(frozen=True)
class IngestConfig:
    address: str = "tcp://127.0.0.1:7700"  # the one address clients know (front door)
    host: str = "127.0.0.1"  # interface the ingest processes bind
    port_base: int = setting(7701, lo=1, hi=65535)  # ingest process N binds port_base + N
    processes: int = setting(1, lo=1)
    partial_interval_ms: int = setting(500, lo=1)  # a partial decode per this much new speech
    max_frame_bytes: int = setting(262_144, lo=1)
    max_message_bytes: int = setting(1_048_576, lo=1)
    max_streams_per_client: int = setting(64, lo=1)
    max_streams: int = setting(1000, lo=1)  # total over the service
    idle_timeout_s: float = setting(30.0, lo=0.1)  # a stream silent this long is closed (vanished client)
    drain_timeout_s: float = 8.0  # on SIGTERM, time to finish open streams (below supervisord's stopwaitsecs)
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
    curve_secret_key: str = ""  # the server's secret key file (zmq.auth certificate format)
    curve_authorized_keys: str = ""  # directory of authorized clients' public key files (*.key)
    # Ops tools (`streamasr status`, the service's readiness wait) are clients of the front door
    # too: with CURVE on they use this key pair file (a *.key_secret), whose public key must be authorized.
    curve_client_key: str = ""
    # An ingest whose loop has not turned for this long is stuck (it wakes every half heartbeat):
    # it exits with every thread's stack in its log, and supervisord starts it again. 0 = never.
    stall_after_s: float = setting(60.0)


@dataclass(frozen=True)
class BrokerConfig:
    heartbeat_ms: int = setting(1000, lo=10)
    liveness: int = setting(3, lo=1)  # missed heartbeats before a peer is declared dead
    partial_deadline_ms: int = setting(2000, lo=1)  # a queued partial older than this is skipped
    final_deadline_ms: int = setting(10000, lo=1)  # finals are never dropped; past this they are logged late
    stall_after_s: float = setting(60.0)  # as [ingest] stall_after_s, for the broker's loop


@dataclass(frozen=True)
class WorkerConfig:
    processes: int = 0  # 0 = one per CPU core
    # A backend call running this long is taken as hung (a native deadlock, a GPU hang): the
    # worker logs `worker.stuck` and exits, so its jobs go to another worker and supervisord
    # starts a new one. Far above any real batch (a tiny.en final takes ~0.35 s on CPU); 0 = never.
    stuck_after_s: float = setting(60.0)


@dataclass(frozen=True)
class MetricsConfig:
    dashboard_port: int = setting(7780, hi=65535)  # the ops page and /metrics, on localhost


@dataclass(frozen=True)
class Config:
    instance: str = "default"  # namespaces shm segments and the run directory
    run_dir: str = ""  # ipc sockets, supervisord files, logs; "" = /tmp/streamasr-<instance>
    log_level: Literal["debug", "info", "warning", "error", "critical"] = "info"
    model: ModelConfig = field(default_factory=ModelConfig)
    shm: ShmConfig = field(default_factory=ShmConfig)
    vad: VadConfig = field(default_factory=VadConfig)
    ingest: IngestConfig = field(default_factory=IngestConfig)
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    workers: WorkerConfig = field(default_factory=WorkerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

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
    def worker_count(self) -> int:
        return self.workers.processes or (os.cpu_count() or 1)

    def ingest_endpoint(self, index: int) -> str:
        return f"tcp://{self.ingest.host}:{self.ingest.port_base + index}"

    def ingest_results_endpoint(self, index: int) -> str:
        """Where workers send ingest process `index` the results of its jobs."""
        return f"ipc://{self.run_path}/ingest-{index}-results.sock"

    def shm_name(self, index: int) -> str:
        return f"streamasr.{self.instance}.ingest{index}"


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    """Construct dataclass `cls` from a TOML table, refusing unknown keys (typos) and values
    that do not fit their field."""
    known = {f.name: f for f in dataclasses.fields(cls)}
    hints = get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            raise ConfigError(f"unknown config key {where}{key}")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}{key} must be a table ([{where}{key}])")
            kwargs[key] = _build(hint, value, f"{where}{key}.")
        else:
            kwargs[key] = _checked(f"{where}{key}", value, hint, known[key].metadata.get("range", (0, None)))
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


def load(path: str | os.PathLike[str] | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Load the default config, then `path` (or $STREAMASR_CONFIG) on top, then `overrides`."""
    data = tomllib.loads(DEFAULT_CONFIG.read_text())
    path = path or os.environ.get(CONFIG_ENV)
    if path:
        data = merge(data, read(path))
    if overrides:
        data = merge(data, overrides)
    return _build(Config, data, "")


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
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
