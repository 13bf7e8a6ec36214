"""A step's layers in one C++ call (engine/step_layers.py): the same logits bit for bit as the layer-by-layer
path, for decode rows, prefill chunks (with and without a cached prefix) and steps mixing them, taken only where
the model and the step fit it, and bad arguments refused by name."""

from __future__ import annotations

import pytest
import torch

import engine.step_layers
from engine import LLM, SamplingParams
from engine.kernels import cpu_ops, cpu_prefill
from engine.step_layers import StepLayers
from tests.test_parity_tiny import capture_logits, prompts

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU kernels are not built here")

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def run(folder, one_call: bool, monkeypatch, prefill_kernel: bool = False,
        **options) -> tuple[list[torch.Tensor], list[tuple[str, bool]]]:
    """Each request's logits at every step, and per forward its kind (decode, prefill, mixed) and whether the
    one call computed it. Six prompts of 1 to 50 tokens in chunks of up to 32 rows (the longer ones in two, the
    second over a cached prefix), then two more that share the first 33-token prompt's cached blocks (the first
step a 1-token prompt's is mixed: its one row is a decode row; the second one of prefill chunks alone)."""
    calls: list[tuple[str, bool]] = []
    real_call = StepLayers.__call__

    def counting(self, x, rope, kv_cache, meta):
        out = real_call(self, x, rope, kv_cache, meta)
        kind = "decode" if not meta.prefills else "prefill" if not meta.num_decode else "mixed"
        calls.append((kind, out is not None))
        return out

    monkeypatch.setattr(StepLayers, "__call__", counting)
    monkeypatch.setattr(cpu_prefill, "_bf16_dot", lambda: prefill_kernel)  # the kernel for chunks, or torch's SDPA
    if not one_call:
        monkeypatch.setattr(StepLayers, "of", classmethod(lambda cls, model: None))
    llm = LLM(str(folder), max_num_batched_tokens=32, **options)
    captured = capture_logits(llm)
    first = prompts(6, seed=3)
    outs = llm.generate(first, GREEDY)
    outs += llm.generate([first[3] + [5, 6], first[3][:20] + [7] * 9], GREEDY)
    llm.close()
    monkeypatch.undo()
    return [torch.stack(captured[o.request_id]) for o in outs], calls


@pytest.mark.parametrize("arch, options", [
    ("llama", dict(dtype="bfloat16")), ("llama", dict(dtype="bfloat16", prefill_kernel=True)),
    ("llama", dict(dtype="bfloat16", quantization="int8")),
    ("llama", dict(dtype="bfloat16", quantization="int8", batch_invariant=False)),
    ("llama", dict(dtype="float32", batch_invariant=False)), ("llama", dict(dtype="float16")),
    ("qwen3", dict(dtype="bfloat16")), ("qwen3", dict(dtype="bfloat16", prefill_kernel=True))],
    ids=["bf16", "bf16 prefill kernel", "int8", "int8 not batch-invariant", "fp32 few-row", "fp16",
         "qwen3 q/k norms", "qwen3 prefill kernel"])
def test_steps_in_one_call_give_the_layer_by_layer_logits_bit_for_bit(arch, options, tiny_checkpoint, monkeypatch):
    """Steps of 1 to 6 decode rows, prefill chunks alone and beside decode rows, over a cached prefix or not: every
    logit equal with and without the one call, which takes every kind of step (float32: those of up to 8 rows,
    its few-row kernel's limit; the rest stay layer by layer)."""
    folder, _ = tiny_checkpoint(arch)
    one_call, calls = run(folder, True, monkeypatch, **options)
    layer_by_layer, none = run(folder, False, monkeypatch, **options)
    assert not any(taken for _, taken in none)
    if options["dtype"] == "float32":
        assert any(taken for _, taken in calls) and not all(taken for _, taken in calls)
    else:
        assert all(taken for _, taken in calls) and {kind for kind, _ in calls} == {"decode", "prefill", "mixed"}
    assert len(one_call) == len(layer_by_layer) == 8
    assert all(torch.equal(a, b) for a, b in zip(one_call, layer_by_layer))


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_models_it_does_not_fit_keep_the_layer_by_layer_path(arch, tiny_checkpoint):
    """MoE layers are not in the one call: the model says so once."""
    folder, _ = tiny_checkpoint(arch)
    llm = LLM(str(folder), dtype="bfloat16")
    llm.generate([[5, 6, 7]], GREEDY)
    assert llm.engine.executor.model._step_layers is False
    llm.close()


