"""Sampling fields of the OpenAI-compatible endpoints, shared by chat and completions.

OpenAI's own fields plus the extensions vLLM and SGLang accept (``top_k``,
``min_p``, ``repetition_penalty``, ``ignore_eos``, ``min_tokens``,
``stop_token_ids``), which benchmark tools such as AIPerf and vLLM's own send.
A field left out (or sent as null) takes the model's default (sampling fields:
``services.engine.sampling_defaults``) or its neutral value. Ranges are checked
by ``SamplingParams.validate``, whose messages name the field; every refusal is a
400 before the engine is asked anything.
"""

from __future__ import annotations

import msgspec

from chatsvc.api.shared import sampling
from chatsvc.api.shared.errors import InvalidRequestError
from chatsvc.service import Services


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    include_usage: bool = False


class SamplingFields(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Request fields that pick tokens and stop them; the same on both endpoints."""

    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    # vLLM's convention: -1 (or 0) = off.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # Token id (as a string: JSON object keys) -> bias in [-100, 100].
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # OpenAI's end-user id: accepted so the SDK's field works; chat completions log it
    # only as a short hash (chatsvc.api.openai.caller_ids), nothing else reads it.
    user: str | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def build_sampling(
    services: Services,
    data: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    **beams,
):
    """``(SamplingParams, requested max_tokens)`` for ``data``; 400 naming a bad field.

    ``beams``: the beam search fields of an endpoint that takes them (``beam_width``,
    ``length_penalty``, ``early_stopping``)."""
    if data.stream_options is not None and not data.stream:
        raise InvalidRequestError("stream_options is only allowed with stream: true")
    top_k = data.top_k
    if top_k == -1:
        top_k = 0
    return sampling.build_sampling(
        services,
        max_tokens=max_tokens,
        temperature=data.temperature,
        top_p=data.top_p,
        top_k=top_k,
        seed=data.seed,
        stop=data.stop_list(),
        n=1 if data.n is None else data.n,
        min_p=data.min_p,
        repetition_penalty=data.repetition_penalty,
        presence_penalty=0.0 if data.presence_penalty is None else data.presence_penalty,
        frequency_penalty=0.0 if data.frequency_penalty is None else data.frequency_penalty,
        logit_bias=_logit_bias(data.logit_bias),
        ignore_eos=bool(data.ignore_eos),
        min_tokens=0 if data.min_tokens is None else data.min_tokens,
        stop_token_ids=tuple(data.stop_token_ids or ()),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        **beams,
    )


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    if not bias:
        return ()
    pairs = []
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise InvalidRequestError(
                f"logit_bias: key {key!r} is not a token id (an integer, as a string)"
            ) from None
        pairs.append((token_id, value))
    return tuple(sorted(pairs))
