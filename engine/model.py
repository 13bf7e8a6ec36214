"""One decoder-only transformer for llama, mistral, qwen3, mixtral and qwen3_moe.

The architectures differ only in a few switches read from `ModelConfig`: q/k
RMSNorm (qwen3), and a dense SwiGLU MLP or a `SparseMoE` per layer. Projections are
fused (qkv, gate_up) when weights load: fewer, larger matmuls. On CPU a step of a few rows
runs its layers in one C++ call where they fit it (engine/step_layers.py: the same bits).
The model never imports torch.distributed; parallelism is applied from outside.

`forward(token_ids [T], positions [T], kv_cache, meta) -> hidden [T, D]`;
`compute_logits(hidden [N, D]) -> [N, V]` in the model's dtype, run only on the rows sampled.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine import bf16
from engine.attention import AttentionMetadata, RotaryEmbedding, fused_decode, paged_attention, rotate_
from engine.config import ModelConfig
from engine.kernels import cpu_ops
from engine.moe import SparseMoE
from engine.step_layers import StepLayers


class RMSNorm(nn.Module):
    """Hugging Face's RMSNorm: float32 statistics, `weight * (x * rstd).to(dtype)`. On CPU one C++ pass over
    each row (engine/kernels/cpu_norm_rope.cpp) computes the same in place of torch's chain of small ops."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_contiguous() and cpu_ops.takes(x, self.weight):
            return cpu_ops.ops().rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its norm): the residual add and the next norm in one pass on CPU."""
        if x.is_contiguous() and delta.is_contiguous() and cpu_ops.takes(x, delta, self.weight):
            return cpu_ops.ops().add_rms_norm(x, delta, self.weight, self.eps)
        x = x + delta
        return x, self(x)


# torch's GEMM gives a bf16 row the bits `mv` gives it in batches of up to this many rows: batch-invariant, the
# engine hands rows to the few-row kernel only where it takes as many or more (engine/parallel/parallelize.py)
INVARIANT_ROWS = 32


class Linear(nn.Linear):
    """`nn.Linear` with CPU paths for decode at small batch, and for bf16 on a CPU without bf16 arithmetic.

    1 to `few_rows` rows (set by engine/parallel/parallelize.py, `few_rows`) go through the C++ few-row
    kernel (engine/kernels/cpu_linear.cpp: up to 64 rows, 8 in float32), which reads the weight near a plain
    read's speed and sums every output in one order: a row gets the same bits in any batch it takes, not what
    torch's GEMM gives it. Otherwise one bf16 row is multiplied as a matrix-vector product, bit for bit what
    the row gets inside a batched `F.linear` (torch's GEMM, up to INVARIANT_ROWS), and torch's `mv` reads the
    weight ~1.5x faster than its `mm` with one row (on AMX CPUs). On a CPU without bf16 arithmetic
    (engine/bf16.py) more bf16 rows than that (a prompt) are multiplied in float32 and rounded once."""

    few_rows = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and 1 <= x.shape[0] <= self.few_rows and cpu_ops.takes(x, self.weight):
            out = cpu_ops.ops().linear(x, self.weight)  # [rows, out]
            return out if self.bias is None else out + self.bias
        if x.shape[0] == 1 and x.dim() == 2 and x.dtype == torch.bfloat16 and x.device.type == "cpu" \
                and self.bias is None:
            return torch.mv(self.weight, x[0]).unsqueeze(0)  # [1, out]
        if x.shape[0] > INVARIANT_ROWS and bf16.emulated(x):
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)  # torch's bf16 GEMM: ~8x slower
        return F.linear(x, self.weight, self.bias)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = self.head_dim**-0.5
        self.kv_head_map: torch.Tensor | None = None  # KV head of each query head when not plain GQA (set by TP)
        self.attend = paged_attention  # replaced from outside by context parallelism

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata):
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) D]
        if self.q_norm is None and self.attend is paged_attention:  # decode-only steps on CPU: one kernel call
            out = fused_decode(qkv, rope, kv_cache[0], kv_cache[1], meta, self.scale, self.num_heads,
                               self.kv_head_map)
            if out is not None:
                return self.o_proj(out)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # contiguous heads: the C++ norm at any T (as engine/step_layers.py)
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        q, k = rotate_(q, *rope), rotate_(k, *rope)
        out = self.attend(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.kv_head_map)  # [T, Hq, D]
        return self.o_proj(out.flatten(1))


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if index in cfg.moe_layers:
            self.mlp: nn.Module = SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                                            cfg.num_experts_per_token, cfg.norm_topk_prob)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, rope, kv_cache, meta):
        x, h = self.post_attention_layernorm.add_forward(x, self.self_attn(self.input_layernorm(x), rope, kv_cache,
                                                                           meta))
        return x + self.mlp(h)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.config = cfg
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_model_len, cfg.rope_theta, cfg.rope_scaling, device=device)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)  # shares embed's weight when tied
        self._step_layers: StepLayers | bool | None = None  # a step's layers in one call: read on first use

    def forward(self, token_ids, positions, kv_cache: list[tuple[torch.Tensor, torch.Tensor]], meta):
        x = self.embed_tokens(token_ids)  # [T, D]
        rope = self.rope.tables(positions, x.dtype)
        if self._step_layers is None:
            self._step_layers = StepLayers.of(self) or False
        if self._step_layers and (out := self._step_layers(x, rope, kv_cache, meta)) is not None:
            return out
        for layer, layer_cache in zip(self.layers, kv_cache):
            x = layer(x, rope, layer_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [N, V]; the sampler up-casts the rows that need more than an argmax


def build_model(cfg: ModelConfig, hf_weights: dict[str, torch.Tensor],
                device: torch.device | str = "cpu") -> Transformer:
    """Construct without allocating, then adopt the checkpoint's tensors (no copy on CPU)."""
    try:
        state = engine_state_dict(cfg, hf_weights)
    except KeyError as e:
        raise KeyError(f"checkpoint is missing weight {e.args[0]!r}") from None
    with torch.device("meta"):
        model = Transformer(cfg, device=device)
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device).eval()


