"""``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` in vLLM's shapes.

Clients count tokens with the server's own tokenizer and chat template:
``{"prompt": ...}`` gives exactly the ids ``/v1/completions`` sends for that text;
``{"messages": [...]}`` gives exactly the ids ``/v1/chat/completions`` sends for
those messages (content tokenized as text, the template's control tokens only).
lm-evaluation-harness reads ``/tokenizer_info`` and then tokenizes through
``/tokenize`` (its "remote" tokenizer), so it needs no local copy of the tokenizer.
"""

from __future__ import annotations

import msgspec
from litestar import Controller, get, post
from litestar.params import JSONBody

from chatsvc.api.openai.chat_completions import render_prompt, template_messages
from chatsvc.api.openai.completions import encode_text
from chatsvc.api.openai.logprob_views import token_texts
from chatsvc.api.openai.models import check_model
from chatsvc.api.openai.schemas import ChatMessage
from chatsvc.api.shared.deps import ServicesDep, TenantDep
from chatsvc.api.shared.errors import InvalidRequestError, documented_errors
from chatsvc.api.shared.rendering import format_chat


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Exactly one of ``prompt`` (raw text) and ``messages`` (a chat, rendered by the
    template). ``add_special_tokens`` defaults to true for a prompt (the tokenizer's
    own, e.g. a BOS) and is refused for messages (the template writes them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    return_token_strs: bool = False


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


class TokenizerInfo(msgspec.Struct, kw_only=True):
    tokenizer_class: str
    vocab_size: int
    model_max_length: int
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None
    chat_template: str | None


class TokenizeController(Controller):
    path = "/"
    tags = ["tokenizer"]

    @post(
        "/tokenize",
        summary="Token ids of a prompt or a chat",
        status_code=200,
        responses=documented_errors(400, 401, 404, 413),
    )
    async def tokenize(
        self, data: JSONBody[TokenizeRequest], services: ServicesDep, tenant: TenantDep
    ) -> TokenizeResponse:
        check_model(services, data.model)
        engine = services.engine
        if (data.prompt is None) == (data.messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages")
        if data.prompt is not None:
            if len(data.prompt) > services.settings.limits.max_message_chars * 4:
                raise InvalidRequestError(f"the prompt has {len(data.prompt)} characters; too long")
            special = True if data.add_special_tokens is None else data.add_special_tokens
            ids = await format_chat(encode_text, engine.tokenizer, data.prompt, special)
        else:
            if data.add_special_tokens:
                raise InvalidRequestError(
                    "add_special_tokens is not supported with messages: the chat template "
                    "writes the special tokens"
                )
            messages = template_messages(services, data.messages)
            ids = await render_prompt(
                services, messages, data.add_generation_prompt, data.continue_final_message
            )
        strs = token_texts(engine.tokenizer).token_strs(ids) if data.return_token_strs else None
        return TokenizeResponse(
            count=len(ids), max_model_len=engine.max_context_len, tokens=ids, token_strs=strs
        )

    @post(
        "/detokenize",
        summary="Text of token ids",
        status_code=200,
        responses=documented_errors(400, 401, 404, 413),
    )
    async def detokenize(
        self, data: JSONBody[DetokenizeRequest], services: ServicesDep, tenant: TenantDep
    ) -> DetokenizeResponse:
        check_model(services, data.model)
        vocab = services.engine.vocab_size
        for token_id in data.tokens:
            if not 0 <= token_id < vocab:
                raise InvalidRequestError(
                    f"tokens: {token_id} is not a token id of this model (vocabulary of {vocab})"
                )
        text = await format_chat(services.engine.chat_format.decode, data.tokens)
        return DetokenizeResponse(prompt=text)

    @get(
        "/tokenizer_info",
        summary="The tokenizer's special tokens and chat template",
        responses=documented_errors(400, 401),
    )
    async def tokenizer_info(self, services: ServicesDep, tenant: TenantDep) -> TokenizerInfo:
        engine = services.engine
        tokenizer = engine.tokenizer
        return TokenizerInfo(
            tokenizer_class=type(tokenizer).__name__,
            vocab_size=engine.vocab_size,
            model_max_length=engine.max_context_len,
            bos_token=tokenizer.bos_token,
            eos_token=tokenizer.eos_token,
            pad_token=tokenizer.pad_token,
            unk_token=tokenizer.unk_token,
            chat_template=getattr(tokenizer, "chat_template", None),
        )
