"""Stateless process groups: built from a TCPStore, never through the global default group.

Several groups can live in one process (a TP group, a CP group, later a KV-transfer
pair or an expert attachment), and instances can come and go without touching
`torch.distributed`'s world. Collectives are called on the group object itself.
"""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist

DEFAULT_TIMEOUT = datetime.timedelta(seconds=60)
IDLE = datetime.timedelta(days=365)  # the operation timeout of a rank that waits for work


def rendezvous(host: str, port: int, rank: int, world_size: int,
               timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> dist.TCPStore:
    """Rank 0 hosts the store; the others connect to it."""
    if rank == 0:
        return hosted_store(host, port, timeout, world_size)
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)


def hosted_store(host: str, port: int, timeout: datetime.timedelta,
                 world_size: int | None = None) -> dist.TCPStore:
    """A TCPStore served from here that listens on `host` alone (port 0: any free one, read `store.port`).
    Given a host, torch's store still listens on every interface; so the socket is bound here and handed
    over (`master_listen_fd`, the store then owns it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as listener:
        listener.bind((host, port))
        listener.listen(socket.SOMAXCONN)
        bound_port = listener.getsockname()[1]
        return dist.TCPStore(host, bound_port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                             master_listen_fd=listener.detach())


def stateless_group(store: dist.Store, name: str, rank: int, world_size: int, *, backend: str = "gloo",
                    timeout: datetime.timedelta = DEFAULT_TIMEOUT, idle_timeout: datetime.timedelta | None = None,
                    host: str = "", lazy: bool = False) -> dist.ProcessGroup:
    """A process group named `name` among `world_size` ranks sharing `store`. Forming it waits at most
    `timeout`; its collectives wait `idle_timeout` if given (a rank that waits for work: a year), else `timeout`.
    Gloo's point-to-point waits take `timeout` whatever `idle_timeout` says: a receive that may idle longer
    passes its own (`work.wait(IDLE)`), as a timed-out wait closes the group's connections.
    `host`: the address this rank's gloo connections use ("": the one this host's name resolves to). `lazy`:
    gloo connects each pair of ranks on its first message, not all of them while the group forms."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    prefixed = dist.PrefixStore(name, store)
    if backend == "gloo":
        if host or lazy:
            options = dist.ProcessGroupGloo._Options()
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=host, lazy_init=lazy) if host
                                else dist.ProcessGroupGloo.create_default_device(lazy_init=lazy)]
            options._timeout = timeout
            group = dist.ProcessGroupGloo(prefixed, rank, world_size, options)
        else:
            group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        if idle_timeout is not None:
            group._set_default_timeout(idle_timeout)
        return group
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
