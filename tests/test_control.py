"""The control plane inside an instance: typed keys and messages, one codec, one store client, and the
step plan's wire form."""

import datetime
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from decode_svc.follower import accept_kv
from engine import step_plan
from engine.parallel.context import ExpertAttachment, ParallelConfig
from engine.parallel.control import (
    FOLLOWER,
    RANK_ERROR,
    Call,
    ControlError,
    ExpertLoad,
    Family,
    RankError,
    Store,
    decode,
    encode,
)
from engine.parallel.executor import follow_plans
from engine.step_plan import ChunkPlan, StepPlan
from kvtransfer.control import PUSH, PUSH_RESULT, PushResult, PushSpec, Reservation
from kvtransfer.plan import DecodeLayout
from kvtransfer.shm_arena import shared_zeros
from kvtransfer.transport import TransferError

SPEC = PushSpec(num_tokens=40, num_kv_heads=2, block_size=16,
                target=DecodeLayout(head_ranges=((0, 1), (1, 2)), block_size=8, block_table=(3, 4, 5), first_token=8),
                addresses=("127.0.0.1:1", "127.0.0.1:2"), timeout_s=30, transport="torch_p2p", link=2,
                trace_context=(("traceparent", "00-ab-cd-01"),))


@pytest.mark.parametrize("message", [
    SPEC, PushResult(bytes=10, pieces=2, seconds=0.5), PushResult(error="decode rank 1 is gone"),
    Reservation((7, 8, 9)), ExpertLoad(((1, 2), (3, 4))), RankError(2, "Traceback ...\nValueError: x"),
])
def test_every_message_reads_back_as_it_was_written(message):
    assert decode(encode(message), type(message)) == message


def test_a_message_of_another_type_or_version_is_refused_naming_the_key():
    with pytest.raises(ControlError, match="push/r1: not a Reservation message: expected Reservation v1, got Push"):
        decode(encode(SPEC), Reservation, "push/r1")
    with pytest.raises(ControlError, match="expected Reservation v1, got Reservation v2"):
        decode(b'{"v": 2, "type": "Reservation", "body": {"block_table": [1]}}', Reservation)
    with pytest.raises(ControlError, match="expected int"):
        decode(b'{"v": 1, "type": "Reservation", "body": {"block_table": ["1"]}}', Reservation)
    with pytest.raises(ControlError, match="not a Reservation"):
        decode(b"\x80\x04K\x01.", Reservation)  # a pickle is not a message


def test_a_call_crosses_as_data_and_its_arguments_are_typed_by_the_function():
    parallel = ParallelConfig(tp=2, experts=ExpertAttachment(address="h:1", group="attach-1", expert_ranks=2))
    hook = Call.of(accept_kv, ranks=2, shared={"grpc_stream": None, "torch_p2p": "127.0.0.1:5"})
    call = Call.of(follow_plans, parallel=parallel, timeout_s=60, source="m.gguf", dtype="float32",
                   layout={"device": "cpu", "block_size": 16}, kv_memory=Call.of(shared_zeros), hook=hook)
    received = decode(encode(call), Call).resolve()
    assert received.func is follow_plans
    assert received.keywords == {"parallel": parallel, "timeout_s": 60.0, "source": "m.gguf", "dtype": "float32",
                                 "layout": {"device": "cpu", "block_size": 16}, "kv_memory": Call.of(shared_zeros),
                                 "hook": hook}  # the nested config and calls come back typed
    assert received.keywords["kv_memory"].resolve().func is shared_zeros
    assert received.keywords["hook"].resolve().keywords == {"ranks": 2, "shared": hook.kwargs["shared"]}


def test_a_call_names_only_module_level_functions_of_the_project():
    with pytest.raises(ControlError, match="module-level function"):
        Call("os:system", {"command": "true"}).resolve()
    with pytest.raises(ControlError, match="module-level function"):
        Call.of(lambda rank: rank)
    with pytest.raises(ControlError, match="arguments of .*expected int"):
        Call.of(accept_kv, ranks="two", shared={}).resolve()


