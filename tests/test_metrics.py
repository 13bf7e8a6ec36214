"""Every process of `infermesh up` serves Prometheus text on its own port, published as `metrics_url`; after
a known set of requests the series say what was sent: counts equal to the requests, histogram counts
equal to the completed ones, token sums equal to the prompts and outputs, KV pushed and routed as it was."""

from __future__ import annotations

import grpc
import pytest
import torch

from engine.cpus import available_cores
from mesh.metrics import scrape
from protos.infermesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.conftest import TINY_VOCAB
from tests.test_mesh_processes import start_mesh, started, stop_mesh
from tests.test_router import GREEDY, generate


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_each_role_exports_what_the_requests_did(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")
    proc, address = start_mesh(str(folder), "--local-prefill-max-tokens", "20")
    instances = started(address)
    try:
        by_role = {i["role"]: i for i in instances}
        assert all(i["metrics_url"].startswith("http://127.0.0.1:") for i in instances)
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in (5, 12, 40, 64)]
        prompts.append(prompts[3])  # its prefix is cached on decode now: prefilled there
        for p in prompts:
            tokens, final = generate(address, p)
            assert len(tokens) == GREEDY.max_tokens
        with pytest.raises(grpc.RpcError):  # a refused one
            list(inference_pb2_grpc.InferenceStub(grpc.insecure_channel(address)).Generate(
                inference_pb2.GenerateRequest(token_ids=inference_pb2.TokenIds(ids=[5]),
                                              sampling=common_pb2.SamplingParams(temperature=-1)), timeout=10))

        router = scrape(by_role["router"]["metrics_url"])
        n = len(prompts)
        assert value(router, "infermesh_requests_total", outcome="ok") == n
        assert value(router, "infermesh_requests_total", outcome="invalid_argument") == 1
        assert value(router, "infermesh_time_to_first_token_seconds_count") == n
        assert value(router, "infermesh_time_per_output_token_seconds_count") == n
        assert 0 < value(router, "infermesh_time_to_first_token_seconds_sum") < 60 * n
        assert value(router, "infermesh_request_prompt_tokens_sum") == sum(map(len, prompts))
        assert value(router, "infermesh_request_generation_tokens_sum") == n * GREEDY.max_tokens
        # 5 and 12 tokens are prefilled on decode; 40 and 64 are pushed; the repeat of 64 either way, as soon as
        # decode's heartbeat has published the prefix it now holds
        disaggregated = value(router, "infermesh_routing_decisions_total", decision="disaggregated")
        local = value(router, "infermesh_routing_decisions_total", decision="local_short_uncached")
        assert disaggregated + local == n and disaggregated in (2, 3)
        assert value(router, "infermesh_retries_total") == 0

        prefill = scrape(by_role["prefill"]["metrics_url"])  # what the router sent it, it pushed
        assert value(prefill, "infermesh_kv_transfer_bytes_total", transport="grpc_stream") > 0
        assert value(prefill, "infermesh_kv_transfer_seconds_count", transport="grpc_stream") == disaggregated
        assert value(prefill, "infermesh_kv_transfer_failures_total", transport="grpc_stream") == 0
        assert value(prefill, "infermesh_cp_method_total", method="one_rank") == disaggregated

        decode = scrape(by_role["decode"]["metrics_url"])
        assert value(decode, "infermesh_requests_running") == value(decode, "infermesh_requests_waiting") == 0
        assert value(decode, "infermesh_kv_blocks_used") == 0 < value(decode, "infermesh_kv_blocks_total")
        assert value(decode, "infermesh_prefix_cache_hits_total") >= 48  # the repeated 64-token prompt's 3 blocks
        # --cpus split: decode borrows the idle prefill instance's core (none to borrow on one core)
        borrowed = value(decode, "infermesh_engine_steps_on_borrowed_cores_total")
        assert (borrowed > 0) == (len(available_cores()) > 1)
    finally:
        stop_mesh(proc, [i["pid"] for i in instances])
