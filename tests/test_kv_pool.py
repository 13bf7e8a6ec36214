"""The KV pool over a real `mooncake_master` and a real `mooncake_client` holding the pool's memory: an
engine computes only the blocks past what another engine stored, with the same answer; a key names the
conditions its KV was computed under; an entry gone between lookup and load, or the master killed, costs
computing, never a wrong or failed answer."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core import EngineConfig, EngineCore
from engine.weights import load_checkpoint
from kvtransfer.kv_pool import MooncakePool, PoolIdentity
from tests.conftest import TINY_VOCAB
from tests.helpers import free_port, wait_until

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
BIN = Path(sys.executable).parent


def reachable(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def pool(tmp_path):
    """A master on loopback and a client process contributing 256 MB to the pool: the master's address."""
    master_port, client_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    master = subprocess.Popen([shutil.which("mooncake_master", path=BIN), "-rpc_address", "127.0.0.1",
                               "-rpc_port", str(master_port), "-metrics_port", str(free_port("127.0.0.1"))],
                              stdout=subprocess.DEVNULL, stderr=(tmp_path / "master.log").open("w"))
    wait_until(lambda: reachable(master_port))
    client = subprocess.Popen([shutil.which("mooncake_client", path=BIN), "-host", "127.0.0.1", "-port",
                               str(client_port), "-master_server_address", f"127.0.0.1:{master_port}",
                               "-metadata_server", "P2PHANDSHAKE", "-global_segment_size", "256 MB"],
                              stdout=subprocess.DEVNULL, stderr=(tmp_path / "client.log").open("w"))
    wait_until(lambda: reachable(client_port))
    yield f"127.0.0.1:{master_port}", master
    for process in (client, master):
        process.kill()
        process.wait()


def engine(folder, master: str, block_size: int = 16, dtype: str = "float32", pool_class=MooncakePool):
    config = EngineConfig(dtype=dtype, block_size=block_size, num_kv_blocks=64)
    checkpoint = load_checkpoint(str(folder), config.torch_dtype)
    identity = PoolIdentity.of(checkpoint, config)
    return EngineCore(checkpoint, config, kv_pool=lambda kv_cache: pool_class(master, kv_cache, identity))


def generate(core: EngineCore, request_id: str, prompt: list[int]) -> list[int]:
    core.add_request(request_id, prompt, GREEDY)
    tokens = []
    while core.has_unfinished():
        tokens += [t for out in core.step() for t in out.new_token_ids]
    return tokens


def stored(core: EngineCore, prompt: list[int], blocks: int) -> bool:
    from engine.block_manager import prefix_hashes

    return core.kv_tier.pool.lookup(prefix_hashes(prompt, 16)[:blocks]) == blocks


