"""A decode-only step's layers in one C++ call (engine/decode_layers.py): the same logits bit for bit as the
layer-by-layer path, taken only where the model and the step fit it, and bad arguments refused by name."""

from __future__ import annotations

import pytest
import torch

import engine.decode_layers
from engine import LLM, SamplingParams
from engine.decode_layers import DecodeLayers
from engine.kernels import cpu_ops
from tests.test_parity_tiny import capture_logits, prompts

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU kernels are not built here")

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def run(folder, one_call: bool, monkeypatch, **options) -> tuple[list[torch.Tensor], list[bool]]:
    """Each request's logits at every step, and per forward whether the one call computed it."""
    calls: list[bool] = []
    real_call = DecodeLayers.__call__

    def counting(self, *args):
        out = real_call(self, *args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(DecodeLayers, "__call__", counting)
    if not one_call:
        monkeypatch.setattr(DecodeLayers, "of", classmethod(lambda cls, model: None))
    llm = LLM(str(folder), max_num_batched_tokens=32, **options)
    captured = capture_logits(llm)
    outs = llm.generate(prompts(6, seed=3), GREEDY)
    llm.close()
    monkeypatch.undo()
    return [torch.stack(captured[o.request_id]) for o in outs], calls


@pytest.mark.parametrize("arch, options", [
    ("llama", dict(dtype="bfloat16")), ("llama", dict(dtype="bfloat16", quantization="int8")),
    ("llama", dict(dtype="bfloat16", quantization="int8", batch_invariant=False)),
    ("llama", dict(dtype="float32", batch_invariant=False)), ("llama", dict(dtype="float16")),
    ("qwen3", dict(dtype="bfloat16"))],
    ids=["bf16", "int8", "int8 not batch-invariant", "fp32 few-row", "fp16", "qwen3 q/k norms"])
def test_decode_steps_in_one_call_give_the_layer_by_layer_logits_bit_for_bit(arch, options, tiny_checkpoint,
                                                                            monkeypatch):
    """Six prompts decoded together (steps of 1 to 6 decode rows, and steps mixing decode rows with prefill
    chunks, which stay layer by layer): every logit equal with and without the one call."""
    folder, _ = tiny_checkpoint(arch)
    one_call, calls = run(folder, True, monkeypatch, **options)
    layer_by_layer, none = run(folder, False, monkeypatch, **options)
    assert any(calls) and not all(calls) and not none  # decode-only steps in one call, mixed steps not
    assert all(torch.equal(a, b) for a, b in zip(one_call, layer_by_layer))


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_models_it_does_not_fit_keep_the_layer_by_layer_path(arch, tiny_checkpoint):
    """MoE layers are not in the one call: the model says so once."""
    folder, _ = tiny_checkpoint(arch)
    llm = LLM(str(folder), dtype="bfloat16")
    llm.generate([[5, 6, 7]], GREEDY)
    assert llm.engine.executor.model._decode_layers is False
    llm.close()


def test_a_hook_a_bias_or_replaced_attention_keeps_the_layer_by_layer_path(tiny_checkpoint):
    """Tensor parallelism's all-reduce hooks and head map, a projection bias and context parallelism's attention
    are each reasons to refuse; so, per step, a hook set on the layers for that step alone (a layer-by-layer
    push)."""
    from engine.model import Transformer

    folder, _ = tiny_checkpoint("llama")
    llm = LLM(str(folder), dtype="bfloat16")
    model: Transformer = llm.engine.executor.model
    layers = DecodeLayers.of(model)
    assert layers is not None and layers.max_rows >= 1

    hook = model.layers[1].self_attn.o_proj.register_forward_hook(lambda *_: None)
    assert DecodeLayers.of(model) is None
    hook.remove()
    attn = model.layers[0].self_attn
    attn.qkv_proj.bias = torch.nn.Parameter(torch.zeros(attn.qkv_proj.out_features, dtype=torch.bfloat16))
    assert DecodeLayers.of(model) is None
    attn.qkv_proj.bias = None
    attn.attend = lambda *args: None
    assert DecodeLayers.of(model) is None
    attn.attend = engine.decode_layers.paged_attention
    attn.kv_head_map = torch.zeros(attn.num_heads, dtype=torch.long)
    assert DecodeLayers.of(model) is None
    attn.kv_head_map = None
    assert DecodeLayers.of(model) is not None

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
    assert DecodeLayers.of(model).batch_invariant is batch_invariant
    llm.close()


def test_the_op_refuses_lists_that_do_not_fit_its_layers():
    """Two layers need two v caches, five norm weights, four q/k norms or none and eight projections (and as
    many scales or none)."""
    x = torch.zeros(1, 8, dtype=torch.bfloat16)
    cache = torch.zeros(1, 4, 1, 8, dtype=torch.bfloat16)
    weights = [torch.ones(8, dtype=torch.bfloat16)] * 5
    projections = [torch.zeros(8, 8, dtype=torch.bfloat16)] * 7
    tables, lens = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="2 layers need 2 v caches, 5 norms, 4 q/k norms or none, 8 projections"):
        cpu_ops.ops().decode_layers(x, weights, [], projections, [], [cache, cache], [cache, cache], x, x,
                                    torch.zeros(1, dtype=torch.long), tables, lens, torch.zeros(1, dtype=torch.long),
                                    1.0, 1, 1e-5)
