"""Settings of each service: one frozen dataclass per role, each setting declared once (type, default, check).

Every field can come from an `INFERMESH_<FIELD>` environment variable (parsed by
the field's type) and be overridden by a CLI flag: `load(cls, flags)` applies
defaults, then the environment, then the flags that were given (`parse_flags` returns
those alone; None is a value: `--metrics-port none` turns the metrics port off).
Bad values raise ValueError naming the variable or flag and the value.
`to_flags(settings)` is the inverse of `parse_flags`: the flags that make a service
started in the same environment load exactly `settings` (how `infermesh up` starts its
children). Secrets (fields kept out of the repr) are never rendered as flags: they
travel in the environment, where `ps` does not show them.
"""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from dataclasses import dataclass

from engine.cpus import parse_cpus
from engine.engine_config import DEFAULTS as ENGINE
from engine.engine_config import EngineConfig
from mesh.planner import PlannerConfig

ENV_PREFIX = "INFERMESH_"
MOONCAKE_PROTOCOLS = ("tcp", "rdma")


@dataclass(frozen=True, kw_only=True, slots=True)
class ServiceSettings:
    host: str = "127.0.0.1"  # the address peers reach this instance at (published in the registry)
    bind_host: str = ""  # where its gRPC, HTTP and metrics servers listen ("": host; 0.0.0.0 in a pod)
    port: int = 0  # 0: pick a free port
    model: str = "smollm2-135m"
    registry: str = "memory"  # memory | redis://HOST:PORT
    trace: str = "none"  # none | console | otlp | file:PATH
    metrics: str = "none"  # none | console | otlp | file:PATH (OpenTelemetry metrics)
    metrics_interval_s: float = 10.0
    metrics_port: int | None = 0  # Prometheus text at http://HOST:PORT/metrics (0: any free port; None: off)
    # a plaintext port with grpc.health.v1 alone, for probes that cannot speak TLS (the kubelet's); None: off
    health_port: int | None = None
    # RPCs its gRPC server runs at once, one thread each (a stream holds one for its life); more: RESOURCE_EXHAUSTED
    max_concurrent_rpcs: int = 512
    heartbeat_s: float = 1.0
    ttl_s: float = 5.0  # a record not renewed for this long is gone
    drain_timeout_s: float = 60.0  # a drain stops the instance after this long even if work is left
    # when set, Admin.Drain needs `authorization: Bearer <token>` (INFERMESH_ADMIN_TOKEN); never shown in a repr
    admin_token: str = dataclasses.field(default="", repr=False)

    def __post_init__(self) -> None:
        for name in ("port", "metrics_port", "health_port"):
            if not 0 <= (getattr(self, name) or 0) < 65536:
                raise ValueError(f"{name} must be in [0, 65535], got {getattr(self, name)}")
        if self.max_concurrent_rpcs < 1:
            raise ValueError(f"max_concurrent_rpcs must be >= 1, got {self.max_concurrent_rpcs}")
        if not 0 < self.heartbeat_s < self.ttl_s:
            raise ValueError(f"need 0 < heartbeat_s ({self.heartbeat_s}) < ttl_s ({self.ttl_s})")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")


