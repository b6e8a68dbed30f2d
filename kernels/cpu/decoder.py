"""A step's decoder layers in one C call (``kernels/cpu/decoder.c``): the layer loop of
a model whose matrices are all in one native linear's layout, run by the native step
(``kernels.step.native_step.NativeStep.decoder_layers``): an fp32 model over narrow
blocks (``kernels.cpu.narrow_linear``), a bf16 model over dot pairs
(``kernels.cpu.pair_linear``) or tiles (``kernels.cpu.tile_linear``).

The C loop calls the kernels the model's Python loop calls, in its order, with its
arguments: the results are the same bits (tests/kernels/test_decoder.py). It exists
for the loop's own cost, which at a decode token of a small model outweighs the
kernels: ten ctypes calls a layer, each with its checks and output tensor.

    weights = decoder_weights(layers)        # once per model: None where it cannot run
    ops.decoder_layers(weights, h, cos, sin) # once per step: None where the step cannot

The structures below mirror decoder.c's field for field; ``check_sizes`` holds them to
the compiled ones.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import NamedTuple

import torch

from kernels.cpu import native
from kernels.cpu.narrow_linear import FORMATS, NarrowWeight
from kernels.cpu.pair_linear import PairWeight
from kernels.cpu.tile_linear import TileWeight

_i64, _i32, _f32, _ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p

# decoder.c's LINEAR_*: each packed weight type, the linear it runs on, and the dtype
# of a model whose matrices these are (the rows, norms and biases).
LINEAR_KINDS = {NarrowWeight: 0, PairWeight: 1, TileWeight: 2}
STEP_DTYPES = {NarrowWeight: torch.float32, PairWeight: torch.bfloat16, TileWeight: torch.bfloat16}


class DecoderMatrix(ctypes.Structure):
    _fields_ = [
        ("packed", _ptr),
        ("scale", _ptr),
        ("bias", _ptr),
        ("n", _i64),
        ("k", _i64),
        ("kind", _i32),
        ("format", _i32),
    ]


class DecoderLayer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _ptr),
        ("post_norm", _ptr),
        ("qkv", DecoderMatrix),
        ("o", DecoderMatrix),
        ("gate_up", DecoderMatrix),
        ("down", DecoderMatrix),
    ]


class DecoderStep(ctypes.Structure):
    _fields_ = [
        ("layers", _ptr),
        *((name, _i64) for name in ("num_layers", "hidden", "num_q_heads", "num_kv_heads")),
        ("head_dim", _i64),
        ("intermediate", _i64),
        ("eps", _f32),
        ("scale_log2", _f32),
        ("dtype", _i32),
        ("kv", _ptr),
        *((name, _i64) for name in ("layer_bytes", "v_bytes", "kv_stride_block")),
        *((name, _i64) for name in ("kv_stride_slot", "kv_stride_head", "block_size")),
        ("kv_dtype", _i32),
        ("scales", _ptr),
        *((name, _i64) for name in ("scale_layer_bytes", "v_scale_bytes")),
        *((name, _i64) for name in ("scale_stride_block", "scale_stride_slot")),
        ("scale_stride_head", _i64),
        ("tokens", _i64),
        ("cos", _ptr),
        ("sin", _ptr),
        ("slots", _ptr),
        ("block_tables", _ptr),
        ("table_stride", _i64),
        ("query_start", _ptr),
        ("context_lens", _ptr),
        ("seqs", _ptr),
        *((name, _i32) for name in ("num_seqs", "q_tile", "span", "num_threads")),
        *((name, _ptr) for name in ("h", "h2", "x", "qkv", "o", "gate_up", "act")),
    ]


class LayerWeights(NamedTuple):
    """One decoder layer's tensors as the model holds them."""

    input_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    qkv: object  # [q + 2 kv, hidden], a packed weight of LINEAR_KINDS (or not: no call)
    qkv_bias: torch.Tensor | None  # [q + 2 kv]
    o: object  # [hidden, q]
    gate_up: object  # [2 I, hidden]
    down: object  # [hidden, I]


class DecoderWeights(NamedTuple):
    """A model's layers as decoder.c reads them: the C array, and the tensors it points
    into (kept alive with it)."""

    array: ctypes.Array
    tensors: tuple
    dtype: torch.dtype  # of the step: its rows, the norms and biases
    hidden: int
    intermediate: int
    qkv_rows: int

    @property
    def num_layers(self) -> int:
        return len(self.array)


