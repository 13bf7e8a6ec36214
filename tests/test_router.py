"""Router + prefill + decode over real gRPC (one process, shared in-memory registry): streamed tokens equal
the single engine's for concurrent requests of mixed lengths, taking both sides of conditional
disaggregation; cancellation reaches decode; bad input and missing instances get clear status codes; a long
prompt's tokenizing holds up no other stream."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from engine import LLM, SamplingParams
from mesh.metrics import scrape
from mesh.registry import MemoryRegistry
from mesh.rpc import channel
from mesh.settings import RouterSettings
from protos.convert import sampling_message
from protos.infermesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc, internal_pb2, internal_pb2_grpc
from router import server as router_server
from router.server import RouterInstance
from tests.conftest import TINY_VOCAB
from tests.tiny_mesh import tiny_mesh

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def mesh(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")
    with tiny_mesh(folder, local_prefill_max_tokens=20) as m:
        yield m.router, m.prefill, m.decode, m.registry, LLM(str(folder), dtype="float32")


def routed_view(router: RouterInstance):
    """The registry as the router routes on it: its snapshot, which a read refreshes behind it."""
    return router.core.registry


def until_seen(router: RouterInstance, condition, timeout_s: float = 30.0) -> None:
    """Wait until the router's view of the instance ids meets `condition`."""
    deadline = time.monotonic() + timeout_s
    while not condition({i.id for i in routed_view(router).instances()}):
        assert time.monotonic() < deadline, "the router's view did not change in time"
        time.sleep(0.02)


def generate(address: str, prompt: list[int], params: SamplingParams = GREEDY, **kwargs):
    stub = inference_pb2_grpc.InferenceStub(channel(address))
    deltas, final = [], None
    for r in stub.Generate(inference_pb2.GenerateRequest(token_ids=inference_pb2.TokenIds(ids=prompt),
                                                         sampling=sampling_message(params)), timeout=120, **kwargs):
        if r.HasField("delta"):
            deltas.append(list(r.delta.token_ids))
        else:
            final = r.final
    return [t for d in deltas for t in d], final


def test_sixteen_concurrent_requests_equal_the_single_engine_both_ways(mesh):
    router, prefill, _, _, reference = mesh
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in [3, 9, 15, 40, 64, 90, 7, 33] * 2]
    expected = [o.token_ids for o in reference.generate(prompts, GREEDY)]
    before = prefill.core.total_requests
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda p: generate(router.address, p), prompts))
    assert [tokens for tokens, _ in results] == expected
    long_prompts = sum(len(p) > 20 for p in prompts)  # the rest were prefilled on decode
    # each prompt comes twice: a twin may find the other's prefix cached on decode and be prefilled there
    assert len({tuple(p) for p in prompts if len(p) > 20}) <= prefill.core.total_requests - before <= long_prompts
    final = results[4][1]
    assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH and list(final.prompt_token_ids) == prompts[4]
    assert final.usage.completion_tokens == 6 and final.timings.total_s >= final.timings.ttft_s > 0


def test_a_prompt_whose_prefix_decode_holds_is_prefilled_there(mesh):
    router, prefill, decode, registry, reference = mesh
    from engine.block_manager import prefix_hashes

    prompt = torch.randint(3, TINY_VOCAB, (100,), generator=torch.Generator().manual_seed(9)).tolist()
    before = prefill.core.total_requests
    first, _ = generate(router.address, prompt)  # 100 uncached tokens: disaggregated
    assert prefill.core.total_requests == before + 1
    deadline = time.monotonic() + 30  # a heartbeat publishes decode's cached blocks, the router's view reads them
    while (routed_view(router).prefix_hits(prefix_hashes(prompt, 16)).get(decode.id, 0) < 6
           and time.monotonic() < deadline):
        time.sleep(0.05)
    again, final = generate(router.address, prompt + [7, 8])  # 6 of 7 blocks cached there: 6 tokens to prefill
    assert prefill.core.total_requests == before + 1  # conditional disaggregation: prefilled on decode
    assert again == reference.generate([prompt + [7, 8]], GREEDY)[0].token_ids
    assert final.usage.cached_prompt_tokens == 96


def test_chat_applies_the_template_and_list_models_names_the_model(mesh):
    router, _, _, _, reference = mesh
    stub = inference_pb2_grpc.InferenceStub(channel(router.address))
    messages = [{"role": "user", "content": "hello world"}]
    tokens = [t for r in stub.Chat(inference_pb2.ChatRequest(
        messages=[inference_pb2.ChatMessage(**m) for m in messages], sampling=sampling_message(GREEDY)), timeout=60)
        if r.HasField("delta") for t in r.delta.token_ids]
    assert tokens == reference.chat(messages, GREEDY)[0].token_ids
    (card,) = stub.ListModels(inference_pb2.ListModelsRequest(), timeout=10).models
    assert card.architecture == "llama" and card.vocab_size == TINY_VOCAB


