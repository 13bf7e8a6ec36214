"""The `torch_p2p` transport (`kvtransfer.transports`): process groups per prefill/decode instance pair,
formed on demand, carrying `kvtransfer.torch_p2p` messages.

A decode instance hosts a rendezvous store (`shared` -> `PairHost`, on rank 0; its address is the KV
target's address for this transport on every rank) and every decode rank runs a `PairListener`
(`Endpoint`). A prefill instance's rank 0 claims the next pair number the first time it pushes to that
decode instance (`Dialer.prepare`: a `control.Store.claim` of its rank count); the listeners see the claim
and join group `pair-<k>` as ranks `prefill_ranks + decode rank`, each then serving it with a
`TorchP2PReceiver`. Every prefill rank joins as its CP rank when the step that pushes begins (the
senders' `open`). Forming a group blocks until every rank of both instances has joined; it happens
once per pair. A pair whose group fails (a peer died) is dropped on both sides and claimed anew next time.
"""

from __future__ import annotations

import datetime
import threading

from engine.parallel.control import Store
from engine.parallel.groups import IDLE  # the decode side waits for the next transfer
from kvtransfer.control import PAIR
from kvtransfer.torch_p2p import TorchP2PReceiver, TorchP2PSender
from kvtransfer.transport import KVReceiver, KVSender

TIMEOUT = datetime.timedelta(seconds=60)  # a send or acknowledgement on the prefill side


class PairHost:
    """The decode instance's pairing store (rank 0), until `close()`."""

    def __init__(self, host: str) -> None:
        self.store = Store.host(host, 0, TIMEOUT)
        self.address = self.store.address

    def close(self) -> None:
        self.store = None  # the last reference: the store's server stops


def shared(host: str) -> PairHost:
    return PairHost(host)


class Endpoint:
    """A decode rank's side of every pair: listens on the shared pairing store."""

    def __init__(self, rank: int, ranks: int, receiver: KVReceiver, links, shared_address: str) -> None:
        self.address = shared_address
        self.listener = PairListener(shared_address, rank, ranks, receiver, links.host)

    def stop(self) -> None:
        self.listener.stop()


class PairListener:
    """On one decode rank: join every pair claimed on `address` and receive KV over it into `receiver`."""

    def __init__(self, address: str, rank: int, ranks: int, receiver: KVReceiver, host: str = "") -> None:
        """`host`: the address this rank's pair groups bind."""
        self.address, self.rank, self.ranks, self.receiver, self.host = address, rank, ranks, receiver, host
        self.receivers: dict[int, TorchP2PReceiver] = {}
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="kv-pair-listener", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Stop listening for new pairs (before the pairing store goes away)."""
        self._stop.set()
        self.thread.join()

    def _loop(self) -> None:
        try:
            self.store = Store.connect(self.address, TIMEOUT)
        except RuntimeError:
            return  # the pairing store is gone: the instance is stopping
        for pair, prefill_ranks in self.store.claims(PAIR, self._stop):
            threading.Thread(target=self._join, args=(pair, prefill_ranks), daemon=True).start()

    def _join(self, pair: int, prefill_ranks: int) -> None:
        """Joining blocks until the prefill ranks join too: on a thread and a store connection of its own
        (a store client runs one operation at a time), not the listener's."""
        try:
            group = self.store.join(f"{PAIR}-{pair}", prefill_ranks + self.rank, prefill_ranks + self.ranks,
                                    timeout=TIMEOUT, idle_timeout=IDLE, host=self.host)
        except RuntimeError:
            return  # the prefill side never joined (it died)
        self.receivers[pair] = TorchP2PReceiver(group, self.receiver, range(prefill_ranks),
                                              on_exit=lambda: self.receivers.pop(pair, None))


class PairLink:
    """One prefill rank's side of a pair: the group (joined on first use) and the lock its senders share."""

    def __init__(self, address: str, pair: int, rank: int, world: int, host: str = "") -> None:
        self.address, self.pair, self.rank, self.world, self.host = address, pair, rank, world, host
        self.lock = threading.Lock()
        self.broken = False
        self._group = None
        self._join = threading.Lock()

    def group(self):
        with self._join:
            if self._group is None:
                try:
                    self._group = Store.connect(self.address, TIMEOUT).join(f"{PAIR}-{self.pair}", self.rank,
                                                                            self.world, timeout=TIMEOUT, host=self.host)
                except RuntimeError:
                    self.broken = True
                    raise
            return self._group


class Dialer:
    """One prefill rank's pairs, by decode pairing address."""

    def __init__(self, rank: int, ranks: int, links=None) -> None:
        self.rank, self.ranks, self.host = rank, ranks, links.host if links is not None else ""
        self._claims: dict[str, int] = {}
        self._links: dict[tuple[str, int], PairLink] = {}
        self._lock = threading.Lock()

    def prepare(self, addresses: tuple[str, ...]) -> int:
        """Rank 0: the pair with the decode instance (every address is its pairing store)."""
        return self.claim(addresses[0])

    def senders(self, addresses: tuple[str, ...], link: int, request_id: str, timeout_s: float) -> list[KVSender]:
        pair = self.link(addresses[0], link, len(addresses))
        return [TorchP2PSender(pair.group, request_id, self.ranks + r, pair.lock) for r in range(len(addresses))]

    def close(self) -> None:
        pass  # groups end with the process, or when a peer fails

    def claim(self, address: str) -> int:
        """Rank 0: this instance's pair number with the decode instance at `address` (claimed once)."""
        with self._lock:
            pair = self._claims.get(address)
            link = self._links.get((address, pair))
            if pair is None or (link is not None and link.broken):
                pair = self._claims[address] = Store.connect(address, TIMEOUT).claim(PAIR, self.ranks)
            return pair

    def link(self, address: str, pair: int, decode_ranks: int) -> PairLink:
        with self._lock:
            key = (address, pair)
            if key not in self._links:
                self._links[key] = PairLink(address, pair, self.rank, self.ranks + decode_ranks, self.host)
            return self._links[key]
