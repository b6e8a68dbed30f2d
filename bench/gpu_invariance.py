"""Invariance on a device (issue 26): a token's bits do not depend on its step.

``bench.gpu_checks`` runs ``check_invariance`` as its "invariance" check and prints one
markdown table row per part:

    span attention   rows of three sequences (contexts up to 700: three spans of 256)
                     attended in chunks, decodes and mixed batches, against each
                     sequence alone in one chunk; keys past every context are NaN
    matmul           a row of the invariant matmul alone, among 5 and 300 rows
    rms_norm         a row alone and among 300
    model            the real model: a 300-token prompt (across the span at 256)
                     prefilled alone in one chunk, then in three chunks and a decode
                     beside another sequence's chunks; the prompt's K/V in every layer
                     and its logits at every position the chunked run computes

bit for bit, fp32 and bf16. On CUDA the kernels are Triton's (the span kernel, the
matmul, RMSNorm); the model runs whatever ``kernels.linear`` gives it there (until the
matmul is wired as its CUDA layout, cuBLAS: its row fails, and says so). On the CPU
(``--device cpu``, how the suite runs this) the torch backend's spans and RMSNorm in
fp32 (the kernel tests cover bf16), the model in fp32 over a 48-token prompt with the
logits of each piece's last 4 tokens (the head is slow there; the engine's own tests
cover the span boundary), and no matmul row (the interpreter tests check it).
"""

from __future__ import annotations

import argparse
import math
import os
from types import SimpleNamespace

import torch

from kernels.backend import ENV_VAR
from kernels.kv_layout import KVShape, layer_views, new_kv_pool

BLOCK = 16
# (sequence, first new token, context) per piece; one list per step. Sequence 0 is 700
# tokens (spans 0-2), 1 is 300, 2 is 40; some pieces repeat rows another step had.
STEPS = [
    [(0, 0, 250), (1, 0, 300)],
    [(2, 0, 40), (0, 250, 520)],
    [(0, 520, 699), (2, 39, 40), (1, 299, 300)],
    [(0, 699, 700)],
]
LENS = [700, 300, 40]


def _row(part: str, dtype: torch.dtype, cases: int, differing: int) -> tuple[str, bool]:
    name = "fp32" if dtype == torch.float32 else "bf16"
    verdict = "bit-identical" if differing == 0 else f"{differing} differ"
    return f"| {part} | {name} | {cases} | {verdict} |", differing == 0


