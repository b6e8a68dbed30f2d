"""What storing an fp32 model's weights narrower costs in quality (``CHATSVC_WEIGHT_DTYPE``).

    .venv/bin/python -m bench.weight_quality [--weights fp32,bf16,int8] [--window 512]
        [--max-tokens 0] [--answer-tokens 32]

For each weight dtype the default model is loaded in fp32 with its matrices stored so,
and two things are measured against the fp32 weights:

- perplexity of ``tests/data/coriolanus.txt`` (the opening of Shakespeare's Coriolanus,
  public domain), scored in windows of ``--window`` tokens, each from its own start
  (the window's first token is not scored);
- greedy agreement on ``PROMPTS`` (chat-formatted): how many answers are token-identical
  to the fp32 weights' over the first ``--answer-tokens``, and the mean length of the
  common prefix.

The gate for int8 (issue 27): perplexity within 1 % of bf16's. Figures, not assertions
(``tests/engine/test_weight_quality.py`` holds the gate on a shorter text).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from chatsvc.engine.forward_batch import ForwardBatch
from chatsvc.engine.loader import LoadedModel, load_model
from kernels.kv_layout import new_kv_pool

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "coriolanus.txt"
BLOCK = 16
PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a prefix cache is in two sentences.",
    "List three uses of a paperclip.",
    "How do I reverse a list in Python?",
    "What is 17 times 23?",
    "Give me a short motivational quote.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Suggest a name for a pet turtle.",
    "What does HTTP stand for?",
    "Summarize the plot of Romeo and Juliet in one sentence.",
)


def _forward(loaded: LoadedModel, tokens: list[int], num_logits: int) -> torch.Tensor:
    """Logits of the last ``num_logits`` of ``tokens``, one prefill from position 0."""
    model = loaded.model
    blocks = (len(tokens) + BLOCK - 1) // BLOCK
    pool = new_kv_pool(blocks, model.kv_shape(BLOCK), model.dtype, model.device)
    table = list(range(blocks))
    slots = list(range(len(tokens)))
    batch = ForwardBatch.from_lists(
        [tokens], [0], [slots], [table], BLOCK, model.device, [num_logits]
    )
    return model.forward(batch, pool)


def perplexity(loaded: LoadedModel, ids: list[int], window: int) -> float:
    """exp(mean negative log-likelihood) over every window's tokens but its first."""
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window]
        if len(chunk) < 2:
            break
        logits = _forward(loaded, chunk, len(chunk))[:-1]  # predicts chunk[1:]
        logp = torch.log_softmax(logits.double(), dim=-1)
        target = torch.tensor(chunk[1:])
        nll -= float(logp.gather(1, target[:, None]).sum())
        count += len(chunk) - 1
    return math.exp(nll / count)


def greedy(loaded: LoadedModel, prompt: str, tokens: int) -> list[int]:
    """``tokens`` greedy tokens after the chat-formatted prompt (a fresh prefill each time:
    a benchmark of quality, not of speed)."""
    text = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    ids = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    out: list[int] = []
    for _ in range(tokens):
        out.append(int(_forward(loaded, ids + out, 1)[0].argmax()))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="fp32,bf16,int8")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument(
        "--max-tokens", type=int, default=0, help="score at most this many (0: all)"
    )
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    args = parser.parse_args(argv)
    names = args.weights.split(",")
    rows = {}
    reference: dict[str, list[int]] | None = None
    for name in names:
        loaded = load_model("smollm2", dtype="fp32", weight_dtype=name)
        ids = loaded.tokenizer(TEXT.read_text())["input_ids"]
        if args.max_tokens:
            ids = ids[: args.max_tokens]
        ppl = perplexity(loaded, ids, args.window)
        answers = {p: greedy(loaded, p, args.answer_tokens) for p in PROMPTS[: args.prompts]}
        reference = reference or answers
        same = sum(answers[p] == reference[p] for p in answers)
        prefix = [
            next(
                (
                    i
                    for i, (a, b) in enumerate(zip(answers[p], reference[p], strict=True))
                    if a != b
                ),
                len(answers[p]),
            )
            for p in answers
        ]
        rows[name] = (
            loaded.model.weight_layout,
            len(ids),
            ppl,
            same,
            len(answers),
            sum(prefix) / len(prefix),
        )
        del loaded
    answers_of = f"answers {args.answer_tokens} tokens"
    print(f"text {TEXT.name}, windows of {args.window}; {answers_of}, vs {names[0]}")
    header = (
        "weights",
        "layout",
        "tokens",
        "perplexity",
        "vs first",
        "same answers",
        "common prefix",
    )
    print("| " + " | ".join(header) + " |")
    print("|---|---|---|---|---|---|---|")
    first = rows[names[0]][2]
    for name, (layout, n, ppl, same, total, prefix) in rows.items():
        print(
            f"| {name} | {layout} | {n} | {ppl:.4f} | {ppl / first - 1:+.2%} | {same}/{total} "
            f"| {prefix:.1f} |"
        )
    if "int8" in rows and "bf16" in rows:
        ratio = rows["int8"][2] / rows["bf16"][2]
        verdict = "holds" if ratio <= 1.01 else "fails"
        print(f"int8 / bf16 perplexity {ratio:.4f}: gate (within 1 %) {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
