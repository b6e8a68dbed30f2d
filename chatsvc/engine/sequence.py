"""One sample's life as data: its tokens, how far its KV is computed, and its timings.

Token ranges of a sequence (block_size 4, prompt of 10, 2 tokens generated):

    token:     0  1  2  3 | 4  5  6  7 | 8  9  10 11
               [ prompt                  ][ output ]
               |<- cached ->|                            prefix-index hit at admission
               |<------- computed -------->|             KV written (num_computed_tokens)
                                           |<to compute>| scheduled in chunks
    blocks:    [ shared    ][ own        ][ own      ]

    num_cached_tokens   = 4   (never the last prompt token: its logits are needed)
    num_computed_tokens = 9   (the cached ones count as computed)
    num_tokens          = 12  (prompt + output; the newest output token has no KV yet)

A decode step computes exactly one token: the newest output token. After a
preemption the sequence keeps its tokens but drops its KV (num_computed_tokens
= 0) and is re-admitted like a prompt of prompt + output tokens, whose full
blocks mostly come back from the prefix index.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from cache import BlockChain
from chatsvc.engine.detokenizer import IncrementalDetokenizer
from chatsvc.engine.logits_processing import LogitsState
from chatsvc.protocol import FinishReason, GenerationRequest, SamplingParams, TokenLogprob


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # never admitted
    RUNNING = "running"  # holds blocks in the cache
    LOADING = "loading"  # holds blocks, waits for the disk tier to fill some of them
    PREEMPTED = "preempted"  # blocks freed, waiting for re-admission
    FINISHED = "finished"


class Beams(Protocol):
    """The beam search a sequence is a beam of (``chatsvc.engine.beam_search.BeamSearch``):
    what the scheduler needs to admit, run and preempt its beams as one request."""

    width: int
    beams: list[Sequence]

    def restart(self) -> Sequence: ...


@dataclass(eq=False)
class Sequence:
    """Mutable state of one sample of one request; owned by the engine thread."""

    seq_id: int
    request: GenerationRequest
    sample_index: int
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    last_token_time: float | None = None
    waiting_since_step: int = 0  # scheduler step at which it (re-)entered the waiting queue
    last_scheduled_step: int = 0  # the last scheduler step that gave it tokens
    num_preemptions: int = 0
    num_deferred_steps: int = 0  # steps admission skipped it to wait for a pending prefix
    was_admitted: bool = False
    # num_cached_tokens by the tier the blocks came from ("device", "host", "disk").
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    cache_owner: bytes = b""  # the session's digest, stamped on the blocks it computes
    # Penalties' token history and logit_bias (None: the request asks for no processing),
    # updated with every appended token.
    logits_state: LogitsState | None = None
    # Scores of prompt tokens 0.. (entry 0 None) as prefill computes them; None: not asked.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Its tokens' block hashes for admission (Scheduler._chain): a prefix of
    # token_ids(), hashed once for every look at the cache, and kept so a preempted
    # sequence is not hashed again.
    block_chain: BlockChain | None = None
    # The beam search this sequence is a beam of (None: a sampled or greedy sample).
    beams: Beams | None = None
    # Its speculative decoding state (``speculative.proposer.SequenceSpeculation``), made
    # by the Speculator at its first decode; None: not speculating (yet).
    speculation: object | None = None

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        """Exactly the newest token lacks KV: one token per step."""
        return bool(self.output_token_ids) and self.num_tokens_to_compute == 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, position: int) -> int:
        if position < self.num_prompt_tokens:
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - self.num_prompt_tokens]

    def append_token(self, token_id: int, now: float) -> None:
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now
        self.output_token_ids.append(token_id)
        if self.logits_state is not None:
            self.logits_state.add_token(token_id)
