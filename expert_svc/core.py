"""The expert side of attachments, on every rank of an expert instance; testable without gRPC.

Rank 0 hosts the rendezvous store (`AttachmentBook`): `attach(instance_id, ranks)` claims the next
attachment number k for the attached instance's rank count (`control.Store.claim`) and returns the group
name `attach-<k>`. Every rank runs an `ExpertRank`: it polls for new attachments, joins each group as
rank `ranks + its rank` and serves it on a thread of its own (`serve_attachment`) until the attached
instance goes away; its groups wait idle without a deadline (the attached side bounds its steps).
Tokens computed per MoE layer and local expert are counted per attachment (`load()` sums them).
Ranks 1.. of an instance run `follow` (a child process each) and publish their counts in the instance store
(`control.EXPERT_LOAD`).
"""

from __future__ import annotations

import datetime
import threading

import torch

from engine.model import build_model
from engine.parallel.context import ParallelConfig, connect
from engine.parallel.control import EXPERT_LOAD, READY, ExpertLoad, Ready, Store
from engine.parallel.expert_attach import ExpertShard, serve_attachment
from engine.parallel.groups import IDLE  # an attachment may sit idle for any time
from engine.parallel.launcher import plan_group, receive_plan
from engine.weights import load_checkpoint

STORE_TIMEOUT = datetime.timedelta(seconds=60)
PUBLISH_S = 0.5  # how often follower ranks publish their token counts for rank 0's status
ATTACH = "attach"  # the claims' family: groups `attach-<k>`


def group_name(attachment: int) -> str:
    return f"{ATTACH}-{attachment}"


class AttachmentBook:
    """Rank 0: the rendezvous store and which instance holds which attachment."""

    def __init__(self, host: str) -> None:
        self.store = Store.host(host, 0, STORE_TIMEOUT)
        self.address = self.store.address
        self.by_instance: dict[str, int] = {}
        self._lock = threading.Lock()

    def attach(self, instance_id: str, ranks: int) -> str:
        if ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {ranks}")
        with self._lock:
            attachment = self.by_instance[instance_id] = self.store.claim(ATTACH, ranks)
        return group_name(attachment)

    def detach(self, instance_id: str) -> bool:
        with self._lock:
            return self.by_instance.pop(instance_id, None) is not None


class ExpertRank:
    """One expert rank: joins every attachment announced on `address` and serves it."""

    def __init__(self, shard: ExpertShard, rank: int, ranks: int, address: str, host: str = "") -> None:
        """`host`: the address this rank's attachment groups bind."""
        self.shard, self.rank, self.ranks, self.address, self.host = shard, rank, ranks, address, host
        self.active: dict[int, torch.Tensor] = {}  # attachment -> tokens [layers, local experts], while served
        self._finished = torch.zeros(len(shard.weights), shard.weights[0][0].shape[0], dtype=torch.long)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._listen, name="expert-attachments", daemon=True)
        self.thread.start()

    def load(self) -> torch.Tensor:
        """Tokens each local expert computed, per MoE layer, over every attachment so far: [layers, local]."""
        with self._lock:
            return self._finished + sum(self.active.values(), torch.zeros_like(self._finished))

    def stop(self) -> None:
        self._stop.set()
        self.thread.join()

    def _listen(self) -> None:
        try:
            self.store = Store.connect(self.address, STORE_TIMEOUT)
        except RuntimeError:
            return  # the rendezvous store is gone: the instance is stopping
        for attachment, attention_ranks in self.store.claims(ATTACH, self._stop):
            threading.Thread(target=self._serve, args=(attachment, attention_ranks), daemon=True,
                             name=f"expert-{group_name(attachment)}").start()  # joining blocks: not here

    def _serve(self, attachment: int, attention_ranks: int) -> None:
        try:
            group = self.store.join(group_name(attachment), attention_ranks + self.rank, attention_ranks + self.ranks,
                                    timeout=STORE_TIMEOUT, idle_timeout=IDLE, host=self.host)
        except RuntimeError:
            return  # the attaching instance never joined
        tokens = torch.zeros_like(self._finished)
        with self._lock:
            self.active[attachment] = tokens
        try:
            serve_attachment(self.shard, group, attention_ranks, tokens)
        except RuntimeError:
            pass  # the attached instance left (or failed): its steps are over
        finally:
            with self._lock:
                self._finished += self.active.pop(attachment)


def follow(rank: int, store: Store, *, host: str, parallel: ParallelConfig, timeout_s: float, source: str,
           dtype: str, address: str) -> None:
    """An expert follower rank: its share of the experts, served to every attachment until the instance stops."""
    checkpoint = load_checkpoint(source, getattr(torch, dtype))
    store.put(READY.key(rank), Ready(rank))
    connect(store.raw, rank, parallel, timeout=datetime.timedelta(seconds=timeout_s), host=host)
    plans = plan_group(store.raw, rank, parallel.world_size, host=host)
    expert = ExpertRank(ExpertShard(build_model(checkpoint.config, checkpoint.weights, "cpu"), rank, parallel.ep),
                        rank, parallel.ep, address, host)
    stopped = threading.Event()

    def publish() -> None:
        while not stopped.wait(PUBLISH_S):
            store.put(EXPERT_LOAD.key(rank), ExpertLoad(tuple(map(tuple, expert.load().tolist()))))

    threading.Thread(target=publish, daemon=True).start()
    while receive_plan(plans) is not None:  # rank 0 sends None when the instance stops
        pass
    stopped.set()
    expert.stop()