@dataclass(frozen=True, kw_only=True, slots=True)
class RankedSettings(ServiceSettings):
    """An instance of ranks (prefill, decode, expert): rank 0 hosts their rendezvous on host:rendezvous_port;
    the first `local_ranks` ranks run here (None: all), the others join from elsewhere (`infermesh rank`)."""

    dtype: str = ENGINE.dtype
    rendezvous_port: int = 0  # 0: any free port (fix it when ranks join from other hosts)
    local_ranks: int | None = None
    cpus: str = ""  # the cores its local ranks run on, e.g. 0-3 (engine.cpus); "": every core the process may use

    def __post_init__(self) -> None:
        super(RankedSettings, self).__post_init__()
        if self.cpus:
            parse_cpus(self.cpus)
        if not 0 <= self.rendezvous_port < 65536:
            raise ValueError(f"rendezvous_port must be in [0, 65535], got {self.rendezvous_port}")
        if self.local_ranks is not None and self.local_ranks < 1:
            raise ValueError(f"local_ranks must be >= 1 (rank 0 runs here), got {self.local_ranks}")


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineSettings(RankedSettings):
    """An engine instance (prefill, decode): the engine's settings take their defaults and checks from
    `engine.engine_config.EngineConfig`, where they are declared."""

    device: str = ENGINE.device  # or cuda: rank i of a host uses its GPU i mod the GPUs it sees; NCCL between ranks
    block_size: int = ENGINE.block_size
    kv_cache_bytes: int = ENGINE.kv_cache_bytes
    max_num_seqs: int = ENGINE.max_num_seqs
    max_num_batched_tokens: int = ENGINE.max_num_batched_tokens
    quantization: str = ENGINE.quantization
    batch_invariant: bool = ENGINE.batch_invariant
    experts: str = ""  # host:port of an expert instance to run the MoE experts on ("": on this instance's ranks)
    expert_timeout_s: float = 30.0  # a step waiting longer than this on the expert instance fails
    mooncake_protocol: str = "tcp"  # the mooncake KV transport's: tcp, or rdma (RDMA NICs)
    mooncake_devices: str = ""  # the RDMA NICs it uses, comma-separated, e.g. mlx5_0,mlx5_1 ("": Mooncake picks)
    # none, or mooncake://HOST:PORT (a Mooncake Store master): a KV pool below the cache, shared by every engine
    # that names it (one-rank engines); full blocks are stored there and prompts' blocks loaded from it
    kv_pool: str = "none"
    kv_pool_timeout_s: float = 2.0  # a pool lookup or load taking longer is given up: the engine computes

    def __post_init__(self) -> None:
        super(EngineSettings, self).__post_init__()
        EngineConfig.from_settings(self)  # the engine's own checks, named as settings
        if self.mooncake_protocol not in MOONCAKE_PROTOCOLS:
            raise ValueError(f"mooncake_protocol must be one of {', '.join(MOONCAKE_PROTOCOLS)}, "
                             f"got {self.mooncake_protocol!r}")
        if self.kv_pool != "none" and not re.fullmatch(r"mooncake://[^:/]+:\d+", self.kv_pool):
            raise ValueError(f"kv_pool must be none or mooncake://HOST:PORT, got {self.kv_pool!r}")
        if self.kv_pool_timeout_s <= 0:
            raise ValueError(f"kv_pool_timeout_s must be > 0, got {self.kv_pool_timeout_s}")

    @property
    def kv_pool_master(self) -> str | None:
        """HOST:PORT of the pool's master, or None."""
        return None if self.kv_pool == "none" else self.kv_pool.removeprefix("mooncake://")


