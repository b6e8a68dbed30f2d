"""AsyncEngine: LLMEngine behind asyncio, stepped by one background thread.

    event loop (callers)                      engine thread
    --------------------                      -------------
    generate(): submit ------ commands ---->  apply adds/aborts between steps
                 await queue <- call_soon_threadsafe -- step() deltas / errors

Only the engine thread touches LLMEngine; callers hand it commands through a
locked list. The engine thread also builds the engine (loads and prepacks the
model): with GNU OpenMP, every thread that runs a parallel region keeps its own
team of workers, and once the process holds more OpenMP threads than cores the
workers stop spinning between ops and sleep, which made each step ~1.7x slower
on 2 cores. So torch's parallel work stays on this one thread.

torch releases the GIL in its kernels, so the loop stays responsive while a
step runs. Leaving ``generate`` early (break, aclose, cancellation) queues an
abort that the thread applies before its next step, so the request's blocks
are free once the current step ends.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future

from chatsvc.engine.config import EngineConfig
from chatsvc.engine.engine import LLMEngine, StepOutput
from chatsvc.engine.errors import EngineStoppedError
from chatsvc.engine.loader import LoadedModel
from chatsvc.engine.request import GenerationDelta, GenerationRequest


class AsyncEngine:
    """Streaming engine for the service (contract: docs/contracts.md)."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self._loaded = loaded
        self.engine: LLMEngine | None = None
        self._commands: list[tuple[str, object]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, asyncio.Queue] = {}

    # -- lifecycle ----------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine thread, which loads the model; returns once it is serving.

        A load error is raised here (and the thread is gone).
        """
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        ready: Future = Future()
        self._thread = threading.Thread(
            target=self._main, args=(ready,), name="chatsvc-engine", daemon=True
        )
        self._thread.start()
        try:
            await asyncio.wrap_future(ready)
        except BaseException:
            # Load failed, or start() was cancelled mid-load: let the thread end.
            self._stopping = True
            self._wake.set()
            await asyncio.to_thread(self._thread.join)
            self._thread = None
            raise

    async def stop(self) -> None:
        """Abort everything in flight and join the engine thread."""
        if self._thread is None:
            return
        self._stopping = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        for queue in self._queues.values():
            queue.put_nowait(EngineStoppedError("the engine stopped"))
        self._queues.clear()

    # -- the interface ------------------------------------------------------------

    @property
    def tokenizer(self):
        return self._engine.tokenizer

    @property
    def chat_format(self):
        return self._engine.chat_format

    @property
    def model_name(self) -> str:
        return self._engine.model_name

    @property
    def max_context_len(self) -> int:
        return self._engine.max_context_len

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        """Stream the deltas of ``request``; raises its error (ValueError when it can never fit).

        Stops after every sample has its final delta. Leaving early aborts the request.
        """
        if self._thread is None or self._stopping:
            raise EngineStoppedError("the engine is not running; call start() first")
        if request.request_id in self._queues:
            raise ValueError(f"request {request.request_id!r} is already running")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request.request_id] = queue
        finished = False
        try:
            # The engine thread validates and admits it; a refusal comes back as an error.
            await self._call("add", request)
            remaining = request.sampling.n
            while remaining:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason is not None:
                    remaining -= 1
                yield item
            finished = True
        finally:
            self._queues.pop(request.request_id, None)
            if not finished:
                self._submit("abort", request.request_id, None)

    async def abort(self, request_id: str) -> None:
        """Abort a request by id; its blocks are freed before the next step."""
        await self._call("abort", request_id)

    def cache_stats(self) -> dict:
        """Cache counters and tier usage (a consistent snapshot between steps)."""
        return self._between_steps(lambda e: e.cache_stats())

    def check_integrity(self) -> None:
        """Run the cache's integrity checker between steps; raises on a broken invariant."""
        self._between_steps(lambda e: e.check_integrity())

    async def forget_session(
        self, session: str, token_ids: list[int], namespace, keep_tokens: int = 0
    ) -> dict:
        """Delete a session's KV from every tier, disk files included (see LLMEngine).

        Its running requests end with an abort delta. Returns the blocks removed
        per tier once their files are gone.
        """

        def forget(engine: LLMEngine):
            outputs, counts, done = engine.forget_session(
                session, token_ids, namespace, keep_tokens
            )
            self._deliver(outputs)
            return counts, done

        counts, done = await self._call("call", forget)
        if done is not None:
            await asyncio.wrap_future(done)
        return counts

    # -- plumbing -----------------------------------------------------------------

    @property
    def _engine(self) -> LLMEngine:
        if self.engine is None:
            raise EngineStoppedError("the engine is not started")
        return self.engine

    def _between_steps(self, fn):
        if self._thread is None:
            return fn(self._engine)
        future: Future = Future()
        self._submit("call", fn, future)
        return future.result()

    async def _call(self, kind: str, payload: object):
        future: Future = Future()
        self._submit(kind, payload, future)
        return await asyncio.wrap_future(future)

    def _submit(self, kind: str, payload: object, future: Future | None = None) -> None:
        with self._lock:
            self._commands.append((kind, (payload, future)))
        self._wake.set()

    def _main(self, ready: Future) -> None:
        if not ready.set_running_or_notify_cancel():
            return  # start() was cancelled before the thread ran
        try:
            self.engine = LLMEngine(self.config, self._loaded)
        except BaseException as error:  # noqa: BLE001 - raised in start()
            ready.set_exception(error)
            return
        ready.set_result(None)
        self._run()

    def _run(self) -> None:
        engine = self._engine
        while not self._stopping:
            self._apply_commands(engine)
            if not engine.has_unfinished_requests:
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = engine.step()
            except Exception as error:  # noqa: BLE001 - a bug in a step fails its requests
                outputs = [
                    StepOutput(request_id, None, error)
                    for request_id in list(engine._requests)  # noqa: SLF001
                ]
                for out in outputs:
                    engine.abort_request(out.request_id)
            self._deliver(outputs)
        for request_id in list(engine._requests):  # noqa: SLF001
            engine.abort_request(request_id)
        self._apply_commands(engine)
        engine.close()  # the disk tier stores what only memory held, then stops its I/O

    def _apply_commands(self, engine: LLMEngine) -> None:
        with self._lock:
            commands, self._commands = self._commands, []
        for kind, (payload, future) in commands:
            # A caller cancelled while its command waited: wrap_future cancelled the
            # Future too, and completing it now would raise in this thread. A skipped
            # "add" is harmless: the caller's finally already queued its abort.
            if future is not None and not future.set_running_or_notify_cancel():
                continue
            try:
                if kind == "add":
                    result = engine.add_request(payload)
                elif kind == "abort":
                    result = engine.abort_request(payload)  # deltas: the caller already left
                else:
                    result = payload(engine)
            except Exception as error:  # noqa: BLE001 - handed to the caller
                if future is not None:
                    future.set_exception(error)
                continue
            if future is not None:
                future.set_result(result if kind == "call" else None)

    def _deliver(self, outputs: list[StepOutput]) -> None:
        # One wake-up of the event loop per step, not one per stream: each wake-up is a
        # write to the loop's self-pipe and a turn of the loop, taken from the CPU the
        # next step needs.
        if outputs:
            self._loop.call_soon_threadsafe(self._put_all, outputs)

    def _put_all(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out.error if out.error is not None else out.delta)
