"""What the service and the API may call on the engine: ``EngineClient``.

``chatsvc.engine.AsyncEngine`` is the implementation; the API and the service
type against this protocol and import only this package, so they load without
torch and never reach into the engine's internals. Everything an engine does
for a caller is here: submit and stream (``generate``), abort, the chat format
to build prompts with, the figures the service logs and reports, and its
liveness. Which kernels run and how a step is kept are the engine's business
(``kernels.backend``, ``chatsvc.engine.scheduler``), not the caller's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from chatsvc.protocol.requests import GenerationDelta, GenerationRequest

if TYPE_CHECKING:
    from cache import Namespace


@runtime_checkable
class ChatTemplate(Protocol):
    """The model's chat template as the API uses it (``chatsvc.engine.chat_format.ChatFormat``).

    Each call may take a while (template rendering, tokenization): the API runs them
    off the event loop. A conversation it refuses raises ``RequestValidationError``.
    """

    stop_token_ids: tuple[int, ...]

    def render(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the whole conversation (generation prompt appended by default)."""
        ...

    def render_continuation(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Token ids of the conversation with its final message left open (to be continued)."""
        ...

    def extend(
        self, prev_token_ids: Sequence[int], messages: Sequence[Mapping[str, str]]
    ) -> tuple[list[int], bool]:
        """``(prev_token_ids + the new turn's tokens, True)`` when the template renders the
        history as a prefix of ``messages``, else ``(render(messages), False)``."""
        ...

    def answer_token_ids(
        self, prompt_token_ids: Sequence[int], token_ids: Sequence[int], text: str
    ) -> list[int]:
        """The token ids to store for a generated answer whose stored text is ``text``."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of token ids, special tokens kept as the template wrote them."""
        ...


@runtime_checkable
class Tokenizer(Protocol):
    """The model's (transformers) tokenizer, as far as the API uses it: raw text to ids
    (``/v1/completions``, ``/tokenize``), single tokens to text (logprobs), and the
    special tokens ``/tokenizer_info`` reports. Prompts of a chat are built with
    ``ChatTemplate`` instead. A fast tokenizer also has ``backend_tokenizer``, which
    the API only probes (byte-level BPE or not) and so leaves out of this protocol.
    """

    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None
    chat_template: str | None
    added_tokens_decoder: Mapping[int, Any]  # id -> its added token (``.content``)

    def __call__(self, text: str, add_special_tokens: bool = True) -> Mapping[str, Any]:
        """Encode ``text``; ``["input_ids"]`` holds its token ids."""
        ...

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | list[str]:
        """The vocabulary's own strings of token ids (e.g. ``Ġthe``), one or a list."""
        ...

    def decode(
        self,
        token_ids: Sequence[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> str:
        """Text of token ids."""
        ...


@dataclass(frozen=True)
class SamplingDefaults:
    """Default sampling fields; ``source`` says where they came from (for /v1/models, logs).

    What a request gets for the sampling fields it leaves unset: the model's own
    (``chatsvc.engine.sampling_defaults`` reads them), else built-in values.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    source: str = "neutral"


@dataclass(frozen=True)
class EngineInfo:
    """What a started engine serves, for the start-up log line and reports."""

    model_name: str
    dtype: str  # "bfloat16", "float32", ...: what the model computes in
    weight_layout: str  # kernels.linear.WEIGHT_LAYOUTS: how its matrices are stored and read
    device: str
    kernel_backend: str  # "native" | "torch" | "triton" (kernels.backend decides)
    kernel_library_sha256: str | None  # the native C library's digest; None off native
    num_gpu_blocks: int
    num_host_blocks: int
    block_size: int
    max_context_len: int
    kv_dtype: str = ""  # what the KV pool stores: the model's dtype, "bfloat16" or "int8"


@runtime_checkable
class EngineClient(Protocol):
    """The engine as its callers see it (contract: docs/contracts.md).

    ``start``/``stop`` belong to the service's lifespan; handlers use the rest.
    Properties other than ``is_running`` and ``failure`` raise
    ``EngineStoppedError`` before the engine has started.
    """

    async def start(self) -> None:
        """Load the model and start serving; a load error is raised here."""
        ...

    async def warm_up(self) -> list[tuple[str, float]]:
        """After ``start``, before the first request: pay the first-call costs of the
        step shapes the engine will run, leaving its cache and statistics as they are;
        (shape, seconds) of each shape run. Background work that must wait until the
        engine serves (the disk tier's preload) starts as it returns."""
        ...

    async def stop(self) -> None:
        """Abort everything in flight and stop."""
        ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        """Stream the request's deltas; leaving early aborts it and frees its blocks.

        Raises ``RequestValidationError`` (``RequestTooLargeError``: it can never
        fit), ``EngineInternalError`` (a step failed for this request alone) or
        ``EngineStoppedError`` (not running, or the engine thread died).
        """
        ...

    async def abort(self, request_id: str) -> None:
        """End a request: its stream gets an ``abort`` delta per unfinished sample."""
        ...

    @property
    def is_running(self) -> bool:
        """Started and serving: not stopped, and the engine thread has not died."""
        ...

    @property
    def failure(self) -> BaseException | None:
        """What killed the engine thread, or None."""
        ...

    def add_death_callback(self, callback: Callable[[BaseException], None]) -> None:
        """Call ``callback(error)`` on the event loop once, if the engine thread dies."""
        ...

    @property
    def chat_format(self) -> ChatTemplate: ...

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer."""
        ...

    @property
    def model_name(self) -> str: ...

    @property
    def max_context_len(self) -> int:
        """Prompt plus generated tokens one request may hold."""
        ...

    @property
    def vocab_size(self) -> int:
        """Token ids of this model lie in ``[0, vocab_size)``."""
        ...

    @property
    def sampling_defaults(self) -> SamplingDefaults:
        """Sampling values for the fields a request leaves unset (the model's own, else
        the built-in ones)."""
        ...

    @property
    def info(self) -> EngineInfo: ...

    def cache_stats(self) -> dict[str, Any]:
        """Cache counters and tier usage, a consistent snapshot between steps (blocks)."""
        ...

    def check_integrity(self) -> None:
        """Run the cache's integrity checker between steps; raises on a broken invariant."""
        ...

    async def forget_session(
        self, session: str, token_ids: list[int], namespace: Namespace, keep_tokens: int = 0
    ) -> dict[str, int]:
        """Delete a session's KV from every tier (disk files included) except the first
        ``keep_tokens`` tokens' blocks and the blocks another session uses (the cache
        knows which); its running requests end with an abort. Returns the blocks
        removed per tier."""
        ...

    async def forget_tokens(
        self, session: str, token_ids: list[int], namespace: Namespace, keep_tokens: int = 0
    ) -> dict[str, int]:
        """Delete the KV of text ``session`` no longer holds (a deleted branch, message or
        response): the blocks of ``token_ids`` past the first ``keep_tokens`` tokens that
        no other session uses, in every tier, never the blocks below them. Returns the
        blocks removed per tier."""
        ...
