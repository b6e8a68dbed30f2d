"""Service settings, read once from ``CHATSVC_*`` environment variables.

``Settings.from_env`` is the one place the service reads its environment: the
engine's settings (model, cache sizes, device, the data directory) are not
repeated here, they are ``EngineConfig.from_env`` of the same variables, built
with the rest and handed down as ``Settings.engine``.
"""

from __future__ import annotations

import difflib
import ipaddress
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from chatsvc import paths
from chatsvc.engine.config import EngineConfig
from chatsvc.store.validate import MAX_NAME_CHARS, MIN_API_KEY_CHARS

log = logging.getLogger(__name__)

ENV_PREFIX = "CHATSVC_"
LOCAL_TENANT = "local"
# Variables of ours read outside ``Settings.from_env``: the chat client's key, the
# kernels' backend, ./dev's torch pin, the fuzz tests' example count.
_OTHER_VARIABLES = ("API_KEY", "KERNEL_BACKEND", "TORCH_VERSION", "FUZZ_EXAMPLES")
# The store's key names allow only these characters.
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# A replica id is a metrics label value and a log field: short and plain.
_REPLICA_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
# Names a local-mode server answers to by default (any port): a page that
# rebinds its own DNS name to 127.0.0.1 still sends its own name as Host.
LOOPBACK_HOST_NAMES = ("localhost", "127.0.0.1", "[::1]")
# A web origin as browsers send it: scheme://host[:port], nothing after (a desktop
# app's own scheme, tauri://localhost, included); "*" may stand for any part.
_ORIGIN_RE = re.compile(r"^[a-z*][a-z0-9+.*-]*://[a-z0-9*_.:\[\]-]+$", re.IGNORECASE)
# A DNS name or an IPv4 address (no port, no path); IPv6 literals are checked apart.
_HOST_NAME_RE = re.compile(r"^[a-z0-9_]([a-z0-9_.-]{0,251}[a-z0-9_])?$")


class SettingsError(ValueError):
    """A setting is missing, malformed or inconsistent with another one."""


@dataclass(frozen=True)
class Limits:
    """Per-request and per-tenant limits; every one is enforced before any state changes."""

    max_body_bytes: int = 1_000_000
    max_message_chars: int = 32_000
    # Messages in one rendered conversation (an OpenAI request's list), checked before
    # any rendering: each one costs template and tokenizer work however short it is.
    max_messages: int = 1024
    max_tokens_cap: int = 2048
    max_n: int = 8
    max_sessions_per_tenant: int = 10_000
    # Messages one session keeps on all its branches (regenerated answers, edits,
    # conversation items): each is stored, so the count is bounded.
    max_messages_per_session: int = 10_000
    # Bytes one session / one tenant stores in the shared Redis (text, token ids,
    # records; chatsvc/store/commit.py counts them): a write past either is a 429.
    max_session_bytes: int = 64 * 2**20
    max_tenant_bytes: int = 8 * 2**30
    max_streams_per_tenant: int = 8
    # Private system prompts one tenant may keep, and shared ones the operator may publish.
    max_system_prompts_per_tenant: int = 100
    max_shared_system_prompts: int = 100
    # Seconds the whole request body may take to arrive before 408 (slow-loris guard).
    body_read_timeout_s: int = 30
    # Bytes one OpenAI completion's answer (or its whole stream) may reach, by an upper
    # estimate from the request: n choices with logprobs of long prompts turn a small
    # body into a huge answer, built while the tenant's generation slot is held.
    max_response_bytes: int = 16 * 1024 * 1024
    # Requests one tenant may start per second on one replica, in bursts of up to
    # ``tenant_request_burst`` (a token bucket, chatsvc/api/shared/request_rate.py),
    # checked before the body is read: a little over waits its turn, further over
    # is a 429 with Retry-After. 0: no limit.
    tenant_requests_per_s: int = 50
    tenant_request_burst: int = 100

    def validate(self) -> None:
        for name, value in vars(self).items():
            lowest = 0 if name == "tenant_requests_per_s" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
                what = "a non-negative" if lowest == 0 else "a positive"
                raise SettingsError(f"{name} must be {what} integer, got {value!r}")


