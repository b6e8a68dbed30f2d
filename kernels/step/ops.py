"""A forward step's kernels, bound once for all of its layers: the interface and its checks.

Every layer of a step calls the same kernels on tensors of the same shapes with the
same index tensors; only the layer's slice of the pool and the data differ. So
``kernels.step.bind.bind_step`` checks the step once and binds one ``StepOps`` of the
backend ``kernels.backend.choose_kernels`` picks (``native_step``, ``torch_step``,
``triton_step`` here), built with that backend's per-step metadata; each
layer then calls:

    rms_norm(x, weight)   rope_(qk, cos, sin)   swiglu(gate_up)
    write_kv(layer, k, v)                       attention(layer, q)

or, where the backend runs a model's whole layer loop itself (the native one, for
matrices in a native linear's layout), the model calls ``decoder_layers`` once instead.

Contract with the caller (the model): the batch's value ranges (slots, block ids,
context lengths) were checked against the pool, and per layer it passes tensors of
the shapes the step was bound for: ``x`` / ``gate_up`` 2-D, ``query`` / ``key`` /
``value`` 3-D with unit stride on the last axis, in the step's dtype (the pool's, or the
model's over a narrower pool: ``StepDims.dtype``). Each call
checks row counts and layer ids, which keep a wrong call from addressing memory
outside its tensors through the step's index tensors.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from kernels.kv_layout import LayerKV, holds, layer_kv, layer_views, num_layers
from kernels.validate import check_index


class StepBatch(Protocol):
    """What a step's kernels read of its batch (``chatsvc.engine.ForwardBatch`` has it)."""

    slot_mapping: torch.Tensor  # [T] int64, -1 = skip
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    context_lens: torch.Tensor  # [B] int32, each sequence's tokens including its new ones
    is_decode: bool  # every sequence has one new token
    max_query_len: int


class StepDims(NamedTuple):
    """The model's sizes a step's kernels need besides the pool's."""

    num_q_heads: int
    scale: float  # the attention's softmax scale
    eps: float  # RMSNorm's
    # What the model computes in: the pool's dtype, unless the pool holds int8 KV or
    # bf16 KV of an fp32 model (kernels/kv_layout.py). None: the pool's.
    dtype: torch.dtype | None = None


class StepOps:
    """One step's kernels on one backend; the checks all of them share.

    Subclasses implement the five operations (see the module docstring).
    """

    backend = ""  # the backend's name, as kernels.backend.choose_kernels gives it

    def __init__(self, batch: StepBatch, kv_pool: torch.Tensor, dims: StepDims) -> None:
        if kv_pool.dim() != 6 or kv_pool.shape[2] != 2 or kv_pool.stride(5) != 1:
            raise ValueError("kv_pool must be [N, L, 2, block_size, H_kv, D], unit stride on D")
        dtype = dims.dtype or kv_pool.dtype
        if not holds(kv_pool.dtype, dtype):
            raise ValueError(f"a {dtype} step over a {kv_pool.dtype} pool")
        num_kv_heads, head_dim = kv_pool.shape[4], kv_pool.shape[5]
        if dims.num_q_heads % num_kv_heads:
            raise ValueError(
                f"H_q ({dims.num_q_heads}) must be a multiple of H_kv ({num_kv_heads})"
            )
        for name in ("slot_mapping", "query_start_loc", "context_lens"):
            check_index(name, getattr(batch, name), 1, kv_pool.device)
        check_index("block_tables", batch.block_tables, 2, kv_pool.device)
        num_seqs = batch.context_lens.shape[0]
        starts, tables = batch.query_start_loc, batch.block_tables
        if starts.shape[0] != num_seqs + 1 or tables.shape[0] != num_seqs:
            raise ValueError("query_start_loc must be [B + 1] and block_tables [B, n]")
        self.batch = batch
        self.kv_pool = kv_pool
        self.dtype = dtype
        self.num_layers = num_layers(kv_pool)
        self.num_tokens = batch.slot_mapping.shape[0]
        self.query_shape = (self.num_tokens, dims.num_q_heads, head_dim)
        self.kv_shape = (self.num_tokens, num_kv_heads, head_dim)
        self.scale = dims.scale
        self.eps = dims.eps

    def check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} is outside the pool's {self.num_layers}")

    def layer_caches(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V caches, ``[N, block_size, H_kv, D]`` views."""
        self.check_layer(layer)
        return layer_views(self.kv_pool, layer)

    def layer_kv(self, layer: int) -> LayerKV:
        """Layer ``layer``'s K and V caches with their scales (an int8 pool's)."""
        self.check_layer(layer)
        return layer_kv(self.kv_pool, layer)

    def check_rows(self, x: torch.Tensor, name: str) -> None:
        if x.shape[0] != self.num_tokens:
            raise ValueError(f"{name} of a {self.num_tokens}-token step got {x.shape[0]} rows")

    def check_query(self, query: torch.Tensor) -> None:
        if query.dtype != self.dtype:
            raise ValueError(f"attention of a {self.dtype} step got a {query.dtype} query")
        if query.shape != self.query_shape:
            raise ValueError(
                f"attention of a {self.num_tokens}-token step got {tuple(query.shape)}"
            )

    def check_kv(self, key: torch.Tensor, value: torch.Tensor) -> None:
        if key.dtype != self.dtype or value.dtype != self.dtype:
            raise ValueError(f"write_kv of a {self.dtype} step got {key.dtype} rows")
        if key.shape != self.kv_shape or value.shape != self.kv_shape:
            raise ValueError(f"write_kv of a {self.num_tokens}-token step got {tuple(key.shape)}")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm of ``x [rows, hidden]`` (any rows: the model's last tokens too)."""
        raise NotImplementedError

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate ``x [T, H, D]`` (q and k of a fused projection) in place."""
        raise NotImplementedError

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``gate_up [T, 2 * I]``."""
        raise NotImplementedError

    def write_kv(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store the step's ``key`` / ``value`` ``[T, H_kv, D]`` into layer ``layer``'s slots."""
        raise NotImplementedError

    def attention(self, layer: int, query: torch.Tensor) -> torch.Tensor:
        """Paged attention of the step's ``query [T, H_q, D]`` over layer ``layer``'s cache."""
        raise NotImplementedError

    def decoder_layers(
        self, weights: object, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor | None:
        """Every layer of the step in one call, where this backend can: ``h [T, hidden]``
        (the embeddings) becomes the last layer's output, in place, and is returned; the
        KV writes are the layer loop's. None where it cannot (then nothing changed and the
        model runs its layers one call at a time). ``weights``: the backend's own form of
        the model's layers (``kernels.cpu.decoder.decoder_weights`` for the native one)."""
        return None
