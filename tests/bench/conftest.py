"""Fixtures for the benchmark harness tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The default model, converted by our loader (cached after the first conversion)."""
    from chatsvc.engine.weights_gguf import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
