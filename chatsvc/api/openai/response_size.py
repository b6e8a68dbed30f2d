"""How many bytes an OpenAI completion's answer may reach, and where it is built.

A 12 KB completions body (4 prompts of 1,024 token ids, ``n: 8``,
``prompt_logprobs: 20``) asks for a 45 MB answer: every choice repeats its prompt's
scores, each a dict of up to 21 entries. So before any work the answer's size is
estimated from the request alone (prompt lengths, the fitted ``max_tokens``, ``n``,
the logprob widths) with generous per-entry costs, and a request whose estimate
passes ``Limits.max_response_bytes`` is a 400. An answer estimated past
``OFF_LOOP_BYTES`` is built and encoded in a worker thread, so building it never
holds up the event loop's other requests (``/healthz``, other tenants' turns and
their turn-lock renewals).

The per-entry costs are upper figures for typical tokens (16 bytes of text, a float
in its longest shortest-repr form), not a bound on every vocabulary: they need only
keep the estimate above what real answers weigh.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import anyio
import msgspec

from chatsvc.api.shared.errors import InvalidRequestError
from chatsvc.protocol import GenerationRequest

T = TypeVar("T")

# Past this estimate an answer is built and encoded off the event loop; below it the
# thread hop costs more than the work.
OFF_LOOP_BYTES = 64 * 1024

# The answer's envelope (id, model, usage), and each choice's own keys.
ANSWER_BYTES = 512
CHOICE_BYTES = 256
# A token's text as JSON (quotes and escapes included); a float; a text offset.
TEXT_BYTES = 16
FLOAT_BYTES = 24
OFFSET_BYTES = 8
# Completions ``logprobs``: per token its text, logprob and offset; per top entry
# ``"text": logprob``.
COMPLETION_ENTRY_BYTES = TEXT_BYTES + FLOAT_BYTES + OFFSET_BYTES + 8
COMPLETION_TOP_BYTES = TEXT_BYTES + FLOAT_BYTES + 8
# ``prompt_logprobs``: per entry ``"id": {"logprob", "rank", "decoded_token"}``.
PROMPT_ENTRY_BYTES = 8 + FLOAT_BYTES + 8 + TEXT_BYTES + 48
# Chat ``logprobs.content``: token, logprob, its bytes as numbers (4 each), and keys.
CHAT_ENTRY_BYTES = TEXT_BYTES + FLOAT_BYTES + 4 * TEXT_BYTES + 64
CHAT_TOP_BYTES = TEXT_BYTES + FLOAT_BYTES + 4 * TEXT_BYTES + 40
# A stream sends one chunk per token of each choice: its envelope and SSE framing.
CHUNK_BYTES = 256


def completion_bytes(
    requests: list[GenerationRequest],
    echo: bool,
    logprobs: int | None,
    prompt_logprobs: int | None,
    stream: bool,
) -> int:
    """Upper estimate of a ``/v1/completions`` answer to ``requests`` (one per prompt).

    ``prompt_logprobs`` is the request's own field (the choices carry those scores
    only when it was given); the engine's width, widened by ``echo`` + ``logprobs``,
    is in each request's sampling.
    """
    total = ANSWER_BYTES
    for request in requests:
        sampling = request.sampling
        prompt_len = len(request.prompt_token_ids)
        scored = sampling.max_tokens + (prompt_len if echo else 0)
        choice = CHOICE_BYTES + scored * TEXT_BYTES
        if logprobs is not None:
            choice += scored * (COMPLETION_ENTRY_BYTES + (logprobs + 1) * COMPLETION_TOP_BYTES)
        if prompt_logprobs is not None:
            width = (sampling.prompt_logprobs or 0) + 1
            choice += prompt_len * width * PROMPT_ENTRY_BYTES
        if stream:
            choice += sampling.max_tokens * CHUNK_BYTES
        total += sampling.n * choice
    return total


def chat_completion_bytes(request: GenerationRequest, stream: bool) -> int:
    """Upper estimate of a ``/v1/chat/completions`` answer to ``request``."""
    sampling = request.sampling
    per_token = TEXT_BYTES
    if sampling.logprobs is not None:
        per_token += CHAT_ENTRY_BYTES + sampling.logprobs * CHAT_TOP_BYTES
    if stream:
        per_token += CHUNK_BYTES
    return ANSWER_BYTES + sampling.n * (CHOICE_BYTES + sampling.max_tokens * per_token)


def check_response_bytes(estimate: int, limit: int) -> None:
    """400 when an answer estimated at ``estimate`` bytes would pass ``limit``."""
    if estimate > limit:
        raise InvalidRequestError(
            f"the answer could reach about {estimate} bytes; the limit is {limit} "
            "(max_response_bytes, CHATSVC_MAX_RESPONSE_BYTES): ask for fewer prompts, "
            "choices (n), tokens or logprobs"
        )


def encode_answer(answer: msgspec.Struct) -> bytes:
    """The JSON of an answer (or of one chunk); called inside ``off_loop``'s work."""
    return msgspec.json.encode(answer)


async def off_loop(work: Callable[[], T], estimate: int) -> T:
    """``work()``, in a worker thread when the answer it builds is estimated large."""
    if estimate <= OFF_LOOP_BYTES:
        return work()
    return await anyio.to_thread.run_sync(work)
