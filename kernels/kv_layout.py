"""The KV-cache memory layout: the one place it is defined.

Every tier (device and host) is a single tensor:

    pool: [num_blocks, num_layers + scale_layers, 2, block_size, num_kv_heads, head_dim]
            ^ block     ^ layer                    ^ 0 = K, 1 = V
                                                      ^ token offset inside the block

Why this order:
- A block is one contiguous chunk across all layers, so copy-on-write and
  tier swaps are plain block copies: ``dst_pool[d] = src_pool[s]``.
- Within a layer, one token's K (or V) for all KV heads is contiguous
  (``num_kv_heads * head_dim`` elements), so a KV write is one row per token.
- Kernels address a layer through the strided views from ``layer_views``;
  they take strides from the tensor and never assume the pool is dense
  per layer.

**KV dtypes.** A float pool (fp32, bf16, fp16: the model's dtype, or bf16 for an
fp32 model, ``CHATSVC_KV_DTYPE=bf16``: each value rounded to nearest even on its way
in, widened to fp32 as it is read) has no scale layers. An int8 pool
(``CHATSVC_KV_DTYPE=int8``) stores each (token, KV head) row of ``head_dim`` values as
int8 with one scale, symmetric (``kernels.kv_quant``):

    x ~ q * scale,  q = round-half-even(x / scale) in [-127, 127],
    scale = max|x| / 127 rounded *up* to bf16 (0 for a row of zeros)

The scales of a block live in the block itself, in ``scale_layers`` trailing
layer-sized slabs (``ceil(2 * num_layers / head_dim)``: one for SmolLM2's 30
layers of 64 dims), as bf16 laid out ``[num_layers, 2, block_size, H_kv]``:

    block b:  layer 0 .. L-1: int8 rows [2, block_size, H_kv, head_dim]
              layer L ..    : bf16 scales [L, 2, block_size, H_kv], then zeros

So **every whole-block operation moves a block's data and its scales together by
construction**: copy-on-write, swaps between tiers, the disk tier's block files
and the host tier all copy ``pool[b]``, which holds both; no path copies data
without scales or the other way round. ``layer_views`` gives the int8 rows of a
layer, ``scale_views`` their scales (``[num_blocks, block_size, H_kv]`` bf16),
``layer_kv`` both (the one helper the kernels and tests split a layer with).

Why per (token, head) and bf16: a token's scale is fixed when its row is written,
so its stored bits never depend on what else its block holds (issue 26's
invariance, and copy-on-write of a partial block stays a plain copy); per head, an
outlier channel of one head costs that head's row only. Two-byte scales in
trailing slabs keep a block within 1.94x of bf16's tokens per byte for SmolLM2
(fp32 scales, inline or not, give 1.88x), keep every int8 row a whole 64-byte
line, and keep blocks a multiple of 256 bytes. Rounding the scale up to bf16 means
``|x / scale| <= 127``: nothing is clipped, the grid is at most 0.8 % coarser.

A slot is ``block_id * block_size + offset`` (``-1`` = skip: padding).
Block sizes are powers of two so kernels split a slot with shifts and masks.
Block starts are 256-byte aligned: ``block_bytes`` is checked to be a multiple
of 256 in ``new_kv_pool`` (the pool's base pointer is allocator-aligned; a CPU
pool of 4 MiB or more starts on a 2 MiB huge page, ``huge_page_memory``).

Refcounts and all other metadata live in host memory (cache/), never here.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass
from typing import NamedTuple

import torch

BLOCK_ALIGN_BYTES = 256
# The huge page size; a CPU pool of two or more lies on them (``huge_page_memory``).
HUGE_PAGE_BYTES = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h
# The dtype of a quantized pool's data, and of its scales.
QUANT_DTYPE = torch.int8
SCALE_DTYPE = torch.bfloat16
# The names of the KV dtypes (EngineConfig.kv_dtype): "auto" is the model's dtype.
KV_DTYPES = ("auto", "bf16", "int8")


# What an int8 pool's rows and scales are and where they lie: part of the disk tier's
# fingerprint (chatsvc/engine/kv_disk/fingerprint.py); any change here must change it.
SCALE_LAYOUT = "int8 rows, bf16 scale per (token, head) rounded up, trailing [L,2,bs,H]"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> "bfloat16": how logs and statistics name a KV dtype."""
    return str(dtype).removeprefix("torch.")


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether a pool of this dtype holds int8 rows with scales (vs the float values)."""
    return dtype == QUANT_DTYPE


def kv_dtype_for(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool dtype a ``KV_DTYPES`` name means for a model computing in ``model_dtype``;
    ValueError where a pool of it cannot hold that model's K/V (``holds``)."""
    if name not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {name!r}")
    kv_dtype = {"auto": model_dtype, "bf16": torch.bfloat16, "int8": QUANT_DTYPE}[name]
    if not holds(kv_dtype, model_dtype):
        raise ValueError(f"a {name} KV cache holds an fp32 or bf16 model's K/V, not {model_dtype}")
    return kv_dtype


