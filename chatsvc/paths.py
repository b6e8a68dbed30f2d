"""Where chatsvc keeps its files: one data directory, given by the settings.

``CHATSVC_DATA_DIR`` is read once, with the other settings (``chatsvc.config``);
everything here takes the configured root (None: ``~/.cache/chatsvc``).

Everything under it is private to the user the service runs as: conversations
(the embedded Redis's append-only file), the converted models and the compiled
kernel library all live there. So every directory chatsvc creates is
0700 and every file 0600; a directory left with looser modes by an older
version is tightened when chatsvc next uses it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

DEFAULT_DATA_DIR = Path("~/.cache/chatsvc")
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def private_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` as an existing directory only its owner can enter; returns it.

    Missing levels are created 0700 one by one (``Path.mkdir(parents=True)``
    would create the parents with the umask's modes instead). An existing
    directory owned by this user loses its group and other bits; one owned by
    somebody else is left alone (e.g. a volume root): its own modes decide.
    """
    path = Path(path).expanduser()
    missing = []
    for level in (path, *path.parents):
        if level.exists():
            break
        missing.append(level)
    for level in reversed(missing):
        try:
            level.mkdir(mode=PRIVATE_DIR_MODE)
        except FileExistsError:
            pass  # another process made it in between; tightened below
        _tighten(level)
    if not path.is_dir():
        raise NotADirectoryError(f"{path} exists and is not a directory")
    _tighten(path)
    return path


def _tighten(path: Path) -> None:
    info = path.stat()
    # mkdir's mode passes through the umask, which can only remove bits; an odd
    # umask (0o277, say) would leave the owner without access, so set it outright.
    if info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) != PRIVATE_DIR_MODE:
        path.chmod(PRIVATE_DIR_MODE)


def write_private_file(path: str | os.PathLike[str], data: str) -> None:
    """Create ``path`` holding ``data``, mode 0600 from the first byte on.

    Fails with ``FileExistsError`` if it exists: a file is never rewritten in
    place, so nobody can slip in between creation and a later chmod.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, PRIVATE_FILE_MODE)
    with os.fdopen(fd, "w") as handle:
        os.fchmod(fd, PRIVATE_FILE_MODE)  # the umask could have taken bits off
        handle.write(data)


def data_root(root: str | os.PathLike[str] | None = None) -> Path:
    """The data root's path: ``root``, or ``~/.cache/chatsvc`` when None (not created)."""
    return Path(root if root is not None else DEFAULT_DATA_DIR).expanduser()


def data_dir(root: str | os.PathLike[str] | None = None) -> Path:
    """The data root (``data_root(root)``) as a private directory, created 0700 on demand."""
    return private_dir(data_root(root))


def models_dir(root: str | os.PathLike[str] | None = None) -> Path:
    """Converted model directories (e.g. the de-quantized default model); created on demand."""
    return private_dir(data_dir(root) / "models")


def kernels_dir(root: str | os.PathLike[str] | None = None) -> Path:
    """Where the native kernel library is built and cached (``kernels.cpu.native`` creates it
    and checks it is private before it loads anything from it)."""
    return data_root(root) / "kernels"
