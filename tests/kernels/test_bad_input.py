"""Bad input raises a clear ValueError before any memory is read or written."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import extend_inputs, make_paged_case, slots_of

import kernels


@pytest.fixture
def case():
    return make_paged_case([10, 20], 8, 2, 64)


def decode(case, query=None, tables=None, lens=None, scale=0.125, **kw):
    query = torch.randn(2, 4, 64) if query is None else query
    tables = case.block_tables if tables is None else tables
    lens = case.context_lens if lens is None else lens
    return kernels.paged_decode_attention(
        query, case.k_cache, case.v_cache, tables, lens, scale, **kw
    )


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda c: {"query": torch.randn(2, 3, 64)}, "multiple of H_kv"),
        (lambda c: {"query": torch.randn(2, 4, 32)}, "head_dim"),
        (lambda c: {"query": torch.randn(2, 4, 64, dtype=torch.float64)}, "dtype"),
        (lambda c: {"query": torch.randn(3, 4, 64)}, "batch mismatch"),
        (lambda c: {"query": torch.randn(8, 64)}, "3-D"),
        (lambda c: {"tables": c.block_tables.float()}, "int32 or int64"),
        (lambda c: {"lens": torch.tensor([10, 33], dtype=torch.int32)}, "context_lens"),
        (lambda c: {"lens": torch.tensor([0, 20], dtype=torch.int32)}, "context_lens"),
        (lambda c: {"tables": _with(c.block_tables, (1, 2), 99)}, "not a block of the pool"),
        (lambda c: {"tables": _with(c.block_tables, (0, 0), -1)}, "not a block of the pool"),
        (lambda c: {"scale": 0.0}, "scale"),
        (lambda c: {"backend": "cuda-magic"}, "backend"),
    ],
)
def test_decode_rejects(case, mutate, message):
    with pytest.raises(ValueError, match=message):
        decode(case, **mutate(case))


def _with(tensor, index, value):
    out = tensor.clone()
    out[index] = value
    return out


def test_decode_without_bounds_checks_still_checks_shapes(case):
    with pytest.raises(ValueError, match="batch mismatch"):
        decode(case, query=torch.randn(3, 4, 64), check_bounds=False)


def test_padding_past_the_last_used_block_is_allowed(case):
    # Table entries beyond a sequence's blocks are padding (-1 here): not an error.
    assert int(case.block_tables[0, 2]) == -1
    assert decode(case).shape == (2, 4, 64)


def test_cache_pair_mismatch(case):
    other = torch.zeros(case.k_cache.shape[0], 16, 2, 64)
    with pytest.raises(ValueError, match="v_cache shape"):
        kernels.paged_decode_attention(
            torch.randn(2, 4, 64),
            case.k_cache,
            other,
            case.block_tables,
            case.context_lens,
            0.125,
        )


@pytest.mark.parametrize(
    ("slots", "message"),
    [
        (lambda c: torch.tensor([0, 10_000]), "outside"),
        (lambda c: torch.tensor([-2, 0]), "outside"),
        (lambda c: torch.tensor([3, 3]), "same slot twice"),
        (lambda c: torch.tensor([3]), "entries"),
        (lambda c: torch.tensor([3.0, 4.0]), "int32 or int64"),
    ],
)
def test_write_kv_rejects_and_changes_nothing(case, slots, message):
    before = case.pool.clone()
    key = torch.randn(2, 2, 64)
    with pytest.raises(ValueError, match=message):
        kernels.write_kv(case.k_cache, case.v_cache, key, key.clone(), slots(case))
    assert torch.equal(case.pool, before)


def test_write_kv_rejects_wrong_row_shape_and_dtype(case):
    slots = slots_of(case, 0, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="key must be"):
        kernels.write_kv(
            case.k_cache, case.v_cache, torch.randn(2, 3, 64), torch.randn(2, 3, 64), slots
        )
    half = torch.randn(2, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dtype"):
        kernels.write_kv(case.k_cache, case.v_cache, half, half, slots)


@pytest.mark.parametrize(
    ("starts", "lens", "message"),
    [
        ([0, 3, 5], [10, 20], None),
        ([0, 3], [10, 20], "batch mismatch"),
        ([1, 3, 5], [10, 20], "from 0 to T"),
        ([0, 4, 3], [10, 20], "from 0 to T|non-decreasing"),
        ([0, 3, 5], [2, 20], "context_lens"),
        ([0, 3, 5], [10, 40], "context_lens"),
    ],
)
def test_extend_validation(case, starts, lens, message):
    query, _ = extend_inputs(case, [3, 2], 4)
    args = (
        query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32),
        0.125,
    )
    if message is None:
        assert kernels.paged_extend_attention(*args).shape == query.shape
    else:
        with pytest.raises(ValueError, match=message):
            kernels.paged_extend_attention(*args)


@pytest.mark.parametrize(
    ("pairs", "message"),
    [
        ([[0, 99]], "outside"),
        ([[-1, 4]], "outside"),
        ([[0, 4], [1, 4]], "same destination"),
        ([[0, 4], [4, 5]], "also be a source"),
        ([[0, 4, 5]], r"\[N, 2\]"),
    ],
)
def test_copy_blocks_rejects_and_changes_nothing(case, pairs, message):
    before = case.pool.clone()
    with pytest.raises(ValueError, match=message):
        kernels.copy_blocks(case.pool, case.pool, torch.tensor(pairs))
    assert torch.equal(case.pool, before)


def test_copy_blocks_rejects_mismatched_pools(case):
    other = torch.zeros(4, 3, *case.pool.shape[2:])
    with pytest.raises(ValueError, match="block shapes differ"):
        kernels.copy_blocks(case.pool, other, torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="dtype"):
        kernels.copy_blocks(case.pool, case.pool.to(torch.bfloat16), torch.tensor([[0, 1]]))
    # Swapping the last two axes leaves a block strided, not one chunk.
    strided = case.pool.transpose(-1, -2)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.copy_blocks(strided, strided, torch.tensor([[0, 1]]))


def test_triton_backend_on_cpu_without_interpreter_is_a_clear_error(case):
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.fail("this suite runs the interpreter only in subprocesses")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        decode(case, backend="triton")


def test_tensors_on_another_device_are_refused(case):
    # The meta device stands in for "not where the cache is" (no GPU needed).
    query = torch.empty(2, 4, 64, device="meta")
    with pytest.raises(ValueError, match="on meta but the KV cache on cpu"):
        decode(case, query=query)
    with pytest.raises(ValueError, match="block_tables on meta"):
        decode(case, tables=case.block_tables.to("meta"))
    key = torch.empty(1, 2, 64, device="meta")
    with pytest.raises(ValueError, match="key on meta"):
        kernels.write_kv(case.k_cache, case.v_cache, key, key, torch.tensor([0]))
