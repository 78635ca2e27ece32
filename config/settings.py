"""Service configuration: one TOML file, read into frozen dataclasses.

Every process (broker, ingest, worker, CLI) loads the same file so they agree on
endpoints, the shm namespace and limits without talking to each other first.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_CONFIG = Path(__file__).with_name("default.toml")
CONFIG_ENV = "STREAMASR_CONFIG"


@dataclass(frozen=True)
class ModelConfig:
    name: str = "whisper-tiny.en"  # a registered name, "null", or a CTranslate2 model directory
    backend: str = "onnxruntime"  # "onnxruntime" | "tensorrt" | "null"
    precision: str = "fp32"  # "fp32" | "int8"
    # Graphs for partial decodes: "" = `precision`. int8 partials with fp32 finals: partials (most
    # of the decodes) cost ~0.6x; finals are decoded on their own, so they stay as accurate as fp32
    # (docs/PERFORMANCE.md, "Whisper on the service").
    partial_precision: str = "int8"
    threads: int = 1  # intra-op threads per worker process
    arena: bool = True  # ONNX Runtime CPU memory arena (one per process, shared by its sessions)
    cache_dir: str = ""  # exported graphs; "" = $XDG_CACHE_HOME/streamasr
    beam_size: int = 1
    max_batch: int = 1  # dynamic batching: most requests per backend call (1: measured best for Whisper on CPU)
    max_wait_ms: float = 5.0  # dynamic batching: longest wait for a batch to fill
    # "short": partials encode the speech plus 2 s instead of 30 s (~0.4x the cost; first words are
    # dropped more often, which finals put right); "full": the 30 s window
    partial_window: str = "short"
    quick_first_partial: bool = True  # a segment's first partial on the short window: text on screen sooner
    null_text: str = "null model"  # text the null backend returns

    @property
    def partials_precision(self) -> str:
        """The graphs partials decode on: `partial_precision`, "" meaning `precision`."""
        return self.partial_precision or self.precision


@dataclass(frozen=True)
class ShmConfig:
    ring_seconds: float = 60.0  # capacity of one stream's ring
    streams_per_ingest: int = 256  # rings preallocated per ingest process


@dataclass(frozen=True)
class VadConfig:
    threshold: float = 0.5
    min_silence_ms: int = 500  # a pause this long ends a segment
    min_speech_ms: int = 150  # shorter bursts are not segments
    max_segment_s: float = 25.0  # cut a segment that runs this long
    pad_ms: int = 400  # audio kept before speech starts and after it ends: Whisper misreads clipped onsets


@dataclass(frozen=True)
class IngestConfig:
    address: str = "tcp://127.0.0.1:7700"  # the one address clients know (front door)
    host: str = "127.0.0.1"  # interface the ingest processes bind
    port_base: int = 7701  # ingest process N binds port_base + N
    processes: int = 1
    partial_interval_ms: int = 500  # a partial decode per this much new speech
    max_frame_bytes: int = 262_144
    max_message_bytes: int = 1_048_576
    max_streams_per_client: int = 64
    max_streams: int = 1000  # total over the service
    idle_timeout_s: float = 30.0  # a stream silent this long is closed (vanished client)
    drain_timeout_s: float = 8.0  # on SIGTERM, time to finish open streams (below supervisord's stopwaitsecs)
    # Admission: a realtime open is refused (`overloaded`) while the broker's load figure — how
    # long realtime streams wait for a model, in seconds, smoothed — is above this. 0 = never.
    # 0.5 s: where partials start to come less often than every partial_interval_ms (measured).
    admit_max_load_s: float = 0.5
    # ... and refused when the realtime streams open and the new one, each asking for the share of
    # the workers' time a speaking stream asks for now (measured by the broker), would keep
    # the workers busier than this (0..1): it counts the streams before their jobs queue. Applied
    # while the workers are at least half this busy. 0 = never.
    admit_max_busy: float = 0.8
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

    def __post_init__(self) -> None:
        if self.admit_max_realtime_streams < 0:
            raise ValueError("ingest.admit_max_realtime_streams must be 0 (no cap) or more")


@dataclass(frozen=True)
class BrokerConfig:
    heartbeat_ms: int = 1000
    liveness: int = 3  # missed heartbeats before a peer is declared dead
    partial_deadline_ms: int = 2000  # a queued partial older than this is skipped
    final_deadline_ms: int = 10000  # finals are never dropped; past this they are logged late


@dataclass(frozen=True)
class WorkerConfig:
    processes: int = 0  # 0 = one per CPU core


@dataclass(frozen=True)
class MetricsConfig:
    dashboard_port: int = 7780  # the ops page and /metrics, on localhost


@dataclass(frozen=True)
class Config:
    instance: str = "default"  # namespaces shm segments and the run directory
    run_dir: str = ""  # ipc sockets, supervisord files, logs; "" = /tmp/streamasr-<instance>
    log_level: str = "info"
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
    """Construct dataclass `cls` from a TOML table, refusing unknown keys (typos)."""
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            raise ValueError(f"unknown config key {where}{key}")
        sub = known[key].default_factory if known[key].default_factory is not dataclasses.MISSING else None
        if isinstance(value, dict) and sub is not None and dataclasses.is_dataclass(sub):
            kwargs[key] = _build(sub, value, f"{where}{key}.")
        else:
            kwargs[key] = value
    return cls(**kwargs)


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load(path: str | os.PathLike[str] | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Load the default config, then `path` (or $STREAMASR_CONFIG) on top, then `overrides`."""
    data = tomllib.loads(DEFAULT_CONFIG.read_text())
    path = path or os.environ.get(CONFIG_ENV)
    if path:
        data = merge(data, tomllib.loads(Path(path).read_text()))
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
