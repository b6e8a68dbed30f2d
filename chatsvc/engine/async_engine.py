"""AsyncEngine: LLMEngine behind asyncio, stepped by one background thread.

    event loop (callers)                      engine thread
    --------------------                      -------------
    generate(): submit ------ commands ---->  apply adds/aborts between steps
                 await queue <- call_soon_threadsafe -- step() deltas / errors

Only the engine thread touches LLMEngine; callers hand it commands (typed
messages, ``chatsvc.engine.commands``) through a locked list. The engine thread
also builds the engine (loads and prepacks the model): with GNU OpenMP, every
thread that runs a parallel region keeps its own team of workers, and once the
process holds more OpenMP threads than cores the workers stop spinning between
ops and sleep, which slows every step (docs/engine.md). So torch's parallel work
stays on this one thread.

torch releases the GIL in its kernels, so the loop stays responsive while a
step runs. Leaving ``generate`` early (break, aclose, cancellation) queues an
abort that the thread applies before its next step, so the request's blocks
are free once the current step ends.

If the thread dies (an exception escapes a step or a command: see LLMEngine on
which failures are a request's own and which are the engine's), it closes the
command list, every stream waiting in ``generate`` gets EngineStoppedError, later
calls get it at once, and the death callbacks run on the event loop (the service
turns not-ready and exits, so a supervisor restarts it). The engine's state is
not trusted again. The same happens when the thread holds requests and makes no
progress for ``watchdog_timeout_s`` (watchdog.py): a step that never returns would
otherwise hold its requests, and their turn locks, for good. The stalled thread is
not joined (it may never end); the process's exit takes it along.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future

from cache import Namespace
from chatsvc.engine.commands import (
    AbortRequest,
    AddRequest,
    CallBetweenSteps,
    Command,
    apply_command,
    error_is_callers,
)
from chatsvc.engine.config import EngineConfig
from chatsvc.engine.engine import LLMEngine, StepOutput
from chatsvc.engine.loader import LoadedModel
from chatsvc.engine.threads import WINDOW_S as THREADS_WINDOW_S
from chatsvc.engine.watchdog import EngineStalledError, Watchdog
from chatsvc.protocol import (
    ChatTemplate,
    EngineInfo,
    EngineStoppedError,
    GenerationDelta,
    GenerationRequest,
    RequestValidationError,
    SamplingDefaults,
    Tokenizer,
)
from kernels.cpu import native
from kernels.kv_layout import dtype_name

log = logging.getLogger(__name__)
# How long an idle engine thread waits on the disk tier before it looks for commands.
IO_POLL_S = 0.05
THREAD_NAME = "chatsvc-engine"


class AsyncEngine:
    """Streaming engine for the service: implements ``chatsvc.protocol.EngineClient``."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self._loaded = loaded
        self.engine: LLMEngine | None = None
        self._info: EngineInfo | None = None
        self._commands: list[Command] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._warming = False  # a warm_up() call is running (stop() then does not join)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        # Set under _lock when the thread ends: no command is accepted after it.
        self._closed = False
        self.failure: BaseException | None = None  # what killed the engine thread
        self._death_callbacks: list[Callable[[BaseException], None]] = []
        self._watchdog: Watchdog | None = None

    # -- lifecycle ----------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine thread, which loads the model; returns once it is serving.

        A load error is raised here (and the thread is gone).
        """
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        self._closed = False
        ready: Future = Future()
        self._thread = threading.Thread(
            target=self._main, args=(ready,), name=THREAD_NAME, daemon=True
        )
        self._thread.start()
        try:
            await asyncio.wrap_future(ready)
            if self.config.watchdog_timeout_s:
                self._watchdog = Watchdog(
                    self.config.watchdog_timeout_s, self._stalled, self._describe_queues
                )
                self._watchdog.start(self._thread)
        except asyncio.CancelledError:
            # Cancelled mid-load (a SIGTERM during start-up): a load cannot be
            # interrupted, and the service must not wait for it. The thread sees
            # _stopping once the load is done and ends by itself (a daemon: a process
            # that exits first takes it along; ``serve`` then exits at once).
            self._stopping = True
            self._wake.set()
            self._thread = None
            raise
        except BaseException:
            # The load failed: the thread is ending.
            self._stopping = True
            self._wake.set()
            await asyncio.to_thread(self._thread.join)
            self._thread = None
            raise

    async def stop(self) -> None:
        """Abort everything in flight and join the engine thread.

        During the warm-up the thread is not joined: its current shape may take
        seconds, no request is in flight and nothing needs storing, so a shutdown
        does not wait; the thread ends by itself after that shape.
        """
        if self._thread is None:
            return
        self._stopping = True
        self._wake.set()
        if self._watchdog is not None:
            self._watchdog.stop()
        if self._warming or isinstance(self.failure, EngineStalledError):
            self._thread = None  # not joined: see above, and the module docstring
            return
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        for queue in self._queues.values():
            queue.put_nowait(EngineStoppedError("the engine stopped"))
        self._queues.clear()

    @property
    def is_running(self) -> bool:
        """Started and serving: not stopped, and the engine thread has not died."""
        return self._thread is not None and not self._stopping and self.failure is None

    def add_death_callback(self, callback: Callable[[BaseException], None]) -> None:
        """Call ``callback(error)`` on the event loop once if the engine thread dies.

        Not called on a normal ``stop()``. Registered after the death, it is called soon.
        """
        if self.failure is not None and self._loop is not None:
            self._loop.call_soon(callback, self.failure)
        else:
            self._death_callbacks.append(callback)

    # -- the interface ------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        return self._engine.tokenizer

    @property
    def chat_format(self) -> ChatTemplate:
        return self._engine.chat_format

    @property
    def model_name(self) -> str:
        return self._engine.model_name

    @property
    def max_context_len(self) -> int:
        return self._engine.max_context_len

    @property
    def vocab_size(self) -> int:
        return self._engine.loaded.config.vocab_size

    @property
    def sampling_defaults(self) -> SamplingDefaults:
        return self._engine.sampling_defaults

    @property
    def info(self) -> EngineInfo:
        """What the started engine serves (model, dtype, kernels, KV pool)."""
        if self._info is None:
            raise EngineStoppedError("the engine is not started")
        return self._info

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        """Stream the deltas of ``request``; raises its error.

        RequestValidationError (a ValueError; RequestTooLargeError when it can never
        fit): the request is bad, nothing was kept. EngineInternalError: a step failed
        for this request alone, its blocks are freed. EngineStoppedError: the engine
        is not running or its thread died. Stops after every sample has its final
        delta. Leaving early aborts the request.
        """
        if self.failure is not None:
            raise _died(self.failure)
        if self._thread is None or self._stopping:
            raise EngineStoppedError("the engine is not running; call start() first")
        if request.request_id in self._queues:
            raise RequestValidationError(f"request {request.request_id!r} is already running")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request.request_id] = queue
        finished = False
        try:
            # The engine thread validates and admits it; a refusal comes back as an error.
            await self._call(AddRequest(request, Future()))
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
                self._submit(AbortRequest(request.request_id))

    async def warm_up(self) -> list[tuple[str, float]]:
        """Run the step shapes the scheduler will use, within ``config.warm_up_s``, before
        serving (engine/warmup.py); (shape, seconds) of each that ran. A stop in the
        middle ends it after the shape running then. Its last act starts the disk
        tier's preload, which reads in the background while no request runs."""

        def warm(engine: LLMEngine):
            # Not watched: it runs up to warm_up_s, and no request waits on it.
            if self._watchdog is not None:
                self._watchdog.pause()
            try:
                shapes = engine.warm_up(self.config.warm_up_s, stop=lambda: self._stopping)
            finally:
                if self._watchdog is not None:
                    self._watchdog.resume()
            if not self._stopping:
                engine.start_preload()
            return [(shape.name, shape.seconds) for shape in shapes]

        # Left set when the call is cancelled: the stop() that follows then does not
        # wait for the shape running.
        self._warming = True
        shapes = await self._call(CallBetweenSteps(warm, Future()))
        self._warming = False
        return shapes

    async def abort(self, request_id: str) -> None:
        """Abort a request by id: its blocks are freed before the next step, and its
        stream ends with an ``abort`` delta per unfinished sample."""
        await self._call(AbortRequest(request_id, Future()))

    def cache_stats(self) -> dict:
        """Cache counters and tier usage (a consistent snapshot between steps)."""
        return self._between_steps(lambda e: e.cache_stats())

    def check_integrity(self) -> None:
        """Run the cache's integrity checker between steps; raises on a broken invariant."""
        self._between_steps(lambda e: e.check_integrity())

    async def forget_session(
        self, session: str, token_ids: list[int], namespace: Namespace, keep_tokens: int = 0
    ) -> dict[str, int]:
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

        counts, done = await self._call(CallBetweenSteps(forget, Future()))
        if done is not None:
            await asyncio.wrap_future(done)
        return counts

    async def forget_tokens(
        self, session: str, token_ids: list[int], namespace: Namespace, keep_tokens: int = 0
    ) -> dict[str, int]:
        """Delete one token history's KV past ``keep_tokens`` (see LLMEngine); returns
        the blocks removed per tier once their files are gone."""

        def forget(engine: LLMEngine):
            return engine.forget_tokens(session, token_ids, namespace, keep_tokens)

        counts, done = await self._call(CallBetweenSteps(forget, Future()))
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
        command = CallBetweenSteps(fn, Future())
        self._submit(command)
        return command.done.result()

    async def _call(self, command: Command):
        self._submit(command)
        return await asyncio.wrap_future(command.done)

    def _submit(self, command: Command) -> None:
        """Queue a command for the engine thread; once it has ended, fail its Future now."""
        with self._lock:
            if not self._closed:
                self._commands.append(command)
                self._wake.set()
                return
        future = command.done
        if future is not None and future.set_running_or_notify_cancel():
            future.set_exception(self._stopped_error())

    def _stopped_error(self) -> EngineStoppedError:
        if self.failure is not None:
            return _died(self.failure)
        return EngineStoppedError("the engine stopped")

    def _main(self, ready: Future) -> None:
        if not ready.set_running_or_notify_cancel():
            self._close()
            return  # start() was cancelled before the thread ran
        try:
            self.engine = LLMEngine(self.config, self._loaded)
            self._info = _describe(self.engine)
        except BaseException as error:  # noqa: BLE001 - raised in start()
            self._close()
            ready.set_exception(error)
            return
        ready.set_result(None)
        try:
            self._run()
        except BaseException as error:  # noqa: BLE001 - the thread's death, reported below
            self._die(error)

    def _run(self) -> None:
        engine = self._engine
        while not self._stopping:
            self._apply_commands(engine)
            if not engine.has_unfinished_requests:
                self._beat()  # nothing waits on an idle engine
                if engine.has_unapplied_io:
                    # Idle, with disk writes still out: take them in as they end (a new
                    # command waits at most this long) rather than at the next request.
                    engine.apply_io(IO_POLL_S)
                    continue
                # Idle: look at the other processes' use every window, so the team the
                # next request starts with follows the last moments, not a window that
                # spans the whole idle time (a client's start-up, long gone, in it).
                if not self._wake.wait(THREADS_WINDOW_S):
                    engine.watch_threads()
                self._wake.clear()
                continue
            self._deliver(engine.step())
            if engine.progressed:
                self._beat()
        for request_id in list(engine._requests):  # noqa: SLF001
            engine.abort_request(request_id)
        self._apply_commands(engine)
        if self.failure is None:  # a stalled engine's state is not trusted to the disk
            engine.close()  # the disk tier stores what only memory held, then stops its I/O
        self._close()

    def _beat(self) -> None:
        if self._watchdog is not None:
            self._watchdog.beat()

    def _describe_queues(self) -> str:
        engine = self._engine
        return f"{engine.num_requests} request(s); {engine.scheduler.describe()}"

    def _stalled(self, error: EngineStalledError) -> None:
        """The watchdog's call (on its thread; it logged the stacks): stop as on a death."""
        self._stopping = True
        self._wake.set()
        self._fail(error)

    def _die(self, error: BaseException) -> None:
        """The engine thread's last act after an unexpected exception."""
        log.critical("the engine thread died; every request in flight fails", exc_info=error)
        self._fail(error)

    def _fail(self, error: BaseException) -> None:
        """Fail every waiter and refuse further commands; the first failure is the one kept."""
        if self._watchdog is not None:
            self._watchdog.stop()
        with self._lock:
            if self.failure is not None:
                return
            self.failure = error
        self._close()
        try:
            self._loop.call_soon_threadsafe(self._fail_waiters)
        except RuntimeError:  # the event loop is already closed: nobody is waiting
            pass

    def _fail_waiters(self) -> None:
        # On the event loop: asyncio queues are not thread-safe.
        error = self._stopped_error()
        for queue in self._queues.values():
            queue.put_nowait(error)
        for callback in self._death_callbacks:
            try:
                callback(self.failure)
            except Exception:  # noqa: BLE001 - one callback's bug must not skip the others
                log.exception("a death callback of the engine failed")

    def _close(self) -> None:
        """Refuse further commands and fail those still queued (their callers wait)."""
        with self._lock:
            self._closed = True
            commands, self._commands = self._commands, []
        for command in commands:
            future = command.done
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(self._stopped_error())

    def _apply_commands(self, engine: LLMEngine) -> None:
        with self._lock:
            commands, self._commands = self._commands, []
        for command in commands:
            future = command.done
            # A caller cancelled while its command waited: wrap_future cancelled the
            # Future too, and completing it now would raise in this thread. A skipped
            # add is harmless: the caller's finally already queued its abort.
            if future is not None and not future.set_running_or_notify_cancel():
                continue
            try:
                result, outputs = apply_command(engine, command)
            except Exception as error:
                if error_is_callers(command, error):
                    if future is not None:
                        future.set_exception(error)
                    continue
                if future is not None:
                    future.set_exception(_died(error))
                raise
            # An abort's final deltas end a stream still waiting in generate(); when
            # the stream itself left, its queue is gone and they are dropped.
            self._deliver(outputs)
            if future is not None:
                future.set_result(result)
            self._beat()

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


def _describe(engine: LLMEngine) -> EngineInfo:
    backend = engine.kernel_backend
    return EngineInfo(
        model_name=engine.model_name,
        dtype=str(engine.model.dtype).removeprefix("torch."),
        weight_layout=engine.model.weight_layout,
        device=str(engine.model.device),
        kernel_backend=backend,
        kernel_library_sha256=native.library_sha256() if backend == "native" else None,
        num_gpu_blocks=engine.num_gpu_blocks,
        num_host_blocks=engine.num_host_blocks,
        block_size=engine.config.block_size,
        max_context_len=engine.max_context_len,
        kv_dtype=dtype_name(engine.kv_dtype),
    )


def _died(error: BaseException) -> EngineStoppedError:
    if isinstance(error, EngineStalledError):
        return EngineStoppedError(f"{error}; it was stopped")
    # Only the type: the message may quote a request's data, and this error reaches clients.
    return EngineStoppedError(f"the engine thread died ({type(error).__name__})")