def test_a_value_that_is_not_data_cannot_be_sent():
    with pytest.raises(TypeError, match="object cannot be a control message field"):
        encode(Reservation((object(),)))


@pytest.fixture
def store():
    hosted = Store.host("127.0.0.1", 0, datetime.timedelta(seconds=10))
    yield hosted
    hosted.raw = None


def test_a_store_holds_typed_messages_under_typed_keys(store):
    peer = Store.connect(store.address)
    assert peer.peek(PUSH.key("r1")) is None
    store.put(PUSH.key("r1"), SPEC)
    assert peer.get(PUSH.key("r1")) == SPEC
    with pytest.raises(TypeError, match="push/r1 holds PushSpec, got Reservation"):
        store.put(PUSH.key("r1"), Reservation((1,)))
    peer.delete(PUSH.key("r1"))
    assert not store.has(PUSH.key("r1"))
    store.put(FOLLOWER, Call.of(accept_kv, ranks=3, shared={}))
    assert peer.get(FOLLOWER).resolve().keywords == {"ranks": 3, "shared": {}}


def test_a_wait_for_results_that_never_come_ends_in_a_timeout_naming_them(store):
    store.put(PUSH_RESULT.key("r1", 1), PushResult(bytes=1))
    keys = [PUSH_RESULT.key("r1", 1), PUSH_RESULT.key("r1", 2)]
    with pytest.raises(TimeoutError, match="push-result/r1/2"):
        store.wait(keys, datetime.timedelta(milliseconds=100))


def test_a_failed_push_result_raises_naming_the_rank():
    with pytest.raises(TransferError, match="prefill rank 3: decode rank 1 is gone"):
        PushResult(error="decode rank 1 is gone").stats(3)


def test_claims_arrive_in_order_and_the_listener_stops_when_told(store):
    stop, seen = threading.Event(), []

    def listen():
        for k, ranks in Store.connect(store.address).claims("pair", stop, poll_s=0.001):
            seen.append((k, ranks))
            if len(seen) == 3:
                stop.set()

    listener = threading.Thread(target=listen)
    listener.start()
    claimer = Store.connect(store.address)
    assert [claimer.claim("pair", ranks) for ranks in (2, 1, 4)] == [1, 2, 3]
    listener.join(timeout=30)
    assert not listener.is_alive() and seen == [(1, 2), (2, 1), (3, 4)]


def test_rank_errors_are_read_back_by_rank(store):
    store.put(RANK_ERROR.key(1), RankError(1, "boom"))
    assert Store.connect(store.address).peek(RANK_ERROR.key(1)).traceback == "boom"
    assert Family("error", RankError).key(1) == RANK_ERROR.key(1)


ids = st.text(st.characters(blacklist_characters="\0", blacklist_categories=("Cs",)), max_size=12)
chunks = st.builds(ChunkPlan, st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=40).map(tuple),
                   st.integers(0, 2**31 - 1), st.lists(st.integers(0, 2**31 - 1), max_size=10).map(tuple),
                   st.booleans())


@given(st.lists(chunks, max_size=6), st.lists(ids, max_size=3), st.data())
def test_a_step_plan_reads_back_as_it_was_written(chunk_list, ended, data):
    pushes = data.draw(st.lists(st.tuples(st.integers(0, max(0, len(chunk_list) - 1)), ids), max_size=3))
    plan = StepPlan(tuple(chunk_list), tuple(ended), tuple(pushes))
    assert step_plan.decode(step_plan.encode(plan)) == plan


def test_a_step_plan_of_another_wire_version_is_refused():
    payload = bytearray(step_plan.encode(StepPlan((ChunkPlan((1,), 0, (0,), True),))))
    payload[0] = 9
    with pytest.raises(ValueError, match="step plan wire version 9, expected 1"):
        step_plan.decode(bytes(payload))