def engine_state_dict(cfg: ModelConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face names -> this model's parameters (qkv and gate_up fused, experts stacked)."""
    out = {"embed_tokens.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    out["lm_head.weight"] = out["embed_tokens.weight"] if cfg.tie_word_embeddings else hf["lm_head.weight"]
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn = src + "self_attn."
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "post_attention_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        out[dst + "self_attn.qkv_proj.weight"] = torch.cat([hf[attn + f"{p}_proj.weight"] for p in "qkv"])
        if cfg.attention_bias:
            out[dst + "self_attn.qkv_proj.bias"] = torch.cat([hf[attn + f"{p}_proj.bias"] for p in "qkv"])
        out[dst + "self_attn.o_proj.weight"] = hf[attn + "o_proj.weight"]
        if cfg.qk_norm:
            out[dst + "self_attn.q_norm.weight"] = hf[attn + "q_norm.weight"]
            out[dst + "self_attn.k_norm.weight"] = hf[attn + "k_norm.weight"]
        if i in cfg.moe_layers:
            out.update(_moe_weights(cfg, hf, src, dst + "mlp."))
        else:
            mlp = src + "mlp."
            out[dst + "mlp.gate_up_proj.weight"] = torch.cat([hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"]])
            out[dst + "mlp.down_proj.weight"] = hf[mlp + "down_proj.weight"]
    return out


def _moe_weights(cfg: ModelConfig, hf: dict[str, torch.Tensor], src: str, dst: str) -> dict[str, torch.Tensor]:
    if src + "block_sparse_moe.gate.weight" in hf:  # mixtral naming: w1 gate, w3 up, w2 down
        base, gate, up, down = src + "block_sparse_moe.", "w1", "w3", "w2"
    else:  # qwen3_moe naming
        base, gate, up, down = src + "mlp.", "gate_proj", "up_proj", "down_proj"
    experts = range(cfg.num_experts)

    def stacked(parts: list[list[torch.Tensor]]) -> torch.Tensor:  # per expert, tensors to concatenate
        if all(a is b for p in parts for a, b in zip(p, parts[0])):  # the same tensors for every expert (upcycled):
            # share them, do not copy
            return torch.cat(parts[0]).expand(len(parts), -1, -1)
        return torch.stack([torch.cat(p) for p in parts])

    return {
        dst + "gate.weight": hf[base + "gate.weight"],
        dst + "w_gate_up": stacked([[hf[f"{base}experts.{e}.{gate}.weight"], hf[f"{base}experts.{e}.{up}.weight"]]
                                    for e in experts]),  # [E, 2I, D]
        dst + "w_down": stacked([[hf[f"{base}experts.{e}.{down}.weight"]] for e in experts]),  # [E, D, I]
    }
