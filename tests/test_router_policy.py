"""Routing policies and conditional disaggregation, as pure functions over registry snapshots."""

from __future__ import annotations

import pytest

from engine.errors import Overloaded
from mesh.registry import InstanceInfo, InstanceState, Role
from router.policy import Decision, NoInstance, pick, route


def inst(iid, role=Role.DECODE, active=0, used=0, total=100, state=InstanceState.SERVING):
    return InstanceInfo(id=iid, role=role, address=f"h:{iid}", pid=1, model="m", active_requests=active,
                        kv_blocks_used=used, kv_blocks_total=total, state=state)


def test_round_robin_cycles_in_id_order():
    pool = [inst("b"), inst("a"), inst("c")]
    assert [pick("round_robin", pool, turn, {}).id for turn in range(4)] == ["a", "b", "c", "a"]


def test_least_load_prefers_fewer_requests_then_more_free_blocks():
    pool = [inst("a", active=2), inst("b", active=1, used=90), inst("c", active=1, used=10)]
    assert pick("least_load", pool, 0, {}).id == "c"


def test_prefix_aware_prefers_the_longest_cached_prefix_then_load():
    pool = [inst("a", active=0), inst("b", active=5), inst("c", active=1)]
    assert pick("prefix_aware", pool, 0, {"b": 3, "c": 3}).id == "c"
    assert pick("prefix_aware", pool, 0, {}).id == "a"


def route_for(prompt_tokens, prefills, hits=None, threshold=64, decodes=None):
    return route(prompt_tokens=prompt_tokens, decodes=decodes or [inst("d1")], prefills=prefills,
                 policy="prefix_aware", turn=0, prefix_hits=hits or {}, block_size=16,
                 local_prefill_max_tokens=threshold, prefill_saturation=4)


def test_long_uncached_prompts_go_to_the_least_loaded_prefill_instance():
    r = route_for(500, [inst("p1", Role.PREFILL, active=2), inst("p2", Role.PREFILL, active=1)])
    assert r.prefill.id == "p2" and r.uncached_tokens == 500 and "disaggregated" in r.reason
    assert r.decision is Decision.DISAGGREGATED


def test_short_or_mostly_cached_prompts_are_prefilled_on_decode():
    prefills = [inst("p1", Role.PREFILL)]
    assert route_for(40, prefills).prefill is None
    cached = route_for(500, prefills, hits={"d1": 30})  # 480 tokens cached: 20 left
    assert cached.prefill is None and cached.uncached_tokens == 20 and "<= local_prefill_max_tokens=64" in cached.reason
    assert cached.decision is Decision.LOCAL_SHORT


def test_a_saturated_or_absent_prefill_pool_means_prefill_on_decode():
    alone = route_for(500, [])
    assert alone.prefill is None and alone.decision is Decision.LOCAL_NO_PREFILL
    busy = route_for(500, [inst("p1", Role.PREFILL, active=4)])
    assert busy.prefill is None and "active requests" in busy.reason and busy.decision is Decision.LOCAL_SATURATED
    draining = route_for(500, [inst("p1", Role.PREFILL, state=InstanceState.DRAINING)])
    assert draining.prefill is None


def test_no_serving_decode_instance_is_an_error():
    with pytest.raises(NoInstance, match="no decode instance is serving"):
        route_for(10, [], decodes=[inst("d1", state=InstanceState.DRAINING)])
    with pytest.raises(ValueError, match="policy must be one of"):
        pick("random", [inst("a")], 0, {})



def test_a_request_no_decode_instance_has_room_for_is_shed_with_the_reasons():
    full = [inst("d1", used=95), inst("d2", active=300)]
    with pytest.raises(Overloaded, match=r"d1: 5 free KV blocks, the prompt needs 7; d2: 300 requests >= 256"):
        route_for(100, [], decodes=full)
    roomy = route_for(100, [], decodes=[*full, inst("d3", used=50)])
    assert roomy.decode.id == "d3"  # the one with room
    assert route_for(100, [], hits={"d1": 4}, decodes=full[:1]).decode.id == "d1"  # its cached prefix needs less
