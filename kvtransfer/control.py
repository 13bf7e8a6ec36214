"""The KV transfer's messages in an instance's store (`engine.parallel.control`: keys, codec, client).

- `PUSH` (`push/<request>`): rank 0 of a prefill instance publishes a request's push before queueing it;
  each follower rank reads it when the step that completes the prompt begins (`prefill_svc.push`).
- `PUSH_RESULT` (`push-result/<request>/<rank>`): what each follower rank's push did.
- `RESERVATION` (`reservation/<request>`): rank 0 of a decode instance publishes the blocks it reserved
  for a request before answering Reserve; its follower ranks write pushed KV only there.
- `KV_ENDPOINT` (`kv-endpoint/<transport>/<rank>`): where each decode rank receives over a transport.
- `PAIR` (claims `pair/<k>`, `control.Store.claim`): a prefill instance asks a decode instance's pairing
  store for a group of both instances' ranks (`kvtransfer.pairing`).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.parallel.control import Family
from kvtransfer.plan import DecodeLayout
from kvtransfer.transport import TransferError, TransferStats


@dataclass(frozen=True, slots=True)
class PushSpec:
    num_tokens: int
    num_kv_heads: int
    block_size: int  # the prefill instance's
    target: DecodeLayout
    addresses: tuple[str, ...]  # per decode rank, where its transport's endpoint is
    timeout_s: float
    transport: str = "grpc_stream"  # a name in kvtransfer.transports
    link: int = 0  # what rank 0's dialer prepared (torch_p2p: the pair number it claimed)
    trace_context: tuple[tuple[str, str], ...] = ()  # W3C headers of the span the push belongs to


@dataclass(frozen=True, slots=True)
class PushResult:
    """One prefill rank's push of one request: its stats, or why it failed."""

    bytes: int = 0
    pieces: int = 0
    seconds: float = 0.0
    error: str = ""

    @classmethod
    def of(cls, stats: TransferStats) -> "PushResult":
        return cls(stats.bytes, stats.pieces, stats.seconds)

    def stats(self, rank: int) -> TransferStats:
        if self.error:
            raise TransferError(f"prefill rank {rank}: {self.error}")
        return TransferStats(self.bytes, self.pieces, self.seconds)


@dataclass(frozen=True, slots=True)
class Reservation:
    block_table: tuple[int, ...]  # the blocks reserved for the request, on every rank of the instance


@dataclass(frozen=True, slots=True)
class KVEndpoint:
    address: str


PUSH = Family("push", PushSpec)
PUSH_RESULT = Family("push-result", PushResult)
RESERVATION = Family("reservation", Reservation)
KV_ENDPOINT = Family("kv-endpoint", KVEndpoint)
PAIR = "pair"  # the claims' family: groups `pair-<k>`
