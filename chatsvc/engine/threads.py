"""How many intra-op threads torch uses for serving (process-wide), and when to use fewer.

A step is hundreds of parallel regions, each ending at a barrier where every thread
of the team waits for the slowest. While the process has its cores to itself the
waiting threads spin and a region costs microseconds; once another process wants one
of those cores (a build, a second service, a container beside it on the node) the
scheduler deschedules a team member for a time slice of milliseconds at a time, and
every barrier waits for it: steps many times longer beside one busy process
(docs/engine.md, "Threads on a shared host"). Fewer threads than busy cores never
wait for a descheduled peer, so ``ThreadGovernor`` sizes the team to the CPUs other
processes leave free, measured from ``/proc`` between steps.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# Seconds between two looks at what the other processes use: long enough that the
# figure is not one time slice's noise, short enough to follow a build that starts.
WINDOW_S = 0.5
# Another process's use counts from this share of a core on: a light client or a
# daemon's tick does not cost the team a thread.
OTHERS_COUNT_FROM = 0.5
# A window longer than this says nothing of now: it spans a start-up (the kernels' build
# by the compiler, another process) or a long step; it only starts a new one.
STALE_S = 4 * WINDOW_S


def set_torch_threads(num_threads: int | None) -> int:
    """Apply the config's thread count, else OMP_NUM_THREADS, else one per usable CPU.

    Returns the count in effect.
    """
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    if num_threads:
        torch.set_num_threads(num_threads)
    elif not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(usable_cpus())
    return torch.get_num_threads()


def usable_cpus(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """The CPUs this process may run on (its affinity), fewer where a cgroup's CPU
    quota (``cpu.max``: quota and period) allows less, rounded up."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpus = cpus or 1
    try:
        quota, period = (cgroup_root / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return cpus
    if quota == "max":
        return cpus
    return max(1, min(cpus, math.ceil(int(quota) / int(period))))


def cpu_seconds(cpus: frozenset[int]) -> tuple[float, float] | None:
    """(busy seconds of ``cpus`` all processes together, this process's CPU seconds)
    since boot; None where ``/proc`` does not say. Busy is everything but idle and
    iowait, a hypervisor's steal included: a stolen core is not ours either."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    busy = 0
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        values = [int(v) for v in fields[:8]]
        busy += sum(values) - values[3] - values[4]  # idle, iowait
    # utime and stime: fields 14 and 15 of stat, 12 and 13 after the name.
    return busy / tick, (int(own[11]) + int(own[12])) / tick


class ThreadGovernor:
    """Keeps torch's team at the CPUs the other processes leave free, between steps.

    ``most``: the team's size with the machine to itself. ``before_step`` looks at
    most once a ``WINDOW_S``: the other processes' use over the window, in cores
    (busy time of our CPUs minus ours), is taken off ``most`` once it reaches
    ``OTHERS_COUNT_FROM`` of a core; never fewer than one thread. With fewer threads
    the others keep their core and the figure stays, so the team grows back only
    once they stop. A window longer than ``STALE_S`` decides nothing (it only starts the
    next): the engine looks every window while idle too (``LLMEngine.watch_threads``),
    so only a start-up or a long step leaves one that old. Where ``/proc`` says nothing
    the team stays at ``most``.
    """

    def __init__(
        self,
        most: int,
        cpus: frozenset[int],
        *,
        read: Callable[[frozenset[int]], tuple[float, float] | None] = cpu_seconds,
        clock: Callable[[], float] = time.monotonic,
        apply: Callable[[int], None] = torch.set_num_threads,
    ) -> None:
        self.most = most
        self.threads = most
        self._cpus = cpus
        self._read = read
        self._clock = clock
        self._apply = apply
        self._last = (clock(), read(cpus))

    def before_step(self) -> int:
        """The team's size for the next step (changed here when the window says so)."""
        now = self._clock()
        then, seen = self._last
        if now - then < WINDOW_S or seen is None:
            return self.threads
        current = self._read(self._cpus)
        self._last = (now, current)
        if current is None or now - then > STALE_S:
            return self.threads
        others = ((current[0] - seen[0]) - (current[1] - seen[1])) / (now - then)
        taken = math.floor(others + (1 - OTHERS_COUNT_FROM)) if others > 0 else 0
        wanted = max(1, self.most - taken)
        if wanted != self.threads:
            log.debug("threads %d -> %d: others used %.2f CPUs", self.threads, wanted, others)
            self._apply(wanted)
            self.threads = wanted
        return self.threads


def governor_for(num_threads: int | None) -> ThreadGovernor | None:
    """The governor of an engine whose thread count was left to it (``num_threads`` and
    ``OMP_NUM_THREADS`` unset), over all of the process's CPUs; None where the count
    is fixed, or where a CPU quota rather than the CPUs bounds the process (other
    processes' use of the machine's CPUs then says nothing of ours)."""
    if num_threads or os.environ.get("OMP_NUM_THREADS") or not hasattr(os, "sched_getaffinity"):
        return None
    cpus = frozenset(os.sched_getaffinity(0))
    most = torch.get_num_threads()
    if most < 2 or usable_cpus() < len(cpus):
        return None
    return ThreadGovernor(most, cpus)
