"""What `infermesh up` starts: how many instances of each role, their parallel sizes, and the settings it
passes them. The settings' defaults are the services' own (`mesh.settings`, `engine.engine_config`): a
spec restates none of them. Plain data, no grpc: the CLI reads its option defaults from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.engine_config import DEFAULTS as ENGINE
from mesh.restarts import RestartPolicy
from mesh.settings import DecodeSettings, RouterSettings

RESTARTS = RestartPolicy()
ROUTER = RouterSettings()  # the defaults of the settings every service shares, and the router's own
ENGINES = DecodeSettings()  # those of prefill and decode instances


@dataclass(frozen=True, kw_only=True, slots=True)
class MeshSpec:
    model: str = ROUTER.model
    host: str = ROUTER.host
    port: int = 8000  # the router's public port
    prefill: int = 1
    prefill_cp: int = 1
    decode: int = 1
    decode_tp: int = 1
    local_prefill_max_tokens: int = ROUTER.local_prefill_max_tokens  # shorter uncached parts: prefilled on decode
    kv_transport: str = ROUTER.kv_transport
    mooncake_protocol: str = ENGINES.mooncake_protocol
    mooncake_devices: str = ENGINES.mooncake_devices
    kv_pool: str = ENGINES.kv_pool  # or mooncake: `up` starts the pool (a master and kv_pool_memory of memory)
    kv_pool_memory: str = "4 GB"  # what the embedded pool holds
    http_port: int | None = ROUTER.http_port  # the router's OpenAI-compatible HTTP front (0: any free port)
    experts: int = 0  # expert instances hosting the MoE experts (0: each instance runs its own)
    expert_ep: int = 1  # EP ranks per expert instance
    registry: str = ROUTER.registry
    trace: str = ROUTER.trace
    metrics: str = ROUTER.metrics
    dtype: str = ENGINE.dtype
    quantization: str = ENGINE.quantization  # prefill and decode weights
    batch_invariant: bool = ENGINE.batch_invariant
    kv_cache_bytes: int = ENGINE.kv_cache_bytes
    max_num_batched_tokens: int = ENGINE.max_num_batched_tokens
    cpus: str = "split"  # split: each engine instance its own share of this host's cores (engine.cpus); shared
    startup_timeout_s: float = 300.0
    max_restarts: int = RESTARTS.max_restarts  # of one process within restart_window_s (mesh.restarts)
    restart_window_s: float = RESTARTS.window_s
    admin_token: str = field(default="", repr=False)  # Scale and every instance's Drain need it (when set)

    def __post_init__(self) -> None:
        if self.decode < 1:
            raise ValueError(f"decode must be >= 1 (someone has to generate), got {self.decode}")
        if self.prefill < 0:
            raise ValueError(f"prefill must be >= 0, got {self.prefill}")
        if self.experts < 0 or self.expert_ep < 1:
            raise ValueError(f"need experts >= 0 and expert_ep >= 1, got {self.experts} and {self.expert_ep}")
        if self.kv_pool not in ("none", "mooncake") and not self.kv_pool.startswith("mooncake://"):
            raise ValueError(f"kv_pool must be none, mooncake or mooncake://HOST:PORT, got {self.kv_pool!r}")
        self.restart_policy()  # checks them
        if self.cpus not in ("split", "shared"):
            raise ValueError(f"cpus must be split or shared, got {self.cpus!r}")

    def restart_policy(self) -> RestartPolicy:
        return RestartPolicy(max_restarts=self.max_restarts, window_s=self.restart_window_s)
