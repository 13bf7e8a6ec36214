"""The engine core: requests in, per-step token and text deltas out.

`EngineCore.step()` is the loop body: schedule -> run the model -> sample ->
append tokens, detokenize, check stop conditions -> report. It is single-threaded;
a service drives it from one thread and feeds requests in between steps.

Requests are validated on `add_request` (`RequestError` names the field and the
limit). A finished or aborted request frees its KV blocks at once. Prompts whose
KV comes from or goes to another instance (reserve / join / recompute, KV sinks)
go through `engine.handoff`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import torch

from engine.block_manager import BlockManager
from engine.engine_config import EngineConfig
from engine.errors import KVCacheFull, NoReservation, RequestError
from engine.handoff import KVHandoff, KVSink
from engine.kv_cache import num_blocks_for
from engine.kv_tier import KVPool, KVTier
from engine.limits import check_prompt
from engine.parallel.context import ParallelConfig, connect
from engine.parallel.executor import ParallelExecutor
from engine.parallel.launcher import Rendezvous
from engine.parallel.parallelize import build_runner
from engine.parallel.tp import max_kv_heads_per_rank
from engine.sampler import sample
from engine.sampling_params import SamplingParams, TokenLogprobs
from engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from engine.sequence import FinishReason, Sequence, SequenceStatus
from engine.step_plan import plan_step
from engine.tokenizer import IncrementalDetokenizer
from engine.weights import Checkpoint


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one step added to one request."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finish_reason: FinishReason | None
    new_logprobs: list[TokenLogprobs]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCore:
    def __init__(self, checkpoint: Checkpoint, config: EngineConfig = EngineConfig(),
                 parallel: ParallelConfig = ParallelConfig(), follower_hook=None,
                 rendezvous: Rendezvous = Rendezvous(), kv_memory=None,
                 kv_pool: Callable[[list], KVPool] | None = None) -> None:
        """`follower_hook`: a `control.Call` of `(rank, store, runner, host) -> before_step(plan)`, run by ranks
        1..N-1 of a parallel instance once their model is built (a service uses it to accept pushed KV on
        every rank). `rendezvous`: where the ranks meet, which of them run here, the address rank 0 binds.
        `kv_memory(shape, dtype) -> zeroed tensor`: where every rank's KV cache lives (an importable function;
        default: private memory on the configured device). `kv_pool(kv_cache) -> KVPool`: a tier below the
        cache that full blocks are stored to and prompts' blocks loaded from (`engine.kv_tier`; one rank)."""
        self.config, self.parallel = config, parallel
        self.model_config = cfg = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        parallel.check(cfg)
        kv_heads = max_kv_heads_per_rank(cfg, parallel.tp)
        num_blocks = config.num_kv_blocks or num_blocks_for(cfg, config.block_size, config.torch_dtype,
                                                            config.kv_cache_bytes, kv_heads)
        layout = dict(dtype=config.torch_dtype, device=config.device, block_size=config.block_size,
                      num_blocks=num_blocks, quantization=config.quantization, kv_memory=kv_memory,
                      batch_invariant=config.batch_invariant)
        if parallel.world_size == 1:
            self.executor = build_runner(checkpoint, connect(None, 0, parallel, host=rendezvous.host), **layout)
        else:
            self.executor = ParallelExecutor(checkpoint, parallel, follower_hook=follower_hook, rendezvous=rendezvous,
                                             **layout)
        num_blocks *= parallel.cp  # each CP rank holds its stripe of the instance's blocks (engine.kv_cache)
        self.blocks = BlockManager(num_blocks, config.block_size, pools=parallel.cp)
        self.recomputed_requests = 0  # reserved requests prefilled here after all (their KV did not come)
        self.prompt_tokens_computed = 0  # prompt tokens this engine ran through the model (not found cached)
        if kv_pool is not None and parallel.world_size > 1:
            raise ValueError(f"a KV pool serves engines of one rank, got {parallel}")
        self.kv_tier = None if kv_pool is None else KVTier(kv_pool(self.kv_cache), self.blocks)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens),
            self.blocks,
        )
        self.max_model_len = min(cfg.max_model_len, config.max_model_len or cfg.max_model_len,
                                 num_blocks * config.block_size)
        self.eos_token_ids = frozenset(cfg.eos_token_ids) | frozenset(self.tokenizer.eos_token_ids)
        self._sequences: dict[str, Sequence] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._emitted: dict[str, int] = {}
        self._arrivals = itertools.count()
        self._generator = torch.Generator()
        if config.seed is not None:
            self._generator.manual_seed(config.seed)
        else:
            self._generator.seed()
        self._seeded: dict[str, torch.Generator] = {}
        self.handoff = KVHandoff(self.scheduler, self.blocks)
        self.last_cp_choices: dict = {}  # request id -> CPChoice of its prefill chunk in the last step (cp > 1)

    # ---- requests -----------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    kv_sink: KVSink | None = None, resume_token_ids: tuple[int, ...] = ()) -> Sequence:
        """Queue a request. With `kv_sink`, its prompt's KV is pushed there layer by layer as it completes.

        `resume_token_ids`: tokens the request already generated on another instance (a migration). It
        goes on after them exactly as if it had generated them here: max_tokens counts them, a seeded
        generator is advanced past their draws, and their text (with any stop-string text held back) is
        rebuilt, so the next delta starts where the streamed text ended."""
        if kv_sink is not None and self.parallel.tp > 1:
            raise ValueError("pushing KV out of a tensor-parallel instance is not supported (prefill uses cp)")
        seq = self._new_sequence(request_id, prompt_token_ids, params)
        try:
            for i, token in enumerate(resume_token_ids):
                self._replay(seq, token, i)
        except RequestError:
            self._forget(request_id)
            raise
        if kv_sink is not None:
            self.handoff.sinks[request_id] = kv_sink
        self.scheduler.add(seq)
        return seq

    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Sequence:
        """Hold KV blocks for a prompt that another instance prefills; `join` or `recompute` it next.
        The sequence's `block_table` says where the KV goes; `num_cached_prompt_tokens` is already here."""
        seq = self._new_sequence(request_id, prompt_token_ids, params)
        try:
            self.handoff.reserve(seq)
        except KVCacheFull:
            self._forget(request_id)
            raise
        return seq

    def join(self, request_id: str, first_token: int, logprobs: TokenLogprobs | None = None) -> StepOutput:
        """The reserved request's prompt KV is in place and `first_token` was drawn by the prefill instance
        (with its `logprobs`, when the request asked for them)."""
        seq = self._reserved(request_id)
        self.handoff.join(seq)
        seeded = self._seeded.get(request_id)
        if seeded is not None and not seq.params.greedy:
            torch.rand((), generator=seeded)  # the prefill instance drew the first token: stay in step with one engine
        return self._append(seq, first_token, logprobs)

    def recompute(self, request_id: str) -> None:
        """The KV transfer failed: prefill the reserved request here instead."""
        self.handoff.recompute(self._reserved(request_id))
        self.recomputed_requests += 1

    @property
    def kv_cache(self):
        """This rank's KV cache, per layer (k, v) [blocks, block_size, kv_heads, head_dim], for KV receivers."""
        return self.executor.kv_cache

    def _reserved(self, request_id: str) -> Sequence:
        seq = self._sequences.get(request_id)
        if seq is None or seq.status is not SequenceStatus.RESERVED:
            raise NoReservation(f"request_id {request_id!r} has no reservation")
        return seq

    def _new_sequence(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Sequence:
        if request_id in self._sequences:
            raise RequestError(f"request_id {request_id!r} is already running")
        check_prompt(prompt_token_ids, self.model_config.vocab_size, self.max_model_len)
        seq = Sequence(request_id, list(prompt_token_ids), params, next(self._arrivals))
        self._sequences[request_id] = seq
        self._detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer)
        self._emitted[request_id] = 0
        if params.seed is not None:
            self._seeded[request_id] = torch.Generator().manual_seed(params.seed)
        return seq

    def abort(self, request_id: str) -> bool:
        seq = self._sequences.get(request_id)
        if seq is None:
            return False
        self.handoff.aborting(seq)
        self.scheduler.finish(seq, FinishReason.ABORT)
        self._forget(request_id)
        return True

    def close(self) -> None:
        """Stop the follower ranks of a parallel instance; safe to call twice."""
        if isinstance(self.executor, ParallelExecutor):
            self.executor.close()

    def load(self) -> dict[str, int]:
        """Requests running and waiting, KV blocks used and in all: plain counts, readable from any thread."""
        return {"requests_running": len(self.scheduler.running), "requests_waiting": len(self.scheduler.waiting),
                "kv_blocks_used": self.blocks.num_used_blocks, "kv_blocks_total": self.blocks.num_blocks}

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop -----------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        if self.kv_tier is not None:
            self.kv_tier.before_schedule(self.scheduler.waiting)
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        self.prompt_tokens_computed += sum(min(c.end, c.seq.num_prompt_tokens) - c.start for c in chunks
                                           if c.start < c.seq.num_prompt_tokens)  # decode rows: skipped
        sampling, logits = self.run_model(chunks)
        self.scheduler.update(chunks)
        if self.kv_tier is not None:
            self.kv_tier.after_update(c.seq for c in chunks)
        if not sampling:
            return []
        seqs = [c.seq for c in sampling]
        tokens, logprobs = sample(
            logits, [s.params for s in seqs], [self._seeded.get(s.request_id) for s in seqs], self._generator
        )
        return [self._append(seq, token, lp) for seq, token, lp in zip(seqs, tokens, logprobs)]

    def run_model(self, chunks: list[ScheduledChunk]) -> tuple[list[ScheduledChunk], torch.Tensor]:
        """The sampling chunks and their logits [len(sampling), V], row for row."""
        plan, ordered = plan_step(chunks, self.config.block_size, self.handoff.take_ended(),
                                  frozenset(self.handoff.sinks))
        logits = self.executor.execute(plan, self.handoff.pusher(plan, self.kv_cache, self.executor.kv_stripe))
        choices = self.executor.last_choices
        self.last_cp_choices = {c.seq.request_id: choice for c, choice in zip(
            (c for c in ordered if c.num_tokens > 1), choices)}
        return [ordered[i] for i in plan.sampling_indices], logits

    def _replay(self, seq: Sequence, token: int, index: int) -> None:
        """Token `index` of a resumed request, as its draw would have left this engine."""
        if not 0 <= token < self.model_config.vocab_size:
            raise RequestError(f"resume_token_ids[{index}]={token} is out of range [0, {self.model_config.vocab_size})",
                               param="resume_token_ids")
        seeded = self._seeded.get(seq.request_id)
        if seeded is not None and not seq.params.greedy:
            torch.rand((), generator=seeded)  # the draw that picked it
        if self._advance(seq, token, None).finished:
            raise RequestError(f"resume_token_ids[{index}] ends the request already (a stop or its length)",
                               param="resume_token_ids")

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprobs | None) -> StepOutput:
        out = self._advance(seq, token, logprob)
        if out.finished:
            self.scheduler.finish(seq, out.finish_reason)
            self._forget(seq.request_id)
        return out

    def _advance(self, seq: Sequence, token: int, logprob: TokenLogprobs | None) -> StepOutput:
        """Append `token`, detokenize, check the stop conditions; the delta of text now safe to stream."""
        params = seq.params
        seq.token_ids.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        reason = None
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            reason = FinishReason.STOP
        else:
            before = len(seq.text)
            seq.text += self._detokenizers[seq.request_id].push(token)
            cut = _find_stop(seq.text, params.stop, before)
            if cut is not None:
                seq.text, reason = seq.text[:cut], FinishReason.STOP
        if reason is None and (len(seq.token_ids) - seq.num_prompt_tokens >= params.max_tokens
                               or seq.num_tokens >= self.max_model_len):
            reason = FinishReason.LENGTH
        emitted = self._emitted[seq.request_id]
        hold = 0 if reason else max((len(s) - 1 for s in params.stop), default=0)  # a stop string may be forming
        upto = max(emitted, len(seq.text) - hold)
        self._emitted[seq.request_id] = upto
        return StepOutput(seq.request_id, [token], seq.text[emitted:upto], reason, [logprob] if logprob else [])

    def _forget(self, request_id: str) -> None:
        if self.kv_tier is not None:
            self.kv_tier.forget(request_id)
        for table in (self._sequences, self._detokenizers, self._emitted, self._seeded, self.handoff.sinks):
            table.pop(request_id, None)


def _find_stop(text: str, stops: tuple[str, ...], new_from: int) -> int | None:
    """Index where the earliest stop string starts, looking only at matches touching new text."""
    hits = [i for s in stops if (i := text.find(s, max(0, new_from - len(s) + 1))) != -1]
    return min(hits) if hits else None
