"""Hostile and mistaken input through the public gRPC API of a real mesh (router, prefill, decode over
loopback): each case gets its status code and a message naming the field and the limit, the mesh serves
the next request, and KV blocks return to zero on every instance. Then hypothesis-generated requests
for a bounded number of examples: never UNKNOWN or INTERNAL, never a crash."""

from __future__ import annotations

import math
import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS
from mesh.registry import Role
from mesh.rpc import channel
from protos.infermesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc, internal_pb2, internal_pb2_grpc
from tests.conftest import TINY_VOCAB
from tests.tiny_mesh import tiny_mesh

CONTEXT = 512  # the tiny checkpoints' max_position_embeddings
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def mesh(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")
    with tiny_mesh(folder, local_prefill_max_tokens=4) as m:
        yield m.router, [m.prefill, m.decode], m.model


def ids(n: int) -> inference_pb2.TokenIds:
    return inference_pb2.TokenIds(ids=[5 + i % 200 for i in range(n)])


def sampling(**fields) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**fields)


def chat(*messages: tuple[str, str]) -> inference_pb2.ChatRequest:
    return inference_pb2.ChatRequest(messages=[inference_pb2.ChatMessage(role=r, content=c) for r, c in messages])


G = inference_pb2.GenerateRequest
CASES = {
    "empty prompt": (G(), INVALID, ["prompt"]),
    "empty text": (G(text=""), INVALID, ["prompt"]),
    "prompt over the context": (G(token_ids=ids(CONTEXT)), INVALID, [f"prompt has {CONTEXT} tokens",
                                                                      f"max_model_len is {CONTEXT}"]),
    "max_tokens 0": (G(text="hi", sampling=sampling(max_tokens=0)), INVALID, ["max_tokens must be >= 1, got 0"]),
    "prompt + max_tokens over the context": (G(token_ids=ids(500), sampling=sampling(max_tokens=100)), INVALID,
                                             ["max_tokens is 100", "500 tokens", f"max_model_len {CONTEXT}"]),
    "max_tokens 10**9": (G(text="hi", sampling=sampling(max_tokens=10**9)), INVALID,
                         ["max_tokens is 1000000000", f"max_model_len {CONTEXT}"]),
    "temperature < 0": (G(text="hi", sampling=sampling(temperature=-0.5)), INVALID,
                        ["temperature must be >= 0, got -0.5"]),
    "temperature NaN": (G(text="hi", sampling=sampling(temperature=math.nan)), INVALID,
                        ["temperature must be >= 0, got nan"]),
    "top_p 0": (G(text="hi", sampling=sampling(top_p=0)), INVALID, ["top_p must be in (0, 1], got 0"]),
    "top_p over 1": (G(text="hi", sampling=sampling(top_p=1.5)), INVALID, ["top_p must be in (0, 1], got 1.5"]),
    "logprobs over the limit": (G(text="hi", sampling=sampling(logprobs=21)), INVALID,
                                ["logprobs must be in [0, 20], got 21"]),
    "unknown model": (G(model="gpt-17", text="hi"), grpc.StatusCode.NOT_FOUND, ["'gpt-17'", "served:"]),
    "token id outside the vocabulary": (G(token_ids=inference_pb2.TokenIds(ids=[5, TINY_VOCAB])), INVALID,
                                        [f"prompt token id {TINY_VOCAB} (at 1) is out of range [0, {TINY_VOCAB})"]),
    "stop token id outside the vocabulary": (G(text="hi", sampling=sampling(stop_token_ids=[10**6])), INVALID,
                                             ["stop_token_ids: 1000000 is out of range"]),
    "too many stop strings": (G(text="hi", sampling=sampling(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)])),
                              INVALID, [f"stop: at most {MAX_STOP_STRINGS} strings, got {MAX_STOP_STRINGS + 1}"]),
    "a stop string too long": (G(text="hi", sampling=sampling(stop=["x" * (MAX_STOP_CHARS + 1)])), INVALID,
                               [f"at most {MAX_STOP_CHARS} characters, got one of {MAX_STOP_CHARS + 1}"]),
    "an empty stop string": (G(text="hi", sampling=sampling(stop=[""])), INVALID, ["stop strings must not be empty"]),
    "a message over the size limit": (G(text="x" * (5 << 20)), grpc.StatusCode.RESOURCE_EXHAUSTED,
                                      ["larger than max"]),
    "chat with no messages": (chat(), INVALID, ["messages must not be empty"]),
    "chat with an unknown role": (chat(("user", "hi"), ("wizard", "hi")), INVALID,
                                  ["messages[1].role must be one of system, user, assistant, got 'wizard'"]),
}


def call(address: str, request, timeout: float = 30):
    stub = inference_pb2_grpc.InferenceStub(channel(address))
    method = stub.Chat if isinstance(request, inference_pb2.ChatRequest) else stub.Generate
    return list(method(request, timeout=timeout))


def kv_blocks_used(mesh) -> dict[str, int]:
    _, workers, _ = mesh
    return {w.role.value: internal_pb2_grpc.AdminStub(channel(w.address)).Status(
        internal_pb2.StatusRequest()).kv_blocks_used for w in workers}