def holds(kv_dtype: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether a pool of ``kv_dtype`` can hold the K/V of a model computing in ``dtype``:
    its own dtype, int8 rows, or bf16 for fp32 (values rounded to nearest even)."""
    narrower = kv_dtype == torch.bfloat16 and dtype == torch.float32
    return kv_dtype in (dtype, QUANT_DTYPE) or narrower


def is_narrowed(kv_dtype: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether a pool of ``kv_dtype`` holds ``dtype``'s values in fewer bits (int8 rows, or
    bf16 for fp32): read only by the kernels that widen each key and value as they load
    it (the span tasks, the C attention, Triton's span kernel), never by the torch
    groups, which read caches of the query's dtype."""
    return kv_dtype != dtype


def scale_layers_for(num_layers: int, head_dim: int, dtype: torch.dtype) -> int:
    """Layer-sized slabs at the end of a block that hold its scales (0 for float pools):
    ``num_layers * 2 * block_size * H_kv`` bf16 in slabs of ``2 * block_size * H_kv *
    head_dim`` bytes."""
    if not is_quantized(dtype):
        return 0
    return -(-2 * num_layers // head_dim)


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")

    def pool_layers(self, dtype: torch.dtype) -> int:
        """The pool's layer axis: the model's layers plus the scale slabs."""
        return self.num_layers + scale_layers_for(self.num_layers, self.head_dim, dtype)

    def block_numel(self, dtype: torch.dtype | None = None) -> int:
        layers = self.num_layers if dtype is None else self.pool_layers(dtype)
        return layers * 2 * self.block_size * self.num_kv_heads * self.head_dim

    def block_bytes(self, dtype: torch.dtype) -> int:
        return self.block_numel(dtype) * torch.empty((), dtype=dtype).element_size()


def new_kv_pool(
    num_blocks: int,
    shape: KVShape,
    dtype: torch.dtype,
    device: torch.device | str,
    pin_memory: bool = False,
) -> torch.Tensor:
    """Allocate one tier: ``[num_blocks, L (+ scale layers), 2, block_size, H_kv, D]``, zeroed."""
    if num_blocks <= 0:
        raise ValueError(f"num_blocks must be positive, got {num_blocks}")
    nbytes = shape.block_bytes(dtype)
    if nbytes % BLOCK_ALIGN_BYTES:
        raise ValueError(
            f"a block is {nbytes} bytes, not a multiple of {BLOCK_ALIGN_BYTES}: "
            "choose a larger block_size"
        )
    dims = (
        num_blocks,
        shape.pool_layers(dtype),
        2,
        shape.block_size,
        shape.num_kv_heads,
        shape.head_dim,
    )
    pin = pin_memory and torch.device(device).type == "cpu" and torch.cuda.is_available()
    total = nbytes * num_blocks
    if torch.device(device).type == "cpu" and not pin and total >= 2 * HUGE_PAGE_BYTES:
        return huge_page_memory(total).view(dtype).view(dims)
    return torch.zeros(dims, dtype=dtype, device=device, pin_memory=pin)


def huge_page_memory(nbytes: int) -> torch.Tensor:
    """``nbytes`` of zeroed CPU memory (uint8) from a 2 MiB boundary, advised to Linux as
    huge pages (``madvise(MADV_HUGEPAGE)``, before the first touch): for the pool, and
    for a model's packed matrices (``kernels.weight_pages``).

    Decode attention reads a sequence's blocks in table order, and they lie anywhere in
    the pool: on 4 KiB pages each block of a layer costs TLB misses (its K rows, its V
    rows and an int8 pool's scale slab are pages of their own), and the loads wait on page
    walks. A default 1 GiB pool on 2 MiB pages fits the TLB (figures: docs/benchmarks.md,
    "int8 KV"). Where transparent huge pages are off or the system is not Linux, the
    advice does nothing and the memory is ordinary pages.
    """
    raw = torch.empty(nbytes + HUGE_PAGE_BYTES, dtype=torch.uint8)
    memory = raw[-raw.data_ptr() % HUGE_PAGE_BYTES :][:nbytes]  # a view: raw's storage lives on
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        whole_pages = nbytes - nbytes % HUGE_PAGE_BYTES
        libc.madvise(memory.data_ptr(), whole_pages, MADV_HUGEPAGE)  # advice: failure is harmless
    return memory.zero_()


def num_layers(pool: torch.Tensor) -> int:
    """The model layers a pool holds (its layer axis less the scale slabs)."""
    total, head_dim = pool.shape[1], pool.shape[5]
    for layers in range(total, 0, -1):
        if layers + scale_layers_for(layers, head_dim, pool.dtype) == total:
            return layers
    raise ValueError(f"a {pool.dtype} pool of {total} layer slabs holds no whole model")


def layer_views(pool: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches of one layer, each ``[num_blocks, block_size, H_kv, D]`` (strided
    views; int8 rows for an int8 pool, whose scales are ``scale_views``)."""
    if not 0 <= layer < num_layers(pool):
        raise ValueError(f"layer {layer} is outside the pool's {num_layers(pool)}")
    return pool[:, layer, 0], pool[:, layer, 1]


def scale_views(pool: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The scales of one layer's K and V rows of an int8 pool, each ``[num_blocks,
    block_size, H_kv]`` bf16 (strided views into the block's scale slabs)."""
    if not is_quantized(pool.dtype):
        raise ValueError(f"a {pool.dtype} pool has no scales")
    layers = num_layers(pool)
    if not 0 <= layer < layers:
        raise ValueError(f"layer {layer} is outside the pool's {layers}")
    n, _, _, block_size, heads, _ = pool.shape
    slabs = pool[:, layers:].reshape(n, -1).view(SCALE_DTYPE)
    scales = slabs[:, : layers * 2 * block_size * heads].view(n, layers, 2, block_size, heads)
    return scales[:, layer, 0], scales[:, layer, 1]


class KVScales(NamedTuple):
    """An int8 cache's row scales: K's and V's, each ``[N, block_size, H_kv]`` bf16."""

    k: torch.Tensor
    v: torch.Tensor


class LayerKV(NamedTuple):
    """One layer of a pool split into what the kernels read: K and V ``[N, bs, H_kv, D]``
    and, for an int8 pool, their scales (None for float pools)."""

    k: torch.Tensor
    v: torch.Tensor
    scales: KVScales | None


def layer_kv(pool: torch.Tensor, layer: int) -> LayerKV:
    """Layer ``layer`` of ``pool``: its K/V views and (int8 pools) their scale views."""
    k, v = layer_views(pool, layer)
    if not is_quantized(pool.dtype):
        return LayerKV(k, v, None)
    return LayerKV(k, v, KVScales(*scale_views(pool, layer)))
