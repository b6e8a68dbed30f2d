"""The engine's TokenLogprob entries in the shapes OpenAI's endpoints (and vLLM's) return.

Chat (``choices[].logprobs.content``): per token its text, log-probability, UTF-8
bytes and the ``top_logprobs`` likeliest tokens. Completions (``choices[].logprobs``):
parallel lists ``tokens``, ``token_logprobs``, ``top_logprobs`` (token text ->
logprob, the chosen token always among them, so up to k + 1 entries, as OpenAI
documents) and ``text_offset`` (each token's start in the choice's text); a prompt's
first token has None entries (nothing precedes it). vLLM's ``prompt_logprobs``:
per prompt token ``{token id: {logprob, rank, decoded_token}}``, None first.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from chatsvc.api.openai.completion_schemas import CompletionLogprobs, PromptLogprob
from chatsvc.api.openai.schemas import ChoiceLogprobs, TokenLogprobView, TopLogprob
from chatsvc.api.openai.token_texts import TokenTexts
from chatsvc.protocol import Tokenizer


@functools.lru_cache(maxsize=4)
def token_texts(tokenizer: Tokenizer) -> TokenTexts:
    """One TokenTexts (with its per-token cache) per tokenizer."""
    return TokenTexts(tokenizer)


def chat_logprobs(texts: TokenTexts, scores: Iterable) -> ChoiceLogprobs:
    """``choices[].logprobs`` of a chat completion (or of one chunk) from TokenLogprobs."""
    content = [
        TokenLogprobView(
            token=texts.text(s.token_id),
            logprob=s.logprob,
            bytes=texts.bytes(s.token_id),
            top_logprobs=[
                TopLogprob(token=texts.text(t), logprob=v, bytes=texts.bytes(t)) for t, v in s.top
            ],
        )
        for s in scores
    ]
    return ChoiceLogprobs(content=content)


class CompletionLogprobsBuilder:
    """Builds the legacy completions ``logprobs`` object, chunk by chunk for streams.

    ``text_offset`` runs on across calls, so a stream's chunks carry the offsets of
    the whole choice text.
    """

    def __init__(self, texts: TokenTexts) -> None:
        self.texts = texts
        self.offset = 0

    def build(self, scores: Iterable, token_ids: Iterable[int] | None = None) -> CompletionLogprobs:
        """Entries for ``scores`` (a None entry: an unscored token, whose id is taken
        from ``token_ids`` at the same position)."""
        ids = list(token_ids) if token_ids is not None else None
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for i, score in enumerate(scores):
            token_id = score.token_id if score is not None else ids[i]
            text = self.texts.text(token_id)
            out.tokens.append(text)
            out.text_offset.append(self.offset)
            self.offset += len(text)
            if score is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(score.logprob)
            top = {self.texts.text(t): v for t, v in score.top}
            top.setdefault(text, score.logprob)
            out.top_logprobs.append(top)
        return out


def prompt_logprob_dicts(texts: TokenTexts, scores: Iterable) -> list:
    """vLLM's ``prompt_logprobs``: None, then per token its own and its top entries by id."""
    out: list = []
    for score in scores:
        if score is None:
            out.append(None)
            continue
        entry = {
            str(t): PromptLogprob(logprob=v, rank=rank, decoded_token=texts.text(t))
            for rank, (t, v) in enumerate(score.top, start=1)
        }
        entry[str(score.token_id)] = PromptLogprob(
            logprob=score.logprob, rank=score.rank, decoded_token=texts.text(score.token_id)
        )
        out.append(entry)
    return out
