"""Continuous batching: which sequences compute how many tokens in the next step.

Each step has a token budget (``max_num_batched_tokens``) and a cap on running
sequences (``max_num_seqs``). When several tenants have work, the budget is split
evenly between them (``StepShares`` in ``fairness.py``): each tenant's decodes,
chunks and admissions below stop at its share, so one tenant's load cannot make
a step, and with it another tenant's next token, as slow as a full budget.
Order of business:

1. Decode first: every running sequence that needs one token gets it (a slot
   from ``append_slots``), oldest first, so no prefill can stall a stream.
2. Running prefills continue with chunks of whatever budget is left (chunked
   prefill: a long prompt advances a chunk per step between decodes).
3. Admission: waiting sequences join while budget, sequence slots and blocks
   last. ``allocate`` maps the longest cached prefix first, so only the
   uncached suffix is computed. Between tenants it is fair (``fairness.py``):
   the next candidate comes from the waiting tenant holding the fewest
   sequence slots. Within a tenant the order is: re-queued preempted
   sequences, then those waiting past the age bound (FIFO), then the longest
   cached prefix first. Admission stops at the first candidate that does not
   fit, so a big request is not overtaken forever by small ones. A request
   with ``n`` samples holds ``n`` slots from its admission on, so
   ``max_num_seqs`` bounds the running sequences, forks included; a request
   whose ``n`` exceeds it runs alone rather than never.
4. Deferral for in-flight prefixes: a candidate whose prefix continues
   through blocks another sequence is computing right now (``pending`` in the
   cache, e.g. 16 conversations opening at once with one system prompt) is
   skipped for this step, so it is admitted a step or two later with a full
   hit instead of computing the same prefix again. At most
   ``max_defer_steps`` times per sequence; preempted and aged sequences are
   never deferred. A prefix may also be on its way from disk (a LOADING
   sequence's blocks are pending too): steps that only wait on loads do not
   count, for deferral or aging (``_tick``).

Out of blocks: the cache already evicts unreferenced cached blocks itself (to
the host tier when it has one). When that is not enough for a decode, the
newest running sequence not yet scheduled this step is preempted by
*recompute*: its blocks are freed, but the full ones whose KV was written stay
in the prefix index (on the device, or swapped to the host when evicted), so on
re-admission ``allocate`` re-matches them and only the tail is recomputed. It
goes back to the front of the waiting queue.

Disk hits: when a candidate's match continues into the disk tier, ``allocate``
hands back loads for those blocks (``SchedulerOutput.loads``). The sequence
then holds its blocks and waits in LOADING (``loading``; never a preemption
victim, never scheduled) while the disk tier reads them and other sequences
step; once the step's I/O reports them ended (``finish_loads``) the verified
ones count as computed and it joins the running list. Sessions that arrive
together with one system prompt land in two rounds (the first one's load, then
its twins', deferred behind it, load their own blocks) and one by one within a
round. While nothing runs but sequences whose loads landed and that have not
computed yet, admission goes first, and if it only started loads (or nothing)
while loads are in flight, the step computes nothing: for up to
``max_load_gather_s`` (``_gathers_loads``), so they prefill in one step as they
would have with a warm cache. Computing the first one alone would add a whole
step (the model's weights read once more) to every other's first token, which
costs far more than the reads it would overlap (docs/engine.md).

Beam search (``beam_search.py``): a search is one request to the scheduler. Its
root (the prompt) is admitted like any prompt, counting ``beam_width`` sequence
slots and, on top of its prompt's blocks, one block per beam for the first fan-out.
Its beams then decode together or not at all in a step (``_schedule_beams``: the
next selection needs every beam's logits), and preemption takes them together:
a victim that is a beam frees every beam's blocks, and the search starts over from
its prompt (``BeamSearch.restart``; nothing was streamed, and the prompt's blocks
come back from the prefix index). Preempting a single beam would leave its
siblings waiting on it while holding their blocks.

No deadlock: a request that could never fit (more blocks than the pool; a beam
search by its peak, every beam at full length) is refused at submit time, so a
sequence or search alone in the engine always fits; if the sequence (or search)
that cannot grow is the only candidate left it preempts itself and is re-admitted
once the others finished or were preempted.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from cache import BlockChain, KVCacheManager
from cache.errors import OutOfBlocksError
from chatsvc.engine.config import SchedulerConfig
from chatsvc.engine.fairness import FairQueue, StepShares, slots_of, tenant_of
from chatsvc.engine.prompt_logprobs import wants_prompt_logits
from chatsvc.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from chatsvc.engine.sequence import Sequence, SequenceStatus
from chatsvc.engine.speculative import Speculator
from chatsvc.engine.step_io import FinishedLoad, SequenceLoads
from chatsvc.protocol import RequestTooLargeError

# Waiting sequences whose cached prefix is measured per step: bounds the hashing
# work when the queue is long; the rest keep FIFO order behind them.
MAX_RANKED_CANDIDATES = 64


class Scheduler:
    """Owns the waiting queue and the running list; talks to the cache, never to the model."""

    def __init__(
        self, cache: KVCacheManager, config: SchedulerConfig, clock=time.perf_counter
    ) -> None:
        self.cache = cache
        self.config = config.validate()
        self.clock = clock  # the bound of the wait for loads (tests step it)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.loading: dict[int, Sequence] = {}
        # Running sequences whose loads landed and that have not computed since, and
        # when the wait for the loads still in flight ends (_gathers_loads).
        self._landed: set[int] = set()
        self._gather_until: float | None = None
        self.num_steps = 0  # the queue's clock (aging, deferral): see _tick
        self._computed = True  # the last step computed something
        self.num_preemptions = 0
        self.num_deferrals = 0
        # Proposes speculative tokens for decodes (chatsvc.engine.speculative); None: off.
        self.speculator: Speculator | None = None

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (status WAITING)."""
        seq.waiting_since_step = self.num_steps
        self.waiting.append(seq)

    def add_forked(self, seq: Sequence) -> None:
        """A child already holding blocks through ``cache.fork``: it joins the running list."""
        seq.num_computed_tokens = self.cache.num_computed_tokens(seq.seq_id)
        seq.status = SequenceStatus.RUNNING
        seq.was_admitted = True
        self.running.append(seq)

    def update_from_step(self, computed: list[ScheduledSequence]) -> None:
        """The step's forward wrote the KV of these items' new tokens.

        The one place a step's bookkeeping happens: the cache indexes the newly
        full blocks and each sequence's ``num_computed_tokens`` advances. Items
        of requests that failed in the step are left out by the caller, so their
        blocks are never marked computed.
        """
        for item in computed:
            if item.draft:
                continue  # unverified: ``settle_speculation`` once verified
            done = item.start + item.num_new_tokens
            self.cache.mark_computed(item.seq.seq_id, done)
            item.seq.num_computed_tokens = done

    def settle_speculation(self, seq: Sequence) -> None:
        """Verification of ``seq``'s speculative decode appended its verified tokens: the
        cache rolls back to them and marks them computed (module doc of
        ``chatsvc.engine.speculative``).

        The KV of every token but the newest is verified (the newest has none yet,
        as after any decode); the rejected proposals' tokens go from the cache's
        table, and the blocks taken for them alone return to the free list.
        """
        done = seq.num_tokens - 1
        self.cache.truncate(seq.seq_id, done)
        self.cache.mark_computed(seq.seq_id, done)
        seq.num_computed_tokens = done

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is and free its blocks (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
            self.cache.free(seq.seq_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        # A loading sequence keeps its blocks until its loads land: the disk tier
        # is writing into them (finish_loading frees them then).

    def finish_loads(self, finished: Iterable[FinishedLoad]) -> None:
        """Apply the loads the step's I/O reports ended (``StepIO``), in order."""
        for seq, num_blocks in finished:
            self.finish_loading(seq, num_blocks)

    def finish_loading(self, seq: Sequence, num_blocks: int) -> None:
        """The disk tier read the first ``num_blocks`` of the sequence's loads; it runs now."""
        del self.loading[seq.seq_id]
        if seq.is_finished:  # aborted or failed while it waited
            self.cache.free(seq.seq_id)
            return
        self.cache.complete_load(seq.seq_id, num_blocks)
        done = self.cache.num_computed_tokens(seq.seq_id)
        if seq.num_preemptions == 0:
            seq.num_cached_tokens += done - seq.num_computed_tokens
            seq.cached_by_tier["disk"] = done - seq.num_computed_tokens
        seq.num_computed_tokens = done
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._landed.add(seq.seq_id)

    def schedule(self) -> SchedulerOutput:
        """Plan the next step; mutates the cache (slots, allocations, preemptions)."""
        ticks = self._tick()
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        shares = StepShares(budget, self._tenants_with_work(), self.config.tenant_step_share)
        gathering = self._gathers_loads()
        if gathering:
            # Twins deferred behind the landed ones' loads start theirs now.
            budget = self._admit(budget, out, ticks, shares)
            if not out.scheduled and self.loading:
                self._computed = False
                return out
        scheduled_ids = {item.seq.seq_id for item in out.scheduled}

        # Longest unscheduled first: when a tenant's share leaves some of its decodes
        # out of a step, the ones left out go first in the next (stable: otherwise
        # the running order).
        decodes = sorted(
            (s for s in self.running if s.status is SequenceStatus.RUNNING and s.is_decode),
            key=lambda s: s.last_scheduled_step,
        )
        num_left = len(decodes)  # decodes not yet given their token
        for seq in decodes:
            num_left -= 1
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted for an earlier decode of this step
            if seq.seq_id in scheduled_ids:
                continue  # a beam, scheduled with the others of its search
            if seq.beams is not None:
                budget -= self._schedule_beams(
                    list(seq.beams.beams), budget, scheduled_ids, out, shares
                )
                continue
            if shares.fit(seq, 1) < 1:
                continue
            # Speculation spends only what every later decode leaves over.
            spare = min(budget - 1 - num_left, shares.fit(seq, budget) - 1)
            draft = self._draft(seq, spare, len(decodes))
            slots = self._append_decode_slot(seq, scheduled_ids, out, draft, num_left)
            if slots is None:
                continue
            draft = tuple(draft[: len(slots) - 1])
            self._schedule(seq, len(slots), slots, out, shares, draft)
            scheduled_ids.add(seq.seq_id)
            budget -= len(slots)

        for seq in list(self.running):
            if budget == 0:
                break
            if seq.seq_id in scheduled_ids or seq.status is not SequenceStatus.RUNNING:
                continue
            if seq.is_decode:
                continue  # left out above; its token has no slot yet (append_slots)
            chunk = shares.fit(seq, min(seq.num_tokens_to_compute, budget))
            if chunk < 1:
                continue
            slots = self.cache.prefill_slots(seq.seq_id, chunk)
            self._schedule(seq, chunk, slots, out, shares)
            scheduled_ids.add(seq.seq_id)
            budget -= chunk

        if not gathering:
            self._admit(budget, out, ticks, shares)
        self._computed = bool(out.scheduled)
        return out

    def describe(self, most: int = 16) -> str:
        """The queues in one line, at most ``most`` sequences each, for a log (the
        engine's watchdog reads it from another thread)."""

        def text(seq: Sequence) -> str:
            status = seq.status.name.lower()
            return f"{seq.seq_id} {status} {seq.num_computed_tokens}/{seq.num_tokens}"

        def listed(seqs: list[Sequence], extra=lambda seq: "") -> str:
            shown = ", ".join(text(seq) + extra(seq) for seq in seqs[:most])
            return f"{len(seqs)} [{shown}{', ...' if len(seqs) > most else ''}]"

        def waited(seq: Sequence) -> str:
            return f" deferred {seq.num_deferred_steps}, since step {seq.waiting_since_step}"

        return (
            f"step {self.num_steps} (the last computed: {self._computed}); "
            f"running {listed(list(self.running))}; waiting {listed(list(self.waiting), waited)}; "
            f"loading {listed(list(self.loading.values()))}"
        )

    def _schedule(
        self,
        seq: Sequence,
        chunk: int,
        slots: list[int],
        out: SchedulerOutput,
        shares: StepShares,
        draft: tuple[int, ...] = (),
    ) -> None:
        out.scheduled.append(ScheduledSequence(seq, chunk, slots, draft))
        self._landed.discard(seq.seq_id)
        shares.spend(seq, chunk)
        seq.last_scheduled_step = self.num_steps

    def _tenants_with_work(self) -> set[str]:
        """Tenants that may compute in the next step: those running, and those waiting
        while a sequence slot is free for them (a tenant that cannot be admitted
        would only shrink the others' shares)."""
        tenants = {tenant_of(seq) for seq in self.running if seq.status is SequenceStatus.RUNNING}
        held = sum(slots_of(seq) for seq in [*self.running, *self.loading.values()])
        if held < self.config.max_num_seqs:
            tenants.update(tenant_of(seq) for seq in self.waiting)
        return tenants

    def _gathers_loads(self) -> bool:
        """Whether this step may wait for the loads in flight (see the module docstring).

        Only while every running sequence is one whose loads landed and that has
        not computed since (no decode, no prefill under way is held back), and
        for at most ``max_load_gather_s`` from the first step that could wait.
        """
        self._landed &= {seq.seq_id for seq in self.running}
        if not self.running or len(self._landed) < len(self.running):
            self._gather_until = None
            return False
        now = self.clock()
        if self._gather_until is None:
            self._gather_until = now + self.config.max_load_gather_s
        return now < self._gather_until

    def _tick(self) -> bool:
        """Advance the queue's clock, unless the last step only waited on disk loads.

        While nothing computes and loads are in flight, the loop wakes once per
        block read: such steps would age waiting requests and use up their
        deferral within milliseconds, and a twin of a loading prompt would then
        load the same prefix again (holding its blocks twice). A load lands in
        bounded time, so the deferral stays bounded.
        """
        if not self._computed and self.loading:
            return False
        self.num_steps += 1
        return True

    def _draft(self, seq: Sequence, spare: int, num_decoding: int) -> list[int]:
        """Proposals for ``seq``'s decode (none without a speculator or spare budget)."""
        if self.speculator is None or spare < 1:
            return []
        return self.speculator.draft(seq, spare, num_decoding)

    def _fit_draft(self, seq: Sequence, draft: list[int], num_left: int) -> list[int]:
        """``draft`` cut to the blocks speculation may take: free ones (never an eviction
        of a cached block) beyond those the step's later decodes may need, and none
        while sequences wait (admission needs them); room in the blocks the decode
        takes anyway is always there."""
        if not draft:
            return draft
        cache = self.cache
        base = cache.num_append_blocks([seq.seq_id])
        spare_blocks = 0 if self.waiting else cache.num_free_blocks - base - num_left
        while draft and (
            cache.num_append_blocks([seq.seq_id], 1 + len(draft)) - base > max(0, spare_blocks)
        ):
            draft = draft[:-1]
        return draft

    def _append_decode_slot(
        self,
        seq: Sequence,
        scheduled_ids: set[int],
        out: SchedulerOutput,
        draft: list[int] = (),
        num_left: int = 0,
    ) -> list[int] | None:
        """Slots for the sequence's newest token (and the proposals ``draft`` that fit:
        ``len(slots) - 1`` of them), preempting others when the pool is out of blocks;
        None when the sequence itself was preempted."""
        draft = self._fit_draft(seq, list(draft), num_left)
        while True:
            try:
                result = self.cache.append_slots(seq.seq_id, [seq.output_token_ids[-1], *draft])
            except OutOfBlocksError:
                victim = self._pick_victim(scheduled_ids)
                if victim is None:
                    raise AssertionError(
                        "the sequence being scheduled is always a candidate"
                    ) from None
                self._preempt(victim, out)
                if victim is seq:
                    return None
                continue
            if not result.plan.is_empty:
                out.plans.append(result.plan)
            return result.slots

    def _schedule_beams(
        self,
        beams: list[Sequence],
        budget: int,
        scheduled_ids: set[int],
        out: SchedulerOutput,
        shares: StepShares,
    ) -> int:
        """One decode for every beam of a search, or none; returns the tokens taken.

        Its beams go together: the next selection needs all their logits. The blocks
        their appends take (``num_append_blocks``: fresh ones, one copy per extra
        sharer of a partial block) are made room for first, by preempting others
        newest first; when only the search itself is left, it is preempted (as a
        whole, like any victim that is a beam).
        """
        if len(beams) > budget or not shares.fits_all(beams):
            return 0
        ids = {beam.seq_id for beam in beams}
        needed = self.cache.num_append_blocks([beam.seq_id for beam in beams])
        while not self.cache.can_allocate(needed):
            victim = self._pick_victim(scheduled_ids | ids)
            self._preempt(beams[0] if victim is None else victim, out)
            if victim is None:
                return 0
        for beam in beams:
            result = self.cache.append_slots(beam.seq_id, [beam.output_token_ids[-1]])
            if not result.plan.is_empty:
                out.plans.append(result.plan)
            self._schedule(beam, 1, result.slots, out, shares)
            scheduled_ids.add(beam.seq_id)
        return len(beams)

    def _pick_victim(self, excluded: set[int]) -> Sequence | None:
        """The newest running sequence not in ``excluded`` (those scheduled this step)."""
        for seq in reversed(self.running):
            if seq.seq_id not in excluded:
                return seq
        return None

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Free the sequence's blocks and queue it first. A beam takes its whole search
        along, which starts over from its prompt (``BeamSearch.restart``)."""
        if seq.beams is None:
            self.running.remove(seq)
            self.cache.free(seq.seq_id)
        else:
            for beam in seq.beams.beams:
                self.running.remove(beam)
                self.cache.free(beam.seq_id)
            seq = seq.beams.restart()
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        seq.waiting_since_step = self.num_steps
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)

    def _chain(self, seq: Sequence) -> BlockChain:
        """The sequence's block chain, grown to its tokens: its blocks are hashed once
        for the ranking, the admission check and ``allocate`` (and again only for the
        tokens it generated before a preemption)."""
        chain = seq.block_chain
        if chain is None:
            chain = seq.block_chain = self.cache.chain(seq.token_ids(), seq.request.namespace)
        elif chain.num_tokens < seq.num_tokens:
            chain.extend(seq.output_token_ids[chain.num_tokens - seq.num_prompt_tokens :])
        return chain

    def _admit(self, budget: int, out: SchedulerOutput, ticks: bool, shares: StepShares) -> int:
        """Admit waiting sequences into the step; returns the budget left."""
        if budget == 0 or not self.waiting:
            return budget
        urgent, ranked = self._ranked_waiting()
        candidates = [(seq, False) for seq in urgent] + [(seq, True) for seq in ranked]
        # A loading sequence holds its slots (it runs once its loads land).
        queue = FairQueue(candidates, [*self.running, *self.loading.values()])
        while queue and budget > 0:
            seq, may_defer = queue.pop()
            if shares.left(seq) < 1:
                queue.drop_tenant(seq)
                continue
            # A request with n above the cap still runs, alone, rather than never.
            if queue.num_slots and queue.num_slots + slots_of(seq) > self.config.max_num_seqs:
                break
            # Measured again: an admission just before may have changed what is cached.
            # A sequence that needs its prompt's logits computes every prompt token.
            reuse = not wants_prompt_logits(seq)
            chain = self._chain(seq)
            match = self.cache.match_prefix(chain, seq.request.namespace, reuse)
            if (
                may_defer
                and match.num_pending_tokens
                and seq.num_deferred_steps < self.config.max_defer_steps
            ):
                seq.num_deferred_steps += ticks
                self.num_deferrals += 1
                continue
            needed = match.num_blocks_needed
            if seq.beams is not None:
                # Room for the first fan-out too: each beam's first token takes a block.
                needed += seq.beams.width
            if not self.cache.can_allocate(needed):
                if not self.running and not out.scheduled and not self.loading:
                    # Nothing else holds blocks: it will never fit. Refused at submit
                    # time already, so this is a safety net against a silent stall.
                    self.waiting.remove(seq)
                    error = RequestTooLargeError(
                        f"request {seq.request.request_id!r} needs {needed} KV blocks; "
                        "the whole pool cannot hold it"
                    )
                    out.failed.append((seq, error))
                break
            result = self.cache.allocate(
                seq.seq_id,
                chain,
                seq.request.namespace,
                owner=seq.cache_owner,
                reuse_prefix=reuse,
            )
            if not result.plan.is_empty:
                out.plans.append(result.plan)
            self.waiting.remove(seq)
            if not seq.was_admitted:
                seq.num_cached_tokens = result.num_cached_tokens
                host = result.num_host_tokens
                seq.cached_by_tier = {"device": result.num_cached_tokens - host, "host": host}
                seq.was_admitted = True
            seq.num_computed_tokens = result.num_cached_tokens
            if result.loads:
                seq.status = SequenceStatus.LOADING
                self.loading[seq.seq_id] = seq
                out.loads.append(SequenceLoads(seq, result.loads))
                queue.admit(seq)
                continue
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            queue.admit(seq)
            chunk = shares.fit(seq, min(seq.num_tokens_to_compute, budget))
            if chunk < 1:
                continue  # its cached context costs more than the share has left: next step
            slots = self.cache.prefill_slots(seq.seq_id, chunk)
            self._schedule(seq, chunk, slots, out, shares)
            budget -= chunk
        return budget

    def _ranked_waiting(self) -> tuple[list[Sequence], list[Sequence]]:
        """Waiting sequences in admission order: (urgent, the rest ranked).

        Urgent ones (preempted, or waiting past the age bound) go first in queue
        order and are never deferred; the rest by longest cached prefix first
        (see the module docstring).
        """
        now = time.perf_counter()
        urgent: list[Sequence] = []
        rest: list[Sequence] = []
        for seq in self.waiting:
            aged = (
                self.num_steps - seq.waiting_since_step > self.config.max_wait_steps
                or now - seq.arrival_time > self.config.max_wait_s
            )
            (urgent if seq.status is SequenceStatus.PREEMPTED or aged else rest).append(seq)
        measured = rest[:MAX_RANKED_CANDIDATES]

        def cached_tokens(seq: Sequence) -> int:
            return self.cache.num_matched_tokens(self._chain(seq), seq.request.namespace)

        # sorted() is stable: equal prefixes keep arrival order.
        ranked = sorted(measured, key=cached_tokens, reverse=True) + rest[len(measured) :]
        return urgent, ranked
