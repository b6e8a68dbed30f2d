"""Our own Llama-family forward pass over a flat batch of tokens from many sequences.

Per layer (T new tokens, shapes in comments):

    x   = rms_norm(h)                          [T, hidden]
    qkv = x @ Wqkv^T (+ b)                     [T, q_size + 2 * kv_size]   one matmul
    rope(q, k) in place ; write_kv(k, v) into the paged cache
    o   = paged attention(q, cache)            [T, H_q, D]
    h   = h + o @ Wo^T                         addmm: residual add fused
    h   = h + swiglu(rms_norm(h) @ Wgu^T) @ Wd^T

The attention, the KV write and the element-wise layers are the step's kernels,
bound once per step (``kernels.step.bind.bind_step``: which backend and which kernel
runs is decided there); the linears are the weight layout's (``kernels.linear``).
Where the step's backend can run the whole loop itself (the native one, for matrices
in a native linear's layout: ``kernels.cpu.decoder``), it does, in one call and to the
same bits.
K and V are read and written only through those kernels. Logits are computed only for
each sequence's last new token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from chatsvc.engine.forward_batch import ForwardBatch
from chatsvc.engine.layers import RotaryTables
from chatsvc.engine.model_config import ModelConfig
from chatsvc.engine.weights import ModelWeights
from kernels.cpu.decoder import LayerWeights, decoder_weights
from kernels.kv_layout import KVShape, holds, scale_layers_for
from kernels.linear import LINEARS, choose_layout, exact_in_bf16
from kernels.step.bind import StepDims, StepOps, bind_step
from kernels.weight_pages import on_huge_pages


class LlamaModel:
    """Llama / Mistral / Qwen2 decoder with fused projections, serving from a paged KV pool.

    Not an ``nn.Module``: weights are plain tensors so the per-layer loop pays no module
    attribute lookups, and there is nothing to train.
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        max_positions: int | None = None,
        check_bounds: bool = True,
        prepack_weights: bool | str | None = None,
        weight_dtype: str | None = None,
        invariant: bool = True,
    ) -> None:
        """check_bounds: validate each step's slots and block ids against the pool once per
        step (reads the index tensors: a host sync on CUDA; a trusted runner may turn it off).

        prepack_weights: store the matrices in a layout made for the CPU's matrix code
        (``kernels.linear.WEIGHT_LAYOUTS``): ``"tiles"`` for ``kernels.cpu.tile_linear``
        (bf16 with AMX and the native kernels); ``"bf16_blocks"`` and ``"int8_blocks"`` for
        ``kernels.cpu.narrow_linear`` (an fp32 model reading bf16- or int8-stored weights,
        AVX2 and the native kernels; bf16 is a default only where the weights are exact in
        bf16); ``"onednn"`` for torch's oneDNN linears. True or None = the first of those
        available here (None: plain where none is), False = plain. The plain matrices in
        ``weights.layers`` are replaced by the packed ones, which still report their
        ``[out, in]`` shape.

        weight_dtype: what an fp32 model stores its matrices in (``kernels.linear.choose_layout``:
        None = bf16 where that loses nothing, "bf16", "int8", "fp32").

        invariant: every step's kernels keep a token's values independent of the rest of
        the step (``kernels.invariance``); False: the fastest kernels for each step.
        """
        if len(weights.layers) != config.num_layers:
            raise ValueError(
                f"config has {config.num_layers} layers, weights have {len(weights.layers)}"
            )
        self.config = config
        self.weights = weights
        self.dtype = weights.embed.dtype
        self.device = weights.embed.device
        self.max_positions = max_positions or config.max_context_len
        self.rope = RotaryTables(config, self.max_positions, self.dtype, self.device)
        self.scale = config.head_dim**-0.5
        self.check_bounds = check_bounds
        self.invariant = invariant
        self.step_dims = StepDims(config.num_heads, self.scale, config.rms_norm_eps, self.dtype)
        self.weight_layout = choose_layout(
            prepack_weights,
            self.device,
            self.dtype,
            weight_dtype,
            lambda: exact_in_bf16(_matrices(weights)),
            invariant,
        )
        self.linears = LINEARS[self.weight_layout]
        self.prepacked = self.weight_layout not in ("plain", "chunked", "triton")
        # Every layout packs (plain and triton keep the matrices as loaded, chunked bf16
        # stores them column by column where that pays).
        pack = self.linears.pack
        for layer in weights.layers:
            layer.qkv_weight = pack(layer.qkv_weight)
            layer.o_weight = pack(layer.o_weight)
            layer.gate_up_weight = pack(layer.gate_up_weight)
            layer.down_weight = pack(layer.down_weight)
        # The embedding stays plain for lookups; a tied head gets its own packed copy.
        self._lm_head = pack(weights.lm_head)
        self._settle_on_huge_pages(weights)
        # The layers as the native step's one-call loop reads them (None: it cannot).
        self.native_layers = decoder_weights(
            [
                LayerWeights(
                    layer.input_norm,
                    layer.post_norm,
                    layer.qkv_weight,
                    layer.qkv_bias,
                    layer.o_weight,
                    layer.gate_up_weight,
                    layer.down_weight,
                )
                for layer in weights.layers
            ]
        )

    def _settle_on_huge_pages(self, weights: ModelWeights) -> None:
        """The packed matrices into one huge-page region in the order a step reads them
        (``kernels.weight_pages``)."""
        names = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")
        matrices = [getattr(layer, name) for layer in weights.layers for name in names]
        placed = iter(on_huge_pages([*matrices, self._lm_head]))
        for layer in weights.layers:
            for name in names:
                setattr(layer, name, next(placed))
        self._lm_head = next(placed)

    def kv_shape(self, block_size: int) -> KVShape:
        """The KV pool shape this model needs for a given block size (a pool of it holds
        K/V in the model's dtype, int8, or bf16 for fp32: ``kernels.kv_layout``)."""
        c = self.config
        return KVShape(c.num_layers, block_size, c.num_kv_heads, c.head_dim)

    def _check(self, batch: ForwardBatch, kv_pool: torch.Tensor) -> None:
        c = self.config
        if not holds(kv_pool.dtype, self.dtype) or kv_pool.device != self.device:
            raise ValueError(
                f"kv_pool is {kv_pool.dtype} on {kv_pool.device}; the model is {self.dtype} "
                f"on {self.device} (KV in that dtype, int8, or bf16 for fp32)"
            )
        layers = c.num_layers + scale_layers_for(c.num_layers, c.head_dim, kv_pool.dtype)
        if kv_pool.dim() != 6 or tuple(kv_pool.shape[1:3]) != (layers, 2):
            raise ValueError(f"kv_pool must be [N, {layers}, 2, bs, H_kv, D]")
        if tuple(kv_pool.shape[4:]) != (c.num_kv_heads, c.head_dim):
            raise ValueError(
                f"kv_pool heads/dim {tuple(kv_pool.shape[4:])} != ({c.num_kv_heads}, {c.head_dim})"
            )
        self._check_bounds(batch, kv_pool.shape[0], kv_pool.shape[3])
        if batch.max_context_len > self.max_positions:
            raise ValueError(
                f"a sequence reaches {batch.max_context_len} tokens; "
                f"the model serves at most {self.max_positions}"
            )

    def _check_bounds(self, batch: ForwardBatch, num_blocks: int, block_size: int) -> None:
        # Once per step here, so the kernels can skip their per-layer value checks.
        if not self.check_bounds:
            return
        if _outside(batch.slot_mapping, -1, num_blocks * block_size):
            raise ValueError(f"slot_mapping has slots outside [-1, {num_blocks * block_size})")
        if batch.block_tables.shape[1] * block_size < batch.max_context_len:
            raise ValueError("block_tables are too narrow for the longest context")
        if _outside(batch.block_tables, 0, num_blocks):
            raise ValueError(f"block_tables hold block ids outside [0, {num_blocks})")

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_pool: torch.Tensor) -> torch.Tensor:
        """Run one step; returns fp32 logits ``[B, vocab]`` of each sequence's last new token.

        Writes this step's K/V into ``kv_pool`` at ``batch.slot_mapping``; nothing else
        changes. Raises ValueError when the pool does not fit the model.
        """
        self._check(batch, kv_pool)
        w = self.weights
        cos, sin = self.rope.lookup(batch.positions)  # [T, 1, D]
        # The only way to the kernels: bound once for all layers, backend chosen there.
        ops = bind_step(batch, kv_pool, self.step_dims, invariant=self.invariant)
        h = F.embedding(batch.input_ids, w.embed)  # [T, hidden]
        done = ops.decoder_layers(self.native_layers, h, cos, sin)
        h = self._layers(ops, h, cos, sin) if done is None else done
        last = h.index_select(0, batch.logits_indices)  # [B, hidden]
        last = ops.rms_norm(last, w.final_norm)
        return self.linears.linear(last, self._lm_head).float()  # [B, vocab]

    def _layers(
        self, ops: StepOps, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """The layer loop, one kernel call at a time."""
        c = self.config
        num_tokens = h.shape[0]
        q_size, kv_size = c.q_size, c.kv_size
        heads_qk = c.num_heads + c.num_kv_heads
        mm, mm_add = self.linears.linear, self.linears.linear_add
        for layer_id, layer in enumerate(self.weights.layers):
            x = ops.rms_norm(h, layer.input_norm)
            qkv = mm(x, layer.qkv_weight, layer.qkv_bias)  # [T, q + 2kv]
            qk = qkv[:, : q_size + kv_size].view(num_tokens, heads_qk, c.head_dim)
            ops.rope_(qk, cos, sin)
            q = qk[:, : c.num_heads]  # [T, H_q, D]
            k = qk[:, c.num_heads :]  # [T, H_kv, D]
            v = qkv[:, q_size + kv_size :].view(num_tokens, c.num_kv_heads, c.head_dim)
            ops.write_kv(layer_id, k, v)
            o = ops.attention(layer_id, q)  # [T, H_q, D]
            h = mm_add(o.reshape(num_tokens, q_size), layer.o_weight, h)
            x = ops.rms_norm(h, layer.post_norm)
            act = ops.swiglu(mm(x, layer.gate_up_weight))  # [T, I]
            h = mm_add(act, layer.down_weight, h)
        return h

    __call__ = forward


def _outside(values: torch.Tensor, low: int, stop: int) -> bool:
    """Whether any of ``values`` lies outside [low, stop): one pass for both bounds (as
    element-wise compares, an or and an any, a decode step's checks took longer than
    its embedding)."""
    if values.numel() == 0:
        return False
    lowest, highest = torch.aminmax(values)
    return int(lowest) < low or int(highest) >= stop


def _matrices(weights: ModelWeights):
    for layer in weights.layers:
        yield from (layer.qkv_weight, layer.o_weight, layer.gate_up_weight, layer.down_weight)
    yield weights.lm_head
