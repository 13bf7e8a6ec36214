"""The engine's side of moving a prompt's KV between instances.

In: a decode instance `reserve`s blocks for a prompt another instance prefills,
then `join`s it once the KV arrived, or `recompute`s it when the transfer
failed. Out: a prefill instance gives a request a `KVSink`, which receives the
prompt's KV layer by layer during the step that completes the prompt.

`KVHandoff` keeps what the step plan needs from this: the reservations ended
since the last step (ranks that accept pushed KV stop writing into their blocks
before the step may reuse them) and the requests whose KV is pushed; it builds
the per-layer hook that feeds the sinks. Single-threaded, like the core.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from engine.block_manager import BlockManager
from engine.errors import KVCacheFull
from engine.kv_cache import KVStripe
from engine.scheduler import Scheduler
from engine.sequence import FinishReason, Sequence, SequenceStatus
from engine.step_plan import StepPlan


class KVSink(Protocol):
    """Takes a request's prompt KV layer by layer, during the step that completes the prompt.

    `push_layer` may go on reading the request's blocks after it returns, until it returns for the step's
    last layer, not after: the blocks may be reused once the request finishes. On a context-parallel
    instance this sink gets rank 0's share; the other ranks push theirs from their follower hook, driven by
    `StepPlan.pushes`."""

    def push_layer(self, layer: int, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: tuple[int, ...],
                   stripe: KVStripe) -> None:
        """`block_table`: the instance's block ids; `stripe`: which of them this rank's cache holds, and where."""


class KVHandoff:
    def __init__(self, scheduler: Scheduler, blocks: BlockManager) -> None:
        self.scheduler, self.blocks = scheduler, blocks
        self.sinks: dict[str, KVSink] = {}  # request id -> where its prompt KV goes
        self._ended: list[str] = []

    def reserve(self, seq: Sequence) -> None:
        """Hold blocks for the whole prompt of `seq` (a cached prefix is reused); raises KVCacheFull."""
        if not self.scheduler.reserve(seq):
            need = self.blocks.blocks_for(seq.num_prompt_tokens)
            raise KVCacheFull(f"KV cache has {self.blocks.num_free_blocks} free blocks; the prompt needs {need}")

    def join(self, seq: Sequence) -> None:
        """The reserved prompt's KV is in its blocks: it decodes from the next step on."""
        self._ended.append(seq.request_id)
        self.scheduler.join(seq)

    def recompute(self, seq: Sequence) -> None:
        """The transfer failed: free the reserved blocks and queue the prompt for prefill here."""
        self._ended.append(seq.request_id)
        self.scheduler.finish(seq, FinishReason.ABORT)
        seq.finish_reason, seq.num_cached_prompt_tokens = None, 0
        self.scheduler.add(seq)

    def aborting(self, seq: Sequence) -> None:
        """Called before `seq` is finished early: a reservation ends with it."""
        if seq.status is SequenceStatus.RESERVED:
            self._ended.append(seq.request_id)

    def take_ended(self) -> tuple[str, ...]:
        """The reservations ended since the last call (for the next step plan)."""
        ended, self._ended = tuple(self._ended), []
        return ended

    def pusher(self, plan: StepPlan, kv_cache, stripe: KVStripe) -> Callable[[int], None] | None:
        """The `on_layer` hook that feeds this step's sinks, or None when it pushes nothing."""
        pushing = [(self.sinks[rid], plan.chunks[i].block_table) for i, rid in plan.pushes]
        if not pushing:
            return None

        def on_layer(layer: int) -> None:  # the layer's KV of these prompts is final: push it
            for sink, table in pushing:
                sink.push_layer(layer, *kv_cache[layer], table, stripe)

        return on_layer
