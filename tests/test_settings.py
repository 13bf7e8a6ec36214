"""Service settings: defaults, then INFERMESH_* variables, then flags; bad values named."""

from __future__ import annotations

import pytest

from mesh.settings import DecodeSettings, PrefillSettings, RouterSettings, load


def test_environment_overrides_defaults_and_flags_override_the_environment():
    env = {"INFERMESH_TP": "2", "INFERMESH_PORT": "7001", "INFERMESH_HEARTBEAT_S": "0.5"}
    s = load(DecodeSettings, {"port": 7002, "dtype": None}, env)
    assert (s.tp, s.port, s.heartbeat_s, s.dtype) == (2, 7002, 0.5, "bfloat16")


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


def test_an_optional_setting_reads_none_and_a_secret_stays_out_of_the_repr():
    assert load(RouterSettings, {}, {"INFERMESH_HTTP_PORT": "none"}).http_port is None
    settings = load(RouterSettings, {}, {"INFERMESH_HTTP_PORT": "0", "INFERMESH_API_TOKEN": "s3cret"})
    assert settings.http_port == 0 and settings.api_token == "s3cret" and "s3cret" not in repr(settings)
    with pytest.raises(ValueError, match="INFERMESH_HTTP_PORT='eighty' is not a valid int"):
        load(RouterSettings, {}, {"INFERMESH_HTTP_PORT": "eighty"})
