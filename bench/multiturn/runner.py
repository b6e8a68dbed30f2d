"""One benchmark run: the same workload against each system in turn, one result file."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.multiturn.client import RunResult, run_workload, warm_up
from bench.multiturn.memory import AdminSampler, static_allocation, summarize_admin
from bench.multiturn.servers import RunningServer, start_server
from bench.multiturn.trace import ideal_for_records
from bench.multiturn.workload import Workload


@dataclass(frozen=True)
class RunOptions:
    concurrency: int = 8
    block_size: int = 16
    # None = the longest request of the trace (prompt + max_tokens): the smallest static
    # reservation that fits every request, so the comparison flatters the static allocator.
    max_context_len: int | None = None
    ready_timeout_s: float = 600.0
    admin_interval_s: float = 0.25
    threads: int | None = None
    # Per system; None = let every conversation finish.
    deadline_s: float | None = None


def resolve_model_dir(model_dir: str | None) -> Path:
    """The safetensors directory every system serves: the given one, or the default model
    converted by our loader (cached under the chatsvc data directory)."""
    if model_dir:
        path = Path(model_dir).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: not a model directory")
        return path
    from chatsvc.engine.weights_gguf import ensure_default_model

    return ensure_default_model()


async def _drive(server: RunningServer, workload: Workload, options: RunOptions):
    await warm_up(server.base_url, server.model, server.spec.headers)
    sampler = None
    stop = asyncio.Event()
    tasks = []
    t0 = time.perf_counter()
    if server.spec.admin_cache_path:
        sampler = AdminSampler(
            server.base_url, server.spec.admin_cache_path, options.admin_interval_s
        )
        tasks.append(asyncio.create_task(sampler.run(t0, stop)))
    try:
        result = await run_workload(
            server.base_url,
            workload,
            server.spec.name,
            options.concurrency,
            model=server.model,
            headers=server.spec.headers,
            deadline_s=options.deadline_s,
        )
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    return result, sampler


def run_system(
    system: str, workload: Workload, model_dir: Path, log_dir: Path, options: RunOptions, tokenizer
) -> dict:
    """Start ``system``, run the workload, stop it; the system's entry of the result file."""
    started = time.perf_counter()
    with start_server(system, model_dir, log_dir, options.ready_timeout_s, options.threads) as srv:
        ready_s = time.perf_counter() - started
        result, sampler = asyncio.run(_drive(srv, workload, options))
    return system_entry(result, workload, tokenizer, options, ready_s, sampler)


def system_entry(
    result: RunResult,
    workload: Workload,
    tokenizer,
    options: RunOptions,
    ready_s: float | None = None,
    sampler: AdminSampler | None = None,
) -> dict:
    entry = result.to_json()
    entry["ready_s"] = ready_s
    ideal, causal = ideal_for_records(result.records, workload, tokenizer, options.block_size)
    entry["ideal"] = {"prompt_tokens": ideal.prompt_tokens, "cached_tokens": ideal.cached_tokens}
    entry["ideal_causal"] = {
        "prompt_tokens": causal.prompt_tokens,
        "cached_tokens": causal.cached_tokens,
    }
    max_len = options.max_context_len or max(
        ((r.prompt_tokens or 0) + r.max_tokens for r in result.records if r.ok), default=0
    )
    static = static_allocation(result.records, max_len)
    entry["static_max_len"] = max_len
    entry["static_memory"] = asdict(static) if static else None
    if sampler is not None:
        admin = summarize_admin(sampler.samples, options.block_size)
        entry["admin_memory"] = asdict(admin) if admin else None
        entry["admin_samples"] = sampler.samples
        entry["admin_errors"] = sampler.errors
    return entry


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


def write_result(result: dict, out_dir: Path, stem: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.json"
    path.write_text(json.dumps(result, indent=1))
    return path
