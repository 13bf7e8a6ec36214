"""Ranks of one instance on different hosts, stood in for by different loopback addresses: a TP=2 decode
instance whose rank 0 binds 127.0.0.2 and whose rank 1 joins from 127.0.0.3 (`infermesh rank --join`),
behind a router with a prefill instance that pushes KV to both ranks, gives the engine's tokens; each
rank serves its KV endpoint on its own address; when the remote rank is killed the instance fails its
next step, says DRAINING, and the router answers UNAVAILABLE."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch

from decode_svc.server import DecodeInstance
from engine import LLM
from mesh.registry import InstanceState, MemoryRegistry
from mesh.settings import DecodeSettings, PrefillSettings, RouterSettings
from prefill_svc.server import PrefillInstance
from router.server import RouterInstance
from tests.conftest import TINY_VOCAB
from tests.helpers import assert_exited, descendants, free_port, wait_until
from tests.test_router import GREEDY, generate

pytestmark = pytest.mark.slow  # whole meshes of processes, real weights or benchmarks: minutes in all


def test_a_decode_instance_over_two_hosts_gives_the_engines_tokens_and_fails_cleanly_without_one(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")
    port = free_port("127.0.0.2")
    joined = subprocess.Popen([str(Path(sys.executable).parent / "infermesh"), "rank", "--join", f"127.0.0.2:{port}",
                               "--rank", "1", "--host", "127.0.0.3"])  # may start before rank 0: it waits
    registry = MemoryRegistry()
    common = dict(model=str(folder), dtype="float32", kv_cache_bytes=1 << 22)
    decode = DecodeInstance(DecodeSettings(tp=2, host="127.0.0.2", rendezvous_port=port, local_ranks=1, **common),
                            registry=registry)
    prefill = PrefillInstance(PrefillSettings(**common), registry=registry)
    router = RouterInstance(RouterSettings(model=str(folder), local_prefill_max_tokens=20), registry=registry)
    try:
        endpoints = decode.kv_endpoints["grpc_stream"]
        assert endpoints[0].startswith("127.0.0.2:") and endpoints[1].startswith("127.0.0.3:")
        wait_until(lambda: len(registry.instances()) == 3)
        g = torch.Generator().manual_seed(8)
        prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in (7, 45, 70)]
        expected = [o.token_ids for o in LLM(str(folder), dtype="float32").generate(prompts, GREEDY)]
        assert [generate(router.address, p)[0] for p in prompts] == expected  # 45 and 70: pushed to both ranks
        assert prefill.core.total_requests == 2

        (rank_process,) = descendants(joined.pid)  # the remote host loses its rank
        os.kill(rank_process, signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as e:
            generate(router.address, prompts[0])
        assert e.value.code() is grpc.StatusCode.UNAVAILABLE
        wait_until(lambda: decode.state is InstanceState.DRAINING)
        assert joined.wait(timeout=30) != 0  # `infermesh rank` exits with its rank's failure
    finally:
        for instance in (router, prefill, decode):
            instance.stop()
        joined.kill()
        joined.wait()
    assert_exited([joined.pid])