def test_a_client_that_cancels_frees_the_blocks_on_decode(mesh):
    router, _, decode, _, _ = mesh
    admin = internal_pb2_grpc.AdminStub(channel(decode.address))
    stub = inference_pb2_grpc.InferenceStub(channel(router.address))
    call = stub.Generate(inference_pb2.GenerateRequest(
        token_ids=inference_pb2.TokenIds(ids=[5] * 50),
        sampling=sampling_message(SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))))
    assert next(call).delta.token_ids  # streaming has begun
    call.cancel()
    deadline = time.monotonic() + 30
    while admin.Status(internal_pb2.StatusRequest()).kv_blocks_used and time.monotonic() < deadline:
        time.sleep(0.05)
    assert admin.Status(internal_pb2.StatusRequest()).kv_blocks_used == 0


def test_bad_input_and_missing_instances_get_clear_codes(mesh, tiny_checkpoint):
    router, _, _, _, _ = mesh
    stub = inference_pb2_grpc.InferenceStub(channel(router.address))
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(inference_pb2.GenerateRequest(), timeout=10))
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "prompt" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(inference_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(top_p=2)),
                           timeout=10))
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "top_p must be in (0, 1]" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        out_of_range = inference_pb2.GenerateRequest(token_ids=inference_pb2.TokenIds(ids=[TINY_VOCAB]))
        list(stub.Generate(out_of_range, timeout=10))
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "out of range" in e.value.details()
    folder, _ = tiny_checkpoint("llama")
    lonely = RouterInstance(RouterSettings(model=str(folder)), registry=MemoryRegistry())
    try:
        with pytest.raises(grpc.RpcError) as e:
            list(inference_pb2_grpc.InferenceStub(channel(lonely.address)).Generate(
                inference_pb2.GenerateRequest(text="hi"), timeout=10))
        assert e.value.code() is grpc.StatusCode.UNAVAILABLE and "no decode instance is serving" in e.value.details()
    finally:
        lonely.stop()


def test_a_decode_instance_that_is_gone_is_skipped_before_the_first_token(mesh):
    router, _, decode, registry, reference = mesh
    from mesh.registry import InstanceInfo, InstanceState, Role

    # a record that outlived its process: the least loaded on paper, unreachable in fact
    ghost = InstanceInfo(id="aaa-ghost", role=Role.DECODE, address="127.0.0.1:1", pid=1, model="m",
                         state=InstanceState.SERVING, kv_blocks_total=10_000)
    registry.register(ghost, ttl_s=60)
    until_seen(router, lambda ids: "aaa-ghost" in ids)
    retries = scrape(router.metrics.url).get(("infermesh_retries_total", ()), 0)
    try:
        tokens, _ = generate(router.address, [5, 6, 7])
        assert tokens == reference.generate([[5, 6, 7]], GREEDY)[0].token_ids
        assert scrape(router.metrics.url)[("infermesh_retries_total", ())] == retries + 1  # the ghost was tried
    finally:
        registry.deregister("aaa-ghost")
        until_seen(router, lambda ids: "aaa-ghost" not in ids)


def test_a_long_prompt_is_tokenized_off_the_event_loop_and_streams_in_flight_go_on(mesh, monkeypatch):
    """The router relays every stream on one event loop: a text prompt past TOKENIZE_ON_THE_LOOP_CHARS is
    tokenized on a thread, so while its tokenizing runs (held here) a stream in flight streams to its end; then
    the long prompt is served with the engine's tokens."""
    router, _, decode, _, llm = mesh
    monkeypatch.setattr(router_server, "TOKENIZE_ON_THE_LOOP_CHARS", 16)
    tokenizer, tokenizing, release = router.core.tokenizer, threading.Event(), threading.Event()
    encode = tokenizer.encode

    def held(text: str, **kwargs) -> list[int]:
        if len(text) > 16:
            tokenizing.set()
            release.wait(60)
        return encode(text, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", held)
    long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    text = "a prompt longer than sixteen characters"
    stub = inference_pb2_grpc.InferenceStub(channel(router.address))
    try:
        with ThreadPoolExecutor(2) as pool:
            streaming = pool.submit(generate, router.address, [5, 6, 7], long)
            waiting = pool.submit(lambda: list(stub.Generate(inference_pb2.GenerateRequest(
                text=text, sampling=sampling_message(GREEDY)), timeout=60)))
            assert tokenizing.wait(30)
            tokens, _ = streaming.result(timeout=60)  # streams on while the long prompt is being tokenized
            assert not waiting.done()
            release.set()
            responses = waiting.result(timeout=60)
    finally:
        release.set()
    assert tokens == llm.generate([[5, 6, 7]], long)[0].token_ids
    expected = llm.generate([encode(text)], GREEDY)[0].token_ids
    assert [t for r in responses if r.HasField("delta") for t in r.delta.token_ids] == expected
    assert decode.in_flight() == 0
