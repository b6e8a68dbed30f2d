"""The sampling a request runs with: its fields with the service's caps, fitted to the context.

Every refusal here is a 400 raised before the engine or Redis is touched, so a
rejected request leaves no state behind.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from chatsvc.api.shared.errors import ContextLengthError, InvalidRequestError
from chatsvc.protocol import RequestValidationError, SamplingDefaults, SamplingParams
from chatsvc.service import Services

# What a beam search's unset sampling fields take: it draws nothing, so the model's
# sampling defaults (temperature 0.2, say) would only make it refuse the request.
NEUTRAL = SamplingDefaults(temperature=0.0, source="beam search")


def build_sampling(
    services: Services,
    *,
    max_tokens: int | None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: list[str] = (),
    n: int = 1,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    beam_width: int | None = None,
    length_penalty: float | None = None,
    early_stopping: bool | str | None = None,
    **options: Any,
) -> tuple[SamplingParams, int | None]:
    """SamplingParams from request fields, with the service's caps; 400 on bad values.

    A sampling field given as None takes the served model's default
    (``engine.sampling_defaults``: its generation config, else the built-in one);
    with beam search (``beam_width`` >= 2) its neutral value instead (temperature 0,
    no filter or penalty: a beam search samples nothing, and any other value is a
    400), and ``length_penalty`` / ``early_stopping`` take transformers' defaults
    (1.0, false). ``options``: further SamplingParams fields (penalties, logit_bias,
    min_tokens, ignore_eos, stop_token_ids, logprobs, prompt_logprobs).
    ``max_tokens`` stays None here when not given: it is resolved against the
    prompt's length by ``fit_context``.
    """
    limits = services.settings.limits
    beams = beam_width is not None and beam_width > 1
    defaults = NEUTRAL if beams else services.engine.sampling_defaults
    if max_tokens is not None and max_tokens > limits.max_tokens_cap:
        raise InvalidRequestError(
            f"max_tokens {max_tokens} exceeds this server's cap of {limits.max_tokens_cap}"
        )
    if n > limits.max_n:
        raise InvalidRequestError(f"n {n} exceeds this server's cap of {limits.max_n}")
    if beams and beam_width > limits.max_n:
        # A search runs beam_width sequences, as n samples run n.
        raise InvalidRequestError(
            f"beam_width {beam_width} exceeds this server's cap of {limits.max_n}"
        )
    # Until fit_context sizes an absent max_tokens, any value min_tokens allows.
    placeholder = max(1, options.get("min_tokens") or 0)
    try:
        params = SamplingParams(
            max_tokens=placeholder if max_tokens is None else max_tokens,
            temperature=defaults.temperature if temperature is None else temperature,
            top_p=defaults.top_p if top_p is None else top_p,
            top_k=defaults.top_k if top_k is None else top_k,
            seed=seed,
            stop=tuple(stop),
            n=n,
            min_p=defaults.min_p if min_p is None else min_p,
            repetition_penalty=(
                defaults.repetition_penalty if repetition_penalty is None else repetition_penalty
            ),
            beam_width=1 if beam_width is None else beam_width,
            length_penalty=1.0 if length_penalty is None else length_penalty,
            early_stopping=False if early_stopping is None else early_stopping,
            **options,
        ).validate(services.engine.vocab_size)
    except (RequestValidationError, TypeError) as exc:
        raise InvalidRequestError(str(exc)) from None
    return params, max_tokens


def fit_context(
    services: Services,
    prompt_len: int,
    sampling: SamplingParams,
    requested: int | None,
    default_max_tokens: int | None = None,
) -> SamplingParams:
    """Return sampling with max_tokens fitted to the model's context; 400 if it cannot fit.

    An explicit max_tokens that overflows the context is an error (as in
    OpenAI's API) rather than a silent truncation; an absent one takes the
    room that is left, up to the server's cap (and ``default_max_tokens``).
    """
    limit = services.engine.max_context_len
    room = limit - prompt_len
    if room < 1:
        raise ContextLengthError(
            f"the prompt has {prompt_len} tokens; this model's context is {limit} tokens"
        )
    if requested is None:
        fitted = min(room, services.settings.limits.max_tokens_cap, default_max_tokens or room)
        if sampling.min_tokens > fitted:
            raise InvalidRequestError(
                f"min_tokens ({sampling.min_tokens}) exceeds the {fitted} tokens this request "
                "may generate; give max_tokens, or fewer min_tokens"
            )
        return replace(sampling, max_tokens=fitted)
    if requested > room:
        raise ContextLengthError(
            f"prompt ({prompt_len} tokens) plus max_tokens ({requested}) exceeds this "
            f"model's context of {limit} tokens"
        )
    return sampling
