"""StepIO: the I/O a step hands off and takes back (the disk tier), behind one seam.

``LLMEngine.step`` talks to its I/O component only through this protocol, in
this order; the component never sees the scheduler::

    finished_loads()    at the start: loads that landed since, for
                        ``Scheduler.finish_loads`` (the sequences then run)
    store(stores)       from the runner, per cache plan, before the plan's swaps
                        reuse the blocks (``ModelRunner.execute_plans``)
    submit(loads)       once the step's plans ran (a plan may have held the
                        blocks' old data), before the forward: the reads overlap
                        its compute; returns the loads that ended at once
    store(stores)       after the forward: write-through of the blocks the step
                        indexed (``KVCacheManager.take_stores``)
    wait(timeout_s)     when the step computed nothing and loads are in flight:
                        sleep on them instead of spinning

and, between steps, ``idle()`` when the engine has no request at all: work no
request waits on (the disk tier's preload after a restart) goes on only then.

``NoStepIO`` is the component when the disk tier is off: without a disk index
the cache plans no load and no store, so it has nothing to do.
"""

from __future__ import annotations

from collections.abc import Sequence as Items
from typing import TYPE_CHECKING, NamedTuple, Protocol

from cache.plan import BlockStore, DiskLoad

if TYPE_CHECKING:
    from chatsvc.engine.sequence import Sequence


class SequenceLoads(NamedTuple):
    """The disk loads of one admitted sequence, in block order (``AllocResult.loads``)."""

    seq: Sequence
    loads: tuple[DiskLoad, ...]


class FinishedLoad(NamedTuple):
    """A sequence whose loads all ended: its first ``num_blocks`` hold verified KV."""

    seq: Sequence
    num_blocks: int


class StepIO(Protocol):
    """Asynchronous block I/O around the step loop (see the module docstring).

    Engine thread only. No method blocks except ``wait``.
    """

    @property
    def has_unapplied_io(self) -> bool:
        """Queued writes whose results ``finished_loads`` has not taken in yet, or
        background work under way: an idle engine must still call ``finished_loads``
        and ``idle`` (``LLMEngine.apply_io``)."""
        ...

    def finished_loads(self) -> list[FinishedLoad]:
        """Take in every ended job; returns the sequences whose loads all ended."""
        ...

    def submit(self, loads: Items[SequenceLoads]) -> list[FinishedLoad]:
        """Start the loads; returns those that ended without any I/O (nothing to read)."""
        ...

    def store(self, stores: Items[BlockStore]) -> None:
        """Copy the blocks out now and write them later; a store that cannot be taken
        now is dropped, never waited for."""
        ...

    def wait(self, timeout_s: float) -> None:
        """Sleep until some job ended, at most ``timeout_s``."""
        ...

    def idle(self) -> None:
        """The engine has no request: background work may go on."""
        ...


class NoStepIO:
    """The StepIO of an engine without a disk tier: nothing to load, nowhere to store."""

    has_unapplied_io = False

    def finished_loads(self) -> list[FinishedLoad]:
        return []

    def submit(self, loads: Items[SequenceLoads]) -> list[FinishedLoad]:
        if loads:
            # They would wait in LOADING forever: a bug, not a state to serve in.
            raise RuntimeError("disk loads without a disk tier")
        return []

    def store(self, stores: Items[BlockStore]) -> None:
        pass  # nowhere below memory: a dropped block is gone, as the cache expects

    def wait(self, timeout_s: float) -> None:
        pass  # nothing in flight to wait for

    def idle(self) -> None:
        pass  # no background work
