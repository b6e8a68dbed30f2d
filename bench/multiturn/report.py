"""Figures of a result file: per-system summary, a markdown table and a PNG plot.

A result file (JSON) holds ``meta`` and ``systems``; each system entry holds ``records``
(the client's :class:`RequestRecord` dicts), ``wall_s``, and optionally ``ideal``
(``prompt_tokens``, ``cached_tokens``), ``admin_memory`` and ``static_memory``
(:class:`MemorySummary` dicts).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    data = sorted(values)
    if not data:
        return None
    pos = (len(data) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def _pcts(values: Sequence[float]) -> dict[str, float | None]:
    return {f"p{q}": percentile(values, q) for q in (50, 90, 99)}


def summarize_system(entry: dict, from_turn: int = 2) -> dict:
    """Summary figures of one system. ``from_turn`` (0-based) picks the turns of the
    headline TTFT (2 = "from turn 3 on")."""
    records = entry["records"]
    cut = [r for r in records if r.get("cut_at_deadline")]
    ok = [
        r
        for r in records
        if r.get("error") is None and not r.get("cut_at_deadline") and r.get("latency_s")
    ]
    wall = entry.get("wall_s") or 0.0
    turns = sorted({r["turn"] for r in ok})
    ttft_by_turn = {
        t: _pcts([r["ttft_s"] for r in ok if r["turn"] == t and r["ttft_s"] is not None])
        for t in turns
    }
    prompt = sum(r["prompt_tokens"] or 0 for r in ok)
    reports_cached = any(r.get("cached_tokens") is not None for r in ok)
    cached = sum(r.get("cached_tokens") or 0 for r in ok)
    completion = sum(r["completion_tokens"] or 0 for r in ok)
    summary = {
        "requests": len(records),
        "errors": len(records) - len(ok) - len(cut),
        "cut_at_deadline": len(cut),
        "truncated": bool(entry.get("truncated")),
        "ttft_by_turn": ttft_by_turn,
        "ttft_late": _pcts(
            [r["ttft_s"] for r in ok if r["turn"] >= from_turn and r["ttft_s"] is not None]
        ),
        "tpot": _pcts([r["tpot_s"] for r in ok if r.get("tpot_s") is not None]),
        "latency": _pcts([r["latency_s"] for r in ok]),
        "requests_per_s": len(ok) / wall if wall > 0 else None,
        "output_tokens_per_s": completion / wall if wall > 0 else None,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cached_tokens": cached if reports_cached else None,
        "hit_rate": cached / prompt if reports_cached and prompt else None,
    }
    for key, prefix in (("ideal", "ideal"), ("ideal_causal", "causal")):
        ideal = entry.get(key)
        if ideal and ideal.get("prompt_tokens"):
            rate = ideal["cached_tokens"] / ideal["prompt_tokens"]
            summary[f"{prefix}_hit_rate"] = rate
            if summary["hit_rate"] is not None and rate > 0:
                summary[f"{prefix}_hit_ratio"] = summary["hit_rate"] / rate
    for key in ("admin_memory", "static_memory"):
        if entry.get(key):
            summary[key] = entry[key]
    return summary


def _cut_note(summary: dict) -> str:
    if not summary["truncated"]:
        return ""
    return f" (run cut at its deadline, {summary['cut_at_deadline']} in flight)"


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{1000 * value:.0f}"


def _num(value: float | None, fmt: str = "{:.2f}") -> str:
    return "–" if value is None else fmt.format(value)


def markdown_table(result: dict) -> str:
    """Markdown tables: headline figures per system, then TTFT p50/p90/p99 per turn."""
    systems = result["systems"]
    sums = {name: summarize_system(entry) for name, entry in systems.items()}
    lines = [
        "| system | TTFT p50/p90/p99 turn≥3 (ms) | TPOT p50/p90 (ms) "
        "| latency p50/p90/p99 (ms) | req/s | out tok/s | errors |",
        "|---" * 7 + "|",
    ]
    for name, s in sums.items():
        late, tpot, lat = s["ttft_late"], s["tpot"], s["latency"]
        lines.append(
            f"| {name} | {_ms(late['p50'])} / {_ms(late['p90'])} / {_ms(late['p99'])} "
            f"| {_ms(tpot['p50'])} / {_ms(tpot['p90'])} "
            f"| {_ms(lat['p50'])} / {_ms(lat['p90'])} / {_ms(lat['p99'])} "
            f"| {_num(s['requests_per_s'])} | {_num(s['output_tokens_per_s'], '{:.1f}')} "
            f"| {s['errors']}{_cut_note(s)} |"
        )
    lines += [
        "",
        "Prefix cache (cached prompt tokens / prompt tokens, as the server reports them):",
        "",
        "| system | prompt tokens | cached | hit rate | ideal | ratio | causal ideal | ratio |",
        "|---" * 8 + "|",
    ]
    for name, s in sums.items():
        lines.append(
            f"| {name} | {s['prompt_tokens']} | {_num(s['cached_tokens'], '{:.0f}')} "
            f"| {_num(s['hit_rate'], '{:.1%}')} | {_num(s.get('ideal_hit_rate'), '{:.1%}')} "
            f"| {_num(s.get('ideal_hit_ratio'), '{:.1%}')} "
            f"| {_num(s.get('causal_hit_rate'), '{:.1%}')} "
            f"| {_num(s.get('causal_hit_ratio'), '{:.1%}')} |"
        )
    turns = sorted({t for s in sums.values() for t in s["ttft_by_turn"]})
    lines += [
        "",
        "TTFT p50 / p90 / p99 (ms) per turn (turn 1 = first user message):",
        "",
        "| system | " + " | ".join(f"turn {t + 1}" for t in turns) + " |",
        "|---" * (len(turns) + 1) + "|",
    ]
    for name, s in sums.items():
        cells = []
        for t in turns:
            p = s["ttft_by_turn"].get(t)
            cells.append(
                "–" if p is None else f"{_ms(p['p50'])} / {_ms(p['p90'])} / {_ms(p['p99'])}"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", *memory_table(sums)]
    return "\n".join(lines) + "\n"


def memory_table(sums: dict[str, dict]) -> list[str]:
    """KV memory lines: tokens the in-flight requests held (client view), what a static
    per-request reservation would take, and what ours allocated (from /admin/cache)."""
    lines = [
        "KV memory, mean over the busy part of the run (token slots):",
        "",
        "| system | tokens held (client view) | static reservation | static waste "
        "| allocated (server) mean / peak | used (server) | waste (server) | waste bound |",
        "|---" * 8 + "|",
    ]
    for name, s in sums.items():
        static, admin = s.get("static_memory") or {}, s.get("admin_memory") or {}
        lines.append(
            f"| {name} | {_num(static.get('mean_used_slots'), '{:.0f}')} "
            f"| {_num(static.get('mean_allocated_slots'), '{:.0f}')} "
            f"| {_num(static.get('waste_pct'), '{:.1f} %')} "
            f"| {_num(admin.get('mean_allocated_slots'), '{:.0f}')} / "
            f"{_num(admin.get('peak_allocated_slots'), '{:.0f}')} "
            f"| {_num(admin.get('mean_used_slots'), '{:.0f}')} "
            f"| {_num(admin.get('waste_pct'), '{:.1f} %')} "
            f"| {_num(admin.get('waste_bound_pct'), '≤ {:.1f} %')} |"
        )
    return lines


def plot(result: dict, path: str | Path) -> Path:
    """PNG: TTFT p50 per turn, throughput and hit rate against the ideal, per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sums = {name: summarize_system(entry) for name, entry in result["systems"].items()}
    names = list(sums)
    fig, (ax_ttft, ax_tput, ax_hit) = plt.subplots(1, 3, figsize=(15, 4.5))
    for name, s in sums.items():
        turns = sorted(s["ttft_by_turn"])
        p50 = [s["ttft_by_turn"][t]["p50"] for t in turns]
        ax_ttft.plot([t + 1 for t in turns], [1000 * (v or 0) for v in p50], marker="o", label=name)
    ax_ttft.set(xlabel="turn", ylabel="TTFT p50 (ms)", yscale="log", title="Time to first token")
    ax_ttft.legend()
    ax_tput.bar(names, [s["output_tokens_per_s"] or 0 for s in sums.values()])
    ax_tput.set(ylabel="output tokens/s", title="Throughput")
    x = range(len(names))
    ax_hit.bar([i - 0.2 for i in x], [s["hit_rate"] or 0 for s in sums.values()], 0.4, label="hit")
    ax_hit.bar(
        [i + 0.2 for i in x],
        [s.get("ideal_hit_rate") or 0 for s in sums.values()],
        0.4,
        label="ideal",
    )
    ax_hit.set_xticks(list(x), names)
    ax_hit.set(ylabel="cached / prompt tokens", ylim=(0, 1), title="Prefix hit rate")
    ax_hit.legend()
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
