"""The attacker of ``bounded_cost``: per endpoint, the largest request the limits allow.

Each shape is built from the ``Limits`` the service was started with (and the
model's context), never from constants of its own: raise a limit and the attack
grows with it. A text is fresh random words each time, so no request is served
from the prefix cache of an earlier one. A refusal (400, 413, 429) is an answer
like any other and is counted; only a 5xx or no answer at all is a problem.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Awaitable, Callable

import httpx

from cache import Namespace
from chatsvc.api.openai import response_size
from chatsvc.api.openai.completions import MAX_PROMPTS
from chatsvc.api.openai.conversations import MAX_ITEMS_PER_CALL
from chatsvc.api.openai.response_views import MAX_PAGE as MAX_ITEMS_PAGE
from chatsvc.config import Limits
from chatsvc.protocol import MAX_LOGPROBS, GenerationRequest, SamplingParams

WORDS = (
    "river stone lamp winter garden copper thread orbit violet harbor meadow signal "
    "lantern basalt cedar quartz pepper marble falcon tundra glacier ember saffron "
    "canyon willow prism cobalt anchor velvet summit beacon thistle monsoon juniper"
).split()
# The first token id of a completions prompt sent as ids: past the special tokens.
FIRST_TOKEN_ID = 300
# The largest pages the list endpoints accept (their ``limit`` parameters' ``le``).
MAX_SESSIONS_PAGE = 500
MAX_MESSAGES_PAGE = 1000
# Room left in the context for a random text's token count to vary between draws.
CONTEXT_MARGIN = 0.9


class PatientTransport(httpx.AsyncBaseTransport):
    """While ``patient``, resends a request refused for the tenant's request rate (a 429
    with ``Retry-After``) once that time has passed. The attack ignores the header, as
    a hostile client would; its set-up and clean-up, which are not measured, wait."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.patient = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        while True:
            response = await self.inner.handle_async_request(request)
            retry_after = response.headers.get("retry-after")
            if not (self.patient and response.status_code == 429 and retry_after):
                return response
            await response.aread()
            await response.aclose()
            await asyncio.sleep(float(retry_after))

    async def aclose(self) -> None:
        await self.inner.aclose()


ENDPOINTS = (
    "completions",
    "chat_completions",
    "responses",
    "tokenize",
    "session_messages",
    "conversation_items",
    "list_pages",
    "delete_session",
)


def words(rng: random.Random, chars: int) -> str:
    """Random words, exactly ``chars`` characters long (a word may be cut at the end)."""
    parts, size = [], 0
    while size < chars:
        word = rng.choice(WORDS)
        parts.append(word)
        size += len(word) + 1
    return " ".join(parts)[:chars].rstrip() or "x"


def completion_prompt_len(limits: Limits, max_model_len: int, prompts: int) -> int:
    """The longest prompt (token ids) of ``prompts`` prompts at n, max_tokens and both
    logprob widths at their caps whose answer the service's own estimate still allows
    (0: none fits). Also within the context and the body limit."""

    def fits(length: int) -> bool:
        sampling = SamplingParams(
            max_tokens=limits.max_tokens_cap,
            n=limits.max_n,
            logprobs=MAX_LOGPROBS,
            prompt_logprobs=MAX_LOGPROBS,
        )
        request = GenerationRequest(
            "probe", [FIRST_TOKEN_ID] * length, sampling, Namespace(b"probe")
        )
        estimate = response_size.completion_bytes(
            [request] * prompts, False, MAX_LOGPROBS, MAX_LOGPROBS, False
        )
        # Five digits and a comma per id: the body of the largest ids.
        body = 6 * length * prompts + 256
        return estimate <= limits.max_response_bytes and body <= limits.max_body_bytes

    low, high = 0, max_model_len - limits.max_tokens_cap
    while low < high:  # the largest length that fits: ``fits`` is monotone
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def completion_shape(limits: Limits, max_model_len: int) -> tuple[int, int]:
    """(prompts, their length): the most prompts (up to the endpoint's own cap) that
    still fit at some length, at the longest length they fit at."""
    prompts = MAX_PROMPTS
    while prompts > 1 and not completion_prompt_len(limits, max_model_len, prompts):
        prompts -= 1
    return prompts, max(1, completion_prompt_len(limits, max_model_len, prompts))


