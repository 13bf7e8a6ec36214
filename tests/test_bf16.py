"""bf16 on a CPU with or without bf16 arithmetic: the engine knows which it runs on (checked against the CPU's
flags as Linux lists them), and a bf16 `Linear` or int8 layer past the few-row kernel gives the float32
product of its bf16 operands rounded once where the CPU lacks it (torch's bf16 GEMM, ~8x slower there, is
not used)."""

from pathlib import Path

import torch
import torch.nn.functional as F

from engine.bf16 import cpu_computes_bf16
from engine.model import Linear


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()  # not x86


def test_the_engine_knows_whether_the_cpu_computes_bf16():
    assert cpu_computes_bf16() == bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def test_a_bf16_linear_past_the_few_row_kernel_rounds_a_float32_product_once():
    g = torch.Generator().manual_seed(0)
    layer = Linear(576, 300, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(100, 576, generator=g).bfloat16()  # more rows than the few-row kernel takes anywhere
    out = layer(x)
    exact = (x.double() @ layer.weight.double().T + layer.bias.double()).bfloat16()
    torch.testing.assert_close(out, exact, rtol=2**-7, atol=2**-7 * 576**0.5)
    if cpu_computes_bf16():
        assert torch.equal(out, F.linear(x, layer.weight, layer.bias))
    else:
        assert torch.equal(out, F.linear(x.float(), layer.weight.float(), layer.bias.float()).bfloat16())


def test_an_int8_layer_past_its_kernel_rows_rounds_a_float32_product_once():
    from engine.quantize import Int8Linear

    g = torch.Generator().manual_seed(1)
    layer = Int8Linear.from_linear(torch.nn.Linear(576, 300, bias=False).to(torch.bfloat16))
    x = torch.randn(100, 576, generator=g).bfloat16()  # past the int8 kernel's rows on every path (64)
    out = layer(x)
    exact = (x.double() @ layer.dequantized().double().T).bfloat16()
    torch.testing.assert_close(out, exact, rtol=2**-6, atol=2**-6 * 576**0.5)
    if not cpu_computes_bf16():
        assert torch.equal(out, (F.linear(x.float(), layer.weight.float()) * layer.scale.float()).bfloat16())
