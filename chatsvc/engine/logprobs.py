"""Log-probabilities of chosen tokens, from the same logits rows the sampler starts from.

They are the model's own distribution, ``log_softmax`` of the raw logits in fp32,
before logit processing, temperature and filters (what vLLM calls raw logprobs, its
default): the numbers a scorer such as lm-evaluation-harness compares across
servers, and the same whatever sampling options a request carries.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from chatsvc.protocol import TokenLogprob


def token_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], num_top: int
) -> list[TokenLogprob]:
    """``TokenLogprob`` of ``token_ids[i]`` under row i of ``logits [R, V]``, with the
    ``num_top`` most likely tokens of each row.

    Rank 1 is the most likely token; equal log-probabilities share the better rank.
    """
    if logits.dim() != 2 or logits.shape[0] != len(token_ids):
        raise ValueError(
            f"logits {tuple(logits.shape)} do not have one row per token ({len(token_ids)})"
        )
    if not token_ids:
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=logp.device)
    chosen = logp.gather(1, ids[:, None])  # [R, 1]
    ranks = ((logp > chosen).sum(dim=-1) + 1).tolist()
    chosen_values = chosen.squeeze(1).tolist()
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(token_ids)
    if num_top > 0:
        values, indices = torch.topk(logp, min(num_top, logp.shape[-1]), dim=-1)
        tops = [
            tuple(zip(row_ids, row_values, strict=True))
            for row_ids, row_values in zip(indices.tolist(), values.tolist(), strict=True)
        ]
    return [
        TokenLogprob(token_id, value, rank, top)
        for token_id, value, rank, top in zip(token_ids, chosen_values, ranks, tops, strict=True)
    ]
