"""Turn a run's records back into token ids, to compute the ideal hit rate of that run.

Each system gets its own trace: its answers (and so the later turns' prompts) can differ.
Prompts are rendered with the model's own chat template, as a server that renders the
whole history each turn would.
"""

from __future__ import annotations

from collections.abc import Sequence

from bench.multiturn.client import RequestRecord
from bench.multiturn.ideal import IdealHits, TraceRequest, ideal_hits
from bench.multiturn.workload import Workload


def _render(tokenizer, messages: list[dict]) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    # transformers 5 returns a BatchEncoding here; older versions a plain list.
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return list(ids)


def trace_requests(
    records: Sequence[RequestRecord], workload: Workload, tokenizer
) -> list[TraceRequest]:
    """Trace of the successful records in send order. The tokens a request computed after
    its prompt are its answer's tokens less the last one sampled (never fed back)."""
    conversations = {c.conversation_id: c for c in workload.conversations}
    answers: dict[tuple[str, int], str] = {
        (r.conversation_id, r.turn): r.answer for r in records if r.ok
    }
    trace = []
    for record in sorted((r for r in records if r.ok), key=lambda r: r.sent_at):
        conv = conversations.get(record.conversation_id)
        if conv is None:
            raise ValueError(f"record of unknown conversation {record.conversation_id!r}")
        messages = [{"role": "system", "content": conv.system_prompt}]
        for turn in range(record.turn):
            messages.append({"role": "user", "content": conv.user_turns[turn]})
            messages.append({"role": "assistant", "content": answers[(conv.conversation_id, turn)]})
        messages.append({"role": "user", "content": conv.user_turns[record.turn]})
        prompt = _render(tokenizer, messages)
        answer_ids = tokenizer.encode(record.answer, add_special_tokens=False)
        # completion_tokens counts an end-of-turn token that the text does not show; the
        # last sampled token, whichever it is, has no KV.
        n_computed = max(0, (record.completion_tokens or len(answer_ids)) - 1)
        end = record.sent_at + record.latency_s
        first = record.sent_at + (record.ttft_s if record.ttft_s is not None else record.latency_s)
        trace.append(TraceRequest(prompt, answer_ids[:n_computed], record.sent_at, first, end))
    return trace


def ideal_for_records(
    records: Sequence[RequestRecord], workload: Workload, tokenizer, block_size: int = 16
) -> tuple[IdealHits, IdealHits]:
    """(ideal, causal ideal) of a run: see :mod:`bench.multiturn.ideal`."""
    trace = trace_requests(records, workload, tokenizer)
    return ideal_hits(trace, block_size), ideal_hits(trace, block_size, causal=True)