def test_a_hook_a_bias_or_replaced_attention_keeps_the_layer_by_layer_path(tiny_checkpoint):
    """Tensor parallelism's all-reduce hooks and head map, a projection bias and context parallelism's attention
    are each reasons to refuse; so, per step, a hook set on the layers for that step alone (a layer-by-layer
    push)."""
    from engine.model import Transformer

    folder, _ = tiny_checkpoint("llama")
    llm = LLM(str(folder), dtype="bfloat16")
    model: Transformer = llm.engine.executor.model
    layers = StepLayers.of(model)
    assert layers is not None and layers.max_rows >= 1

    hook = model.layers[1].self_attn.o_proj.register_forward_hook(lambda *_: None)
    assert StepLayers.of(model) is None
    hook.remove()
    attn = model.layers[0].self_attn
    attn.qkv_proj.bias = torch.nn.Parameter(torch.zeros(attn.qkv_proj.out_features, dtype=torch.bfloat16))
    assert StepLayers.of(model) is None
    attn.qkv_proj.bias = None
    attn.attend = lambda *args: None
    assert StepLayers.of(model) is None
    attn.attend = engine.step_layers.paged_attention
    attn.kv_head_map = torch.zeros(attn.num_heads, dtype=torch.long)
    assert StepLayers.of(model) is None
    attn.kv_head_map = None
    assert StepLayers.of(model) is not None

    from engine.attention import build_metadata
    x = torch.zeros(1, model.config.hidden_size, dtype=torch.bfloat16)
    rope = model.rope.tables(torch.tensor([3]), x.dtype)
    meta = build_metadata(slot_mapping=[3], decode_block_tables=[[0]], decode_context_lens=[4], prefill_chunks=[],
                          block_size=llm.engine.executor.block_size, device="cpu")
    kv_cache = llm.engine.executor.kv_cache
    assert layers(x, rope, kv_cache, meta) is not None
    hooks = [layer.register_forward_hook(lambda *_: None) for layer in model.layers]
    assert layers(x, rope, kv_cache, meta) is None
    for hook in hooks:
        hook.remove()
    llm.close()


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_int8_projections_take_the_engines_batch_invariance_into_the_one_call(batch_invariant, tiny_checkpoint):
    """Not batch-invariant, the int8 kernel may take AMX tiles from 2 rows (tests/test_kernels.py): the one call
    passes each projection's setting on, so its steps compute what the layers' own calls would."""
    from engine.quantize import Int8Linear

    folder, _ = tiny_checkpoint("llama")
    llm = LLM(str(folder), dtype="bfloat16", quantization="int8", batch_invariant=batch_invariant)
    model = llm.engine.executor.model
    assert {m.batch_invariant for m in model.modules() if isinstance(m, Int8Linear)} == {batch_invariant}
    assert StepLayers.of(model).batch_invariant is batch_invariant
    llm.close()


def test_the_op_refuses_lists_that_do_not_fit_its_layers_or_its_step():
    """Two layers need two v caches, five norm weights, four q/k norms or none and eight projections (and as
    many scales or none); a step's chunks, their rows inside the step and their blocks where they have a prefix;
    decode rows, their block tables."""
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    cache = torch.zeros(1, 4, 1, 8, dtype=torch.bfloat16)
    norms = [torch.ones(8, dtype=torch.bfloat16)] * 5
    projections = [torch.zeros(8, 8, dtype=torch.bfloat16)] * 8
    tables, lens = torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.int32)
    slots, heads = torch.zeros(2, dtype=torch.long), torch.zeros(1, dtype=torch.long)

    def call(projections=projections, tables=tables, spans=(), span_tables=(), span_masks=()):
        return cpu_ops.ops().step_layers(x, norms, [], projections, [], [cache, cache], [cache, cache], x, x, slots,
                                         tables, lens, heads, 1.0, 1, 1e-5, True, list(spans), list(span_tables),
                                         list(span_masks), False)

    with pytest.raises(RuntimeError, match="2 layers need 2 v caches, 5 norms, 4 q/k norms or none, 8 projections"):
        call(projections=projections[:7])
    with pytest.raises(RuntimeError, match="spans must hold .* got 2 numbers, 1 tables and 1 masks"):
        call(spans=(0, 2), span_tables=[None], span_masks=[None])
    with pytest.raises(RuntimeError, match=r"chunk 0 \(rows 1 \+ 2, context 2\) does not fit a step of 2 rows"):
        call(spans=(1, 2, 2), span_tables=[None], span_masks=[None])
    with pytest.raises(RuntimeError, match=r"chunk 0 \(rows 0 \+ 2, context 5\) .* has a prefix without its blocks"):
        call(spans=(0, 2, 5), span_tables=[None], span_masks=[None])
    with pytest.raises(RuntimeError, match="decode rows need their block tables and context lengths"):
        call(tables=None)
