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
            "CHATSVC_ADMIN_KEY": "admin-key-123456789",
            "CHATSVC_API_KEYS": "acme:key-aaaa-1111-bbbb, globex:key:with:colons:2222",
            "CHATSVC_MAX_TOKENS_CAP": "99",
            "CHATSVC_MAX_STREAMS_PER_TENANT": "2",
            "CHATSVC_TURN_LOCK_TTL_S": "5",
        }
    )
    assert (settings.host, settings.port) == ("0.0.0.0", 9000)
    assert settings.redis_url == "redis://redis:6379/0"
    assert settings.key_prefix == "prod"
    assert settings.session_ttl_s == 3600
    assert settings.api_keys == (
        ("acme", "key-aaaa-1111-bbbb"),
        ("globex", "key:with:colons:2222"),
    )
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
        ({"CHATSVC_API_KEYS": "acme:short"}, "'acme' must be at least 16"),
        ({"CHATSVC_API_KEYS": "a:key-000000000001,a:key-000000000002"}, "once"),
        ({"CHATSVC_API_KEYS": "a:key-000000000001,b:key-000000000001"}, "distinct"),
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
    assert parse_api_keys(" , acme:key-123456789012 ,") == (("acme", "key-123456789012"),)


@pytest.mark.parametrize("key", ["k" * 8, "0123456789abcde"])
def test_keys_the_tenant_check_would_refuse_are_a_settings_error(key):
    # 8-15 characters used to pass here and then crash start-up in the store.
    with pytest.raises(SettingsError, match=r"tenant 'acme' must be at least 16 characters"):
        Settings.from_env({"CHATSVC_API_KEYS": f"globex:{'g' * 16},acme:{key}"})
    # Settings built in code (tests, embedding) are held to the same rule.
    with pytest.raises(SettingsError, match="'acme'"):
        Settings(api_keys=(("acme", key),)).validate()
    assert Settings.from_env({"CHATSVC_API_KEYS": f"acme:{key}x" + "y" * 16}).auth_enabled


def test_admin_key_and_tenant_names_follow_the_same_rules():
    with pytest.raises(SettingsError, match="admin key must be at least 16"):
        Settings.from_env({"CHATSVC_ADMIN_KEY": "admin-key-12"})
    with pytest.raises(SettingsError, match="tenant name"):
        Settings(api_keys=(("x" * 201, "k" * 32),)).validate()
    with pytest.raises(SettingsError, match="tenant name"):
        Settings(api_keys=((" ", "k" * 32),)).validate()


def test_a_malformed_entry_is_named_by_position_not_echoed():
    with pytest.raises(SettingsError, match="entry 2 is not tenant:key") as raised:
        Settings.from_env({"CHATSVC_API_KEYS": "acme:key-123456789012,bare-secret-key-0001"})
    assert "bare-secret-key-0001" not in str(raised.value)


def test_an_unknown_variable_is_warned_about_naming_the_closest_setting(caplog):
    env = {"CHATSVC_MAX_TOKEN_CAP": "5", "CHATSVC_PORT": "9000", "CHATSVC_XYZZY": "1"}
    with caplog.at_level("WARNING", logger="chatsvc.config"):
        settings = Settings.from_env(env)
    assert settings.port == 9000
    warnings = [r.getMessage() for r in caplog.records if r.name == "chatsvc.config"]
    assert len(warnings) == 2, warnings
    assert "CHATSVC_MAX_TOKEN_CAP" in warnings[0] and "CHATSVC_MAX_TOKENS_CAP" in warnings[0]
    assert "CHATSVC_XYZZY" in warnings[1] and "did you mean" not in warnings[1]


def test_every_documented_variable_is_known():
    # docs/api.md's table lists the variables; none may be warned about as unknown.
    import re
    from pathlib import Path

    from chatsvc.config import known_variables

    doc = (Path(__file__).parents[2] / "docs" / "api.md").read_text()
    rows = "\n".join(line for line in doc.splitlines() if line.startswith("| `CHATSVC_"))
    documented = set(re.findall(r"CHATSVC_[A-Z0-9_]*[A-Z0-9]", rows))
    assert len(documented) >= 25
    assert documented - set(known_variables()) == set()
