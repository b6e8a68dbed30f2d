"""Sampling values a request gets for the fields it leaves unset.

A model's ``generation_config.json`` may say how it wants to be sampled; vLLM
reads ``temperature``, ``top_p``, ``top_k``, ``min_p`` and ``repetition_penalty``
from it (``--generation-config auto``, its default) and so do we. A field the file
does not name keeps its neutral value (temperature 1, no filter, no penalty), as in
vLLM. A model whose file names none of them (the default SmolLM2-135M-Instruct's
names only token ids) gets ``BUILT_IN``: at temperature 1 a 135M model wanders off
within a few words, and the model's authors sample it at temperature 0.2, top-p 0.9.
"""

from __future__ import annotations

import json
import logging
from dataclasses import fields
from pathlib import Path

from chatsvc.protocol import SamplingDefaults
from chatsvc.protocol.requests import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY

log = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"

BUILT_IN = SamplingDefaults(temperature=0.2, top_p=0.9, source="built-in")
_FIELDS = tuple(f.name for f in fields(SamplingDefaults) if f.name != "source")


def read_sampling_defaults(model_dir: Path | None) -> SamplingDefaults:
    """The defaults of a model directory (None, e.g. random weights: ``BUILT_IN``).

    A malformed or out-of-range value in the file is logged and skipped, never fatal.
    """
    path = None if model_dir is None else Path(model_dir) / GENERATION_CONFIG
    if path is None or not path.is_file():
        return BUILT_IN
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        log.warning("ignoring %s: %s", path, error)
        return BUILT_IN
    found = {}
    for name in _FIELDS:
        value = config.get(name) if isinstance(config, dict) else None
        if value is None:
            continue
        if _valid(name, value):
            found[name] = int(value) if name == "top_k" else float(value)
        else:
            log.warning("ignoring %s=%r in %s: out of range", name, value, path)
    if not found:
        return BUILT_IN
    return SamplingDefaults(**found, source=GENERATION_CONFIG)


def _valid(name: str, value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if name == "temperature":
        return 0.0 <= value < float("inf")
    if name == "top_p":
        return 0.0 < value <= 1.0
    if name == "top_k":
        return float(value).is_integer() and value >= 0
    if name == "min_p":
        return 0.0 <= value <= 1.0
    # repetition_penalty, the range requests may use
    return MIN_REPETITION_PENALTY <= value <= MAX_REPETITION_PENALTY
