"""Per-step kernel metadata: built once, reused by every layer, same results as without
(the grouped torch path, ``invariant=False``; the invariant one's plan is tested in
test_span_attention.py)."""

import pytest
import torch
from kernel_cases import assert_close, decode_oracle, make_paged_case

import kernels
from kernels import extend_metadata as em
from kernels.step.write_index import write_index

LENS = [40, 3, 17, 33, 1]


def _metadata(case, dtype=torch.float32):
    """A decode step's groups: one new token per sequence, 6 query heads over 2 KV heads."""
    row_bytes = case.k_cache.shape[2] * case.k_cache.shape[3] * case.k_cache.element_size()
    starts = torch.arange(len(LENS) + 1, dtype=torch.int32)
    return em.extend_metadata(case.block_tables, starts, case.context_lens, 8, 3, row_bytes, dtype)


@pytest.mark.parametrize("chunk_bytes", [1, 2 * 40 * 2 * 64 * 4, 4 << 20])
def test_decode_with_prebuilt_metadata_matches_the_oracle(monkeypatch, chunk_bytes):
    monkeypatch.setattr(em, "GATHER_CHUNK_BYTES", chunk_bytes)
    case = make_paged_case(LENS, 8, 2, 64)
    query = torch.randn(len(LENS), 6, 64)
    metadata = _metadata(case)
    assert sum(g.row_end - g.row_start for g in metadata.groups) == len(LENS)
    if chunk_bytes == 1:
        assert len(metadata.groups) == len(LENS)
    args = (query, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.125)
    grouped = {"backend": "torch", "invariant": False}
    with_meta = [
        kernels.paged_decode_attention(*args, metadata=metadata, **grouped) for _ in range(2)
    ]
    without = kernels.paged_decode_attention(*args, **grouped)
    assert torch.equal(with_meta[0], with_meta[1])
    assert torch.equal(with_meta[0], without)
    assert_close(with_meta[0], decode_oracle(case, query), torch.float32)


def test_masks_cut_each_sequence_at_its_length():
    case = make_paged_case(LENS, 8, 2, 64)
    (group,) = _metadata(case).groups
    assert group.ids.shape == (len(LENS), 5)
    allowed = group.bias[:, 0, 0, :] == 0
    assert allowed.sum(dim=1).tolist() == LENS


def test_decode_rejects_metadata_of_another_batch():
    case = make_paged_case(LENS, 8, 2, 64)
    query = torch.randn(len(LENS) - 1, 6, 64)
    metadata = _metadata(case)
    with pytest.raises(ValueError, match="metadata built for"):
        kernels.paged_decode_attention(
            query,
            case.k_cache,
            case.v_cache,
            case.block_tables[:-1],
            case.context_lens[:-1],
            0.125,
            metadata=metadata,
        )
    with pytest.raises(ValueError, match="ExtendMetadata"):
        kernels.paged_decode_attention(
            query,
            case.k_cache,
            case.v_cache,
            case.block_tables[:-1],
            case.context_lens[:-1],
            0.125,
            metadata=("not", "metadata"),
        )


@pytest.mark.parametrize("slots", [[5, 0, 17, 9], [5, -1, 17, -1]])
def test_write_kv_with_a_prebuilt_index_matches_without(slots):
    case = make_paged_case([8], 8, 2, 64, spare_blocks=3)
    key, value = torch.randn(4, 2, 64), torch.randn(4, 2, 64)
    slot_mapping = torch.tensor(slots)
    expected = case.pool.clone()
    k_view, v_view = case.k_cache, case.v_cache
    kernels.write_kv(k_view, v_view, key, value, slot_mapping)
    expected, case.pool[:] = case.pool.clone(), expected
    index = write_index(slot_mapping, 8)
    assert (index.keep is None) == (min(slots) >= 0)
    kernels.write_kv(k_view, v_view, key, value, slot_mapping, index=index)
    assert torch.equal(case.pool, expected)


def test_write_kv_rejects_an_index_of_other_slots_and_writes_nothing():
    case = make_paged_case([8], 8, 2, 64)
    before = case.pool.clone()
    key, value = torch.randn(2, 2, 64), torch.randn(2, 2, 64)
    index = write_index(torch.tensor([1, 2, 3]), 8)
    with pytest.raises(ValueError, match="3 tokens"):
        kernels.write_kv(case.k_cache, case.v_cache, key, value, torch.tensor([1, 2]), index=index)
    with pytest.raises(ValueError, match="block_size 4"):
        kernels.write_kv(
            case.k_cache,
            case.v_cache,
            key,
            value,
            torch.tensor([1, 2]),
            index=write_index(torch.tensor([1, 2]), 4),
        )
    assert torch.equal(case.pool, before)
