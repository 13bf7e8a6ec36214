"""The router's OpenAI-compatible HTTP front, driven by clients we did not write (the `openai` package,
raw HTTP) against real services on loopback: completions and chat, streamed and not, n, seed, stop and
logprobs give what the gRPC API gives for the same request; usage counts are right; every failure has
its HTTP status and OpenAI error body; a client that disconnects mid-stream frees its KV on decode."""

from __future__ import annotations

import json

import grpc
import httpx
import openai
import pytest

from decode_svc.server import DecodeInstance
from engine.model_info import load_model_info
from mesh.registry import MemoryRegistry
from mesh.rpc import channel
from mesh.settings import DecodeSettings, PrefillSettings, RouterSettings
from prefill_svc.server import PrefillInstance
from protos.infermesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc, internal_pb2, internal_pb2_grpc
from router.server import RouterInstance
from tests.helpers import wait_until
from tests.test_lifecycle import hold_steps
from tests.test_mesh_processes import start_mesh, started, stop_mesh
from tests.tiny_mesh import tiny_mesh

PROMPT = "the quick brown fox jumps over the lazy dog"
CHAT = [{"role": "system", "content": "def main(): return 42"}, {"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def mesh(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")
    with tiny_mesh(folder, http_port=0, local_prefill_max_tokens=8) as m:
        client = openai.OpenAI(base_url=f"http://{m.router.http.address}/v1", api_key="unused", max_retries=0)
        yield m.router, m.decode, client, m.model


def grpc_generate(router, text: str | None = None, messages=None, **sampling):
    """The same request through the gRPC face: (text, token ids, final, logprobs)."""
    stub = inference_pb2_grpc.InferenceStub(channel(router.address))
    params = common_pb2.SamplingParams(**sampling)
    if messages is None:
        call = stub.Generate(inference_pb2.GenerateRequest(text=text, sampling=params), timeout=60)
    else:
        call = stub.Chat(inference_pb2.ChatRequest(messages=[inference_pb2.ChatMessage(**m) for m in messages],
                                                   sampling=params), timeout=60)
    text, ids, logprobs, final = "", [], [], None
    for r in call:
        if r.HasField("delta"):
            text, ids, logprobs = text + r.delta.text, ids + list(r.delta.token_ids), logprobs + list(r.delta.logprobs)
        else:
            final = r.final
    return text, ids, final, logprobs


GREEDY = dict(temperature=0.0, max_tokens=12, extra_body={"ignore_eos": True})


def test_a_greedy_completion_equals_the_grpc_answer_and_counts_its_usage(mesh):
    router, _, client, folder = mesh
    text, ids, final, _ = grpc_generate(router, PROMPT, temperature=0.0, max_tokens=12, ignore_eos=True)
    answer = client.completions.create(model=folder, prompt=PROMPT, **GREEDY)
    (choice,) = answer.choices
    assert choice.text == text and choice.finish_reason == "length" and answer.object == "text_completion"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens, answer.usage.total_tokens) == (
        len(final.prompt_token_ids), 12, len(final.prompt_token_ids) + 12)
    by_ids = client.completions.create(model=folder, prompt=list(final.prompt_token_ids), **GREEDY)
    assert by_ids.choices[0].text == text  # a prompt of token ids


