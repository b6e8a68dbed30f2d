"""Where chatsvc keeps its files: one data directory, overridable by environment."""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_ENV = "CHATSVC_DATA_DIR"


def data_dir() -> Path:
    """The data root: ``$CHATSVC_DATA_DIR`` or ``~/.cache/chatsvc``; created on demand."""
    configured = os.environ.get(DATA_DIR_ENV)
    root = Path(configured).expanduser() if configured else Path.home() / ".cache" / "chatsvc"
    root.mkdir(parents=True, exist_ok=True)
    return root


def models_dir() -> Path:
    """Converted model directories (e.g. the de-quantized default model); created on demand."""
    path = data_dir() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path
