"""A client's text made into the engine's tokens: checked, rendered off the event loop,
and given the cache namespace its blocks hash in.

Everything here that can fail on bad input runs before the engine or Redis is
touched, so a rejected request leaves no state behind.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
from jinja2 import TemplateError

from cache import Namespace
from chatsvc.api.shared.errors import InvalidRequestError
from chatsvc.protocol import ChatTemplate, RequestValidationError
from chatsvc.service import Services
from chatsvc.store.records import SystemPromptRecord, TenantRecord

T = TypeVar("T")


def check_text(text: str, services: Services, what: str = "message") -> str:
    """``text`` as given; 400 when it has no visible character or passes the length limit."""
    if not any(c.isprintable() and not c.isspace() for c in text):
        raise InvalidRequestError(f"the {what} is empty (no visible character)")
    limit = services.settings.limits.max_message_chars
    if len(text) > limit:
        raise InvalidRequestError(f"the {what} has {len(text)} characters; the limit is {limit}")
    return text


async def format_chat(call: Callable[..., T], *args: Any) -> T:
    """Run a ChatFormat call (template rendering, tokenization) in a worker thread.

    A large conversation takes long to render and tokenize; on the event loop
    that would stall every other request and the turn locks' renewals. The
    engine thread is not used: it is reserved for the model. A conversation the
    chat format or the template refuses is a 400; any other failure is ours (500).
    """
    try:
        return await anyio.to_thread.run_sync(functools.partial(call, *args))
    except RequestValidationError as exc:
        raise InvalidRequestError(str(exc)) from None
    except TemplateError as exc:
        raise InvalidRequestError(f"the chat template refused the conversation: {exc}") from None


async def system_prefix_tokens(services: Services, text: str) -> list[int]:
    """The tokens a system prompt contributes to the front of every rendered conversation.

    Rendering the system message followed by two different user messages and
    keeping the common prefix gives exactly the tokens that do not depend on
    what follows, whatever the template and tokenizer do at the boundary.
    """
    return await format_chat(_system_prefix, services.engine.chat_format, text)


def _system_prefix(fmt: ChatTemplate, text: str) -> list[int]:
    a = fmt.render([{"role": "system", "content": text}, {"role": "user", "content": "a"}])
    b = fmt.render([{"role": "system", "content": text}, {"role": "user", "content": "Zq"}])
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def shared_prefix_len(prompt: list[int], system_prompt: SystemPromptRecord | None) -> int:
    """Leading prompt tokens that belong to a *shared* system prompt (0 = all private).

    Only the exact tokens stored with the shared prompt count, and only when
    the prompt really starts with them; the first token after them (the user's
    text) is private, so the tenant's salt covers every block holding it.
    """
    if system_prompt is None or not system_prompt.shared or not system_prompt.token_ids:
        return 0
    n = len(system_prompt.token_ids)
    return n if prompt[:n] == system_prompt.token_ids else 0


def namespace_for(tenant: TenantRecord, shared_len: int) -> Namespace:
    """The cache namespace of a tenant's prompt whose first ``shared_len`` tokens are public."""
    return Namespace(tenant_salt=tenant.cache_salt, shared_prefix_len=shared_len, label=tenant.id)