def _matrix(weight, bias: torch.Tensor | None = None) -> DecoderMatrix:
    n, k = weight.shape
    narrow = isinstance(weight, NarrowWeight)
    return DecoderMatrix(
        weight.packed.data_ptr(),
        weight.scale.data_ptr() if narrow and weight.scale is not None else None,
        None if bias is None else bias.data_ptr(),
        n,
        k,
        LINEAR_KINDS[type(weight)],
        FORMATS[weight.format] if narrow else 0,
    )


def _vector(t: torch.Tensor | None, size: int, dtype: torch.dtype) -> bool:
    return t is None or (
        t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
        and tuple(t.shape) == (size,)
    )  # fmt: skip


def decoder_weights(layers: Sequence[LayerWeights]) -> DecoderWeights | None:
    """The layers packed for ``chatsvc_decoder_layers``; None where they cannot run there:
    matrices not all of one type of ``LINEAR_KINDS``, norms or biases that are not
    contiguous CPU vectors of that type's ``STEP_DTYPES`` (a bf16 model over narrow
    blocks, whose linears widen their rows first), or shapes that do not chain."""
    if not layers:
        return None
    first = layers[0]
    kind = type(first.qkv)
    if kind not in LINEAR_KINDS:
        return None
    dtype = STEP_DTYPES[kind]
    hidden, qkv_rows = first.qkv.shape[1], first.qkv.shape[0]
    intermediate = first.gate_up.shape[0] // 2
    kept = []
    for layer in layers:
        matrices = (layer.qkv, layer.o, layer.gate_up, layer.down)
        if not all(type(m) is kind for m in matrices):
            return None
        shapes = tuple(m.shape for m in matrices)
        if shapes[0] != (qkv_rows, hidden) or shapes[2] != (2 * intermediate, hidden):
            return None
        if shapes[3] != (hidden, intermediate) or shapes[1][0] != hidden:
            return None
        vectors = ((layer.input_norm, hidden), (layer.post_norm, hidden))
        if not all(_vector(t, n, dtype) for t, n in (*vectors, (layer.qkv_bias, qkv_rows))):
            return None
        kept.extend(layer)
    check_sizes(native.require())
    array = (DecoderLayer * len(layers))(
        *(
            DecoderLayer(
                layer.input_norm.data_ptr(),
                layer.post_norm.data_ptr(),
                _matrix(layer.qkv, layer.qkv_bias),
                _matrix(layer.o),
                _matrix(layer.gate_up),
                _matrix(layer.down),
            )
            for layer in layers
        )
    )
    return DecoderWeights(array, tuple(kept), dtype, hidden, intermediate, qkv_rows)


def check_sizes(lib: ctypes.CDLL) -> None:
    """RuntimeError unless the structures here have the compiled ones' sizes."""
    step, layer = ctypes.c_int64(), ctypes.c_int64()
    lib.chatsvc_decoder_sizes(ctypes.addressof(step), ctypes.addressof(layer))
    ours = (ctypes.sizeof(DecoderStep), ctypes.sizeof(DecoderLayer))
    if ours != (step.value, layer.value):
        raise RuntimeError(
            f"kernels/cpu/decoder.py's structures ({ours}) do not match decoder.c's "
            f"({step.value}, {layer.value})"
        )


# The step's rows besides h (in its dtype), in DecoderStep's names.
ROWS = ("h2", "x", "qkv", "o", "gate_up", "act")


def scratch(weights: DecoderWeights, tokens: int, q_size: int) -> tuple[torch.Tensor, ...]:
    """The step's ``ROWS`` in its dtype, carved from one tensor."""
    sizes = (
        weights.hidden,
        weights.hidden,
        weights.qkv_rows,
        q_size,
        2 * weights.intermediate,
        weights.intermediate,
    )
    flat = torch.empty(tokens * sum(sizes), dtype=weights.dtype)
    return tuple(
        part.view(tokens, size)
        for part, size in zip(flat.split([tokens * s for s in sizes]), sizes, strict=True)
    )


def run(lib: ctypes.CDLL, step: DecoderStep) -> None:
    """One ``chatsvc_decoder_layers`` call; MemoryError where a kernel found no scratch."""
    status = lib.chatsvc_decoder_layers(ctypes.addressof(step))
    if status == -1:
        raise MemoryError("the native attention kernel could not allocate its scratch memory")
    if status != 0:
        raise RuntimeError("a linear did not run: no memory for its scratch, or no tile unit")
