"""Weight-only int8 (`quantization="int8"`): the engine computes what transformers computes with the same
weights rounded to int8 and back (fp32 logits close, greedy tokens identical), on tiny checkpoints and on
SmolLM2; both of its matmul paths agree; TP=2 gives what one rank gives; a mesh started with
`--quantization int8` serves the int8 engine's tokens and log-probabilities; a bad value is refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from engine import LLM, EngineConfig, SamplingParams
from engine.quantize import Int8Linear, kernel_rows, quantize_rows
from mesh.rpc import channel
from mesh.settings import DecodeSettings, load
from protos.convert import sampling_message
from protos.infermesh.v1 import inference_pb2, inference_pb2_grpc
from tests.conftest import TINY_VOCAB
from tests.test_mesh_processes import start_mesh, started, stop_mesh
from tests.test_parallel_parity import run_with_logits
from tests.test_parity_tiny import capture_logits, hf_greedy, prompts

HF_QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def rounded_to_int8(hf_model):
    """A copy of a transformers model whose projections and LM head hold int8-rounded weights (row scales)."""
    model = copy.deepcopy(hf_model)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.split(".")[-1] in HF_QUANTIZED and "experts" not in name:
            weight, scale = quantize_rows(module.weight.detach())
            module.weight = nn.Parameter(weight.float() * scale[:, None], requires_grad=False)
    return model


def test_rows_round_to_int8_within_half_a_step():
    w = torch.randn(48, 80) * torch.logspace(-3, 1, 48)[:, None]  # rows of very different magnitudes
    w[5] = 0.0  # an all-zero row gets a positive scale, not a division by zero
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.shape == (48,) and bool((scale > 0).all())
    assert int(q.abs().amax(dim=1)[torch.arange(48) != 5].min()) == 127  # each row's largest entry maps to ±127
    assert bool(((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-12).all())


@pytest.mark.parametrize("batch_invariant", [True, False], ids=["batch-invariant", "not batch-invariant"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_matmul_paths_compute_the_dequantized_linear(dtype, batch_invariant):
    torch.manual_seed(0)
    linear = nn.Linear(96, 40, bias=True).to(dtype)
    layer = Int8Linear.from_linear(linear)
    layer.batch_invariant = batch_invariant  # not: bf16 from 2 rows on AMX tiles, where the CPU has them
    reference = nn.functional.linear  # with the dequantized weight, in float32
    most = kernel_rows(dtype)
    for rows in (1, 2, most, most + 1):  # the int8 kernel, then the converted weight
        x = torch.randn(rows, 96).to(dtype)
        expected = reference(x.float(), layer.dequantized(), linear.bias.float())
        tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)
        torch.testing.assert_close(layer(x).float(), expected, **tolerance)
        assert layer(x).dtype == dtype


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mixtral"])
def test_int8_engine_equals_transformers_with_int8_rounded_weights(arch, tiny_checkpoint):
    folder, hf = tiny_checkpoint(arch)
    # prefill in chunks of 16 tokens: each through the int8 kernel, the first two sampling no row
    llm = LLM(str(folder), dtype="float32", quantization="int8", max_num_batched_tokens=16)
    layer = llm.engine.executor.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.int8  # really quantized, not a float copy
    assert llm.engine.executor.model.lm_head.weight.dtype == torch.int8
    captured = capture_logits(llm)
    prompt = prompts(4)[3]  # 33 tokens
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    ref_tokens, ref_logits = hf_greedy(rounded_to_int8(hf), prompt, steps=16)
    assert out.token_ids == ref_tokens
    torch.testing.assert_close(torch.stack(captured[out.request_id]), ref_logits.float(), atol=1e-4, rtol=0)
    _, unrounded_logits = hf_greedy(hf, prompt, steps=16)
    assert (unrounded_logits - ref_logits).abs().max() > 1e-3  # an engine that skipped the rounding fails above
    llm.close()


@pytest.mark.slow
def test_int8_smollm2_equals_transformers_with_int8_rounded_weights(smollm2_path, smollm2_hf):
    llm = LLM(str(smollm2_path), dtype="float32", quantization="int8")
    captured = capture_logits(llm)
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=7, temperature=0.0))  # the 8th is end of turn
    ref_tokens, ref_logits = hf_greedy(rounded_to_int8(smollm2_hf), prompt, steps=len(out.token_ids))
    assert out.token_ids == ref_tokens
    assert "Paris" in out.text
    torch.testing.assert_close(torch.stack(captured[out.request_id]), ref_logits.float(), atol=2e-3, rtol=0)
    llm.close()


def test_tensor_parallel_int8_equals_one_rank_int8(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")
    single = run_with_logits(LLM(str(folder), dtype="float32", block_size=8, quantization="int8"))
    tp = LLM(str(folder), dtype="float32", block_size=8, quantization="int8", tp=2)
    try:
        parallel = run_with_logits(tp)
    finally:
        tp.close()
    for (tokens, logits, cached), (p_tokens, p_logits, p_cached) in zip(single, parallel):
        assert tokens == p_tokens and cached == p_cached
        torch.testing.assert_close(p_logits, logits, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_a_mesh_started_with_int8_serves_the_int8_engines_tokens_and_logprobs(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in (9, 60)]  # local, disaggregated
    proc, address = start_mesh(str(folder), "--quantization", "int8", "--prefill-cp", "2", "--decode-tp", "2",
                               "--local-prefill-max-tokens", "20")
    pids = [i["pid"] for i in started(address)]
    try:
        stub = inference_pb2_grpc.InferenceStub(channel(address))
        served = []
        for prompt in prompts:
            deltas = [r.delta for r in stub.Generate(inference_pb2.GenerateRequest(
                token_ids=inference_pb2.TokenIds(ids=prompt), sampling=sampling_message(params)), timeout=120)
                if r.HasField("delta")]
            served.append(([t for d in deltas for t in d.token_ids],
                           [lp.chosen.logprob for d in deltas for lp in d.logprobs]))
    finally:
        stop_mesh(proc, pids)
    int8 = LLM(str(folder), dtype="float32", quantization="int8").generate(prompts, params)
    plain = LLM(str(folder), dtype="float32").generate(prompts, params)
    for (tokens, logprobs), q in zip(served, int8):
        assert tokens == q.token_ids
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor([lp.logprob for lp in q.logprobs]),
                                   atol=1e-4, rtol=0)
    unrounded = torch.tensor([lp.logprob for p in plain for lp in p.logprobs])
    assert (torch.tensor([lp for _, lps in served for lp in lps]) - unrounded).abs().max() > 1e-3  # int8, not fp


def test_an_unknown_quantization_is_refused_by_name():
    with pytest.raises(ValueError, match="quantization must be one of none, int8, got 'int4'"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="quantization must be one of none, int8, got 'fp8'"):
        load(DecodeSettings, {}, {"INFERMESH_QUANTIZATION": "fp8"})
