"""The flash-decoding partition choice (pure arithmetic; the kernels are in triton_checks)."""

from __future__ import annotations

from kernels.decode_split import choose_partition

H200_SMS = 132


def test_few_long_sequences_are_split_to_fill_the_device():
    partition = choose_partition(H200_SMS, 1, 8, 16384, 64)
    assert partition == 512  # ~33 programs per sequence head: 32 partitions
    assert 16384 // partition * 8 >= H200_SMS


def test_a_full_batch_is_not_split():
    assert choose_partition(H200_SMS, 256, 8, 16384, 64) == 16384


def test_partitions_never_shorter_than_256_tokens_or_the_tile():
    assert choose_partition(H200_SMS, 1, 1, 1024, 64) == 256
    assert choose_partition(H200_SMS, 1, 1, 300, 512) == 512


def test_no_split_without_an_sm_count():
    assert choose_partition(None, 1, 1, 32768, 64) == 32768
