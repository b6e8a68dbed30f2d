"""Shared fixtures for engine tests: the default model loaded once (fp32), and a tiny
paged-KV driver that feeds our forward pass without the scheduler."""

from __future__ import annotations

import random

import pytest
import torch

from chatsvc.engine.forward_batch import ForwardBatch
from chatsvc.engine.llama import LlamaModel
from chatsvc.engine.loader import LoadedModel, load_model
from kernels.kv_layout import new_kv_pool


@pytest.fixture(scope="session")
def smollm2_fp32() -> LoadedModel:
    """SmolLM2-135M-Instruct in fp32 on CPU (converted from the GGUF on first use)."""
    return load_model("smollm2", dtype="fp32")


@pytest.fixture(scope="session")
def smollm2_hf_fp32(smollm2_fp32: LoadedModel):
    """transformers' own LlamaForCausalLM on the same cached safetensors directory."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(
        str(smollm2_fp32.path), dtype=torch.float32, local_files_only=True
    )
    return model.eval()


class PagedDriver:
    """Runs sequences through ``LlamaModel.forward`` over a paged pool whose blocks are
    handed out in a shuffled order, so every block table is non-contiguous."""

    def __init__(
        self,
        model: LlamaModel,
        num_blocks: int = 64,
        block_size: int = 16,
        seed=0,
        kv_dtype: torch.dtype | None = None,
    ):
        self.model = model
        self.block_size = block_size
        shape, dtype = model.kv_shape(block_size), kv_dtype or model.dtype
        self.pool = new_kv_pool(num_blocks, shape, dtype, model.device)
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.tables: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}

    def step(self, new_tokens: dict[str, list[int]]) -> torch.Tensor:
        """Feed each sequence its new tokens in one batch; logits ``[B, vocab]`` in key order."""
        ids, done, slots, tables = [], [], [], []
        for seq, tokens in new_tokens.items():
            table = self.tables.setdefault(seq, [])
            start = self.lengths.get(seq, 0)
            end = start + len(tokens)
            while len(table) * self.block_size < end:
                table.append(self.free_blocks.pop())
            slots.append(
                [
                    table[p // self.block_size] * self.block_size + p % self.block_size
                    for p in range(start, end)
                ]
            )
            ids.append(tokens)
            done.append(start)
            tables.append(table)
            self.lengths[seq] = end
        batch = ForwardBatch.from_lists(ids, done, slots, tables, self.block_size)
        return self.model.forward(batch, self.pool)


@pytest.fixture
def paged_driver():
    """Factory: ``paged_driver(model, num_blocks=64, block_size=16, seed=0, kv_dtype=None)``
    (None: KV in the model's dtype)."""
    return PagedDriver
