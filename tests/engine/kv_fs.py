"""Real filesystem faults for the disk tier's tests: read-only directories, small disks.

As root (the CI container) these are real mounts: a read-only bind mount and a
tiny tmpfs. Without the privilege to mount, a read-only directory falls back to
permission bits (which stop an unprivileged user just as well) and a small
disk cannot be had: those tests skip, saying why, except in CI, where a root
that cannot mount fails them (``tests/components.py``).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

from tests.components import missing_component


def _mount(*args: str) -> bool:
    result = subprocess.run(["mount", *args], capture_output=True, text=True)
    return result.returncode == 0


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


@contextlib.contextmanager
def read_only_dir(path: Path) -> Iterator[Path]:
    """``path`` (created) cannot be written while the block runs."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        if not _mount("--bind", str(path), str(path)):
            missing_component("cannot bind-mount here (need CAP_SYS_ADMIN) for a read-only dir")
        try:
            if not _mount("-o", "remount,bind,ro", str(path)):
                missing_component("cannot remount read-only here")
            yield path
        finally:
            _umount(path)
        return
    path.chmod(0o500)
    try:
        yield path
    finally:
        path.chmod(0o700)


@contextlib.contextmanager
def small_filesystem(path: Path, size_bytes: int) -> Iterator[Path]:
    """A real filesystem of ``size_bytes`` (tmpfs) mounted at ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size_bytes},mode=0700"
    if os.geteuid() != 0 or not _mount("-t", "tmpfs", "-o", options, "tmpfs", str(path)):
        missing_component(
            "mounting a small tmpfs needs root (CAP_SYS_ADMIN); the disk-full case is "
            "covered by the injected-error test"
        )
    try:
        yield path
    finally:
        _umount(path)


def fill(path: Path) -> Path:
    """Write a file into ``path`` until its filesystem is full; returns the file."""
    filler = path / "filler"
    chunk = b"\0" * (64 << 10)
    with filler.open("wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(chunk)
    return filler
