"""Multi-turn chat workloads: seeded synthetic conversations, or a replayed JSONL file.

A workload is plain data, fixed before any server is touched, so every system in a run
sees exactly the same conversations (same text, same answer budgets, same think times).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from bench.multiturn.words import WORDS


@dataclass(frozen=True)
class Distribution:
    """A length or time distribution: ``const:V``, ``uniform:LO:HI`` or ``lognormal:MEDIAN:SIGMA``.

    Integer draws (token counts) are rounded and clamped to at least ``minimum``.
    """

    kind: str
    params: tuple[float, ...]

    @classmethod
    def parse(cls, spec: str) -> Distribution:
        """Parse ``kind:p1[:p2]``; a bare number means ``const``. Raises ValueError."""
        parts = spec.strip().split(":")
        if len(parts) == 1:
            parts = ["const", parts[0]]
        kind, raw = parts[0].lower(), parts[1:]
        try:
            params = tuple(float(p) for p in raw)
        except ValueError as exc:
            raise ValueError(f"distribution {spec!r}: parameters must be numbers") from exc
        dist = cls(kind, params)
        dist.validate()
        return dist

    def validate(self) -> None:
        arity = {"const": 1, "uniform": 2, "lognormal": 2}
        if self.kind not in arity:
            raise ValueError(f"unknown distribution {self.kind!r} (const, uniform, lognormal)")
        if len(self.params) != arity[self.kind]:
            raise ValueError(
                f"{self.kind} takes {arity[self.kind]} parameter(s), got {self.params}"
            )
        if any(not math.isfinite(p) or p < 0 for p in self.params):
            raise ValueError(f"{self.kind} parameters must be finite and >= 0, got {self.params}")
        if self.kind == "uniform" and self.params[0] > self.params[1]:
            raise ValueError(f"uniform needs LO <= HI, got {self.params}")
        if self.kind == "lognormal" and self.params[0] <= 0:
            raise ValueError("lognormal median must be > 0")

    def sample(self, rng: random.Random) -> float:
        if self.kind == "const":
            return self.params[0]
        if self.kind == "uniform":
            return rng.uniform(self.params[0], self.params[1])
        median, sigma = self.params
        return rng.lognormvariate(math.log(median), sigma)

    def sample_int(self, rng: random.Random, minimum: int = 1, maximum: int | None = None) -> int:
        value = max(minimum, round(self.sample(rng)))
        return value if maximum is None else min(value, maximum)

    def __str__(self) -> str:
        return ":".join([self.kind, *(f"{p:g}" for p in self.params)])


@dataclass(frozen=True)
class WorkloadConfig:
    """Shape of a synthetic workload. ``seed`` fixes every draw."""

    num_conversations: int = 16
    num_turns: int = 6
    num_system_prompts: int = 4
    num_tenants: int = 4
    system_prompt_tokens: Distribution = field(default_factory=lambda: Distribution.parse("200"))
    user_tokens: Distribution = field(default_factory=lambda: Distribution.parse("uniform:24:72"))
    answer_tokens: Distribution = field(default_factory=lambda: Distribution.parse("uniform:24:64"))
    think_time_s: Distribution = field(default_factory=lambda: Distribution.parse("uniform:0:1"))
    max_user_tokens: int = 2048
    max_answer_tokens: int = 1024
    seed: int = 0

    def validate(self) -> None:
        for name in ("num_conversations", "num_turns", "num_system_prompts", "num_tenants"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for dist in (self.system_prompt_tokens, self.user_tokens, self.answer_tokens):
            dist.validate()
        self.think_time_s.validate()


@dataclass(frozen=True)
class Conversation:
    """One chat: a system prompt and the user turns, each with its answer budget and the
    think time the user waits *before* sending it (0 for the first turn)."""

    conversation_id: str
    tenant: str
    system_prompt_id: int
    system_prompt: str
    user_turns: tuple[str, ...]
    answer_tokens: tuple[int, ...]
    think_times_s: tuple[float, ...]

    @property
    def num_turns(self) -> int:
        return len(self.user_turns)


@dataclass(frozen=True)
class Workload:
    conversations: tuple[Conversation, ...]
    description: str

    @property
    def num_requests(self) -> int:
        return sum(c.num_turns for c in self.conversations)

    def to_json(self) -> list[dict]:
        return [
            {
                "conversation_id": c.conversation_id,
                "tenant": c.tenant,
                "system_prompt_id": c.system_prompt_id,
                "system_prompt": c.system_prompt,
                "user_turns": list(c.user_turns),
                "answer_tokens": list(c.answer_tokens),
                "think_times_s": list(c.think_times_s),
            }
            for c in self.conversations
        ]


def make_text(rng: random.Random, num_words: int) -> str:
    """About ``num_words`` tokens of text: the list holds short common words that BPE
    vocabularies keep whole, so one word with its leading space is about one token."""
    words = [rng.choice(WORDS) for _ in range(num_words)]
    # Sentences keep chat templates and tokenizers on their ordinary path.
    out, since_stop = [], 0
    for i, word in enumerate(words):
        since_stop += 1
        if since_stop >= 12 or i == len(words) - 1:
            out.append(word + ".")
            since_stop = 0
        else:
            out.append(word)
    return " ".join(out).capitalize()


def _system_prompts(config: WorkloadConfig, rng: random.Random) -> list[str]:
    prompts = []
    for index in range(config.num_system_prompts):
        n = config.system_prompt_tokens.sample_int(rng, minimum=4, maximum=config.max_user_tokens)
        prompts.append(f"You are assistant number {index}. " + make_text(rng, n))
    return prompts


def generate_workload(config: WorkloadConfig) -> Workload:
    """Draw a workload; the same config (seed included) always gives the same workload."""
    config.validate()
    # Separate streams so adding a turn does not reshuffle the system prompts.
    prompt_rng = random.Random(f"{config.seed}:system")
    prompts = _system_prompts(config, prompt_rng)
    conversations = []
    for index in range(config.num_conversations):
        rng = random.Random(f"{config.seed}:conversation:{index}")
        prompt_id = rng.randrange(len(prompts))
        turns, answers, thinks = [], [], []
        for turn in range(config.num_turns):
            n_user = config.user_tokens.sample_int(rng, maximum=config.max_user_tokens)
            turns.append(make_text(rng, n_user))
            answers.append(config.answer_tokens.sample_int(rng, maximum=config.max_answer_tokens))
            thinks.append(0.0 if turn == 0 else max(0.0, config.think_time_s.sample(rng)))
        conversations.append(
            Conversation(
                conversation_id=f"c{index:04d}",
                tenant=f"t{index % config.num_tenants}",
                system_prompt_id=prompt_id,
                system_prompt=prompts[prompt_id],
                user_turns=tuple(turns),
                answer_tokens=tuple(answers),
                think_times_s=tuple(thinks),
            )
        )
    desc = (
        f"synthetic seed={config.seed} conversations={config.num_conversations} "
        f"turns={config.num_turns} system_prompts={config.num_system_prompts} "
        f"system={config.system_prompt_tokens} user={config.user_tokens} "
        f"answer={config.answer_tokens} think_s={config.think_time_s}"
    )
    return Workload(tuple(conversations), desc)


def load_replay(path: str | Path, config: WorkloadConfig) -> Workload:
    """Replay a JSONL file: each line a JSON list of user turns (strings), or an object
    ``{"turns": [...], "system": "..."}``. Answer budgets, think times and (when a line
    names none) system prompts are drawn from ``config`` with its seed."""
    config.validate()
    prompts = _system_prompts(config, random.Random(f"{config.seed}:system"))
    conversations = []
    lines = Path(path).read_text().splitlines()
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not JSON: {exc}") from exc
        system = None
        if isinstance(item, dict):
            system, item = item.get("system"), item.get("turns")
        if (
            not isinstance(item, list)
            or not item
            or not all(isinstance(t, str) and t for t in item)
        ):
            raise ValueError(f"{path}:{lineno}: expected a non-empty list of non-empty strings")
        if system is not None and not isinstance(system, str):
            raise ValueError(f"{path}:{lineno}: system must be a string")
        index = len(conversations)
        rng = random.Random(f"{config.seed}:replay:{index}")
        prompt_id = rng.randrange(len(prompts)) if system is None else -1
        conversations.append(
            Conversation(
                conversation_id=f"r{index:04d}",
                tenant=f"t{index % config.num_tenants}",
                system_prompt_id=prompt_id,
                system_prompt=prompts[prompt_id] if system is None else system,
                user_turns=tuple(item),
                answer_tokens=tuple(
                    config.answer_tokens.sample_int(rng, maximum=config.max_answer_tokens)
                    for _ in item
                ),
                think_times_s=tuple(
                    0.0 if t == 0 else max(0.0, config.think_time_s.sample(rng))
                    for t in range(len(item))
                ),
            )
        )
    if not conversations:
        raise ValueError(f"{path}: no conversations")
    return Workload(tuple(conversations), f"replay {path} seed={config.seed}")