class Attacker:
    """One tenant's client sending its endpoint's largest request; tallies statuses."""

    def __init__(
        self, http: httpx.AsyncClient, limits: Limits, max_model_len: int, model: str, seed: int
    ) -> None:
        self.http = http
        self.limits = limits
        self.max_model_len = max_model_len
        self.model = model
        self.rng = random.Random(seed)
        self.statuses: Counter[int] = Counter()  # 0: no answer (transport error)
        self.problems: list[str] = []
        # Set by ``prepare``: the chat-shaped endpoints' characters over all messages,
        # the completions' number of prompts and their length.
        self.chat_chars = 0
        self.prompts = self.prompt_len = 0
        self.session_id: str | None = None
        self.long_session_id: str | None = None

    async def send(self, method: str, path: str, **kwargs) -> httpx.Response | None:
        try:
            response = await self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            self.statuses[0] += 1
            self.problems.append(f"{method} {path}: no answer: {type(exc).__name__}: {exc}")
            return None
        self.statuses[response.status_code] += 1
        if response.status_code >= 500:
            self.problems.append(f"{method} {path}: {response.status_code} {response.text[:300]}")
        return response

    def unit(self, endpoint: str) -> Callable[[], Awaitable[None]]:
        """The coroutine function that sends one round of ``endpoint``'s attack."""
        return getattr(self, f"_{endpoint}")

    def shape(self, endpoint: str) -> str:
        """The endpoint's request in words, once ``prepare`` has run."""
        lim = self.limits
        chat = (
            f"{lim.max_messages} messages, {self.chat_chars} chars, max_tokens {lim.max_tokens_cap}"
        )
        items = f"{MAX_ITEMS_PER_CALL} items x {lim.max_message_chars} chars a call"
        return {
            "completions": f"{self.prompts} prompts x {self.prompt_len} ids, n {lim.max_n}, "
            f"max_tokens {lim.max_tokens_cap}, logprobs and prompt_logprobs {MAX_LOGPROBS}",
            "chat_completions": f"{chat}, n {lim.max_n}, top_logprobs {MAX_LOGPROBS}",
            "responses": chat,
            "tokenize": f"a {lim.max_message_chars * 4}-char prompt, token strings",
            "session_messages": f"a {lim.max_message_chars}-char message, "
            f"max_tokens {lim.max_tokens_cap}",
            "conversation_items": f"{items}, until the session's quota, a new one",
            "list_pages": f"/sessions x {MAX_SESSIONS_PAGE}, messages x {MAX_MESSAGES_PAGE}, "
            f"items x {MAX_ITEMS_PAGE} of a full session",
            "delete_session": f"one turn, then {items} to the quota, then DELETE",
        }[endpoint]

    async def prepare(self, endpoint: str) -> None:
        """What the endpoint's attack needs in place before it is measured."""
        if endpoint == "completions":
            self.prompts, self.prompt_len = completion_shape(self.limits, self.max_model_len)
        if endpoint in ("chat_completions", "responses"):
            self.chat_chars = await self._fitted_chat_chars()
        if endpoint == "list_pages":
            sid = await self._new_session()
            if sid is not None:
                await self._fill(sid)
                self.long_session_id = sid
            for _ in range(self.limits.max_sessions_per_tenant - 1):
                if await self._new_session() is None:
                    break

    async def clear(self) -> None:
        """Delete every session of the tenant: the next endpoint starts from nothing."""
        deleted = True
        while deleted:
            page = await self.http.get("/sessions", params={"limit": MAX_SESSIONS_PAGE})
            page.raise_for_status()
            ids = [s["id"] for s in page.json()["sessions"]]
            deleted = False
            for sid in ids:
                response = await self.http.delete(f"/sessions/{sid}")
                deleted = deleted or response.status_code == 204
        self.session_id = self.long_session_id = None

    def _chat_messages(self, total_chars: int) -> list[dict[str, str]]:
        count = self.limits.max_messages
        each = max(1, min(self.limits.max_message_chars, total_chars // count))
        roles = ["user" if (count - 1 - i) % 2 == 0 else "assistant" for i in range(count)]
        return [{"role": role, "content": words(self.rng, each)} for role in roles]

    async def _fitted_chat_chars(self) -> int:
        """The most characters (up to the endpoints' 4x max_message_chars over all
        messages) whose rendered chat leaves room for max_tokens in the context."""
        chars = self.limits.max_message_chars * 4
        room = CONTEXT_MARGIN * (self.max_model_len - self.limits.max_tokens_cap)
        while chars > self.limits.max_messages:
            body = {"model": self.model, "messages": self._chat_messages(chars)}
            response = await self.http.post("/tokenize", json=body)
            response.raise_for_status()
            if response.json()["count"] <= room:
                return chars
            chars = int(chars * 0.9)
        return chars

    async def _completions(self) -> None:
        ids = [
            [self.rng.randrange(FIRST_TOKEN_ID, 40_000) for _ in range(self.prompt_len)]
            for _ in range(self.prompts)
        ]
        body = {
            "model": self.model,
            "prompt": ids,
            "n": self.limits.max_n,
            "max_tokens": self.limits.max_tokens_cap,
            "logprobs": MAX_LOGPROBS,
            "prompt_logprobs": MAX_LOGPROBS,
            "temperature": 1.0,
            "ignore_eos": True,
        }
        await self.send("POST", "/v1/completions", json=body)

    async def _chat_completions(self) -> None:
        body = {
            "model": self.model,
            "messages": self._chat_messages(self.chat_chars),
            "n": self.limits.max_n,
            "max_tokens": self.limits.max_tokens_cap,
            "logprobs": True,
            "top_logprobs": MAX_LOGPROBS,
            "temperature": 1.0,
            "ignore_eos": True,
        }
        await self.send("POST", "/v1/chat/completions", json=body)

    async def _responses(self) -> None:
        body = {
            "model": self.model,
            "input": self._chat_messages(self.chat_chars),
            "max_output_tokens": self.limits.max_tokens_cap,
            "temperature": 1.0,
        }
        await self.send("POST", "/v1/responses", json=body)

    async def _tokenize(self) -> None:
        body = {
            "model": self.model,
            "prompt": words(self.rng, self.limits.max_message_chars * 4),
            "return_token_strs": True,
        }
        await self.send("POST", "/tokenize", json=body)

    async def _session_messages(self) -> None:
        if self.session_id is None:
            self.session_id = await self._new_session()
            if self.session_id is None:
                return
        body = {
            "content": words(self.rng, self.limits.max_message_chars),
            "max_tokens": self.limits.max_tokens_cap,
            "temperature": 1.0,
        }
        response = await self.send("POST", f"/sessions/{self.session_id}/messages", json=body)
        if response is None or response.status_code in (400, 429):
            self.session_id = None  # the context or the session's quota is full

    async def _conversation_items(self) -> None:
        sid = await self._new_session()
        if sid is not None:
            await self._fill(sid)

    async def _list_pages(self) -> None:
        await self.send("GET", "/sessions", params={"limit": MAX_SESSIONS_PAGE})
        if self.long_session_id is not None:
            sid = self.long_session_id
            await self.send("GET", f"/sessions/{sid}/messages", params={"limit": MAX_MESSAGES_PAGE})
            await self.send(
                "GET", f"/v1/conversations/{sid}/items", params={"limit": MAX_ITEMS_PAGE}
            )

    async def _delete_session(self) -> None:
        """A session with a long history (one generated turn, so it has KV to forget,
        then items up to its quota), deleted."""
        sid = await self._new_session()
        if sid is None:
            return
        body = {
            "content": words(self.rng, self.limits.max_message_chars),
            "max_tokens": self.limits.max_tokens_cap,
            "temperature": 1.0,
        }
        await self.send("POST", f"/sessions/{sid}/messages", json=body)
        await self._fill(sid)
        await self.send("DELETE", f"/sessions/{sid}")

    async def _new_session(self) -> str | None:
        response = await self.send("POST", "/v1/conversations", json={})
        return (
            response.json()["id"] if response is not None and response.status_code == 200 else None
        )

    async def _fill(self, sid: str) -> None:
        """Add the most items per call, each of the most characters, until the session
        (or the tenant) is refused more."""
        while True:
            items = [
                {
                    "type": "message",
                    "role": "user",
                    "content": words(self.rng, self.limits.max_message_chars),
                }
                for _ in range(MAX_ITEMS_PER_CALL)
            ]
            response = await self.send(
                "POST", f"/v1/conversations/{sid}/items", json={"items": items}
            )
            if response is None or response.status_code != 200:
                return
