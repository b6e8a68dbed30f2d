"""Sampling defaults: the model's generation_config.json where it names them, else built-in."""

from __future__ import annotations

import json

from chatsvc.engine.sampling_defaults import BUILT_IN, read_sampling_defaults


def test_a_config_without_sampling_fields_gets_the_built_in_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert read_sampling_defaults(tmp_path) == BUILT_IN
    assert (BUILT_IN.temperature, BUILT_IN.top_p) == (0.2, 0.9)
    assert read_sampling_defaults(tmp_path / "missing") == BUILT_IN
    assert read_sampling_defaults(None) == BUILT_IN


def test_named_fields_win_and_the_rest_stay_neutral(tmp_path):
    config = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True}
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    got = read_sampling_defaults(tmp_path)
    assert (got.temperature, got.top_p, got.top_k) == (0.6, 0.95, 20)
    assert (got.min_p, got.repetition_penalty) == (0.0, 1.0)
    assert got.source == "generation_config.json"


def test_bad_values_are_skipped_not_fatal(tmp_path):
    config = {"temperature": -1, "top_p": 0.8, "repetition_penalty": "high"}
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    got = read_sampling_defaults(tmp_path)
    assert (got.temperature, got.top_p, got.repetition_penalty) == (1.0, 0.8, 1.0)
    (tmp_path / "generation_config.json").write_text("{not json")
    assert read_sampling_defaults(tmp_path) == BUILT_IN


def test_the_default_model_has_no_sampling_fields(smollm2_fp32):
    assert read_sampling_defaults(smollm2_fp32.path) == BUILT_IN
