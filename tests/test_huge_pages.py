"""Model weights in huge pages (engine/huge_pages.py): the same values, ties kept, views left in place,
in a mapping advised MADV_HUGEPAGE; an engine on CPU reads its weights from there."""

from __future__ import annotations

import torch
from torch import nn

from engine import LLM
from engine.huge_pages import to_huge_pages


def advised_for_huge_pages(address: int) -> bool:
    """Whether the mapping holding `address` carries the huge-page advice ("hg" in /proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        first = line.split()[0]
        if "-" in first and ":" not in first:
            start, end = (int(a, 16) for a in first.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return "hg" in line.split()[1:]
    return False


def test_to_huge_pages_moves_contiguous_weights_keeps_ties_and_leaves_views():
    model = nn.Module()
    model.embed = nn.Embedding(100, 32)
    model.head = nn.Linear(32, 100, bias=False)
    model.head.weight = model.embed.weight  # tied
    model.proj = nn.Linear(32, 48)
    model.experts = nn.Parameter(torch.randn(48, 32).expand(4, -1, -1), requires_grad=False)  # a view: shared rows
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    old_experts, old_proj = model.experts, model.proj.weight.data_ptr()
    moved = to_huge_pages(model)
    assert moved >= (100 * 32 + 48 * 32 + 48) * 4
    assert model.head.weight is model.embed.weight
    assert model.experts is old_experts
    assert model.proj.weight.data_ptr() != old_proj
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    for p in (model.embed.weight, model.proj.weight, model.proj.bias):
        assert advised_for_huge_pages(p.data_ptr())
    assert not advised_for_huge_pages(model.experts.data_ptr())


def test_an_engine_on_cpu_reads_its_weights_from_huge_pages_where_its_kernels_gain_from_them(tiny_checkpoint):
    """The few-row kernel (bf16 on AMX or AVX512-BF16, or batch_invariant=False) and int8 weights read from huge pages;
    torch's `mv` and GEMM (fp32, batch-invariant) do not gain from them, and the engine does not pay for the
    copy there."""
    from engine.parallel.parallelize import few_rows
    folder, _ = tiny_checkpoint("llama")
    bf16_kernel = few_rows(torch.bfloat16, batch_invariant=True) > 0
    for options, huge in (({}, False), ({"batch_invariant": False}, True), ({"quantization": "int8"}, True),
                          ({"dtype": "bfloat16"}, bf16_kernel)):
        model = LLM(str(folder), **{"dtype": "float32", **options}).engine.executor.model
        assert all(advised_for_huge_pages(p.data_ptr()) == huge for p in model.parameters()), options


def test_weights_stay_where_they_are_when_free_memory_is_short_of_a_copy(monkeypatch, caplog):
    import engine.huge_pages as huge_pages
    monkeypatch.setattr(huge_pages, "_free_bytes", lambda: 1000)
    model = nn.Linear(64, 64)
    weight = model.weight
    assert to_huge_pages(model) == 0 and model.weight is weight
    assert "weights stay in small pages" in caplog.text
