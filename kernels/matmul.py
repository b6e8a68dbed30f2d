"""A linear layer's matmul in Triton whose rows do not depend on how many there are.

    matmul(x, weight, bias=None, residual=None) -> residual + x @ weight^T + bias

``x [M, K]``, ``weight [N, K]`` (the layer's ``[out, in]`` matrix as loaded), ``bias [N]``,
``residual [M, N]``, one dtype (fp32, bf16 or fp16) on one device; returns ``[M, N]`` in
that dtype. cuBLAS picks its kernel, tiles and split-K by the shape, so one token's
output row changed with the step's row count M (the same held for torch's CPU
products). Here every program has one shape, whatever M:

    grid = (ceil(M / BLOCK_M), ceil(N / BLOCK_N))
    program (i, j): out[i-th BLOCK_M rows, j-th BLOCK_N columns]
        acc = 0 (fp32);  for k0 in 0, BLOCK_K, 2 BLOCK_K, ... < K (in order, no split-K):
            acc += x[rows, k0:k0+BLOCK_K] . weight[cols, k0:k0+BLOCK_K]^T
        out = (acc + bias) + residual, added in fp32, rounded once

A row's sums are the same sequence of ``tl.dot`` steps in any launch: the tile shapes are
constexprs fixed per device kind, K is walked in one order, and ``tl.dot`` computes each
output row from its own input row (the rows beside it, masked ones included, never enter
it). ``matmul_torch`` is the reference twin (fp32 products, the tolerances of
tests/kernels/kernel_cases.py); ``check_matmul`` validates the inputs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.triton_compat import dot_dtype, runnable, tl, triton

MATMUL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class MatmulTiles(NamedTuple):
    """A program's tile and the launch's warps and stages."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Every program on CUDA has this shape, whatever M (docs/kernels.md, "Invariance", for the
# H200 figures); under the interpreter, which runs numpy, a smaller one.
CUDA_TILES = MatmulTiles(128, 128, 64, 8, 3)
INTERPRETED_TILES = MatmulTiles(16, 16, 16, 1, 1)


def matmul_tiles(device: torch.device) -> MatmulTiles:
    """The program shape on ``device``: fixed per device kind, never chosen by the shape."""
    return CUDA_TILES if device.type == "cuda" else INTERPRETED_TILES


@triton.jit
def matmul_kernel(
    x_ptr,
    weight_ptr,
    bias_ptr,
    residual_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_rm,
    stride_om,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    depth = tl.arange(0, BLOCK_K)
    row_mask = rows < M
    col_mask = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_rows = weight_ptr + cols.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + depth) < K
        x = tl.load(
            x_rows + (k0 + depth)[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0
        )
        w = tl.load(
            w_rows + (k0 + depth)[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0
        )
        acc += tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    if HAS_RESIDUAL:
        residual = residual_ptr + rows.to(tl.int64)[:, None] * stride_rm + cols[None, :]
        acc += tl.load(residual, mask=mask, other=0.0).to(tl.float32)
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def check_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> None:
    """Raise ``ValueError`` unless the operands fit (see the module docstring): 2-D ``x``
    and ``weight`` with unit stride along K, ``bias`` / ``residual`` of the output's
    width (unit stride along N), one dtype and one device."""
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"x must be [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    (m, k), (n, k_w) = x.shape, weight.shape
    if k != k_w:
        raise ValueError(f"x has K = {k} columns but weight [N, K] has {k_w}")
    if x.dtype not in MATMUL_DTYPES:
        raise ValueError(f"dtype must be one of {MATMUL_DTYPES}, got {x.dtype}")
    for name, tensor, shape in (
        ("weight", weight, (n, k)),
        ("bias", bias, (n,)),
        ("residual", residual, (m, n)),
    ):
        if tensor is None:
            continue
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)}, got {tuple(tensor.shape)}")
        if tensor.dtype != x.dtype or tensor.device != x.device:
            raise ValueError(
                f"{name} is {tensor.dtype} on {tensor.device}, x {x.dtype} on {x.device}"
            )
        if tensor.numel() and tensor.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride along its last axis")
    if x.numel() and x.stride(-1) != 1:
        raise ValueError("x must have unit stride along K")


def matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``residual + x @ weight^T + bias`` by ``matmul_kernel`` (see the module docstring);
    CUDA tensors, or CPU tensors under Triton's interpreter. Raises ``ValueError`` for
    operands that do not fit."""
    check_matmul(x, weight, bias, residual)
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:  # no products: the additions alone
        out.zero_()
        if bias is not None:
            out += bias
        if residual is not None:
            out += residual
        return out
    tiles = matmul_tiles(x.device)
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n))
    runnable(matmul_kernel, x.device)[grid](
        x,
        weight,
        bias if bias is not None else out,  # not read without HAS_BIAS
        residual if residual is not None else out,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None,
        DOT_DTYPE=dot_dtype(x),
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out


def matmul_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: the same sum in fp32 (torch's product), bias then residual, rounded once."""
    check_matmul(x, weight, bias, residual)
    acc = x.float() @ weight.float().t()
    if bias is not None:
        acc = acc + bias.float()
    if residual is not None:
        acc = acc + residual.float()
    return acc.to(x.dtype)
