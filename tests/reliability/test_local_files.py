"""What another local user can reach: the data dir and the local tenant's key.

The data dir holds every conversation (the embedded Redis's AOF) and the local
tenant's key. Directories are created 0700 and files 0600.
"""

from __future__ import annotations

import stat
from pathlib import Path

from chatsvc import paths
from chatsvc.config import Settings
from chatsvc.service import _local_key


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_the_data_dir_and_everything_made_under_it_are_private(tmp_path, monkeypatch):
    root = tmp_path / "a" / "b"
    monkeypatch.setenv(paths.DATA_DIR_ENV, str(root))
    assert paths.data_dir() == root
    assert _mode(tmp_path / "a") == _mode(root) == 0o700
    assert _mode(paths.models_dir()) == 0o700


def test_a_data_dir_an_older_version_left_open_is_tightened(tmp_path, monkeypatch):
    root = tmp_path / "old"
    root.mkdir()
    root.chmod(0o755)
    monkeypatch.setenv(paths.DATA_DIR_ENV, str(root))
    paths.data_dir()
    assert _mode(root) == 0o700


def test_the_local_tenant_key_is_a_0600_file_in_a_0700_dir(tmp_path):
    settings = Settings(data_dir=tmp_path / "data")
    key = _local_key(settings)
    path = tmp_path / "data" / "local_tenant.key"
    assert _mode(path) == 0o600 and _mode(path.parent) == 0o700
    assert path.read_text() == key and len(key) >= 32
    assert _local_key(settings) == key  # stable across restarts


def test_a_local_key_file_left_readable_is_tightened_and_kept(tmp_path):
    settings = Settings(data_dir=tmp_path)
    path = tmp_path / "local_tenant.key"
    path.write_text("an-older-versions-local-key-0123456789")
    path.chmod(0o644)
    assert _local_key(settings) == "an-older-versions-local-key-0123456789"
    assert _mode(path) == 0o600
