"""fp32 linears over weights stored narrower (AVX2, AVX-512), ``kernels/cpu/narrow_linear.c``.

    out = x @ W^T (+ bias) (+ residual)      x [M, K] fp32, W [N, K] stored narrow, out fp32

On a CPU without native bf16 the model computes in fp32, and a decode step is bound by
reading the weights. Three storage formats:

    bf16   the weights rounded to bf16 (a bf16 checkpoint's own values: nothing lost),
           half the bytes of fp32
    int8   ``quantize_int8``: symmetric int8 with one fp32 scale per output row,
           a quarter of the bytes, summed against x quantized to int8 per group of
           ``ACTIVATION_GROUP`` (``quantize_rows``) by integer dot products, as
           llama.cpp's Q8 dot products do
    fp32   the weights as they are: for fp32 weights bf16 does not hold, the same fixed
           order of sums (``kernels.invariance``) as bf16

The kernel sums every output in one fixed order (bf16, fp32: each stored value widened
exactly; int8: exact integer sums per group, the groups in order), so a row's output
does not depend on the other rows of the step. The reference twin is
``narrow_linear_reference``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels.cpu import native
from kernels.validate import check_linear_inputs

FORMATS = {"bf16": 0, "int8": 1, "fp32": 2}  # narrow_linear.c: FORMAT_*
INT8_LEVELS = 127  # symmetric: -127..127, so a row's largest magnitude is stored exactly
# int8: x's values per scale (narrow_linear.h: GROUP). One scale per row cost 3.8 %
# perplexity (a row's outlier channels), 32 values 0.5 % (docs/benchmarks.md).
ACTIVATION_GROUP = 32


class NarrowWeight(NamedTuple):
    """A ``[N, K]`` weight packed in 16-column blocks; ``shape`` is the weight's own."""

    packed: torch.Tensor  # flat bf16, uint8 or fp32: chatsvc_narrow_linear_packed_elements
    scale: torch.Tensor | None  # [N] fp32 for int8, else None
    shape: tuple[int, int]
    format: str  # a key of FORMATS


