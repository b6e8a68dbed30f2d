"""Settings: parsing CHATSVC_* variables and refusing unsafe or malformed values."""

from __future__ import annotations

import pytest

from chatsvc.config import Settings, SettingsError, parse_api_keys


def test_defaults_are_local_and_valid():
    settings = Settings.from_env({})
    assert settings.host == "127.0.0.1"
    assert settings.port == 8000
    assert settings.redis_url is None
    assert not settings.auth_enabled


def test_reads_every_variable():
    settings = Settings.from_env(
        {
            "CHATSVC_HOST": "0.0.0.0",
            "CHATSVC_PORT": "9000",
            "CHATSVC_REDIS_URL": "redis://redis:6379/0",
            "CHATSVC_KEY_PREFIX": "prod",
            "CHATSVC_SESSION_TTL_S": "3600",
            "CHATSVC_ADMIN_KEY": "admin-key-123",
            "CHATSVC_API_KEYS": "acme:key-aaaa-1111, globex:key:with:colons",
            "CHATSVC_MAX_TOKENS_CAP": "99",
            "CHATSVC_MAX_STREAMS_PER_TENANT": "2",
            "CHATSVC_TURN_LOCK_TTL_S": "5",
        }
    )
    assert (settings.host, settings.port) == ("0.0.0.0", 9000)
    assert settings.redis_url == "redis://redis:6379/0"
    assert settings.key_prefix == "prod"
    assert settings.session_ttl_s == 3600
    assert settings.api_keys == (("acme", "key-aaaa-1111"), ("globex", "key:with:colons"))
    assert settings.limits.max_tokens_cap == 99
    assert settings.limits.max_streams_per_tenant == 2
    assert settings.turn_lock_ttl_s == 5


def test_refuses_public_host_without_keys():
    with pytest.raises(SettingsError, match="without API keys"):
        Settings.from_env({"CHATSVC_HOST": "0.0.0.0"})
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert Settings.from_env({"CHATSVC_HOST": host}).host == host


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"CHATSVC_PORT": "eighty"}, "CHATSVC_PORT must be an integer"),
        ({"CHATSVC_PORT": "70000"}, "port"),
        ({"CHATSVC_SESSION_TTL_S": "0"}, "TTL"),
        ({"CHATSVC_KEY_PREFIX": "has space"}, "key prefix"),
        ({"CHATSVC_MAX_N": "0"}, "max_n"),
        ({"CHATSVC_API_KEYS": "acme"}, "not tenant:key"),
        ({"CHATSVC_API_KEYS": "acme:short"}, "under 8"),
        ({"CHATSVC_API_KEYS": "a:key-00000001,a:key-00000002"}, "once"),
        ({"CHATSVC_API_KEYS": "a:key-00000001,b:key-00000001"}, "distinct"),
        ({"CHATSVC_ADMIN_KEY": "short"}, "admin key"),
        ({"CHATSVC_TURN_LOCK_TTL_S": "0"}, "turn lock TTL"),
    ],
)
def test_bad_values_raise_clear_errors(env, match):
    with pytest.raises(SettingsError, match=match):
        Settings.from_env(env)


def test_overrides_are_validated():
    settings = Settings.from_env({})
    assert settings.with_overrides(port=1234, host=None).port == 1234
    with pytest.raises(SettingsError):
        settings.with_overrides(host="10.0.0.1")


def test_parse_api_keys_skips_blank_entries():
    assert parse_api_keys(" , acme:key-12345678 ,") == (("acme", "key-12345678"),)
