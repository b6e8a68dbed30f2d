"""Speculative decoding without a draft model (issue 30; docs/engine.md, "Speculative
decoding").

A proposer guesses the next few tokens of a sequence from text it has seen: the
sequence's own context (``ngram``: prompt lookup) or its tenant's earlier outputs too
(``suffix``). The sequence's decode step then carries its newest token and the ``k``
proposals through the ordinary extend path, the logits of all ``k + 1`` positions come
back, and ``verify`` keeps the proposals the request would have produced itself plus
one more token. The cache sees the proposals only as appended, uncomputed tokens until
verification; the rejected ones are rolled back (``KVCacheManager.truncate``).
"""

from chatsvc.engine.speculative.proposer import AdaptiveK, Proposer, Speculator

__all__ = ["AdaptiveK", "Proposer", "Speculator"]
