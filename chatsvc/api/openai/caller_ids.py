"""The ids an OpenAI client may attach to a request: ``prompt_cache_key``, ``user``,
``safety_identifier``.

They change nothing the model does. ``prompt_cache_key`` is the affinity key a
load balancer can route on, so that requests sharing a prefix reach the replica
that holds its KV: the service answers it back in the ``X-Prompt-Cache-Key``
response header (a proxy in front can learn it there, or a client can send the
same header on its requests for the balancer to hash). ``user`` and
``safety_identifier`` name the end user for abuse tracing; they may be emails,
so the log carries only a short hash of each (an operator who knows the value
finds its lines by hashing it the same way), never the value.
"""

from __future__ import annotations

import hashlib
import logging
import re

from chatsvc.api.shared.errors import InvalidRequestError

PROMPT_CACHE_KEY_HEADER = "X-Prompt-Cache-Key"
MAX_ID_CHARS = 256
# Printable ASCII only: the key goes into a response header as it is.
_HEADER_SAFE = re.compile(r"^[\x20-\x7e]+$")

log = logging.getLogger(__name__)


def check_caller_ids(
    prompt_cache_key: str | None, user: str | None, safety_identifier: str | None
) -> None:
    """400 for an id that is empty, longer than 256 characters, or (the cache key,
    which becomes a header) anything but printable ASCII."""
    for name, value in (
        ("prompt_cache_key", prompt_cache_key),
        ("user", user),
        ("safety_identifier", safety_identifier),
    ):
        if value is None:
            continue
        if not value or len(value) > MAX_ID_CHARS:
            raise InvalidRequestError(f"{name} must hold 1 to {MAX_ID_CHARS} characters")
    if prompt_cache_key is not None and not _HEADER_SAFE.match(prompt_cache_key):
        raise InvalidRequestError(
            "prompt_cache_key must be printable ASCII (it is sent back in a header)"
        )


def affinity_headers(prompt_cache_key: str | None) -> dict[str, str]:
    """The response headers that carry the request's affinity key (none without one)."""
    return {} if prompt_cache_key is None else {PROMPT_CACHE_KEY_HEADER: prompt_cache_key}


def id_for_log(value: str | None) -> str:
    """A stable, short stand-in for a caller-supplied id: ``h:`` + 16 hex of its sha256."""
    if value is None:
        return "-"
    return "h:" + hashlib.sha256(value.encode()).hexdigest()[:16]


def log_caller_ids(
    endpoint: str,
    request_id: str,
    prompt_cache_key: str | None,
    user: str | None,
    safety_identifier: str | None,
) -> None:
    """One line tying the request to its caller ids, each as ``id_for_log`` writes it."""
    if prompt_cache_key is None and user is None and safety_identifier is None:
        return
    log.info(
        "%s %s: prompt_cache_key %s, user %s, safety_identifier %s",
        endpoint,
        request_id,
        id_for_log(prompt_cache_key),
        id_for_log(user),
        id_for_log(safety_identifier),
    )
