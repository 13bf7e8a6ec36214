"""The gRPC shell of an expert instance: Expert (Attach, Detach) and an Admin status that adds the placement,
tokens per expert and layer, and the attached instances; the shared lifecycle, health and registry
record (role `expert`, with its rendezvous) of `mesh.instance`.

    python -m expert_svc.server --port 0 --model PATH --ep 2 [--registry ...]

Its EP ranks (this process and ep-1 children) each hold a contiguous share of every MoE layer's
experts. Attach: the caller gets a group name on the rendezvous store; every rank of the caller joins
it, then the expert ranks, and every MoE layer of every step exchanges tokens over it. A model other
than this instance's -> FAILED_PRECONDITION; ranks < 1 -> INVALID_ARGUMENT; draining -> UNAVAILABLE.
Its in-flight work is its attachments: a drain waits for the attached instances to leave.
"""

from __future__ import annotations

import torch
from opentelemetry.metrics import Observation

from engine.errors import RequestError, Unsupported
from engine.model import build_model
from engine.parallel.context import ParallelConfig
from engine.parallel.control import EXPERT_LOAD, Call
from engine.parallel.expert_attach import ExpertShard
from engine.parallel.launcher import RankGroup, Rendezvous
from engine.threads import pin_cpus
from engine.weights import load_checkpoint
from expert_svc.core import AttachmentBook, ExpertRank, follow
from mesh.instance import Instance
from mesh.registry import Registry, Role
from mesh.service import serve
from mesh.settings import ExpertSettings
from protos.infermesh.v1 import internal_pb2, internal_pb2_grpc


class ExpertService(internal_pb2_grpc.ExpertServicer):
    def __init__(self, instance: "ExpertInstance") -> None:
        self.instance = instance

    def Attach(self, request, context):
        inst = self.instance
        inst.admit()
        if request.model != inst.settings.model:
            raise Unsupported(f"model {request.model!r} is not this expert instance's model {inst.settings.model!r}")
        try:
            group = inst.book.attach(request.instance_id, request.ranks)
        except ValueError as e:
            raise RequestError(str(e)) from None
        return internal_pb2.AttachResponse(rendezvous=inst.book.address, group=group,
                                           expert_ranks=inst.settings.ep, placement=inst.shard.placement)

    def Detach(self, request, context):
        return internal_pb2.DetachResponse(found=self.instance.book.detach(request.instance_id))


class ExpertInstance(Instance):
    """An expert instance: its EP ranks serving attachments, the gRPC shell."""

    role = Role.EXPERT

    def __init__(self, settings: ExpertSettings, instance_id: str | None = None,
                 registry: Registry | None = None) -> None:
        super().__init__(settings, instance_id, registry)
        s = settings
        self.book = AttachmentBook(s.host)
        checkpoint = load_checkpoint(s.model, getattr(torch, s.dtype))
        self.shard = ExpertShard(build_model(checkpoint.config, checkpoint.weights, "cpu"), 0, s.ep)
        self.ranks = None
        if s.ep > 1:
            follower = Call.of(follow, source=str(checkpoint.source), dtype=s.dtype, address=self.book.address)
            self.ranks = RankGroup(ParallelConfig(ep=s.ep), follower, rendezvous=Rendezvous.of(s))
            try:
                self.ranks.connect()
            except BaseException as e:
                raise self.ranks.failure(e) from e
        self.rank = ExpertRank(self.shard, 0, s.ep, self.book.address, s.host)
        self.metrics.meter.create_observable_counter(
            "infermesh_expert_tokens", callbacks=[self._observe_tokens], unit="{token}",
            description="Tokens each expert computed, per MoE layer (labels: layer, expert)")
        self.serve([(internal_pb2_grpc.add_ExpertServicer_to_server, ExpertService(self), "infermesh.v1.Expert")])

    def _observe_tokens(self, options):
        for layer, tokens in enumerate(self.load().tolist()):
            for expert, count in enumerate(tokens):
                yield Observation(count, {"layer": layer, "expert": expert})

    def load(self) -> torch.Tensor:
        """Tokens per MoE layer and expert (global ids), over every rank: [layers, num_experts]."""
        parts = [self.rank.load()]
        store = self.ranks.store if self.ranks else None
        for r in range(1, self.settings.ep):
            published = store.peek(EXPERT_LOAD.key(r))
            parts.append(torch.tensor(published.tokens) if published is not None
                         else torch.zeros(len(self.shard.weights), self.shard.placement.count(r), dtype=torch.long))
        return torch.cat(parts, dim=1)

    def attached(self) -> list[str]:
        """The instances whose attachment rank 0 is serving now."""
        serving = set(self.rank.active)
        return sorted(i for i, a in self.book.by_instance.items() if a in serving)

    def describe(self) -> dict:
        return {"parallel": {"tp": 1, "cp": 1, "ep": self.settings.ep}, "rendezvous": self.book.address,
                "placement": self.shard.placement, "active_requests": len(self.attached())}

    def in_flight(self) -> int:
        return len(self.attached())

    def status(self) -> internal_pb2.InstanceStatus:
        status = super().status()
        for layer, tokens in enumerate(self.load().tolist()):
            status.expert_load.add(layer=layer, tokens=tokens)
        status.attached[:] = self.attached()
        return status

    def close(self) -> None:
        self.metrics.shutdown()  # a last export, while the ranks can still report
        self.rank.stop()
        if self.ranks:
            self.ranks.close()


def main(argv: list[str] | None = None) -> None:
    serve("expert", ExpertSettings, ExpertInstance, argv, pin=pin_cpus)


if __name__ == "__main__":
    main()
