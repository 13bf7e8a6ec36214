"""Model configuration: one frozen description of a decoder-only transformer.

`ModelConfig` is built from a Hugging Face `config.json` dict (`from_hf`) or from
GGUF metadata (`from_gguf`). It holds only what the math needs; everything is
validated on construction, and an architecture we cannot run exactly is refused
with a message that says which ones we can.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen3", "mixtral", "qwen3_moe")
QUANTIZATIONS = ("none", "int8")  # of the weights; int8: engine/quantize.py


def check_quantization(name: str) -> None:
    if name not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {name!r}")


class ConfigError(ValueError):
    """A model configuration we cannot run; the message names the field."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling; `kind` is 'default', 'linear' or 'llama3'."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position: int
    tie_word_embeddings: bool
    qk_norm: bool = False  # qwen3: RMSNorm over head_dim on q and k before RoPE
    attention_bias: bool = False
    sliding_window: int | None = None
    # Mixture of experts (num_experts == 0 means dense everywhere).
    num_experts: int = 0
    num_experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.num_experts:
            if not 0 < self.num_experts_per_token <= self.num_experts:
                raise ConfigError(
                    f"num_experts_per_token must be in [1, num_experts={self.num_experts}], "
                    f"got {self.num_experts_per_token}"
                )
            if self.moe_intermediate_size <= 0:
                raise ConfigError(f"moe_intermediate_size must be > 0, got {self.moe_intermediate_size}")
        if self.rope_scaling.kind not in ("default", "linear", "llama3"):
            raise ConfigError(
                f"rope_scaling type {self.rope_scaling.kind!r} is not supported; supported: default, linear, llama3"
            )

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    @property
    def max_model_len(self) -> int:
        """Longest sequence we run exactly (sliding-window attention is not implemented,
        so a model with a window is served up to that window)."""
        if self.sliding_window:
            return min(self.max_position, self.sliding_window)
        return self.max_position

    # ---- constructors -------------------------------------------------------------

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        arch = cfg.get("model_type")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"config.json model_type {arch!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            num_layers = int(cfg["num_hidden_layers"])
            vocab = int(cfg["vocab_size"])
            intermediate = int(cfg["intermediate_size"])
        except KeyError as e:
            raise ConfigError(f"config.json is missing required field {e.args[0]!r}") from None
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or rope
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        num_experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
        moe_layers: tuple[int, ...] = ()
        if num_experts:
            step = int(cfg.get("decoder_sparse_step", 1) or 1)
            dense = set(cfg.get("mlp_only_layers") or ())
            moe_layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        sliding = cfg.get("sliding_window")
        if arch.startswith("qwen3") and not cfg.get("use_sliding_window", False):
            sliding = None
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=_rope_scaling(scaling),
            max_position=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=arch.startswith("qwen3"),
            attention_bias=bool(cfg.get("attention_bias", False)),
            sliding_window=int(sliding) if sliding else None,
            num_experts=num_experts,
            num_experts_per_token=int(cfg.get("num_experts_per_tok", 0) or 0),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or intermediate) if num_experts else 0,
            # Mixtral always renormalises the top-k weights; Qwen3-MoE says so in its config.
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)) if arch == "qwen3_moe" else True,
            moe_layers=moe_layers,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], *, tied: bool) -> "ModelConfig":
        """From GGUF metadata (`general.architecture` and its `{arch}.*` keys)."""
        arch = meta.get("general.architecture")
        if arch != "llama":
            raise ConfigError(f"GGUF architecture {arch!r} is not supported; supported: llama")

        def get(key: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise ConfigError(f"GGUF metadata is missing {arch}.{key}")
            return value

        hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
        num_layers = int(get("block_count"))
        num_experts = int(meta.get(f"{arch}.expert_count", 0) or 0)
        vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            architecture="mixtral" if num_experts else "llama",
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=int(meta.get(f"{arch}.rope.dimension_count") or hidden // heads),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            max_position=int(get("context_length")),
            tie_word_embeddings=tied,
            num_experts=num_experts,
            num_experts_per_token=int(meta.get(f"{arch}.expert_used_count", 0) or 0),
            moe_intermediate_size=int(get("feed_forward_length")) if num_experts else 0,
            moe_layers=tuple(range(num_layers)) if num_experts else (),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=(int(eos),) if eos is not None else (),
        )


def _rope_scaling(raw: dict[str, Any]) -> RopeScaling:
    kind = raw.get("rope_type") or raw.get("type") or "default"
    if kind == "default":
        return RopeScaling()
    return RopeScaling(
        kind=kind,
        factor=float(raw.get("factor", 1.0)),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position=int(raw.get("original_max_position_embeddings", 8192)),
    )
