"""The fleet's cache view: every replica's /admin/cache, side by side and summed.

    python -m chatsvc.fleet_view --admin-key KEY http://10.0.0.5:8000 http://10.0.0.6:8000

Ask each replica directly, not through the load balancer (which would answer
from one replica only). Per replica and for the fleet: prompt tokens, tokens
served from the prefix cache and their ratio (the hit rate), history turns,
affinity misses (chatsvc/affinity.py) and the history tokens they recomputed.
``--json`` prints the same as one JSON object. The Prometheus equivalent is in
docs/scale-out.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import httpx

COLUMNS = (
    ("replica", "replica"),
    ("requests", "requests"),
    ("prompt_tokens", "prompt tok"),
    ("cached_tokens", "cached tok"),
    ("hit_rate", "hit rate"),
    ("history_turns", "history turns"),
    ("affinity_misses", "affinity misses"),
    ("miss_rate", "miss rate"),
    ("recomputed_tokens", "recomputed tok"),
)


def fetch(url: str, admin_key: str | None, timeout_s: float = 10.0) -> dict[str, Any]:
    """One replica's /admin/cache; raises httpx.HTTPError when it does not answer 200."""
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    response = httpx.get(url.rstrip("/") + "/admin/cache", headers=headers, timeout=timeout_s)
    response.raise_for_status()
    return response.json()


def row(name: str, report: dict[str, Any]) -> dict[str, Any]:
    """The figures of one replica's /admin/cache report."""
    overall = report["requests"]["overall"]
    affinity = report.get("affinity") or {}
    recomputed = affinity.get("recomputed_tokens") or {}
    return _with_rates(
        {
            "replica": report.get("replica") or name,
            "requests": overall["requests"],
            "prompt_tokens": overall["prompt_tokens"],
            "cached_tokens": overall["cached_tokens"],
            "history_turns": affinity.get("history_turns", 0),
            "affinity_misses": affinity.get("affinity_misses", 0),
            "recomputed_tokens": recomputed.get("affinity_miss", 0),
        }
    )


def total(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The fleet's row: counts summed, rates recomputed from the sums (not averaged)."""
    summed: dict[str, Any] = {"replica": "fleet"}
    for key in ("requests", "prompt_tokens", "cached_tokens", "history_turns"):
        summed[key] = sum(r[key] for r in rows)
    summed["affinity_misses"] = sum(r["affinity_misses"] for r in rows)
    summed["recomputed_tokens"] = sum(r["recomputed_tokens"] for r in rows)
    return _with_rates(summed)


def _with_rates(r: dict[str, Any]) -> dict[str, Any]:
    r["hit_rate"] = r["cached_tokens"] / r["prompt_tokens"] if r["prompt_tokens"] else 0.0
    r["miss_rate"] = r["affinity_misses"] / r["history_turns"] if r["history_turns"] else 0.0
    return r


def table(rows: Sequence[dict[str, Any]]) -> str:
    def cell(key: str, value: Any) -> str:
        return f"{value:.1%}" if key.endswith("_rate") else str(value)

    cells = [[title for _, title in COLUMNS]]
    cells += [[cell(key, r[key]) for key, _ in COLUMNS] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    lines = []
    for line in cells:
        padded = [
            c.rjust(w) if i else c.ljust(w)
            for i, (c, w) in enumerate(zip(line, widths, strict=True))
        ]
        lines.append("  ".join(padded))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chatsvc.fleet_view", description=__doc__)
    parser.add_argument("urls", nargs="+", help="each replica's base URL")
    parser.add_argument(
        "--admin-key", default=os.environ.get("CHATSVC_ADMIN_KEY"), help="$CHATSVC_ADMIN_KEY"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    args = parser.parse_args(argv)
    rows, failures = [], []
    for url in args.urls:
        try:
            rows.append(row(url, fetch(url, args.admin_key)))
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            failures.append(f"{url}: {type(exc).__name__}: {exc}")
    fleet = total(rows)
    if args.json:
        print(json.dumps({"replicas": rows, "fleet": fleet, "unreachable": failures}, indent=1))
    else:
        print(table([*rows, fleet]))
        for failure in failures:
            print(f"unreachable: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