def _attention_rows(backend: str, dtype: torch.dtype, device: str) -> tuple[str, bool]:
    import kernels

    gen = torch.Generator().manual_seed(0)
    kv_heads, group, head_dim = 2, 3, 64
    per_seq = [-(-n // BLOCK) for n in LENS]
    pool = new_kv_pool(sum(per_seq), KVShape(1, BLOCK, kv_heads, head_dim), dtype, "cpu")
    pool.copy_(torch.randn(pool.shape, generator=gen).to(dtype))
    pool = pool.to(device)
    tables = torch.zeros(len(LENS), max(per_seq), dtype=torch.int32)
    first = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = torch.arange(first, first + n, dtype=torch.int32)
        first += n
    queries = [torch.randn(n, kv_heads * group, head_dim, generator=gen).to(dtype) for n in LENS]

    def attend(pieces):
        poisoned = pool.clone()
        k_cache, v_cache = layer_views(poisoned, 0)
        for seq, _, stop in pieces:  # keys past each context: NaN, never to be read
            pos = torch.arange(stop, LENS[seq])
            blocks = tables[seq, pos // BLOCK].long().to(device)
            k_cache[blocks, (pos % BLOCK).to(device)] = float("nan")
            v_cache[blocks, (pos % BLOCK).to(device)] = float("nan")
        query = torch.cat([queries[s][a:b] for s, a, b in pieces]).to(device)
        sizes = [b - a for _, a, b in pieces]
        starts = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)
        out = kernels.paged_extend_attention(
            query,
            k_cache,
            v_cache,
            tables[[s for s, _, _ in pieces]].to(device),
            starts.to(device),
            torch.tensor([b for _, _, b in pieces], dtype=torch.int32, device=device),
            1 / math.sqrt(head_dim),
            backend=backend,
            max_query_len=max(sizes),
        )
        return out.cpu().split(sizes)

    alone = [attend([(s, 0, n)])[0] for s, n in enumerate(LENS)]
    differing = cases = 0
    for step in STEPS:
        for (seq, start, stop), out in zip(step, attend(step), strict=True):
            differing += int((out != alone[seq][start:stop]).flatten(1).any(dim=1).sum())
            cases += stop - start
    return _row(f"span attention ({backend})", dtype, cases, differing)


def _matmul_rows(dtype: torch.dtype, device: str) -> tuple[str, bool]:
    from kernels.matmul import matmul

    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(1536, 576, generator=gen).to(dtype).to(device)
    x = torch.randn(300, 576, generator=gen).to(dtype).to(device)
    full = matmul(x, weight)
    differing = 0
    for rows, at in ((1, 0), (5, 2), (300, 123)):
        xs = torch.randn(rows, 576, generator=gen).to(dtype).to(device)
        xs[at] = x[123]
        differing += int(not torch.equal(matmul(xs, weight)[at], full[123]))
    return _row("matmul rows (triton)", dtype, 3, differing)


def _rms_norm_rows(backend: str, dtype: torch.dtype, device: str) -> tuple[str, bool]:
    import kernels

    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(300, 576, generator=gen) * 3).to(dtype).to(device)
    weight = torch.randn(576, generator=gen).to(dtype).to(device)
    full = kernels.rms_norm(x, weight, 1e-5, backend=backend)
    alone = kernels.rms_norm(x[123:124], weight, 1e-5, backend=backend)
    return _row(f"rms_norm rows ({backend})", dtype, 1, int(not torch.equal(alone[0], full[123])))


def _model_rows(
    loaded, dtype: torch.dtype, device: str, length: int, tail: int | None
) -> tuple[str, bool]:
    """A ``length``-token prompt alone in one chunk, then in chunks beside another sequence
    (its K/V from the earlier chunks: the cached prefix): the prompt's K/V, and the logits
    of the last ``tail`` positions of each chunked piece (None: all of them)."""
    from chatsvc.engine.forward_batch import ForwardBatch

    model = loaded.model
    prompt = torch.randint(100, 40000, (length,), generator=torch.Generator().manual_seed(3))
    other = torch.randint(100, 40000, (length // 2,), generator=torch.Generator().manual_seed(4))
    tokens = [prompt.tolist(), other.tolist()]
    blocks = [-(-len(t) // BLOCK) for t in tokens]
    tables = [list(range(blocks[0])), list(range(blocks[0], sum(blocks)))]
    a, b, c, half = length // 3, 5 * length // 6, length - 1, length // 2

    def run(steps, tail):
        pool = new_kv_pool(sum(blocks), model.kv_shape(BLOCK), model.dtype, device)
        logits = {}
        for step in steps:
            wanted = [hi - lo if tail is None else min(tail, hi - lo) for _, lo, hi in step]
            batch = ForwardBatch.from_lists(
                [tokens[s][lo:hi] for s, lo, hi in step],
                [lo for _, lo, _ in step],
                [
                    [tables[s][p // BLOCK] * BLOCK + p % BLOCK for p in range(lo, hi)]
                    for s, lo, hi in step
                ],
                [tables[s] for s, _, _ in step],
                BLOCK,
                device,
                num_logits=wanted,
            )
            rows = iter(model.forward(batch, pool).cpu())
            for (s, _, hi), count in zip(step, wanted, strict=True):
                for p in range(hi - count, hi):
                    logits[(s, p)] = next(rows)
        return logits, pool[: blocks[0]].cpu()

    solo, solo_kv = run([[(0, 0, length)]], None)
    steps = [
        [(1, 0, half // 2), (0, 0, a)],
        [(0, a, b), (1, half // 2, half)],
        [(0, b, c)],
        [(0, c, length)],
    ]
    mixed, mixed_kv = run(steps, tail)
    compared = [key for key in mixed if key[0] == 0]
    differing = sum(int(not torch.equal(mixed[key], solo[key])) for key in compared)
    differing += int(not torch.equal(mixed_kv, solo_kv))
    return _row("model logits + K/V", dtype, len(compared) + 1, differing)


def _random_model(dtype: torch.dtype, device: str) -> SimpleNamespace:
    """SmolLM2-135M's shape with random weights, as the loaded model's stand-in where the
    converted checkpoint cannot travel (a device machine takes 64 MiB of files)."""
    from chatsvc.engine.llama import LlamaModel
    from chatsvc.engine.weights_random import named_config, random_weights

    config = named_config("smollm2-135m")
    return SimpleNamespace(model=LlamaModel(config, random_weights(config, dtype, device)))


def check_invariance(device: str, fp32_model=None, random_weights: bool = False) -> str:
    """Print the table; PASS when every row is bit-identical (``fp32_model``: a loaded
    fp32 model on ``device`` to reuse, else one is loaded; ``random_weights``: the model
    rows run SmolLM2's shape with random weights instead of the checkpoint)."""
    from chatsvc.engine.loader import load_model

    on_cuda = torch.device(device).type == "cuda"
    backend = "triton" if on_cuda else "torch"
    dtypes = [torch.float32, torch.bfloat16]
    rows = []
    for dtype in dtypes if on_cuda else [torch.float32]:
        rows.append(_attention_rows(backend, dtype, device))
        if on_cuda:
            rows.append(_matmul_rows(dtype, device))
        rows.append(_rms_norm_rows(backend, dtype, device))
    previous = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = backend
    try:
        for dtype in dtypes if on_cuda else [torch.float32]:
            if dtype == torch.float32 and fp32_model is not None:
                loaded = fp32_model
            elif random_weights:
                loaded = _random_model(dtype, device)
            else:
                name = "fp32" if dtype == torch.float32 else "bf16"
                loaded = load_model("smollm2", dtype=name, device=device)
            if on_cuda:
                rows.append(_model_rows(loaded, dtype, device, 300, None))
            else:
                rows.append(_model_rows(loaded, dtype, device, 48, 4))
    finally:
        if previous is None:
            del os.environ[ENV_VAR]
        else:
            os.environ[ENV_VAR] = previous
    print("| part | dtype | rows compared | result |\n|---|---|---|---|")
    for line, _ in rows:
        print(line)
    failed = [line for line, ok in rows if not ok]
    if failed:
        raise AssertionError(f"{len(failed)} of {len(rows)} parts differ")
    return f"PASS ({len(rows)} parts bit-identical)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--random-weights",
        action="store_true",
        help="model rows over SmolLM2's shape with random weights (no checkpoint needed)",
    )
    args = parser.parse_args()
    print(check_invariance(args.device, random_weights=args.random_weights))


if __name__ == "__main__":
    main()
