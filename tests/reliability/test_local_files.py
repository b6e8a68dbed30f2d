"""What another local user can reach: the data dir and the kernel library.

The data dir holds every conversation (the embedded Redis's AOF) and the
compiled kernel library that runs inside the service (local mode keeps no key
file: its tenant is the one named "local", and keys come only from settings).
Directories are created 0700 and files 0600; a kernel library that someone
else could have written is never loaded (tests/store/test_embedded.py covers
the Redis side: no TCP listener, private files).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from chatsvc import paths
from kernels.cpu import native


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_the_data_dir_and_everything_made_under_it_are_private(tmp_path):
    root = tmp_path / "a" / "b"
    assert paths.data_dir(root) == root
    assert _mode(tmp_path / "a") == _mode(root) == 0o700
    assert _mode(paths.models_dir(root)) == 0o700


def test_a_data_dir_an_older_version_left_open_is_tightened(tmp_path):
    root = tmp_path / "old"
    root.mkdir()
    root.chmod(0o755)
    paths.data_dir(root)
    assert _mode(root) == 0o700


# -- the native kernel library -----------------------------------------------------
# A one-function library stands in for the kernel sources: the build, the cache
# and the checks are the real ones, and a build takes a fraction of a second.

_FLAGS = ["-O0", "-fPIC", "-shared"]


@pytest.fixture
def tiny_sources(tmp_path, monkeypatch):
    if shutil.which("gcc") is None:
        pytest.fail("these tests need gcc, as the native kernels do")
    source = tmp_path / "answer.c"
    source.write_text("int chatsvc_answer(void) { return 42; }\n")
    monkeypatch.setattr(native, "_build_dir", tmp_path / "data" / "kernels")
    monkeypatch.setattr(native, "SOURCES", (source,))
    monkeypatch.setattr(native, "HEADERS", ())
    return tmp_path


def _planted_library(where: Path, marker: Path) -> bytes:
    """A library whose constructor leaves ``marker``: proof its code ran."""
    source = where / "planted.c"
    source.write_text(
        "#include <stdio.h>\n"
        "__attribute__((constructor)) static void planted(void) {\n"
        f'    FILE *f = fopen("{marker}", "w"); if (f) fclose(f);\n'
        "}\n"
        "int chatsvc_answer(void) { return 666; }\n"
    )
    out = where / "planted.so"
    subprocess.run(["gcc", *_FLAGS, str(source), "-o", str(out)], check=True)
    return out.read_bytes()


def test_a_planted_world_writable_library_is_not_loaded_but_rebuilt(tiny_sources, caplog):
    marker = tiny_sources / "planted-code-ran"
    target = native.build("gcc", _FLAGS)
    planted = _planted_library(tiny_sources, marker)
    target.write_bytes(planted)
    target.chmod(0o666)  # anyone could have written it

    with pytest.raises(RuntimeError, match="writable by its group or by others"):
        native.open_trusted(target)
    assert not marker.exists()

    with caplog.at_level(logging.WARNING, logger="kernels.cpu.native"):
        rebuilt = native.build("gcc", _FLAGS)
    assert rebuilt == target and target.read_bytes() != planted
    assert "not loading the cached kernel library" in caplog.text
    assert native.untrusted_reason(target) is None and _mode(target.parent) == 0o700
    lib, digest = native.open_trusted(target)
    assert lib.chatsvc_answer() == 42 and not marker.exists()
    assert digest == hashlib.sha256(target.read_bytes()).hexdigest()


def test_a_library_owned_by_another_user_or_a_symlink_is_not_trusted(tiny_sources):
    target = native.build("gcc", _FLAGS)
    other_uid = target.stat().st_uid + 1
    assert "owned by uid" in native.untrusted_reason(target, uid=other_uid)
    link = target.with_name("link.so")
    link.symlink_to(target)
    assert "symbolic link" in native.untrusted_reason(link)
    with pytest.raises(RuntimeError, match="symbolic link"):
        native.open_trusted(link)


def test_a_kernel_dir_open_to_others_is_tightened_and_one_of_another_user_refused(
    tiny_sources, monkeypatch
):
    kernels_dir = native.build_dir()
    kernels_dir.mkdir(parents=True)
    kernels_dir.chmod(0o777)
    native.build("gcc", _FLAGS)
    assert _mode(kernels_dir) == 0o700
    # Seen from another user, the same directory is someone else's: no build, no load.
    monkeypatch.setattr(os, "geteuid", lambda: kernels_dir.stat().st_uid + 1)
    with pytest.raises(RuntimeError, match="refusing to build or load kernels"):
        native.build("gcc", _FLAGS)


def test_the_loaded_library_sha256_is_logged_and_kept(tiny_sources, monkeypatch, caplog):
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setattr(native, "_loaded_sha256", None)
    monkeypatch.setattr(native, "_error", None)
    monkeypatch.setattr(native, "_declare", lambda lib: None)  # the tiny library has none
    monkeypatch.setattr(native, "default_flags", lambda: list(_FLAGS))
    monkeypatch.setenv("CC", "gcc")
    with caplog.at_level(logging.INFO, logger="kernels.cpu.native"):
        lib = native.library()
    assert isinstance(lib, ctypes.CDLL) and lib.chatsvc_answer() == 42
    path = native.build("gcc", _FLAGS)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert native.library_sha256() == digest
    assert digest in caplog.text
