"""The engine against transformers on tiny random checkpoints (fp32): logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_ARCHS, TINY_VOCAB

from engine import LLM, SamplingParams

STEPS = 32
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 7, 16, 33, 50, 5, 64, 12][:n]
    return [torch.randint(3, TINY_VOCAB, (length,), generator=g).tolist() for length in lengths]


def hf_greedy(model, prompt: list[int], steps: int = STEPS):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits)  # [steps, V]


def capture_logits(llm: LLM) -> dict[str, list[torch.Tensor]]:
    """From now on, every sampled row's logits, by request id, in step order."""
    captured: dict[str, list[torch.Tensor]] = {}
    run = llm.engine.run_model

    def capturing_run(chunks):
        sampling, logits = run(chunks)
        for chunk, row in zip(sampling, logits):
            captured.setdefault(chunk.seq.request_id, []).append(row.clone())
        return sampling, logits

    llm.engine.run_model = capturing_run
    return captured


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_logits_match_transformers_at_prefill_and_every_decode_step(arch, tiny_checkpoint):
    folder, hf = tiny_checkpoint(arch)
    llm = LLM(str(folder), dtype="float32")
    captured = capture_logits(llm)
    prompt = prompts(4)[3]
    (out,) = llm.generate([prompt], GREEDY)
    ref_tokens, ref_logits = hf_greedy(hf, prompt)
    ours = torch.stack(captured[out.request_id])  # [steps, V]
    assert out.token_ids == ref_tokens
    assert ours.shape == ref_logits.shape
    torch.testing.assert_close(ours, ref_logits.float(), atol=1e-4, rtol=0)


def test_decode_through_the_few_row_kernel_matches_transformers_and_is_invariant_up_to_8_rows(tiny_checkpoint):
    """`batch_invariant=False`: decode steps of 1 to 8 rows multiply through the C++ few-row kernel. Logits
    still match transformers at every step, and 8 prompts decoded together get the tokens each gets alone."""
    folder, hf = tiny_checkpoint("llama")
    llm = LLM(str(folder), dtype="float32", batch_invariant=False)
    assert {m.few_rows for m in llm.engine.executor.model.modules() if hasattr(m, "few_rows")} == {8}
    captured = capture_logits(llm)
    prompt = prompts(4)[3]
    (out,) = llm.generate([prompt], GREEDY)
    ref_tokens, ref_logits = hf_greedy(hf, prompt)
    assert out.token_ids == ref_tokens
    torch.testing.assert_close(torch.stack(captured[out.request_id]), ref_logits.float(), atol=1e-4, rtol=0)
    batch = prompts(8, seed=1)
    together = llm.generate(batch, GREEDY)
    for p, t in zip(batch, together):
        assert t.token_ids == llm.generate([p], GREEDY)[0].token_ids == hf_greedy(hf, p)[0]


def test_bf16_rows_through_the_few_row_kernel_get_the_same_logits_bit_for_bit_in_any_company(tiny_checkpoint):
    """bf16, every projection and the LM head through the few-row kernel (up to 64 rows, so 40 here: on AMX in
    three tiles of x, on AVX512-BF16 in ten groups of 4 rows, elsewhere in groups of 2 or 8): one-token
    prompts keep every step within the kernel's rows, and norms, RoPE and paged attention are per row, so each
    prompt's logits at every step are bit for bit the ones it gets alone."""
    from engine.parallel.parallelize import few_rows
    folder, _ = tiny_checkpoint("llama")
    llm = LLM(str(folder), dtype="bfloat16", batch_invariant=False)
    n = min(40, few_rows(torch.bfloat16, batch_invariant=False))
    assert n >= 8
    captured = capture_logits(llm)
    tokens = torch.randperm(TINY_VOCAB - 3, generator=torch.Generator().manual_seed(4))[:n] + 3
    batch = [[t] for t in tokens.tolist()]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    together = llm.generate(batch, params)
    logits_together = [torch.stack(captured.pop(out.request_id)) for out in together]  # [16, V] each
    for prompt, out, logits in zip(batch, together, logits_together):
        (alone,) = llm.generate([prompt], params)
        assert alone.token_ids == out.token_ids
        assert torch.equal(torch.stack(captured.pop(alone.request_id)), logits)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_continuous_batch_of_mixed_lengths_equals_one_at_a_time_and_transformers(arch, tiny_checkpoint):
    folder, hf = tiny_checkpoint(arch)
    batch = prompts(8, seed=1)
    # a small token budget forces chunked prefill mixed with decodes in the same steps
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=24)
    together = llm.generate(batch, GREEDY)
    alone = [llm.generate([p], GREEDY)[0] for p in batch]
    for prompt, a, b in zip(batch, together, alone):
        assert a.token_ids == b.token_ids
        assert a.token_ids == hf_greedy(hf, prompt)[0]


def test_preempted_requests_recompute_to_the_same_tokens(tiny_checkpoint):
    folder, hf = tiny_checkpoint("llama")
    batch = prompts(6, seed=2)
    # 12 blocks of 8 tokens cannot hold six sequences growing to ~80 tokens: preemption must happen
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=12, block_size=8)
    outs = llm.generate(batch, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(batch, outs):
        assert out.token_ids == hf_greedy(hf, prompt)[0]
    assert llm.engine.blocks.num_used_blocks == 0


def test_prefix_cache_reuse_gives_the_same_tokens(tiny_checkpoint):
    folder, hf = tiny_checkpoint("qwen3")
    base = prompts(7, seed=3)[6]  # 64 tokens
    llm = LLM(str(folder), dtype="float32", block_size=8)
    first = llm.generate([base], GREEDY)[0]
    follow_up = base + first.token_ids + [5, 6, 7]  # a second turn extends the first
    second = llm.generate([follow_up], GREEDY)[0]
    assert second.cached_prompt_tokens >= 64
    assert second.token_ids == hf_greedy(hf, follow_up)[0]


def test_sharded_safetensors_with_an_index_load_the_same_model(tiny_checkpoint, tmp_path):
    folder, hf = tiny_checkpoint("mixtral")
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    (tmp_path / "tokenizer.json").write_text((folder / "tokenizer.json").read_text())
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    prompt = prompts(3)[2]
    (out,) = LLM(str(tmp_path), dtype="float32").generate([prompt], GREEDY)
    assert out.token_ids == hf_greedy(hf, prompt)[0]


@pytest.mark.parametrize("shape", [(576, 960), (1536, 576), (64, 48)])
def test_a_single_bf16_row_is_multiplied_bit_for_bit_as_in_a_batch(shape):
    """Batch-1 decode multiplies its one row as a matrix-vector product (faster on CPU): the row's result
    must be what a batched step gives it, bit for bit, so a sequence's tokens never depend on its company."""
    from engine.model import Linear

    g = torch.Generator().manual_seed(0)
    linear = Linear(*shape, bias=False).to(torch.bfloat16)
    linear.weight.data = torch.randn(shape[1], shape[0], generator=g).bfloat16()
    rows = torch.randn(5, shape[0], generator=g).bfloat16()
    alone = torch.cat([linear(rows[i:i + 1]) for i in range(5)])
    assert torch.equal(alone, linear(rows)) and torch.equal(alone, torch.nn.functional.linear(rows, linear.weight))
