"""The CPU paths against a dense oracle: the torch reference (the oracle for Triton) and
the native backend (C for short query runs, the reference for the rest)."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_cases import (
    assert_close,
    decode_oracle,
    extend_inputs,
    extend_oracle,
    make_paged_case,
    slots_of,
)

import kernels
from kernels.backend import resolve_backend

SHAPES = [
    # (group, head_dim, block_size, lens)
    (1, 64, 8, [1, 8, 13]),
    (3, 64, 16, [16, 5, 37]),
    (4, 128, 64, [64, 100, 7]),
    (3, 64, 8, [70]),
]
DTYPES = [torch.float32, torch.bfloat16]


BACKENDS = ["torch", "native"]


def test_cpu_tensors_take_the_native_path_by_default(monkeypatch):
    # This machine has a C compiler, as every machine CI runs on does: the library builds.
    assert resolve_backend(None, torch.device("cpu")) == "native"
    assert resolve_backend("auto", torch.device("cpu")) == "native"
    assert resolve_backend("auto", torch.device("cuda")) == "triton"
    monkeypatch.setenv("CHATSVC_KERNEL_BACKEND", "torch")
    assert resolve_backend(None, torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="runs on the CPU"):
        resolve_backend("native", torch.device("cuda"))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("group", "head_dim", "block_size", "lens"), SHAPES)
def test_decode_matches_dense(group, head_dim, block_size, lens, dtype, backend):
    case = make_paged_case(lens, block_size, 2, head_dim, dtype)
    query = torch.randn(len(lens), 2 * group, head_dim).to(dtype)
    out = kernels.paged_decode_attention(
        query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.context_lens,
        1 / math.sqrt(head_dim),
        backend=backend,
    )
    assert out.dtype == dtype and out.shape == query.shape
    assert_close(out, decode_oracle(case, query), dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("group", "head_dim", "block_size", "lens"), SHAPES)
@pytest.mark.parametrize("with_prefix", [False, True])
def test_extend_matches_dense(group, head_dim, block_size, lens, dtype, with_prefix, backend):
    case = make_paged_case(lens, block_size, 2, head_dim, dtype)
    # With a prefix: the last third of each sequence is new (at least one token).
    q_lens = [max(1, n // 3) for n in lens] if with_prefix else list(lens)
    query, starts = extend_inputs(case, q_lens, 2 * group)
    out = kernels.paged_extend_attention(
        query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        starts,
        case.context_lens,
        1 / math.sqrt(head_dim),
        backend=backend,
    )
    assert out.dtype == dtype and out.shape == query.shape
    assert_close(out, extend_oracle(case, query, q_lens), dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_extend_skips_a_sequence_without_new_tokens(backend):
    case = make_paged_case([9, 20], 8, 1, 64)
    q_lens = [0, 4]
    query, starts = extend_inputs(case, q_lens, 2)
    out = kernels.paged_extend_attention(
        query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        starts,
        case.context_lens,
        0.125,
        backend=backend,
    )
    expected = extend_oracle(case, query, q_lens)
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_ignores_data_past_the_context(backend):
    """Garbage in the unused tail of the last block must not leak into the output."""
    case = make_paged_case([11], 8, 1, 64)
    query = torch.randn(1, 1, 64)
    args = (case.block_tables, case.context_lens, 0.125)
    before = kernels.paged_decode_attention(
        query, case.k_cache, case.v_cache, *args, backend=backend
    )
    last_block = int(case.block_tables[0, 1])
    case.k_cache[last_block, 3:] = 1e4
    case.v_cache[last_block, 3:] = -1e4
    after = kernels.paged_decode_attention(
        query, case.k_cache, case.v_cache, *args, backend=backend
    )
    assert torch.equal(before, after)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_scatters_and_skips(dtype, backend):
    case = make_paged_case([10, 5], 8, 2, 64, dtype)
    before = case.pool.clone()
    # Strided rows, as k and v are views into the fused QKV projection.
    key = torch.randn(4, 5, 64).to(dtype)[:, 1:3]
    value = torch.randn(4, 5, 64).to(dtype)[:, 3:]
    slots = torch.cat(
        [
            slots_of(case, 0, torch.tensor([9, 2])),
            torch.tensor([-1]),
            slots_of(case, 1, torch.tensor([4])),
        ]
    )
    kernels.write_kv(case.k_cache, case.v_cache, key, value, slots, backend=backend)
    bs = case.block_size
    for i in (0, 1, 3):
        s = int(slots[i])
        assert torch.equal(case.k_cache[s // bs, s % bs], key[i])
        assert torch.equal(case.v_cache[s // bs, s % bs], value[i])
    changed = (case.pool != before).flatten(1).any(1).nonzero().flatten().tolist()
    assert sorted(changed) == sorted({int(s) // bs for s in slots[[0, 1, 3]]})
    # Only layer 1 (the one written) may differ.
    assert torch.equal(case.pool[:, 0], before[:, 0])


def test_copy_blocks_reference_within_and_between_pools():
    case = make_paged_case([30], 8, 2, 64)
    pool = case.pool
    original = pool.clone()
    kernels.copy_blocks(pool, pool, torch.tensor([[0, 5], [1, 6]]))
    assert torch.equal(pool[5], original[0]) and torch.equal(pool[6], original[1])
    assert torch.equal(pool[:5], original[:5])
    host = torch.zeros((3, *pool.shape[1:]), dtype=pool.dtype)
    kernels.copy_blocks(pool, host, torch.tensor([[2, 1]], dtype=torch.int32))
    assert torch.equal(host[1], pool[2])
    assert not host[0].any() and not host[2].any()


def test_empty_inputs_are_no_ops():
    case = make_paged_case([5], 8, 1, 64)
    before = case.pool.clone()
    empty = torch.empty(0, 1, 64)
    kernels.write_kv(case.k_cache, case.v_cache, empty, empty, torch.empty(0, dtype=torch.int64))
    kernels.copy_blocks(case.pool, case.pool, torch.empty(0, 2, dtype=torch.int64))
    out = kernels.paged_decode_attention(
        torch.empty(0, 1, 64),
        case.k_cache,
        case.v_cache,
        torch.empty(0, 1, dtype=torch.int32),
        torch.empty(0, dtype=torch.int32),
        0.125,
    )
    assert out.shape == (0, 1, 64)
    assert torch.equal(case.pool, before)


@pytest.mark.parametrize("chunk_bytes", [1, 2 * 40 * 2 * 64 * 4])
def test_decode_reference_in_groups_of_sequences(monkeypatch, chunk_bytes):
    """Small gather budgets split the batch (1 = one sequence per group)."""
    from kernels import extend_metadata

    monkeypatch.setattr(extend_metadata, "GATHER_CHUNK_BYTES", chunk_bytes)
    lens = [40, 3, 17, 33, 1]
    case = make_paged_case(lens, 8, 2, 64)
    query = torch.randn(len(lens), 6, 64)
    out = kernels.paged_decode_attention(
        query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.context_lens,
        0.125,
        backend="torch",
    )
    assert_close(out, decode_oracle(case, query), torch.float32)
