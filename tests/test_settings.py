"""Service settings: defaults, then INFERMESH_* variables, then flags; bad values named."""

from __future__ import annotations

import pytest

from mesh.settings import DecodeSettings, PrefillSettings, RouterSettings, load, parse_flags, to_flags


def test_environment_overrides_defaults_and_flags_override_the_environment():
    env = {"INFERMESH_TP": "2", "INFERMESH_PORT": "7001", "INFERMESH_HEARTBEAT_S": "0.5"}
    s = load(DecodeSettings, parse_flags(DecodeSettings, ["--port", "7002"]), env)
    assert (s.tp, s.port, s.heartbeat_s, s.dtype) == (2, 7002, 0.5, "bfloat16")
    assert load(DecodeSettings, parse_flags(DecodeSettings, ["--metrics-port", "none"]), {}).metrics_port is None


def test_a_bad_variable_is_named_with_its_value():
    with pytest.raises(ValueError, match="INFERMESH_TP='two' is not a valid int"):
        load(DecodeSettings, {}, {"INFERMESH_TP": "two"})


def test_values_are_validated():
    with pytest.raises(ValueError, match="policy must be round_robin, least_load or prefix_aware, got 'random'"):
        load(RouterSettings, {"policy": "random"}, {})
    with pytest.raises(ValueError, match=r"need 0 < heartbeat_s \(5.0\) < ttl_s \(5.0\)"):
        load(RouterSettings, {"heartbeat_s": 5.0}, {})
    with pytest.raises(ValueError, match="unknown setting"):
        load(RouterSettings, {"tp": 2}, {})
    with pytest.raises(ValueError, match=r"health_port must be in \[0, 65535\], got 70000"):
        load(DecodeSettings, {"health_port": 70000}, {})
    assert load(PrefillSettings, {}, {"INFERMESH_SHARED_KV_CACHE": "true"}).shared_kv_cache
    with pytest.raises(ValueError, match="shared_kv_cache holds the KV cache in /dev/shm, host memory: device must be"):
        load(PrefillSettings, {"shared_kv_cache": True, "device": "cuda"}, {})
    with pytest.raises(ValueError, match="mooncake_protocol must be one of tcp, rdma, got 'udp'"):
        load(DecodeSettings, {"mooncake_protocol": "udp"}, {})
    with pytest.raises(ValueError, match="kv_pool must be none or mooncake://HOST:PORT, got 'redis://h:1'"):
        load(DecodeSettings, {"kv_pool": "redis://h:1"}, {})
    with pytest.raises(ValueError, match="kv_pool serves engines of one rank for now, got cp=2"):
        load(PrefillSettings, {"kv_pool": "mooncake://h:1", "cp": 2}, {})
    assert load(DecodeSettings, {}, {"INFERMESH_KV_POOL": "mooncake://pool:50051"}).kv_pool_master == "pool:50051"


def test_an_optional_setting_reads_none_and_a_secret_stays_out_of_the_repr():
    assert load(RouterSettings, {}, {"INFERMESH_HTTP_PORT": "none"}).http_port is None
    settings = load(RouterSettings, {}, {"INFERMESH_HTTP_PORT": "0", "INFERMESH_API_TOKEN": "s3cret"})
    assert settings.http_port == 0 and settings.api_token == "s3cret" and "s3cret" not in repr(settings)
    with pytest.raises(ValueError, match="INFERMESH_HTTP_PORT='eighty' is not a valid int"):
        load(RouterSettings, {}, {"INFERMESH_HTTP_PORT": "eighty"})


@pytest.mark.parametrize("settings", [
    PrefillSettings(model="m.gguf", dtype="float32", cp=2, cp_method="pass_q", shared_kv_cache=True, cpus="0-1",
                    kv_cache_bytes=3 << 20, metrics_port=None, health_port=9001, heartbeat_s=0.25,
                    batch_invariant=False),
    DecodeSettings(registry="redis://127.0.0.1:6379", cpus="0", borrow_cpus="1", reservation_lease_s=7.5,
                   local_ranks=1, experts="127.0.0.1:5000", mooncake_protocol="rdma", mooncake_devices="mlx5_0",
                   kv_pool="mooncake://127.0.0.1:50051"),
    RouterSettings(http_port=0, policy="prefix_aware", kv_transport="torch_p2p", migration_limit=0, port=8000),
    DecodeSettings(),
], ids=["prefill", "decode", "router", "defaults"])
def test_flags_rendered_from_settings_load_the_same_settings(settings):
    cls = type(settings)
    assert load(cls, parse_flags(cls, to_flags(settings, {})), {}) == settings
    assert to_flags(cls(), {}) == []  # nothing to say for the defaults


def test_rendered_flags_override_the_environment_where_it_differs_and_never_carry_a_secret():
    env = {"INFERMESH_DTYPE": "float32", "INFERMESH_TP": "2", "INFERMESH_ADMIN_TOKEN": "s3cret"}
    settings = load(DecodeSettings, {"dtype": "bfloat16"}, env)  # the flag wins over the environment
    flags = to_flags(settings, env)
    assert flags == ["--dtype", "bfloat16"]  # tp=2 and the token come from the same environment in the child
    assert load(DecodeSettings, parse_flags(DecodeSettings, flags), env) == settings
    assert "s3cret" not in to_flags(load(RouterSettings, {"api_token": "s3cret"}, {}), {})