@dataclass(frozen=True)
class Settings:
    """Everything the service needs besides the engine's own configuration.

    ``api_keys`` maps tenant names to their bootstrap API keys. With none, the
    service is a local single-user tool: it serves one tenant without auth and
    refuses any host that is not a loopback address (anyone who can reach the
    port could otherwise use it).

    ``allowed_hosts`` are the names a request's ``Host`` header may carry (any
    port). Empty = the default: loopback names in local mode, any name with keys.
    ``("*",)`` turns the check off, which local mode refuses.

    ``cors_origins`` are the web origins whose pages may call the API from a
    browser (CORS). Empty = none, the default: no page on another origin can read
    an answer. ``("*",)`` = every origin, which local mode refuses as it refuses
    every host name.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    redis_url: str | None = None
    # None = ~/.cache/chatsvc (chatsvc.paths).
    data_dir: Path | None = None
    key_prefix: str = "chatsvc"
    session_ttl_s: int | None = None
    # A turn lock is renewed every third of this while its turn runs; a short TTL
    # only bounds how long a crashed replica's turn keeps its session busy (409).
    turn_lock_ttl_s: int = 30
    admin_key: str | None = None
    api_keys: tuple[tuple[str, str], ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    limits: Limits = field(default_factory=Limits)
    # Opt-in debugging aid: log prompt and completion text (off: lengths only).
    log_text: bool = False
    # The ``replica`` label of this process's metrics; None = "<hostname>:<port>".
    replica_id: str | None = None
    # from_env: EngineConfig.from_env of the same variables; tests pass a small config.
    engine: EngineConfig = field(default_factory=EngineConfig)

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys)

    def host_allow_list(self) -> frozenset[str] | None:
        """The ``Host`` names served (lower case, IPv6 in brackets); None = any name.

        The bind host is always on the list, so a server bound to a name answers to it.
        """
        names = tuple(normalize_host_name(name) for name in self.allowed_hosts)
        if "*" in names:
            return None
        if not names:
            if self.auth_enabled:
                return None
            names = LOOPBACK_HOST_NAMES
        return frozenset((*names, normalize_host_name(self.host)))

    def cors_allow_list(self) -> list[str]:
        """The origins allowed to call from a browser, as browsers write them (lower case)."""
        return [origin.lower() for origin in self.cors_origins]

    def redis_dir(self) -> Path:
        """Where the embedded server keeps its append-only file when no URL is set."""
        return paths.data_dir(self.data_dir) / "redis"

    def validate(self) -> Settings:
        """Raise SettingsError on the first inconsistency; returns self for chaining."""
        if not self.host:
            raise SettingsError("host must not be empty")
        if not 0 <= self.port <= 65535:
            raise SettingsError(f"port must be in 0..65535, got {self.port}")
        if not _PREFIX_RE.match(self.key_prefix):
            raise SettingsError(
                f"key prefix must be 1-64 of [A-Za-z0-9_.-], got {self.key_prefix!r}"
            )
        if self.session_ttl_s is not None and self.session_ttl_s < 1:
            raise SettingsError(f"session TTL must be positive seconds, got {self.session_ttl_s}")
        if not 1 <= self.turn_lock_ttl_s <= 3600:
            raise SettingsError(f"turn lock TTL must be 1..3600 s, got {self.turn_lock_ttl_s}")
        if self.admin_key is not None and len(self.admin_key) < MIN_API_KEY_CHARS:
            raise SettingsError(f"admin key must be at least {MIN_API_KEY_CHARS} characters")
        for name, key in self.api_keys:
            check_tenant_entry(name, key)
        names = [name for name, _ in self.api_keys]
        if len(set(names)) != len(names):
            raise SettingsError("each tenant may appear once in CHATSVC_API_KEYS")
        keys = [key for _, key in self.api_keys]
        if len(set(keys)) != len(keys):
            raise SettingsError("API keys must be distinct")
        if self.admin_key is not None and self.admin_key in keys:
            raise SettingsError("the admin key must differ from every tenant key")
        self.limits.validate()
        if self.replica_id is not None and not _REPLICA_RE.match(self.replica_id):
            raise SettingsError(
                f"replica id must be 1-64 of [A-Za-z0-9_.:-], got {self.replica_id!r}"
            )
        for name in self.allowed_hosts:
            if name != "*" and not is_valid_host_name(normalize_host_name(name)):
                raise SettingsError(
                    f"allowed host {name!r} is not a host name or IP address "
                    "(list names without a port: every port is accepted)"
                )
        for origin in self.cors_origins:
            if origin != "*" and not _ORIGIN_RE.match(origin):
                raise SettingsError(
                    f"CORS origin {origin!r} is not an origin: scheme://host[:port], no path "
                    "(e.g. http://localhost:3000; '*' within it matches any part)"
                )
        if not self.auth_enabled and "*" in self.cors_origins:
            raise SettingsError(
                "CHATSVC_CORS_ORIGINS=* needs CHATSVC_API_KEYS: without keys, any web page "
                "the user opens could drive the service; name the frontend's origin instead"
            )
        if not self.auth_enabled and "*" in self.allowed_hosts:
            raise SettingsError(
                "CHATSVC_ALLOWED_HOSTS=* needs CHATSVC_API_KEYS: without keys, any web page "
                "could drive the service through DNS rebinding"
            )
        if not self.auth_enabled and not is_loopback(self.host):
            raise SettingsError(
                f"refusing to bind {self.host!r} without API keys: set CHATSVC_API_KEYS "
                "(tenant:key,...) or bind a loopback address such as 127.0.0.1"
            )
        return self

    def with_overrides(self, **changes: Any) -> Settings:
        """A validated copy with some fields replaced (the CLI's --host/--port)."""
        changes = {k: v for k, v in changes.items() if v is not None}
        return replace(self, **changes).validate()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Read and validate ``CHATSVC_*`` variables; unknown values raise SettingsError."""
        env = os.environ if environ is None else environ
        warn_unknown_variables(env)

        def get(name: str) -> str | None:
            value = env.get(ENV_PREFIX + name)
            return value.strip() if value is not None and value.strip() else None

        limits = Limits(
            **{
                name: _parse_int(ENV_PREFIX + name.upper(), get(name.upper()), default)
                for name, default in vars(Limits()).items()
            }
        )
        ttl = get("SESSION_TTL_S")
        try:
            engine = EngineConfig.from_env(env)
        except ValueError as exc:
            raise SettingsError(f"engine settings: {exc}") from None
        data_dir = Path(get("DATA_DIR")).expanduser() if get("DATA_DIR") else None
        if engine.kv_disk_dir is None:
            # The disk KV tier is on by default, beside the embedded Redis's data, so a
            # restarted service finds its sessions' KV again ($CHATSVC_KV_DISK_DIR moves it).
            engine = replace(engine, kv_disk_dir=str(paths.data_dir(data_dir) / "kv"))
        return cls(
            host=get("HOST") or "127.0.0.1",
            port=_parse_int(ENV_PREFIX + "PORT", get("PORT"), 8000),
            redis_url=get("REDIS_URL"),
            data_dir=data_dir,
            key_prefix=get("KEY_PREFIX") or "chatsvc",
            session_ttl_s=None if ttl is None else _parse_int(ENV_PREFIX + "SESSION_TTL_S", ttl, 0),
            turn_lock_ttl_s=_parse_int(ENV_PREFIX + "TURN_LOCK_TTL_S", get("TURN_LOCK_TTL_S"), 30),
            admin_key=get("ADMIN_KEY"),
            api_keys=parse_api_keys(get("API_KEYS") or ""),
            allowed_hosts=_parse_list(get("ALLOWED_HOSTS")),
            cors_origins=_parse_list(get("CORS_ORIGINS")),
            limits=limits,
            log_text=_parse_bool(ENV_PREFIX + "LOG_TEXT", get("LOG_TEXT")),
            replica_id=get("REPLICA_ID"),
            engine=engine,
        ).validate()


def known_variables() -> tuple[str, ...]:
    """Every ``CHATSVC_*`` variable chatsvc reads (docs/api.md lists them)."""
    names = [f.name for f in fields(Settings) if f.name not in ("limits", "engine")]
    names += [f.name for f in fields(Limits)] + [f.name for f in fields(EngineConfig)]
    names += [name.lower() for name in _OTHER_VARIABLES]
    return tuple(sorted({ENV_PREFIX + name.upper() for name in names}))


def warn_unknown_variables(env: Mapping[str, str]) -> list[str]:
    """Log a warning for each ``CHATSVC_*`` variable chatsvc does not read, naming the
    closest known one: a misspelt limit would otherwise keep its default unnoticed.
    Returns the unknown names."""
    known = known_variables()
    unknown = sorted(name for name in env if name.startswith(ENV_PREFIX) and name not in known)
    # Compared without the prefix, which every name shares and would make any two alike.
    suffixes = [name.removeprefix(ENV_PREFIX) for name in known]
    for name in unknown:
        closest = difflib.get_close_matches(name.removeprefix(ENV_PREFIX), suffixes, n=1)
        hint = f"; did you mean {ENV_PREFIX}{closest[0]}?" if closest else ""
        log.warning("ignoring unknown setting %s%s", name, hint)
    return unknown


def parse_api_keys(spec: str) -> tuple[tuple[str, str], ...]:
    """Parse ``tenant:key,tenant2:key2``; a key may itself contain ':'."""
    pairs = []
    for number, item in enumerate(filter(None, (part.strip() for part in spec.split(","))), 1):
        tenant, sep, key = item.partition(":")
        if not sep or not tenant.strip() or not key.strip():
            # Numbered, not quoted: a malformed entry may be a bare key.
            raise SettingsError(f"CHATSVC_API_KEYS entry {number} is not tenant:key")
        pairs.append(check_tenant_entry(tenant.strip(), key.strip()))
    return tuple(pairs)


def normalize_host_name(name: str) -> str:
    """``name`` as it is compared with a Host header: lower case, IP addresses in their
    canonical form, an IPv6 address in brackets (as it appears in a Host header)."""
    name = name.strip().lower()
    inner = name[1:-1] if name.startswith("[") and name.endswith("]") else name
    try:
        address = ipaddress.ip_address(inner)
    except ValueError:
        return name
    return f"[{address.compressed}]" if address.version == 6 else str(address)


def is_valid_host_name(name: str) -> bool:
    """True for a normalized DNS name, IPv4 address or bracketed IPv6 address."""
    if name.startswith("[") and name.endswith("]"):
        try:
            return ipaddress.ip_address(name[1:-1]).version == 6
        except ValueError:
            return False
    return bool(_HOST_NAME_RE.match(name))


def check_tenant_entry(name: str, key: str) -> tuple[str, str]:
    """One configured tenant, checked by the rules the store and the key check use.

    Names are the tenants' identity in the store, which refuses blank or overlong
    ones; keys are compared as plain sha256 digests, which is only safe for long
    keys. Checking both here makes a bad entry a settings error, not a crash later.
    """
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME_CHARS:
        raise SettingsError(f"tenant name {name!r} must be 1-{MAX_NAME_CHARS} characters")
    if not isinstance(key, str) or len(key) < MIN_API_KEY_CHARS:
        raise SettingsError(
            f"API key of tenant {name!r} must be at least {MIN_API_KEY_CHARS} characters"
        )
    return name, key


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _parse_list(raw: str | None) -> tuple[str, ...]:
    """A comma-separated list; blank entries are skipped."""
    return tuple(filter(None, (item.strip() for item in (raw or "").split(","))))


def _parse_bool(name: str, raw: str | None) -> bool:
    if raw is None:
        return False
    value = raw.lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{name} must be a boolean (1/0, true/false), got {raw!r}")


def _parse_int(name: str, raw: str | None, default: int) -> int:
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise SettingsError(f"{name} must be an integer, got {raw!r}") from None
