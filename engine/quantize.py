"""Weight-only int8 quantization (`quantization="int8"`): the projections and the LM head.

Each weight row (output channel) is stored as int8 with one scale: `w ≈ w_int8 * scale[:, None]`, where
`scale = max|row| / 127` and `w_int8 = round(w / scale)`. Activations, norms, embeddings, the KV cache,
MoE experts and their router stay in the model's dtype. The contract is exactness against the dequantized
model: an int8 engine computes what the same model computes with every quantized weight replaced by
`w_int8 * scale` (tested against transformers so loaded, fp32), so the only error is the rounding of the
weights, and it is the same on every parallel layout (quantize first, then shard: a row-parallel shard
keeps its rows' scales, a column-parallel shard takes its rows' scales along).

Why: decode at small batch reads every weight once per token, so it is bound by memory bandwidth; int8
halves the bytes of bf16. On CPU the int8 kernel (engine/kernels/cpu_linear.cpp, `linear_int8`: one
summation order for any batch it takes) takes up to `kernel_rows(dtype)` rows: 64 of bf16 where the CPU has
AVX512-BF16 (the weights converted to bf16 exactly and summed with VDPBF16PS: ~1.3x bf16 weights at one row
on an AMX CPU, ~0.4x at 32, where bf16 takes AMX tiles), 64 of bf16 elsewhere and 16 of float32 (float32 FMAs;
torch's `_weight_int8pack_mm` where the kernels are not built). An engine that is not batch-invariant
(`Int8Linear.batch_invariant`) sends 2 to 64 rows of bf16 through AMX tiles where the CPU has them (the
weights converted to bf16 a pass at a time, then summed as bf16 weights are): 1.6x at 8 rows, 2.2x at 32;
one row stays on the dot path, ~30 % faster there; so a row alone gets other bits than in a batch. Larger
batches (and other devices) convert the weight to the activations' dtype each call (to float32, for bf16 on a
CPU without bf16 arithmetic: engine/bf16.py), which costs more than bf16 weights would.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from engine import bf16
from engine.kernels import cpu_ops

QUANTIZED_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
PACKED_MAX_ROWS = 16  # torch's int8 kernel beats converting the weight up to here


@functools.cache
def _kernel_rows(dtype: torch.dtype) -> int:
    return cpu_ops.ops().linear_int8_rows(dtype)


def kernel_rows(dtype: torch.dtype) -> int:
    """How many rows of activations in `dtype` an int8 layer multiplies through an int8 kernel on CPU."""
    return _kernel_rows(dtype) if cpu_ops.available() else PACKED_MAX_ROWS


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (int8 [out, in], float32 scale [out]): symmetric, one scale per row."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


class Int8Linear(nn.Module):
    """A bias-optional linear layer over an int8 weight [out, in] and a scale [out] in the model's dtype.
    `batch_invariant` (set by engine/parallel/parallelize.py): False lets the CPU kernel take 2 rows and more
    on AMX tiles, so a row's bits depend on whether it was alone (see the module's docstring)."""

    batch_invariant = True

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        dtype = linear.weight.dtype
        weight, scale = quantize_rows(linear.weight.detach())
        return cls(weight, scale.to(dtype), linear.bias)

    def dequantized(self) -> torch.Tensor:
        """The weight this layer computes with, [out, in] in float32."""
        return self.weight.float() * self.scale.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, in] -> [N, out]
        if x.device.type == "cpu" and x.shape[0] <= kernel_rows(x.dtype):
            if x.shape[0] and cpu_ops.takes(x, self.scale):  # (a step may sample no rows: [0, in])
                out = cpu_ops.ops().linear_int8(x, self.weight, self.scale, self.batch_invariant)
            else:
                out = torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scale.to(x.dtype))
        elif bf16.emulated(x):  # a bf16 GEMM in float32 (engine/bf16.py)
            out = (F.linear(x.float(), self.weight.float()) * self.scale.float()).to(x.dtype)
        else:
            out = F.linear(x, self.weight.to(x.dtype)) * self.scale.to(x.dtype)
        return out if self.bias is None else out + self.bias


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace, in place, each decoder layer's projections and the LM head with `Int8Linear`s. A tied LM
    head gets its own int8 copy (the embedding table stays in the model's dtype: a lookup reads one row)."""
    for layer in model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in QUANTIZED_LINEARS:
                if isinstance(getattr(parent, name, None), nn.Linear):
                    setattr(parent, name, Int8Linear.from_linear(getattr(parent, name)))
    model.lm_head = Int8Linear.from_linear(model.lm_head)
    return model
