"""Extend steps batched into padded groups (the torch path with ``invariant=False``, and the
native path's long runs): the grouping, and the same results as the oracle."""

import math

import pytest
import torch
from kernel_cases import assert_close, extend_inputs, extend_oracle, make_paged_case

import kernels
from kernels import extend_metadata as em

# A mixed step: three decodes, three new turns over a cached prefix, one prompt with
# no prefix (q_len == context), one more decode, and a sequence with no new tokens.
LENS = [40, 3, 17, 30, 21, 26, 12, 9, 5]
Q_LENS = [1, 1, 1, 7, 5, 6, 12, 1, 0]
GROUP = 3


def _case_and_metadata(dtype=torch.float32):
    case = make_paged_case(LENS, 8, 2, 32, dtype=dtype)
    query, starts = extend_inputs(case, Q_LENS, 2 * GROUP)
    row_bytes = 2 * 32 * case.k_cache.element_size()
    metadata = em.extend_metadata(
        case.block_tables, starts, case.context_lens, 8, GROUP, row_bytes, dtype
    )
    return case, query, starts, metadata


def _extend(case, query, starts, backend="torch", invariant=False, **kwargs):
    return kernels.paged_extend_attention(
        query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        starts,
        case.context_lens,
        1 / math.sqrt(32),
        backend=backend,
        invariant=invariant,
        **kwargs,
    )


def test_groups_keep_decodes_apart_and_pad_similar_turns_together(monkeypatch):
    # Without the slack (sized for real steps), so this small case shows the ratio rule.
    monkeypatch.setattr(em, "MAX_PADDING_RATIO", 1.5)
    monkeypatch.setattr(em, "PADDING_SLACK", 0)
    _, _, _, metadata = _case_and_metadata()
    shapes = [(g.row_start, g.row_end, g.batch, g.q_pad) for g in metadata.groups]
    assert shapes == [(0, 3, 3, 1), (3, 21, 3, 7), (21, 33, 1, 12), (33, 34, 1, 1)]
    decodes, turns, prompt, _ = metadata.groups
    # Decodes: no padding, one mask row per sequence, cut at each context length.
    assert decodes.gather_rows is None and decodes.bias.shape == (3, 1, 1, 40)
    assert (decodes.bias[:, 0, 0] == 0).sum(dim=1).tolist() == LENS[:3]
    # Turns: padded to 7 rows each; pad rows repeat the sequence's last token.
    padded_second = [*range(7, 12), 11, 11]
    assert turns.gather_rows.tolist() == [*range(7), *padded_second, *range(12, 18), 17]
    assert turns.valid_rows.tolist() == list(range(7)) + list(range(7, 12)) + list(range(14, 20))
    assert turns.bias.shape == (3, 1, GROUP * 7, 32)
    # Row g * Q + i of the folded heads sees keys [0, prefix + i]; a pad row its last token's.
    second = (turns.bias[1, 0] == 0).sum(dim=1).view(GROUP, 7)
    first_pos = LENS[4] - Q_LENS[4]
    expected = [first_pos + min(i, 4) + 1 for i in range(7)]
    assert second.tolist() == [expected] * GROUP
    # The prompt with nothing cached runs causal attention without a mask.
    assert prompt.bias is None and prompt.num_keys == 12


def test_prebuilt_groups_match_the_oracle_and_the_unbatched_path(monkeypatch):
    for dtype in (torch.float32, torch.bfloat16):
        case, query, starts, metadata = _case_and_metadata(dtype)
        with_meta = _extend(case, query, starts, metadata=metadata)
        assert torch.equal(with_meta, _extend(case, query, starts))
        assert_close(with_meta, extend_oracle(case, query, Q_LENS), dtype)
    # One sequence per call (every group refused) gives the same answer.
    monkeypatch.setattr(em, "MAX_PADDING_RATIO", 0.0)
    monkeypatch.setattr(em, "PADDING_SLACK", 0)
    monkeypatch.setattr(em, "GATHER_CHUNK_BYTES", 1)
    case, query, starts, metadata = _case_and_metadata()
    assert len(metadata.groups) == sum(1 for q in Q_LENS if q)
    out = _extend(case, query, starts, metadata=metadata)
    assert_close(out, extend_oracle(case, query, Q_LENS), torch.float32)


def test_extend_rejects_metadata_of_another_step():
    case, query, starts, metadata = _case_and_metadata()
    with pytest.raises(ValueError, match="metadata built for"):
        _extend(case, query[:-1], starts.clone().clamp_(max=query.shape[0] - 1), metadata=metadata)
    with pytest.raises(ValueError, match="ExtendMetadata"):
        _extend(case, query, starts, metadata=("not", "metadata"))


def test_native_metadata_leaves_short_runs_out_of_the_groups():
    case = make_paged_case(LENS, 8, 2, 32)
    query, starts = extend_inputs(case, Q_LENS, 2 * GROUP)
    metadata = em.extend_metadata(
        case.block_tables, starts, case.context_lens, 8, GROUP, 2 * 32 * 4, torch.float32, 6
    )
    # Runs of up to 6 new tokens go native; a group never spans a native sequence.
    assert metadata.native_seqs.tolist() == [0, 1, 2, 4, 5, 7]
    assert [(g.row_start, g.row_end) for g in metadata.groups] == [(3, 10), (21, 33)]
    out = _extend(case, query, starts, backend="native", metadata=metadata)
    assert_close(out, extend_oracle(case, query, Q_LENS), torch.float32)
    # The torch path would skip the native sequences: it refuses such metadata.
    with pytest.raises(ValueError, match="native_max_query"):
        _extend(case, query, starts, metadata=metadata)
    # The native path takes torch metadata (every sequence grouped) and gives the same.
    _, _, _, torch_metadata = _case_and_metadata()
    again = _extend(case, query, starts, backend="native", metadata=torch_metadata)
    assert_close(again, out, torch.float32)