def assert_serving_and_empty(mesh) -> None:
    """The next request is served, then no KV block is held anywhere."""
    router, _, _ = mesh
    responses = call(router.address, G(token_ids=ids(24), sampling=sampling(max_tokens=3, ignore_eos=True)))
    assert responses[-1].final.usage.completion_tokens == 3
    deadline = time.monotonic() + 10
    while any(kv_blocks_used(mesh).values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kv_blocks_used(mesh) == {"prefill": 0, "decode": 0}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_gets_its_code_and_a_message_naming_the_field_and_the_limit(mesh, case):
    request, code, phrases = CASES[case]
    router, _, _ = mesh
    with pytest.raises(grpc.RpcError) as e:
        call(router.address, request)
    assert e.value.code() is code, e.value.details()
    for phrase in phrases:
        assert phrase in e.value.details()
    assert_serving_and_empty(mesh)


def test_invalid_utf8_in_a_text_field_is_invalid_argument_not_internal(mesh):
    router, _, _ = mesh
    raw = channel(router.address).unary_stream("/infermesh.v1.Inference/Generate")  # bytes in, bytes out
    request = G(text="hi there").SerializeToString().replace(b"hi there", b"hi \xff\xfere")
    with pytest.raises(grpc.RpcError) as e:
        list(raw(request, timeout=30))
    assert e.value.code() is INVALID, e.value.details()
    assert "UTF-8" in e.value.details()
    assert_serving_and_empty(mesh)


def test_a_long_prompt_without_max_tokens_gets_the_room_left(mesh):
    """Unset max_tokens is 256, cut to what the context leaves: never a refusal of a request that named none."""
    router, _, _ = mesh
    final = call(router.address, G(token_ids=ids(CONTEXT - 5), sampling=sampling(ignore_eos=True)))[-1].final
    assert final.usage.completion_tokens == 5 and final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert_serving_and_empty(mesh)


def test_a_deadline_of_one_millisecond_and_an_immediate_cancel_leave_nothing_behind(mesh):
    router, _, _ = mesh
    long_one = G(token_ids=ids(200), sampling=sampling(max_tokens=200, ignore_eos=True))
    with pytest.raises(grpc.RpcError) as e:
        call(router.address, long_one, timeout=0.001)
    assert e.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    stream = inference_pb2_grpc.InferenceStub(channel(router.address)).Generate(long_one, timeout=30)
    stream.cancel()
    with pytest.raises(grpc.RpcError) as e:
        list(stream)
    assert e.value.code() is grpc.StatusCode.CANCELLED
    assert_serving_and_empty(mesh)


# ---- fuzz ------------------------------------------------------------------------------------------------

def mostly(good, bad):
    """Draws from `good` about three times in four: hostile values, and enough requests served to fuzz serving."""
    return st.one_of(good, good, good, bad)


u32, u64 = st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)
floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
unit = st.floats(0, 1, width=32, exclude_min=True)
vocab_ids = mostly(st.integers(0, TINY_VOCAB - 1), u32)
texts = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)  # protobuf refuses lone surrogates itself
samplings = st.builds(
    common_pb2.SamplingParams,
    max_tokens=mostly(st.none() | st.integers(1, 40), u32), temperature=mostly(unit, floats),
    top_p=mostly(st.none() | unit, floats), top_k=mostly(st.integers(0, 400), u32), seed=st.none() | u64,
    stop=mostly(st.lists(texts.filter(bool), max_size=2), st.lists(texts, max_size=20)),
    stop_token_ids=st.lists(vocab_ids, max_size=3), ignore_eos=st.booleans(),
    logprobs=mostly(st.none() | st.integers(0, 20), u32),
)
prompt_ids = st.builds(inference_pb2.TokenIds, ids=mostly(st.lists(vocab_ids, min_size=1, max_size=40), st.lists(u32)))
generates = st.builds(G, model=mostly(st.just(""), texts), sampling=samplings, request_id=texts,
                      text=mostly(texts.filter(bool), texts)) | st.builds(G, sampling=samplings, token_ids=prompt_ids)
messages = st.builds(inference_pb2.ChatMessage, role=mostly(st.sampled_from(["system", "user", "assistant"]), texts),
                     content=texts)
chats = st.builds(inference_pb2.ChatRequest, sampling=samplings,
                  messages=mostly(st.lists(messages, min_size=1, max_size=3), st.lists(messages, max_size=1)))
CLEAR = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED}


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(request=generates | chats)
def test_generated_requests_get_an_answer_or_a_clear_refusal(mesh, request):
    router, _, _ = mesh
    try:
        responses = call(router.address, request)
        assert responses[-1].HasField("final")
    except grpc.RpcError as e:
        assert e.code() in CLEAR, f"{e.code()}: {e.details()}"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=64))
def test_generated_bytes_get_a_clear_refusal_or_an_answer(mesh, data):
    router, _, _ = mesh
    raw = channel(router.address).unary_stream("/infermesh.v1.Inference/Generate")
    try:
        list(raw(data, timeout=30))
    except grpc.RpcError as e:
        assert e.code() in CLEAR, f"{e.code()}: {e.details()}"


def test_after_the_fuzz_the_mesh_serves_and_holds_no_kv(mesh):
    router, workers, _ = mesh
    assert {w.role for w in workers} == {Role.PREFILL, Role.DECODE}
    assert_serving_and_empty(mesh)
