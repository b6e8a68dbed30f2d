"""Builds of the kernel library for other CPUs' paths, shared by the kernel tests.

A build of the whole library takes 5-20 s, and several tests check the same
variant (``-mno-amx-tile`` is what four files want), so each set of flags is
built once per run: in one directory both pytest-xdist workers use, under a lock
per set of flags, so the second worker to ask waits for the first one's build
and loads it from the cache (``native.build``'s key) instead of compiling again.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
from collections.abc import Callable

import pytest

from kernels.cpu import native


@pytest.fixture(scope="session")
def variant_library(tmp_path_factory) -> Callable[[list[str]], ctypes.CDLL]:
    """``variant_library(extra_flags)``: the library built with the default flags and
    ``extra_flags`` (``-mno-amx-tile``, ...) with gcc, loaded."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's directory, above each worker's own
    directory = root / "kernel-variants"
    loaded: dict[tuple[str, ...], ctypes.CDLL] = {}

    def load(extra_flags: list[str]) -> ctypes.CDLL:
        flags = [*native.default_flags(), *extra_flags]
        key = tuple(flags)
        if key not in loaded:
            name = hashlib.sha256(" ".join(flags).encode()).hexdigest()[:16]
            lock_path = root / f"kernel-variant-{name}.lock"
            with open(lock_path, "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                previous = native._build_dir
                native._build_dir = directory
                try:
                    path = native.build("gcc", flags)
                finally:
                    native._build_dir = previous
            loaded[key] = native.load(path)
        return loaded[key]

    return load