def test_a_second_engine_computes_only_the_blocks_past_what_the_first_stored(tiny_checkpoint, pool):
    folder, _ = tiny_checkpoint("llama")
    master, _ = pool
    prompt = torch.randint(3, TINY_VOCAB, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    (expected,) = LLM(str(folder), dtype="float32").generate([prompt], GREEDY)
    first = engine(folder, master)
    assert generate(first, "a", prompt) == expected.token_ids
    assert first.prompt_tokens_computed == 200 and first.kv_tier.loaded_tokens == 0
    wait_until(lambda: stored(first, prompt, 12))  # written in the background: 12 full blocks of the prompt
    second = engine(folder, master)  # another instance, or this one restarted: the pool outlived the first
    assert generate(second, "b", prompt) == expected.token_ids
    assert second.kv_tier.loaded_tokens == 192 and second.prompt_tokens_computed == 8  # (200 - 1) // 16 blocks
    assert second.kv_tier.pool.errors == 0


def test_an_engine_under_other_conditions_never_loads_the_first_ones_blocks(tiny_checkpoint, pool):
    folder, _ = tiny_checkpoint("llama")
    master, _ = pool
    prompt = torch.randint(3, TINY_VOCAB, (100,), generator=torch.Generator().manual_seed(2)).tolist()
    first = engine(folder, master)
    generate(first, "a", prompt)
    wait_until(lambda: stored(first, prompt, 6))
    for other in (engine(folder, master, block_size=8), engine(folder, master, dtype="bfloat16")):
        generate(other, "b", prompt)
        assert other.kv_tier.loaded_tokens == 0 and other.prompt_tokens_computed == 100
    folder_b, _ = tiny_checkpoint("qwen3")  # other weights
    assert PoolIdentity.of(load_checkpoint(str(folder_b)), EngineConfig()).model != \
        PoolIdentity.of(load_checkpoint(str(folder)), EngineConfig()).model


def test_a_key_is_the_same_in_every_process(tiny_checkpoint):
    """Engines are separate processes: the identity must not depend on anything a process draws (string hash
    seeds, set order)."""
    folder, _ = tiny_checkpoint("llama")
    code = ("import sys; from engine.core import EngineConfig; from engine.weights import load_checkpoint; "
            "from kvtransfer.kv_pool import PoolIdentity; "
            f"print(PoolIdentity.of(load_checkpoint({str(folder)!r}), EngineConfig()).key(7))")
    keys = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip()
            for seed in ("1", "2")}
    assert keys == {PoolIdentity.of(load_checkpoint(str(folder)), EngineConfig()).key(7)}


class EvictingPool(MooncakePool):
    """A pool whose entries are removed from the store right after a lookup found them."""

    def lookup(self, hashes):
        held = super().lookup(hashes)
        for h in hashes[:held]:
            self._store.remove(self.identity.key(h), True)
        return held


def stored_by_another_engine(folder, master: str, seed: int) -> tuple[list[int], list[int]]:
    """A 100-token prompt that an engine computed and the pool holds (its 6 full blocks), and its answer."""
    prompt = torch.randint(3, TINY_VOCAB, (100,), generator=torch.Generator().manual_seed(seed)).tolist()
    first = engine(folder, master)
    generate(first, "a", prompt)
    wait_until(lambda: stored(first, prompt, 6))
    (expected,) = LLM(str(folder), dtype="float32").generate([prompt], GREEDY)
    return prompt, expected.token_ids


def test_an_entry_gone_between_lookup_and_load_is_computed_and_the_answer_is_the_same(tiny_checkpoint, pool):
    folder, _ = tiny_checkpoint("llama")
    master, _ = pool
    prompt, expected = stored_by_another_engine(folder, master, 3)
    second = engine(folder, master, pool_class=EvictingPool)
    assert generate(second, "b", prompt) == expected
    assert second.kv_tier.loaded_tokens == 0 and second.prompt_tokens_computed == 100
    assert second.kv_tier.pool.errors >= 1


def test_the_master_killed_costs_computing_and_is_counted(tiny_checkpoint, pool):
    folder, _ = tiny_checkpoint("llama")
    master, process = pool
    prompt, expected = stored_by_another_engine(folder, master, 4)
    second = engine(folder, master)
    process.kill()
    process.wait()
    assert generate(second, "b", prompt) == expected  # the blocks are in the pool, which cannot be asked
    assert second.kv_tier.loaded_tokens == 0 and second.prompt_tokens_computed == 100
    assert second.kv_tier.pool.errors >= 1