def test_a_greedy_chat_equals_the_grpc_answer_streamed_or_not(mesh):
    router, _, client, folder = mesh
    text, _, final, _ = grpc_generate(router, messages=CHAT, temperature=0.0, max_tokens=12, ignore_eos=True)
    answer = client.chat.completions.create(model=folder, messages=CHAT, **GREEDY)
    assert answer.choices[0].message.content == text and answer.choices[0].message.role == "assistant"
    assert answer.usage.prompt_tokens == len(final.prompt_token_ids) and answer.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(model=folder, messages=CHAT, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"  # the role comes first
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12  # the usage chunk, last


def test_a_streamed_completion_is_the_same_text_in_deltas(mesh):
    router, _, client, folder = mesh
    text, _, _, _ = grpc_generate(router, PROMPT, temperature=0.0, max_tokens=12, ignore_eos=True)
    chunks = list(client.completions.create(model=folder, prompt=PROMPT, stream=True, **GREEDY))
    assert len(chunks) > 2 and "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_choices_with_a_seed_draw_seed_plus_index_each(mesh):
    router, _, client, folder = mesh
    sampled = dict(temperature=1.0, max_tokens=10, ignore_eos=True)
    expected = [grpc_generate(router, PROMPT, seed=7 + i, **sampled)[0] for i in range(2)]
    answer = client.completions.create(model=folder, prompt=PROMPT, n=2, seed=7, temperature=1.0, max_tokens=10,
                                       extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(answer.choices, key=lambda c: c.index)] == expected
    assert expected[0] != expected[1] and answer.usage.completion_tokens == 20
    greedy = client.chat.completions.create(model=folder, messages=CHAT, n=2, **GREEDY)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content


def test_a_stop_string_ends_the_text_before_it(mesh):
    router, _, client, folder = mesh
    text, _, _, _ = grpc_generate(router, PROMPT, temperature=0.0, max_tokens=12, ignore_eos=True)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    answer = client.completions.create(model=folder, prompt=PROMPT, stop=[stop], **GREEDY)
    assert answer.choices[0].text == text[:text.index(stop)] and answer.choices[0].finish_reason == "stop"


def test_logprobs_are_the_engines_in_both_apis(mesh):
    router, _, client, folder = mesh
    _, ids, _, logprobs = grpc_generate(router, PROMPT, temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    tokenizer = load_model_info(folder)[1]
    answer = client.completions.create(model=folder, prompt=PROMPT, logprobs=2, temperature=0.0, max_tokens=6,
                                       extra_body={"ignore_eos": True})
    lp = answer.choices[0].logprobs
    assert lp.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert lp.token_logprobs == pytest.approx([x.chosen.logprob for x in logprobs], abs=1e-6)
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(logprob, abs=1e-6)
               for top, logprob in zip(lp.top_logprobs, lp.token_logprobs))  # greedy: the best is the chosen one
    chat = client.chat.completions.create(model=folder, messages=CHAT, logprobs=True, top_logprobs=2, max_tokens=6,
                                          temperature=0.0, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 6 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-6) for c in content)


def test_models_and_health(mesh):
    router, _, client, folder = mesh
    assert [m.id for m in client.models.list().data] == [folder]
    assert httpx.get(f"http://{router.http.address}/health").json() == {"status": "ok"}


def test_bad_fields_are_400_with_the_field_named_and_the_front_keeps_serving(mesh):
    router, _, client, folder = mesh
    cases = [(dict(temperature=-1.0), "temperature", "temperature must be >= 0"),
             (dict(max_tokens=0), "max_tokens", "max_tokens must be in [1, "),
             (dict(top_p=1.5), "top_p", "top_p must be in (0, 1]"),
             (dict(n=99), "n", "n must be in [1, 16]"),
             (dict(extra_body={"presence_penalty": 0.5}), "presence_penalty", "not supported")]
    for kwargs, param, words in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=folder, prompt=PROMPT, **kwargs)
        assert e.value.status_code == 400 and e.value.body["param"] == param and words in e.value.body["message"]
    raw = httpx.post(f"http://{router.http.address}/v1/chat/completions",
                     json={"messages": [{"role": "wizard", "content": "hi"}]})
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    assert "role must be one of system, user, assistant" in raw.json()["error"]["message"]
    raw = httpx.post(f"http://{router.http.address}/v1/completions", content=b"{not json")
    assert raw.status_code == 400 and "not valid JSON" in raw.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-17", prompt=PROMPT, max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and repr(folder) in e.value.body["message"]
    assert client.completions.create(model=folder, prompt=PROMPT, **GREEDY).choices[0].finish_reason == "length"


