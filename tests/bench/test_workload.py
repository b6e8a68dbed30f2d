"""Workload generator: reproducibility, distributions, replay files."""

from __future__ import annotations

import json
import random
import statistics

import pytest

from bench.multiturn.words import WORDS
from bench.multiturn.workload import (
    Distribution,
    WorkloadConfig,
    generate_workload,
    load_replay,
    make_text,
)


def test_same_seed_gives_identical_workload():
    config = WorkloadConfig(num_conversations=5, num_turns=4, seed=7)
    assert generate_workload(config) == generate_workload(config)
    assert generate_workload(config).to_json() == generate_workload(config).to_json()


def test_other_seed_gives_other_workload():
    a = generate_workload(WorkloadConfig(num_conversations=3, seed=1))
    b = generate_workload(WorkloadConfig(num_conversations=3, seed=2))
    assert a.conversations[0].user_turns != b.conversations[0].user_turns


def test_more_conversations_keep_the_earlier_ones():
    # Each conversation has its own random stream: growing N must not reshuffle the rest.
    small = generate_workload(WorkloadConfig(num_conversations=2, seed=3))
    large = generate_workload(WorkloadConfig(num_conversations=6, seed=3))
    assert large.conversations[:2] == small.conversations


def test_shape_tenants_and_shared_system_prompts():
    config = WorkloadConfig(num_conversations=12, num_turns=3, num_system_prompts=2, num_tenants=3)
    workload = generate_workload(config)
    assert workload.num_requests == 36
    assert {c.tenant for c in workload.conversations} == {"t0", "t1", "t2"}
    prompts = {c.system_prompt_id: c.system_prompt for c in workload.conversations}
    assert set(prompts) <= {0, 1} and len(set(prompts.values())) == len(prompts)
    # The same system prompt is used by several tenants: that is what makes it shareable.
    by_prompt = {}
    for conv in workload.conversations:
        by_prompt.setdefault(conv.system_prompt_id, set()).add(conv.tenant)
    assert any(len(tenants) > 1 for tenants in by_prompt.values())
    for conv in workload.conversations:
        assert conv.think_times_s[0] == 0.0
        assert len(conv.user_turns) == len(conv.answer_tokens) == len(conv.think_times_s) == 3


def test_constant_lengths_are_exact():
    config = WorkloadConfig(
        num_conversations=3,
        num_turns=2,
        user_tokens=Distribution.parse("const:10"),
        answer_tokens=Distribution.parse("17"),
        think_time_s=Distribution.parse("0.5"),
    )
    for conv in generate_workload(config).conversations:
        assert all(len(t.split()) == 10 for t in conv.user_turns)
        assert conv.answer_tokens == (17, 17)
        assert conv.think_times_s == (0.0, 0.5)


def test_uniform_draws_stay_in_bounds_and_cover_them():
    rng = random.Random(0)
    dist = Distribution.parse("uniform:20:40")
    draws = [dist.sample_int(rng) for _ in range(2000)]
    assert min(draws) == 20 and max(draws) == 40
    assert 29 < statistics.mean(draws) < 31


def test_lognormal_median_and_spread():
    rng = random.Random(0)
    draws = [Distribution.parse("lognormal:50:0.5").sample(rng) for _ in range(4000)]
    assert 47 < statistics.median(draws) < 53
    # sigma 0.5: the 84th percentile sits near median * e^0.5 = 82.4
    assert 76 < sorted(draws)[int(0.841 * len(draws))] < 89


def test_integer_draws_are_clamped():
    rng = random.Random(0)
    dist = Distribution.parse("uniform:0:1000")
    draws = [dist.sample_int(rng, minimum=5, maximum=50) for _ in range(200)]
    assert min(draws) == 5 and max(draws) == 50


@pytest.mark.parametrize(
    "spec",
    ["", "gauss:1:2", "uniform:5", "uniform:9:3", "const:-1", "lognormal:0:1", "const:x", "nan"],
)
def test_bad_distribution_specs_raise(spec):
    with pytest.raises(ValueError):
        Distribution.parse(spec)


def test_bad_config_raises():
    with pytest.raises(ValueError, match="num_turns"):
        generate_workload(WorkloadConfig(num_turns=0))


def test_text_is_the_requested_number_of_list_words():
    text = make_text(random.Random(1), 30)
    words = text.lower().replace(".", "").split()
    assert len(words) == 30 and set(words) <= set(WORDS)


def test_text_is_about_one_token_per_word(tokenizer):
    text = make_text(random.Random(2), 100)
    n = len(tokenizer.encode(text, add_special_tokens=False))
    # Full stops and the capital letter add a few tokens on top of the 100 words.
    assert 100 <= n <= 115


def test_replay_reads_lists_and_objects(tmp_path):
    path = tmp_path / "conv.jsonl"
    lines = [
        json.dumps(["hi", "and then?"]),
        "",
        json.dumps({"system": "Be brief.", "turns": ["x"]}),
    ]
    path.write_text("\n".join(lines))
    config = WorkloadConfig(answer_tokens=Distribution.parse("9"), seed=4)
    workload = load_replay(path, config)
    assert [c.user_turns for c in workload.conversations] == [("hi", "and then?"), ("x",)]
    assert workload.conversations[1].system_prompt == "Be brief."
    assert workload.conversations[0].answer_tokens == (9, 9)
    assert workload == load_replay(path, config)


@pytest.mark.parametrize(
    "line", ["not json", "[]", '["ok", 3]', '{"turns": "abc"}', '{"turns": ["a"], "system": 1}']
)
def test_replay_rejects_bad_lines(tmp_path, line):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(["fine"]) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=":2:"):
        load_replay(path, WorkloadConfig())


def test_replay_of_empty_file_raises(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match="no conversations"):
        load_replay(path, WorkloadConfig())
