"""LLMEngine: the synchronous engine loop (add requests, step, collect deltas).

One ``step()`` = schedule -> run cache plans and the model -> sample -> stop
checks -> deltas. Not thread-safe: one thread owns it (AsyncEngine's loop).

n > 1: a request starts as one sequence; when its prompt is computed, n - 1
children are forked from it (``cache.fork``: every prompt block shared,
refcount + 1, the partial last block copied on first write) and each sample
draws its first token from the same logits with its own seed.

Beam search (``beam_width`` >= 2): the request's rows go to its ``BeamSearch``
(``beam_search.py``) instead of sampling; each step it picks the next beams, which
fork, take over or drop sequences on the block table, and when it ends the ``n``
best hypotheses come back as one delta each (nothing is streamed before).

Speculative decoding (``speculative/``, off unless configured): a decode may carry
proposals; ``_verify`` keeps those the request's own picks confirm (greedy: the tokens
it produces without speculation) and the scheduler rolls the cache back to them.

Failure isolation: a failure that belongs to one request (non-finite logits in
its row, its sampling, its stop handling or detokenization, a forward pass that
fails with it alone) ends that request with EngineInternalError and frees its
blocks; every other request of the step goes on with the tokens it would have
produced without it. A failure of the shared machinery (the scheduler, the cache
plans, the cache's bookkeeping) is raised from ``step``: the engine's state can no
longer be trusted, and the AsyncEngine that owns it stops.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from cache import KVCacheManager
from cache.forget import owner_digest
from chatsvc.engine.allocator import keep_freed_memory
from chatsvc.engine.beam_search import BeamSearch, peak_blocks
from chatsvc.engine.chat_format import ChatFormat
from chatsvc.engine.config import EngineConfig
from chatsvc.engine.detokenizer import IncrementalDetokenizer
from chatsvc.engine.forgotten import ForgottenSessions
from chatsvc.engine.kv_disk import open_disk_tier
from chatsvc.engine.loader import LoadedModel, load_model
from chatsvc.engine.logits_processing import LogitsState
from chatsvc.engine.logprobs import token_logprobs
from chatsvc.engine.prompt_logprobs import take_prompt_logprobs
from chatsvc.engine.runner import ModelRunner
from chatsvc.engine.sampling import SamplingError, make_generator, sample_rows
from chatsvc.engine.sampling_defaults import read_sampling_defaults
from chatsvc.engine.scheduler import Scheduler
from chatsvc.engine.scheduler_output import ScheduledSequence, keep_rows
from chatsvc.engine.sequence import Sequence, SequenceStatus
from chatsvc.engine.speculative import Speculator
from chatsvc.engine.speculative.verify import verify_draft
from chatsvc.engine.step_io import NoStepIO, StepIO
from chatsvc.engine.threads import governor_for, set_torch_threads
from chatsvc.engine.warmup import WarmedShape, run_warm_up, warm_up_shapes
from chatsvc.paths import kernels_dir
from chatsvc.protocol import (
    CACHE_TIERS,
    EngineInternalError,
    FinishReason,
    GenerationDelta,
    GenerationRequest,
    RequestMetrics,
    RequestTooLargeError,
    RequestValidationError,
    SamplingParams,
    TokenLogprob,
)
from kernels.backend import choose_kernels, resolve_backend
from kernels.cpu import native
from kernels.kv_layout import dtype_name, is_narrowed, is_quantized, kv_dtype_for

log = logging.getLogger(__name__)
# A step that computed nothing while loads are in flight sleeps on them this long at
# most, instead of spinning.
IDLE_WAIT_S = 0.05


@dataclass(frozen=True)
class StepOutput:
    """One delta for a request, or the error that ended it (then ``delta`` is None)."""

    request_id: str
    delta: GenerationDelta | None
    error: Exception | None = None


@dataclass
class _RequestState:
    request: GenerationRequest
    seqs: list[Sequence] = field(default_factory=list)
    stop_token_ids: frozenset[int] = frozenset()
    num_unfinished: int = 1
    beams: BeamSearch | None = None  # a beam search's state; its beams are the live ones

    @property
    def needs_fork(self) -> bool:
        return len(self.seqs) < self.request.sampling.n

    def live(self) -> list[Sequence]:
        """The request's sequences now: its samples, or its search's running beams."""
        return self.seqs if self.beams is None else self.beams.beams


class LLMEngine:
    """Synchronous engine over one model, one KV cache and one scheduler."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config.validate()
        set_torch_threads(config.num_threads)
        self.thread_governor = governor_for(config.num_threads)
        keep_freed_memory()
        native.set_build_dir(kernels_dir(config.data_dir))
        if loaded is None:
            loaded = load_model(
                config.model,
                config.dtype,
                config.device,
                config.max_model_len,
                config.seed,
                data_dir=config.data_dir,
                weight_dtype=config.weight_dtype,
                invariant=config.invariant,
            )
        self.loaded = loaded
        self.model = loaded.model
        # Chosen now, so a CPU engine builds its native kernels (on the first start of a
        # machine) before it reports ready, not in the first request.
        self.kernel_backend = resolve_backend(None, self.model.device)
        self.tokenizer = loaded.tokenizer
        # Stop ids listed only in generation_config.json (Llama 3's <|eot_id|>) must end a
        # turn for every user of the chat format, not just this engine's stop check.
        self.chat_format = ChatFormat(loaded.tokenizer, loaded.config.eos_token_ids)
        self.model_name = loaded.name
        limit = config.max_model_len or loaded.config.max_context_len
        self.max_context_len = min(limit, self.model.max_positions)
        shape = self.model.kv_shape(config.block_size)
        # What the pool stores: the model's dtype, bf16 for an fp32 model, or int8 rows
        # with scales (kv_layout).
        self.kv_dtype = kv_dtype_for(config.kv_dtype, self.model.dtype)
        if is_narrowed(self.kv_dtype, self.model.dtype):  # refused now where no kernel reads it
            device, dtype, invariant = self.model.device, self.model.dtype, config.invariant
            choose_kernels(device, dtype, shape.head_dim, None, invariant, self.kv_dtype)
        unit = self.kv_dtype if is_quantized(self.kv_dtype) else torch.bfloat16
        self.num_gpu_blocks = config.num_blocks_for(
            shape.block_bytes(self.kv_dtype), shape.block_bytes(unit)
        )
        self.num_host_blocks = config.host_blocks_for(self.num_gpu_blocks)
        self.cache = KVCacheManager(
            self.num_gpu_blocks,
            config.block_size,
            num_host_blocks=self.num_host_blocks,
            enable_prefix_cache=config.enable_prefix_cache,
            debug_checks=config.debug_checks,
        )
        self.scheduler = Scheduler(self.cache, config.scheduler)
        self.speculator = None
        if config.speculative != "off":
            self.speculator = Speculator(
                config.speculative, config.speculative_max_k, self.max_context_len
            )
            self.scheduler.speculator = self.speculator
        self.runner = ModelRunner(
            self.model, config.block_size, self.num_gpu_blocks, self.num_host_blocks, self.kv_dtype
        )
        self.default_stop_ids = frozenset(self.chat_format.stop_token_ids) | frozenset(
            loaded.config.eos_token_ids
        )
        # What a request that leaves a sampling field unset gets (the API fills them in).
        self.sampling_defaults = read_sampling_defaults(loaded.path)
        self._requests: dict[str, _RequestState] = {}
        self._seq_ids = itertools.count()
        self.forgotten = ForgottenSessions()
        # Block files below the memory tiers (None when off or unusable here). The step
        # sees the tier only as its StepIO; forgetting, stats and shutdown ask it directly.
        self.disk_tier = open_disk_tier(
            config, loaded, self.cache, self.runner.kv_pool, self.runner.host_pool
        )
        self.step_io: StepIO = NoStepIO() if self.disk_tier is None else self.disk_tier
        # Whether the last step moved a request on (the AsyncEngine's watchdog): it
        # computed tokens, started or landed a load, failed or preempted a sequence.
        self.progressed = False

    def warm_up(self, budget_s: float, stop: Callable[[], bool] | None = None) -> list[WarmedShape]:
        """Run the step shapes the scheduler will use, within ``budget_s`` seconds, before
        any request (warmup.py): the cache and its statistics stay as they are.
        ``stop()`` true ends it before the next shape."""
        tier = self.disk_tier
        shapes = warm_up_shapes(
            self.config.max_num_seqs,
            self.config.max_num_batched_tokens,
            self.max_context_len,
            disk_load=tier is not None,
        )
        pool = self.runner.kv_pool
        disk_load = None if tier is None else tier.warm_up_load
        return run_warm_up(
            self.model, pool, self.config.block_size, shapes, budget_s, stop, disk_load
        )

    def start_preload(self) -> int:
        """After a restart, read the most recently used sessions' blocks into memory in
        the background, while no request runs (kv_disk/preload.py); blocks planned."""
        return 0 if self.disk_tier is None else self.disk_tier.start_preload()

    # -- requests -----------------------------------------------------------------

    def add_request(self, request: GenerationRequest) -> None:
        """Queue a request. Raises RequestValidationError (RequestTooLargeError when it can
        never fit) before keeping any state of it."""
        request.validate(self.loaded.config.vocab_size)
        if request.request_id in self._requests:
            raise RequestValidationError(f"request {request.request_id!r} is already running")
        num_prompt = len(request.prompt_token_ids)
        if num_prompt >= self.max_context_len:
            raise RequestTooLargeError(
                f"the prompt has {num_prompt} tokens; the context holds {self.max_context_len} "
                "including at least one generated token"
            )
        longest = min(num_prompt + request.sampling.max_tokens, self.max_context_len)
        num_blocks = math.ceil(longest / self.config.block_size)
        if num_blocks > self.num_gpu_blocks:
            raise RequestTooLargeError(
                f"prompt + max_tokens = {longest} tokens need {num_blocks} KV blocks; "
                f"the pool has {self.num_gpu_blocks}"
            )
        if request.sampling.is_beam_search:
            self._check_beams_fit(request, longest)
        state = _RequestState(
            request,
            stop_token_ids=self._stop_token_ids(request.sampling),
            num_unfinished=request.sampling.n,
        )
        seq = self._new_sequence(request, 0)
        state.seqs.append(seq)
        if request.sampling.is_beam_search:
            state.beams = seq.beams = BeamSearch(
                seq, request.sampling, state.stop_token_ids, longest - num_prompt
            )
        self._requests[request.request_id] = state
        self.scheduler.add(seq)

    def _check_beams_fit(self, request: GenerationRequest, longest: int) -> None:
        """Refuse a beam search that could not run alone (``peak_blocks``), or whose beams
        could not decode in one step."""
        width = request.sampling.beam_width
        bs = self.config.block_size
        if width > self.config.max_num_batched_tokens:
            raise RequestValidationError(
                f"beam_width {width} exceeds the {self.config.max_num_batched_tokens} tokens "
                "a step computes: its beams decode in one step"
            )
        num_blocks = peak_blocks(len(request.prompt_token_ids), longest, width, bs)
        if num_blocks > self.num_gpu_blocks:
            raise RequestTooLargeError(
                f"beam search of width {width} over {longest} tokens needs {num_blocks} "
                f"KV blocks at its peak; the pool has {self.num_gpu_blocks}"
            )

    def abort_request(self, request_id: str) -> list[StepOutput]:
        """Stop a request now and free its blocks; returns its final ``abort`` deltas.

        An unknown (or already finished) id returns an empty list.
        """
        state = self._requests.pop(request_id, None)
        if state is None:
            return []
        outputs = []
        now = time.perf_counter()
        if state.beams is not None:
            self._drop_beams(state.beams)
            metrics = self._metrics(state.beams.beams[0], now)
            delta = GenerationDelta(0, [], "", "abort", metrics)
            return [
                StepOutput(request_id, replace(delta, index=index))
                for index in range(state.beams.num_results)
            ]
        for seq in state.seqs:
            if seq.is_finished:
                continue
            self.scheduler.remove(seq)
            self._finish(seq, "abort")
            delta = GenerationDelta(seq.sample_index, [], "", "abort", self._metrics(seq, now))
            outputs.append(StepOutput(request_id, delta))
        return outputs

    @property
    def has_unfinished_requests(self) -> bool:
        # Loads of aborted requests still hold blocks until they land.
        return bool(self._requests) or bool(self.scheduler.loading)

    @property
    def has_unapplied_io(self) -> bool:
        """Disk writes whose results only this thread can take in (index entry, buffer
        back), or a preload under way: an idle engine must still call ``apply_io``."""
        return self.step_io.has_unapplied_io

    def apply_io(self, wait_s: float) -> None:
        """Wait up to ``wait_s`` for a disk job to end, then take in every ended one; with
        no request in the engine, background I/O (the preload) goes on."""
        self.step_io.wait(wait_s)
        self.scheduler.finish_loads(self.step_io.finished_loads())
        self.forget_late()
        if not self.has_unfinished_requests:
            self.step_io.idle()

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # -- the loop -----------------------------------------------------------------

    def watch_threads(self) -> None:
        """Between steps and while idle: let the thread governor (threads.py) look at
        what other processes use, so the next step's team follows the last window."""
        if self.thread_governor is not None:
            self.thread_governor.before_step()

    def step(self) -> list[StepOutput]:
        """Run one scheduler step; returns the deltas (and errors) it produced.

        A request's own failure is reported as its error (its blocks are freed);
        a failure of the scheduler, the cache plans or the cache's bookkeeping is
        raised (see the module docstring).
        """
        self.watch_threads()
        io = self.step_io
        landed = io.finished_loads()
        self.scheduler.finish_loads(landed)
        out = self.scheduler.schedule()
        self.progressed = bool(landed or out.scheduled or out.loads or out.failed or out.preempted)
        outputs: list[StepOutput] = []
        for seq, error in out.failed:
            outputs.extend(self._fail_request(seq.request.request_id, error))
        self.runner.execute_plans(out.plans, io)
        # After the plans (one may have held the blocks' old data), before the forward,
        # so the reads overlap the step's compute.
        self.scheduler.finish_loads(io.submit(out.loads))
        completing, logits = [], None
        if out.scheduled:
            items, logits = self._forward(out.scheduled, outputs)
            if items:
                items, logits = self._take_prompt_logprobs(items, logits, outputs)
            if items:
                self.scheduler.update_from_step(items)
                completing, logits = self.runner.completing_rows(items, logits)
        if completing:
            outputs.extend(self._sample_and_stop(completing, logits))
        # Write-through: the blocks the step indexed (a verified speculative run's too),
        # before a later plan can reuse them. Not after an exception: the engine's state
        # is then in doubt and nothing of it may reach the disk.
        io.store(self.cache.take_stores())
        if not out.scheduled and self.scheduler.loading:
            io.wait(IDLE_WAIT_S)  # nothing to compute until a load lands
        self.forget_late()
        return outputs

    def _forward(
        self, items: list[ScheduledSequence], outputs: list[StepOutput]
    ) -> tuple[list[ScheduledSequence], torch.Tensor | None]:
        """The step's forward pass; when it fails, each sequence alone, to find the culprits.

        Returns the items computed and their logits rows; the requests of sequences
        that fail alone are failed into ``outputs``. Retrying is safe: a failed pass
        wrote only its own sequences' slots and marked nothing computed (runner.py).
        """
        try:
            return items, self.runner.forward(items, self.cache)
        except Exception as error:  # noqa: BLE001 - retried one by one below
            log.warning(
                "a forward pass over %d sequences failed (%s: %s); running them one by one",
                len(items),
                type(error).__name__,
                error,
            )
        results = self.runner.forward_each(items, self.cache)
        failed: dict[str, Exception] = {}
        for item, result in zip(items, results, strict=True):
            if isinstance(result, Exception):
                failed.setdefault(item.seq.request.request_id, result)
        for request_id, error in failed.items():
            outputs.extend(self._fail_internal(request_id, "the model's forward pass", error))
        # A sample of a failed request that ran fine alone is dropped with its request.
        kept = [
            (item, row)
            for item, row in zip(items, results, strict=True)
            if item.seq.request.request_id not in failed
        ]
        if not kept:
            return [], None
        return [item for item, _ in kept], torch.cat([row for _, row in kept])

    def _take_prompt_logprobs(
        self, items: list[ScheduledSequence], logits: torch.Tensor, outputs: list[StepOutput]
    ) -> tuple[list[ScheduledSequence], torch.Tensor]:
        """Record prompt logprobs from the extra rows; one row per item remains.

        A request whose prompt rows cannot be scored fails alone; its items are dropped
        before ``Scheduler.update_from_step``, like those of a request whose forward pass failed.
        """
        logits, failures = take_prompt_logprobs(items, logits)
        if not failures:
            return items, logits
        for index, error in failures.items():
            request_id = items[index].seq.request.request_id
            outputs.extend(self._fail_internal(request_id, "prompt logprobs", error))
        return keep_rows(items, logits, lambda item: item.seq.request.request_id in self._requests)

    def _sample_and_stop(
        self, items: list[ScheduledSequence], logits: torch.Tensor
    ) -> list[StepOutput]:
        rows: list[int] = []
        targets: list[Sequence] = []
        beam_rows: dict[str, dict[Sequence, int]] = {}
        speculative: list[tuple[ScheduledSequence, int]] = []
        offset = 0
        for item in items:
            seq, row = item.seq, offset
            offset += item.num_rows
            if item.draft:
                speculative.append((item, row))
                continue
            if seq.beams is not None:
                beam_rows.setdefault(seq.request.request_id, {})[seq] = row
                continue
            rows.append(row)
            targets.append(seq)
            state = self._requests[seq.request.request_id]
            if seq.sample_index == 0 and state.needs_fork:
                for child in self._fork_children(state, seq):
                    rows.append(row)
                    targets.append(child)
        now = time.perf_counter()
        outputs = []
        for request_id, rows_of in beam_rows.items():
            outputs.extend(self._beam_step(request_id, rows_of, logits, now))
        for item, first in speculative:
            outputs.extend(self._verify(item, logits[first : first + item.num_rows], now))
        if not targets:
            return outputs
        if len(rows) != logits.shape[0] or rows != list(range(len(rows))):
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
        results = sample_rows(
            logits,
            [s.sampling for s in targets],
            [s.generator for s in targets],
            [s.logits_state for s in targets],
        )
        scores = self._token_logprobs(targets, results, logits)
        for row, (seq, result) in enumerate(zip(targets, results, strict=True)):
            request_id = seq.request.request_id
            if request_id not in self._requests:
                continue  # failed by another of its samples in this step
            if isinstance(result, SamplingError):
                outputs.extend(self._fail_internal(request_id, "sampling", result))
                continue
            outputs.extend(self._append_token(seq, result, now, scores.get(row)))
        return outputs

    @staticmethod
    def _token_logprobs(
        seqs: list[Sequence], results: list[int | SamplingError], logits: torch.Tensor
    ) -> dict[int, TokenLogprob]:
        """Logprobs of the sampled tokens of the rows that ask for them, from the raw logits."""
        rows = [
            i
            for i, (seq, result) in enumerate(zip(seqs, results, strict=True))
            if seq.sampling.logprobs is not None and not isinstance(result, SamplingError)
        ]
        if not rows:
            return {}
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        num_top = max(seqs[i].sampling.logprobs for i in rows)
        scored = token_logprobs(logits.index_select(0, index), [results[i] for i in rows], num_top)
        # One top-k for the widest request; each keeps its own k.
        return {
            i: TokenLogprob(s.token_id, s.logprob, s.rank, s.top[: seqs[i].sampling.logprobs])
            for i, s in zip(rows, scored, strict=True)
        }

    def _fork_children(self, state: _RequestState, parent: Sequence) -> list[Sequence]:
        children = []
        for index in range(len(state.seqs), state.request.sampling.n):
            child = self._fork(parent, index)
            state.seqs.append(child)
            children.append(child)
        return children

    def _fork(self, parent: Sequence, index: int) -> Sequence:
        """A running child sharing every block of ``parent`` (and its tokens so far)."""
        child = self._new_sequence(parent.request, index)
        child.output_token_ids = list(parent.output_token_ids)
        child.first_token_time = parent.first_token_time
        child.last_token_time = parent.last_token_time
        child.last_scheduled_step = parent.last_scheduled_step  # its place in the decode order
        self.cache.fork(parent.seq_id, child.seq_id)
        child.num_cached_tokens = parent.num_cached_tokens
        child.cached_by_tier = dict(parent.cached_by_tier)
        child.arrival_time = parent.arrival_time
        child.prompt_logprobs = parent.prompt_logprobs  # the same prompt, scored once
        child.beams = parent.beams
        self.scheduler.add_forked(child)
        return child

    # -- beam search ----------------------------------------------------------------

    def _beam_step(
        self, request_id: str, rows_of: dict[Sequence, int], logits: torch.Tensor, now: float
    ) -> list[StepOutput]:
        """One selection of a beam search from its beams' rows of ``logits``; when the
        search ends, its answers. A failure here (non-finite logits, its text) is the
        request's own."""
        state = self._requests.get(request_id)
        if state is None:
            return []  # failed earlier in this step
        search = state.beams
        first = search.num_generated == 0
        try:
            # Every beam decoded in this step (the scheduler runs them together).
            index = torch.tensor([rows_of[beam] for beam in search.beams], device=logits.device)
            picks = search.select(logits.index_select(0, index))
            answers = self._beam_answers(state, now) if search.done else []
        except Exception as error:  # noqa: BLE001 - this request's own failure
            return self._fail_internal(request_id, "beam search", error)
        if search.done:
            del self._requests[request_id]
            self._drop_beams(search)
            return answers
        if first:
            # The prompt's blocks are indexed; the beams' own die with them.
            self.cache.stop_indexing(search.beams[0].seq_id)
        search.advance(picks, lambda parent: self._fork(parent, 0), self._drop_beam, now)
        return []

    def _drop_beam(self, beam: Sequence) -> None:
        self.scheduler.remove(beam)  # its blocks are freed now
        beam.status = SequenceStatus.FINISHED
        self.forgotten.finished(beam)

    def _drop_beams(self, search: BeamSearch) -> None:
        for beam in search.beams:
            if not beam.is_finished:
                self._drop_beam(beam)

    def _beam_answers(self, state: _RequestState, now: float) -> list[StepOutput]:
        """A finished search's ``n`` best hypotheses, one final delta each, best first; the
        text as a streamed answer's would be (a stop token adds none)."""
        beam = state.beams.beams[0]
        if beam.first_token_time is None:  # the search ended at its first step
            beam.first_token_time = beam.last_token_time = now
        stop = state.stop_token_ids
        outputs = []
        for index, answer in enumerate(state.beams.results()):
            detokenizer = IncrementalDetokenizer(self.tokenizer, state.request.prompt_token_ids)
            text = "".join(detokenizer.add_token(t) for t in answer.token_ids if t not in stop)
            text += detokenizer.flush()
            metrics = self._metrics(beam, now, len(answer.token_ids))
            delta = GenerationDelta(
                index, list(answer.token_ids), text, answer.finish_reason, metrics
            )
            outputs.append(StepOutput(state.request.request_id, delta))
        return outputs

    def _verify(self, item: ScheduledSequence, rows: torch.Tensor, now: float) -> list[StepOutput]:
        """Verify a speculative decode (``speculative/verify.py``), append the tokens it
        keeps with every stop check a decode makes, roll the cache back to them, and
        return one delta for them all. A failure here is the request's own."""
        seq = item.seq
        request_id = seq.request.request_id
        if request_id not in self._requests:
            return []  # failed by another of its samples in this step
        params = seq.sampling
        tokens: list[int] = []
        scores: list[TokenLogprob] = []
        text: list[str] = []
        reason: list[FinishReason] = []

        def pick(row: torch.Tensor) -> int:
            result = sample_rows(row[None], [params], [seq.generator], [seq.logits_state])[0]
            if isinstance(result, SamplingError):
                raise result
            if params.logprobs is not None:
                scores.extend(token_logprobs(row[None], [result], params.logprobs))
            return result

        def emit(token: int) -> bool:
            seq.append_token(token, now)
            tokens.append(token)
            stop, released = self._stop_check(seq, token)
            text.append(released)
            if stop is not None:
                reason.append(stop)
            return stop is not None

        try:
            accepted = verify_draft(rows, item.draft, pick, emit)
        except Exception as error:  # noqa: BLE001 - this request's own verification
            return self._fail_internal(request_id, "speculative verification", error)
        self.speculator.record(seq, len(item.draft), accepted)
        self.scheduler.settle_speculation(seq)
        metrics = None
        if reason:
            self.scheduler.remove(seq)
            self._finish(seq, reason[0])
            metrics = self._metrics(seq, now)
        delta = GenerationDelta(
            seq.sample_index,
            tokens,
            "".join(text),
            reason[0] if reason else None,
            metrics,
            logprobs=tuple(scores) if params.logprobs is not None else None,
        )
        return [StepOutput(request_id, delta)]

    def _append_token(
        self, seq: Sequence, token: int, now: float, score: TokenLogprob | None = None
    ) -> list[StepOutput]:
        seq.append_token(token, now)
        try:
            reason, text = self._stop_check(seq, token)
        except Exception as error:  # noqa: BLE001 - this request's own text handling
            return self._fail_internal(seq.request.request_id, "stop handling", error)
        metrics = None
        if reason is not None:
            self.scheduler.remove(seq)
            self._finish(seq, reason)
            metrics = self._metrics(seq, now)
        prompt_scores = None
        if seq.prompt_logprobs is not None and len(seq.output_token_ids) == 1:
            prompt_scores = tuple(seq.prompt_logprobs)
        delta = GenerationDelta(
            seq.sample_index,
            [token],
            text,
            reason,
            metrics,
            logprobs=None if score is None else (score,),
            prompt_logprobs=prompt_scores,
        )
        return [StepOutput(seq.request.request_id, delta)]

    def _stop_check(self, seq: Sequence, token: int) -> tuple[FinishReason | None, str]:
        """Whether the newest token ends the sample, and the text it releases."""
        state = self._requests[seq.request.request_id]
        reason: FinishReason | None = None
        if token in state.stop_token_ids:
            reason, text = "stop", ""
        else:
            text = seq.detokenizer.add_token(token)
            if seq.detokenizer.stopped_by is not None:
                reason = "stop"
            elif len(seq.output_token_ids) >= seq.sampling.max_tokens:
                reason = "length"
            elif seq.num_tokens >= self.max_context_len:
                reason = "length"
        if reason is not None:
            text += seq.detokenizer.flush()
        return reason, text

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.forgotten.finished(seq)
        if self.speculator is not None:
            self.speculator.finished(seq)
        state = self._requests.get(seq.request.request_id)
        if state is None:
            return
        state.num_unfinished -= 1
        if state.num_unfinished == 0:
            del self._requests[seq.request.request_id]

    def _fail_internal(self, request_id: str, stage: str, error: Exception) -> list[StepOutput]:
        """End a request whose own computation failed: EngineInternalError, detail logged."""
        log.error("request %s failed in %s", request_id, stage, exc_info=error)
        failure = EngineInternalError(f"request {request_id!r} failed in {stage}: {error}")
        failure.__cause__ = error
        return self._fail_request(request_id, failure)

    def _fail_request(self, request_id: str, error: Exception) -> list[StepOutput]:
        state = self._requests.pop(request_id, None)
        if state is None:
            return []
        for seq in state.live():
            if not seq.is_finished:
                self.scheduler.remove(seq)
                seq.status = SequenceStatus.FINISHED
                self.forgotten.finished(seq)
        return [StepOutput(request_id, None, error)]

    def _stop_token_ids(self, params: SamplingParams) -> frozenset[int]:
        """Tokens that end a sample: the model's end-of-sequence and end-of-turn tokens
        (not with ``ignore_eos``) and the request's ``stop_token_ids``."""
        own = frozenset(params.stop_token_ids)
        return own if params.ignore_eos else self.default_stop_ids | own

    def _new_sequence(self, request: GenerationRequest, index: int) -> Sequence:
        params = request.sampling
        session = request.labels.get("session")
        logits_state = None
        # A beam search masks its stop tokens itself (beam_search.py) and takes no other
        # processing.
        if LogitsState.is_needed(params) and not params.is_beam_search:
            logits_state = LogitsState(
                params,
                request.prompt_token_ids,
                self.loaded.config.vocab_size,
                self._stop_token_ids(params),
                self.model.device,
            )
        return Sequence(
            cache_owner=owner_digest(request.namespace.tenant_salt, session) if session else b"",
            seq_id=next(self._seq_ids),
            request=request,
            sample_index=index,
            prompt_token_ids=list(request.prompt_token_ids),
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, params.stop, params.min_tokens
            ),
            generator=None if params.is_greedy else make_generator(params.sample_seed(index)),
            logits_state=logits_state,
            prompt_logprobs=None if params.prompt_logprobs is None else [None],
        )

    @staticmethod
    def _metrics(seq: Sequence, now: float, num_out: int | None = None) -> RequestMetrics:
        """The figures of ``seq``'s sample; ``num_out``: its output tokens when another
        count stands for them (a beam search's answer)."""
        first = seq.first_token_time
        if num_out is None:
            num_out = len(seq.output_token_ids)
        tpot = 0.0
        if first is not None and num_out > 1 and seq.last_token_time is not None:
            tpot = (seq.last_token_time - first) / (num_out - 1)
        return RequestMetrics(
            prompt_tokens=seq.num_prompt_tokens,
            cached_prompt_tokens=seq.num_cached_tokens,
            cached_tokens_by_tier={t: seq.cached_by_tier.get(t, 0) for t in CACHE_TIERS},
            completion_tokens=num_out,
            ttft_s=(first - seq.arrival_time) if first is not None else 0.0,
            tpot_s=tpot,
            latency_s=now - seq.arrival_time,
        )

    # -- introspection ------------------------------------------------------------

    def cache_stats(self) -> dict:
        snapshot = self.cache.stats_snapshot()
        snapshot["num_preemptions"] = self.scheduler.num_preemptions
        snapshot["block_size"] = self.config.block_size
        snapshot["kv_dtype"] = dtype_name(self.kv_dtype)
        snapshot["block_bytes"] = self.model.kv_shape(self.config.block_size).block_bytes(
            self.kv_dtype
        )
        if self.disk_tier is not None:
            snapshot["disk"].update(self.disk_tier.stats_snapshot())
        if self.speculator is not None:
            snapshot["speculative"] = self.speculator.stats()
        return snapshot

    def forget_session(
        self, session: str, token_ids: list[int], namespace, keep_tokens: int = 0
    ) -> tuple:
        """Delete a session's KV from every tier (its stored tokens and what it computed).

        The session's running requests (``labels["session"]``, same tenant) are
        aborted first, and their tokens forgotten too. Blocks wholly inside the
        first ``keep_tokens`` stay (another live session shares them). Returns
        (abort deltas for their callers, counts of blocks removed per tier, a
        future for the file deletions or None).
        """
        owner = owner_digest(namespace.tenant_salt, session)
        # First: a sequence of the session that ends from now on is forgotten once freed.
        self.forgotten.add(owner)
        chains = []
        outputs = []
        for request_id, state in list(self._requests.items()):
            request = state.request
            if request.labels.get("session") != session:
                continue
            if request.namespace.tenant_salt != namespace.tenant_salt:
                continue
            chains.extend(seq.token_ids() for seq in state.live())
            outputs.extend(self.abort_request(request_id))
        chains.append(list(token_ids))
        # Longest first: an aborted turn's blocks hang below the stored history.
        counts, done = self._forget(
            sorted(chains, key=len, reverse=True), namespace, owner, keep_tokens
        )
        return outputs, counts, done

    def forget_late(self) -> None:
        """Forget the chains of deleted sessions' sequences the cache has let go of
        since (``chatsvc.engine.forgotten``); their files go in the background."""
        for seq in self.forgotten.take_freed(self.cache.__contains__):
            counts, _ = self._forget([seq.token_ids()], seq.request.namespace, seq.cache_owner, 0)
            log.info("a deleted session's late sequence: KV blocks removed per tier %s", counts)

    def forget_tokens(
        self, session: str, token_ids: list[int], namespace, keep_tokens: int = 0
    ) -> tuple:
        """Delete the KV of one token history of ``session`` past its first
        ``keep_tokens`` (text the session no longer holds: a deleted branch, message
        or response), in every tier, unless another session uses it.

        Only the history's own blocks go, never what hangs below them (the session's
        other branches may). Returns (counts per tier, a future for the file deletions
        or None).
        """
        owner = owner_digest(namespace.tenant_salt, session)
        return self._forget([list(token_ids)], namespace, owner, keep_tokens, owned_below=False)

    def _forget(
        self,
        chains: list[list[int]],
        namespace,
        owner: bytes,
        keep_tokens: int,
        owned_below: bool = True,
    ):
        counts = {"device": 0, "host": 0, "disk": 0, "kept": 0}
        done = None
        for chain in chains:
            if self.disk_tier is not None:
                removed, done = self.disk_tier.forget(
                    chain, namespace, owner, keep_tokens, owned_below
                )
            else:
                result = self.cache.forget(chain, namespace, owner, keep_tokens, owned_below)
                removed = {
                    "device": result.device_blocks,
                    "host": result.host_blocks,
                    "kept": result.kept_blocks,
                }
            for tier, count in removed.items():
                counts[tier] += count
        return counts, done

    def close(self) -> None:
        """Stop the disk tier's I/O (storing what it still has to); the engine is done."""
        if self.disk_tier is not None:
            self.disk_tier.close()
            self.disk_tier = None
            self.step_io = NoStepIO()

    def check_integrity(self) -> None:
        self.cache.check_integrity()
