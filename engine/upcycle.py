"""`smollm2-135m-moe`: SmolLM2 "upcycled" into a mixture of experts — a test and demo model, not a trained one.

Every layer's FFN is copied into 8 experts, and a router (seeded random weights) picks 2 of them with
weights renormalised to sum to 1, so each MoE layer computes w1·FFN(x) + w2·FFN(x) = FFN(x): the dense
model's output up to rounding. Greedy tokens therefore equal the dense SmolLM2's, whichever experts the
router picks — an end-to-end check of the expert path (dispatch, compute, combine) on real weights.
The experts share one tensor (no 8x memory) until a rank slices its own. The name and the config live
in `engine.model_info` (torch-free); this module builds the weights.
"""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.model_info import UPCYCLED, upcycled_config

ROUTER_SEED = 0


def upcycle(name: str, dense: ModelConfig, dense_weights: dict[str, torch.Tensor]
            ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The dense model's config and weights as the MoE model `name` (Hugging Face mixtral naming)."""
    _, num_experts, top_k = UPCYCLED[name]
    weights = dict(dense_weights)
    g = torch.Generator().manual_seed(ROUTER_SEED)
    for i in range(dense.num_layers):
        mlp, moe = f"model.layers.{i}.mlp.", f"model.layers.{i}.block_sparse_moe."
        ffn = {w: weights.pop(mlp + f"{p}_proj.weight") for w, p in (("w1", "gate"), ("w3", "up"), ("w2", "down"))}
        for e in range(num_experts):
            weights.update({f"{moe}experts.{e}.{w}.weight": tensor for w, tensor in ffn.items()})  # the same tensors
        dtype = ffn["w1"].dtype
        weights[moe + "gate.weight"] = torch.randn(num_experts, dense.hidden_size, generator=g).to(dtype)
    return upcycled_config(dense, num_experts, top_k), weights