@dataclass(frozen=True, kw_only=True, slots=True)
class PrefillSettings(EngineSettings):
    cp: int = 1
    cp_method: str = "auto"
    shared_kv_cache: bool = False  # the KV cache in /dev/shm: the shared_memory transport's decode copies from it

    def __post_init__(self) -> None:
        super(PrefillSettings, self).__post_init__()
        if self.kv_pool != "none" and self.cp != 1:
            raise ValueError(f"kv_pool serves engines of one rank for now, got cp={self.cp}")
        if self.shared_kv_cache and self.device != "cpu":
            raise ValueError(f"shared_kv_cache holds the KV cache in /dev/shm, host memory: device must be cpu, "
                             f"got {self.device!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class DecodeSettings(EngineSettings):
    tp: int = 1
    reservation_lease_s: float = 30.0  # a KV reservation not joined within this is cancelled, its blocks freed
    borrow_cpus: str = ""  # cores of other engine instances this one may run a step on while they idle (cpu_lending)

    def __post_init__(self) -> None:
        super(DecodeSettings, self).__post_init__()
        if self.kv_pool != "none" and self.tp != 1:
            raise ValueError(f"kv_pool serves engines of one rank for now, got tp={self.tp}")
        if self.borrow_cpus:
            parse_cpus(self.borrow_cpus)
            if not self.cpus:
                raise ValueError("borrow_cpus needs cpus: an instance on every core has none to borrow")
            if self.tp != 1:
                raise ValueError(f"borrow_cpus: only a decode instance of one rank borrows cores (tp=1), "
                                 f"got tp={self.tp}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ExpertSettings(RankedSettings):
    ep: int = 1  # expert-parallel ranks: each holds its contiguous share of every MoE layer's experts

    def __post_init__(self) -> None:
        super(ExpertSettings, self).__post_init__()
        if self.ep < 1:
            raise ValueError(f"ep must be >= 1, got {self.ep}")


@dataclass(frozen=True, kw_only=True, slots=True)
class RouterSettings(ServiceSettings):
    policy: str = "least_load"  # round_robin | least_load | prefix_aware
    local_prefill_max_tokens: int = 64  # conditional disaggregation: decode prefills uncached parts this short
    request_timeout_s: float = 300.0
    kv_transport: str = "grpc_stream"  # how prefill pushes KV to decode: a name in kvtransfer.transports
    migration_limit: int = 3  # times one stream may move to another decode instance when its own dies
    registry_refresh_s: float = 0.25  # routing reads the registry from a snapshot this old at most while requests flow
    shed_active_requests: int = 256  # a decode instance with this many requests has no room (with free KV blocks)
    http_port: int | None = None  # the OpenAI-compatible HTTP front (0: any free port; None: off)
    # its planner (router.planner_watch): a window of its metrics this long, sized against these p90 SLOs
    planner_interval_s: float = 30.0
    ttft_slo_s: float = PlannerConfig().ttft_slo_s
    tpot_slo_s: float = PlannerConfig().tpot_slo_s
    # when set, the public API (gRPC and HTTP) needs `authorization: Bearer <token>`; never shown in a repr
    api_token: str = dataclasses.field(default="", repr=False)

    def __post_init__(self) -> None:
        super(RouterSettings, self).__post_init__()
        if self.migration_limit < 0:
            raise ValueError(f"migration_limit must be >= 0, got {self.migration_limit}")
        if self.registry_refresh_s <= 0:
            raise ValueError(f"registry_refresh_s must be > 0, got {self.registry_refresh_s}")
        if self.shed_active_requests < 1:
            raise ValueError(f"shed_active_requests must be >= 1, got {self.shed_active_requests}")
        if self.http_port is not None and not 0 <= self.http_port < 65536:
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")
        if self.planner_interval_s <= 0:
            raise ValueError(f"planner_interval_s must be > 0, got {self.planner_interval_s}")
        self.planner()  # checks the SLOs
        if self.policy not in ("round_robin", "least_load", "prefix_aware"):
            raise ValueError(f"policy must be round_robin, least_load or prefix_aware, got {self.policy!r}")

    def planner(self) -> PlannerConfig:
        return PlannerConfig(ttft_slo_s=self.ttft_slo_s, tpot_slo_s=self.tpot_slo_s)


S = typing.TypeVar("S", bound=ServiceSettings)


def load(cls: type[S], flags: dict[str, object] | None = None, environ: typing.Mapping[str, str] = os.environ) -> S:
    """Defaults, then INFERMESH_* variables, then `flags` (every value in it, None included)."""
    hints = typing.get_type_hints(cls)
    values: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        name = ENV_PREFIX + f.name.upper()
        if name in environ:
            values[f.name] = _parse(environ[name], hints[f.name], name)
    values.update(flags or {})
    unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ValueError(f"unknown setting(s) for {cls.__name__}: {', '.join(sorted(unknown))}")
    return cls(**values)


def parse_flags(cls: type[ServiceSettings], argv: list[str] | None = None) -> dict[str, object]:
    """The `--field-name VALUE` flags given, of the fields of `cls`, by field name."""
    import argparse

    parser = argparse.ArgumentParser(prog=cls.__name__, allow_abbrev=False)  # a flag is spelled whole
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, default=argparse.SUPPRESS,
                            type=(lambda text, k=kind, n=f.name: _parse(text, k, f"--{n.replace('_', '-')}")))
    return vars(parser.parse_args(argv))


def to_flags(settings: ServiceSettings, environ: typing.Mapping[str, str] = os.environ) -> list[str]:
    """`--field-name VALUE` for every field whose value differs from what the defaults and `environ` give, so
    that `load(cls, parse_flags(cls, to_flags(s)), environ) == s` (secrets aside: they are not rendered)."""
    baseline = load(type(settings), {}, environ)
    flags = []
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if f.repr and value != getattr(baseline, f.name):
            flags += [f"--{f.name.replace('_', '-')}", _render(value)]
    return flags


def _render(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _parse(text: str, kind, name: str) -> object:
    optional = [k for k in typing.get_args(kind) if k is not type(None)]
    if optional:  # `X | None`: X, or None spelled "none" or ""
        return None if text.lower() in ("", "none") else _parse(text, optional[0], name)
    try:
        if kind is bool:
            if text.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(text)
            return text.lower() in ("1", "true", "yes")
        return kind(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a valid {kind.__name__}") from None
