"""ForwardBatch.from_lists: the flat layout of a step and its validation."""

from __future__ import annotations

import pytest
import torch

from chatsvc.engine.forward_batch import ForwardBatch


def test_mixed_batch_layout():
    # seq 0: 3 cached tokens + 1 decode token; seq 1: fresh prompt of 3 tokens.
    batch = ForwardBatch.from_lists(
        token_ids=[[9], [4, 5, 6]],
        num_computed=[3, 0],
        slot_mappings=[[35], [16, 17, 18]],
        block_tables=[[2, 8], [1]],
        block_size=16,
    )
    assert batch.input_ids.tolist() == [9, 4, 5, 6]
    assert batch.positions.tolist() == [3, 0, 1, 2]
    assert batch.slot_mapping.tolist() == [35, 16, 17, 18]
    assert batch.query_start_loc.tolist() == [0, 1, 4]
    assert batch.context_lens.tolist() == [4, 3]
    assert batch.block_tables.tolist() == [[2, 8], [1, 0]]  # padded with block 0
    assert batch.logits_indices.tolist() == [0, 3]
    assert not batch.is_decode
    assert (batch.max_query_len, batch.max_context_len) == (3, 4)
    assert (batch.num_tokens, batch.num_seqs) == (4, 2)
    dtypes = [
        batch.input_ids.dtype,
        batch.positions.dtype,
        batch.slot_mapping.dtype,
        batch.logits_indices.dtype,
    ]
    assert dtypes == [torch.int64] * 4
    assert batch.query_start_loc.dtype == batch.context_lens.dtype == torch.int32
    assert batch.block_tables.dtype == torch.int32


def test_all_single_tokens_is_decode():
    batch = ForwardBatch.from_lists([[1], [2]], [5, 0], [[5], [16]], [[0], [1]], block_size=16)
    assert batch.is_decode
    assert batch.logits_indices.tolist() == [0, 1]


@pytest.mark.parametrize(
    "args,message",
    [
        (([], [], [], []), "at least one sequence"),
        (([[1]], [0, 0], [[0]], [[0]]), "one entry per sequence"),
        (([[]], [0], [[]], [[0]]), "no new tokens"),
        (([[1, 2]], [0], [[0]], [[0]]), "2 new tokens but 1 slots"),
        (([[1]], [-1], [[0]], [[0]]), "num_computed"),
        (([[1] * 5], [12], [[0] * 5], [[0]]), "cannot hold 17 tokens"),
    ],
)
def test_inconsistent_input_raises(args, message):
    with pytest.raises(ValueError, match=message):
        ForwardBatch.from_lists(*args, block_size=16)