def test_a_document_prefilled_on_one_instance_is_loaded_not_computed_on_the_next(tiny_checkpoint, pool):
    """Two prefill instances and a decode instance on one pool: a document; then, the prefill and decode
    instances that served it gone, the document again: the other prefill instance computes only the blocks
    past what the first stored, and the answers are the engine's."""
    from decode_svc.server import DecodeInstance
    from mesh.metrics import scrape
    from mesh.registry import MemoryRegistry
    from mesh.settings import DecodeSettings, PrefillSettings, RouterSettings
    from prefill_svc.server import PrefillInstance
    from router.server import RouterInstance
    from tests.test_router import generate as ask

    folder, _ = tiny_checkpoint("llama")
    master, _ = pool
    registry = MemoryRegistry()
    common = dict(model=str(folder), dtype="float32", kv_cache_bytes=1 << 22, kv_pool=f"mooncake://{master}")
    prefills = [PrefillInstance(PrefillSettings(**common), registry=registry) for _ in range(2)]
    decode = DecodeInstance(DecodeSettings(**common), registry=registry)
    router = RouterInstance(RouterSettings(model=str(folder), policy="round_robin", local_prefill_max_tokens=0),
                            registry=registry)
    try:
        wait_until(lambda: len(registry.instances()) == 4)
        document = torch.randint(3, TINY_VOCAB, (400,), generator=torch.Generator().manual_seed(6)).tolist()
        (expected,) = LLM(str(folder), dtype="float32").generate([document], GREEDY)
        assert ask(router.address, document)[0] == expected.token_ids
        (first,) = [p for p in prefills if p.core.engine.prompt_tokens_computed]
        wait_until(lambda: stored(first.core.engine, document, 24))  # (400 - 1) // 16 full blocks
        first.stop()  # both gone (restarted, scaled in): a new decode instance caches nothing, and the other
        decode.stop()  # prefill instance prefills the document again, from the pool
        decode = DecodeInstance(DecodeSettings(**common), registry=registry)
        wait_until(lambda: sorted(i.role.value for i in registry.instances()) == ["decode", "prefill", "router"])
        assert ask(router.address, document)[0] == expected.token_ids
        (second,) = [p for p in prefills if p is not first]
        assert second.core.engine.kv_tier.loaded_tokens == 384 and second.core.engine.prompt_tokens_computed == 16
        assert decode.core.engine.prompt_tokens_computed == 0  # the KV was pushed
        counted = scrape(second.metrics.url)
        assert counted[("infermesh_kv_pool_loaded_tokens_total", ())] == 384
        assert counted[("infermesh_prompt_tokens_computed_total", ())] == 16
        assert counted[("infermesh_kv_pool_errors_total", ())] == 0
        assert counted[("infermesh_kv_pool_lookup_seconds_count", ())] == 1  # the document, once
    finally:
        for instance in (router, decode, *prefills):
            instance.stop()


def test_up_starts_the_pool_and_its_engines_store_there(tiny_checkpoint):
    """`infermesh up --kv-pool mooncake`: the master and the pool's memory run under the supervisor (their RPC
    ports on --host), every engine instance attaches, and a prefilled prompt's blocks are stored."""
    from mesh.metrics import scrape
    from tests.helpers import listening
    from tests.test_mesh_processes import cli, start_mesh, started, stop_mesh
    from tests.test_router import generate as ask

    folder, _ = tiny_checkpoint("llama")
    proc, address = start_mesh(str(folder), "--kv-pool", "mooncake", "--kv-pool-memory", "64 MB",
                               "--local-prefill-max-tokens", "0")
    instances = started(address)
    pids, pool = [i["pid"] for i in instances], {}
    try:
        kept = json.loads(cli("status", "--target", address, "--json").stdout)["processes"]
        pool = {Path(f"/proc/{p['pid']}/exe").resolve().name: p["pid"] for p in kept if p["kind"] == "kv-pool"}
        assert sorted(pool) == ["mooncake_client", "mooncake_master"]
        assert all(a.startswith("127.0.0.1:") for a in listening([pool["mooncake_master"]]))
        prompt = torch.randint(3, TINY_VOCAB, (100,), generator=torch.Generator().manual_seed(8)).tolist()
        (expected,) = LLM(str(folder), dtype="float32").generate([prompt], GREEDY)
        assert ask(address, prompt)[0] == expected.token_ids
        (prefill,) = [i for i in instances if i["role"] == "prefill"]
        wait_until(lambda: scrape(prefill["metrics_url"])[("infermesh_kv_pool_stored_tokens_total", ())] == 96)
        assert scrape(prefill["metrics_url"])[("infermesh_kv_pool_errors_total", ())] == 0
    finally:
        stop_mesh(proc, pids + list(pool.values()))