def narrow_linear_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether a model of ``dtype`` may run its linears on ``narrow_linear``: fp32 or bf16
    (summed in fp32, see ``kernels.linear``) on a CPU whose native library has AVX2 + FMA."""
    if torch.device(device).type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    lib = native.library()
    return lib is not None and bool(lib.chatsvc_narrow_linear_available())


def _check_weight(weight: torch.Tensor) -> None:
    if weight.dim() != 2 or not weight.is_floating_point() or weight.device.type != "cpu":
        raise ValueError(
            f"weights to pack are 2-D floating CPU tensors, got {tuple(weight.shape)} "
            f"{weight.dtype} on {weight.device}"
        )


def pack_bf16_weight(weight: torch.Tensor) -> NarrowWeight:
    """``weight [N, K]`` (a floating CPU tensor) rounded to bf16 and packed."""
    _check_weight(weight)
    narrow = weight.to(torch.bfloat16).contiguous()
    lib = native.require()
    n, k = narrow.shape
    packed = torch.empty(
        lib.chatsvc_narrow_linear_packed_elements(n, k, FORMATS["bf16"]), dtype=torch.bfloat16
    )
    lib.chatsvc_narrow_linear_pack_bf16(
        narrow.data_ptr(), narrow.stride(0), n, k, packed.data_ptr()
    )
    return NarrowWeight(packed, None, (n, k), "bf16")


def pack_fp32_weight(weight: torch.Tensor) -> NarrowWeight:
    """``weight [N, K]`` (a floating CPU tensor) in fp32, packed."""
    _check_weight(weight)
    wide = weight.to(torch.float32).contiguous()
    lib = native.require()
    n, k = wide.shape
    packed = torch.empty(
        lib.chatsvc_narrow_linear_packed_elements(n, k, FORMATS["fp32"]), dtype=torch.float32
    )
    lib.chatsvc_narrow_linear_pack_f32(wide.data_ptr(), wide.stride(0), n, k, packed.data_ptr())
    return NarrowWeight(packed, None, (n, k), "fp32")


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` as int8 ``q`` and fp32 ``scale [N]``, ``weight ~ scale[:, None] * q``:
    each row's step is its largest magnitude / 127, values rounded to nearest (an all-zero
    row gets scale 0)."""
    w = weight.float()
    peak = w.abs().amax(dim=1) if w.shape[1] else w.new_zeros(w.shape[0])
    scale = peak / INT8_LEVELS
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / safe[:, None]).clamp(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)
    return q, scale.contiguous()


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` as int8 ``q [M, KP]`` and fp32 ``scale [M, KP / ACTIVATION_GROUP]``,
    KP = K padded with zeros to a multiple of the group: each group's step is its largest
    magnitude / 127, ``q = round(x / step)`` to nearest even (an all-zero group: step 0, q 0).
    The kernel's own quantization, bit for bit."""
    m, k = x.shape
    padded = -(-k // ACTIVATION_GROUP) * ACTIVATION_GROUP
    groups = F.pad(x.float(), (0, padded - k)).view(m, padded // ACTIVATION_GROUP, ACTIVATION_GROUP)
    step = groups.abs().amax(dim=2) / INT8_LEVELS
    safe = torch.where(step > 0, step, torch.ones_like(step))
    q = torch.round(groups / safe[:, :, None]).clamp(-INT8_LEVELS, INT8_LEVELS)
    return q.to(torch.int8).view(m, padded), step


def pack_int8_weight(weight: torch.Tensor) -> NarrowWeight:
    """``weight [N, K]`` (a floating CPU tensor) quantized by ``quantize_int8`` and packed."""
    _check_weight(weight)
    q, scale = quantize_int8(weight)
    lib = native.require()
    n, k = q.shape
    packed = torch.empty(
        lib.chatsvc_narrow_linear_packed_elements(n, k, FORMATS["int8"]), dtype=torch.uint8
    )
    lib.chatsvc_narrow_linear_pack_int8(q.data_ptr(), q.stride(0), n, k, packed.data_ptr())
    return NarrowWeight(packed, scale, (n, k), "int8")


def narrow_linear(
    x: torch.Tensor,
    weight: NarrowWeight,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    *,
    avx2_tiles: bool = False,
) -> torch.Tensor:
    """``x @ W^T (+ bias) (+ residual)`` as a new ``[M, N]`` fp32 tensor. The kernel runs
    its AVX-512 tiles where the build has them; ``avx2_tiles`` forces the AVX2 ones (the
    tests hold both to the same bits)."""
    check_linear_inputs(x, weight.shape, torch.float32, bias, residual)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    lib = native.require()
    status = lib.chatsvc_narrow_linear(
        x.data_ptr(),
        x.stride(0),
        x.shape[0],
        weight.packed.data_ptr(),
        FORMATS[weight.format],
        None if weight.scale is None else weight.scale.data_ptr(),
        weight.shape[0],
        weight.shape[1],
        None if bias is None else bias.data_ptr(),
        None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0),
        out.data_ptr(),
        out.stride(0),
        0 if avx2_tiles else 1,
        torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError(
            "the narrow-weight linear kernel did not run: a build without AVX2 and FMA, "
            "or no memory for its scratch"
        )
    return out


def narrow_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    format: str = "bf16",
) -> torch.Tensor:
    """The twin: the same sum through torch, in fp32, with the plain weight stored as
    ``format`` stores it."""
    if format in ("bf16", "fp32"):
        stored = weight.to(torch.bfloat16) if format == "bf16" else weight
        out = F.linear(x, stored.float(), bias)
    else:
        q, scale = quantize_int8(weight)
        xq, step = quantize_rows(x)
        padded = F.pad(q, (0, xq.shape[1] - q.shape[1])).double()
        groups = xq.shape[1] // ACTIVATION_GROUP
        # Each group's integer sums (exact in float64), scaled by the group's step.
        sums = torch.einsum(
            "mgk,ngk->mgn",
            xq.double().view(x.shape[0], groups, ACTIVATION_GROUP),
            padded.view(q.shape[0], groups, ACTIVATION_GROUP),
        )
        out = ((sums * step.double()[:, :, None]).sum(dim=1) * scale.double()).float()
        if bias is not None:
            out = out + bias
    return out if residual is None else out + residual