def test_unauthenticated_overloaded_unavailable_and_timed_out_requests_get_401_429_503_504(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")
    registry, empty = MemoryRegistry(), MemoryRegistry()
    common = dict(model=str(folder), dtype="float32")
    decode = DecodeInstance(DecodeSettings(**num_kv_blocks_hint(8), **common), registry=registry)
    prefill = PrefillInstance(PrefillSettings(kv_cache_bytes=1 << 22, **common), registry=registry)
    routers = [RouterInstance(RouterSettings(model=str(folder), http_port=0, local_prefill_max_tokens=4, **extra),
                              registry=r)
               for r, extra in ((registry, {"api_token": "s3cret"}), (registry, {}), (empty, {}),
                                (registry, {"request_timeout_s": 0.001}))]
    try:
        wait_until(lambda: len(registry.instances()) == 5)
        secured, plain, lonely, hasty = (f"http://{r.http.address}/v1" for r in routers)

        def refused(base: str, status: int, kind: str, words: str, error_class, body=None, key: str = "none"):
            """The same request through the openai client and raw HTTP: one status, one OpenAI error body."""
            body = body or {"model": str(folder), "prompt": PROMPT, "max_tokens": 2}
            with pytest.raises(error_class) as e:
                openai.OpenAI(base_url=base, api_key=key, max_retries=0).completions.create(**body)
            raw = httpx.post(f"{base}/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=30)
            error = raw.json()["error"]
            assert e.value.status_code == raw.status_code == status and set(error) == {"message", "type", "param",
                                                                                       "code"}
            assert error["type"] == kind and words in error["message"] and words in e.value.body["message"]

        refused(secured, 401, "authentication_error", "the API needs a valid token", openai.AuthenticationError)
        assert openai.OpenAI(base_url=secured, api_key="s3cret", max_retries=0).completions.create(
            model=str(folder), prompt=PROMPT, max_tokens=2).choices
        with grpc.insecure_channel(routers[0].address) as ch:  # the gRPC face asks for the same token
            with pytest.raises(grpc.RpcError) as e:
                inference_pb2_grpc.InferenceStub(ch).ListModels(inference_pb2.ListModelsRequest(), timeout=10)
        assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED

        holder = internal_pb2_grpc.DecodeStub(channel(decode.address))  # hold 7 of decode's 8 blocks
        holder.Reserve(internal_pb2.ReserveRequest(request_id="holder", prompt_token_ids=[5] * 100), timeout=10)
        refused(plain, 429, "rate_limit_error", "free blocks", openai.RateLimitError,  # 40 tokens: disaggregated
                body={"model": str(folder), "prompt": [6] * 40, "max_tokens": 2})
        holder.Cancel(internal_pb2.CancelRequest(request_id="holder"), timeout=10)
        refused(lonely, 503, "service_unavailable", "no decode instance is serving", openai.InternalServerError)
        refused(hasty, 504, "timeout", "Deadline Exceeded", openai.InternalServerError)
        assert openai.OpenAI(base_url=plain, api_key="none", max_retries=0).completions.create(
            model=str(folder), prompt=[6] * 40, max_tokens=2).choices  # the room is back: served
    finally:
        for instance in (*routers, prefill, decode):
            instance.stop()


def num_kv_blocks_hint(blocks: int) -> dict:
    """kv_cache_bytes for `blocks` blocks of 16 tokens of the tiny llama (2 layers, 2 KV heads of 16, fp32)."""
    return {"kv_cache_bytes": blocks * 16 * 2 * 2 * 2 * 16 * 4, "block_size": 16}


def test_a_client_that_disconnects_mid_stream_frees_its_kv_on_decode(mesh):
    router, decode, _, folder = mesh
    admin = internal_pb2_grpc.AdminStub(channel(decode.address))
    core, steps, cancels = decode.core, [0], []
    step, cancel = core.engine.step, core.cancel

    def counted():
        steps[0] += 1
        return step()

    core.engine.step = counted
    core.cancel = lambda rid: cancels.append(rid) or cancel(rid)  # the Decode stream's end calls it
    try:
        body = {"model": folder, "prompt": [5, 6, 7], "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.Client(timeout=30) as http, http.stream("POST", f"http://{router.http.address}/v1/completions",
                                                             json=body) as response:
            lines = response.iter_lines()  # held: closing it would close the connection
            first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
            assert first["choices"][0]["text"] is not None
            gate = hold_steps(decode)  # the request stays in flight, with its blocks, until we let the engine go
            assert admin.Status(internal_pb2.StatusRequest(), timeout=10).kv_blocks_used > 0
        # the connection is closed: the router cancels its call to decode, whose stream then cancels the request
        wait_until(lambda: cancels)
        held = steps[0]
        gate.set()
        wait_until(lambda: admin.Status(internal_pb2.StatusRequest(), timeout=10).kv_blocks_used == 0)
        assert steps[0] - held <= 2  # cancelled at once, not run to its 400 tokens
    finally:
        core.engine.step = step
        del core.cancel


def test_a_client_that_leaves_before_its_whole_answer_frees_its_kv_on_decode(mesh):
    """Not streamed: the client gives up waiting for the body (its read timeout) while decode holds the request;
    the router sees the connection close, cancels the choice's task and with it the request on decode."""
    router, decode, _, folder = mesh
    core, engine = decode.core, decode.core.engine
    step, cancel, steps, cancels = engine.step, core.cancel, [0], []

    def counted():
        steps[0] += 1
        return step()

    engine.step = counted
    core.cancel = lambda rid: cancels.append(rid) or cancel(rid)
    try:
        gate = hold_steps(decode)  # no step runs until the client has left
        body = {"model": folder, "prompt": [5, 6, 7], "max_tokens": 400, "temperature": 0, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"http://{router.http.address}/v1/completions", json=body,
                       timeout=httpx.Timeout(30, read=1.0))
        wait_until(lambda: cancels)
        held = steps[0]
        gate.set()
        admin = internal_pb2_grpc.AdminStub(channel(decode.address))
        wait_until(lambda: admin.Status(internal_pb2.StatusRequest(), timeout=10).kv_blocks_used == 0)
        assert steps[0] - held <= 2  # cancelled at once, not run to its 400 tokens
    finally:
        engine.step = step
        del core.cancel


def test_an_http_request_continues_the_clients_trace_across_the_mesh(tiny_checkpoint, tmp_path):
    folder, _ = tiny_checkpoint("llama")
    spans_file = tmp_path / "spans.jsonl"
    proc, address = start_mesh(str(folder), "--trace", f"file:{spans_file}", "--http-port", "0",
                               "--local-prefill-max-tokens", "8")
    instances = started(address)
    (http,) = [i["http_address"] for i in instances if i["role"] == "router"]
    trace_id, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    try:
        answer = httpx.post(f"http://{http}/v1/completions", timeout=60,
                            headers={"traceparent": f"00-{trace_id}-{client_span}-01"},
                            json={"prompt": PROMPT * 4, "max_tokens": 3, "temperature": 0})
        assert answer.status_code == 200
    finally:
        stop_mesh(proc, [i["pid"] for i in instances])
    spans = {s["name"]: s for s in map(json.loads, spans_file.read_text().splitlines())}
    assert {"router.generate", "decode.reserve", "prefill.run", "decode.request"} <= set(spans)  # disaggregated
    assert {s["trace_id"] for s in spans.values()} == {trace_id}  # one trace: the client's
    assert spans["router.generate"]["parent_id"] == client_span
    assert spans["decode.request"]["parent_id"] == spans["router.generate"]["span_id"]
