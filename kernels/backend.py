"""Which kernels run: the one place that decides, for a step and for every public function.

Both ways into the kernels take their decision here, as one ``KernelChoice``: a forward
step binds the chosen backend's kernels once for all its layers (``kernels.step``), and
each public per-op function in ``kernels`` (tests, references, the engine's block
copies) asks ``choose_kernels`` in every call and runs that backend's kernel.

``backend`` is one of ``"auto"`` (default), ``"torch"``, ``"native"`` or
``"triton"``. ``"auto"`` means Triton on CUDA, and on the CPU ``"native"``
where ``kernels.cpu.native`` could build its library (``"torch"`` where it could
not). The environment variable ``CHATSVC_KERNEL_BACKEND`` replaces the default of
``"auto"`` for callers that pass nothing (an explicit argument wins).

    resolve_backend(backend, device)              -> "triton" | "native" | "torch"
    choose_kernels(device, dtype, head_dim, ...)  -> KernelChoice: the backend whose
        kernels run a step or an operation on such tensors and, on the native one, how
        many new tokens of a sequence its C attention takes (longer runs go to the
        torch groups)
    tile_linears_available(device, dtype)         -> bf16 linears on the tile unit
    pair_linears_available(device, dtype)         -> bf16 linears on AVX512-BF16 dot pairs
    narrow_linears_available(device, dtype)       -> fp32 linears, bf16/int8 weights (AVX2)
    arithmetic_identity(device)                   -> names the code that computes the sums

``"native"`` runs the C kernels (``kernels/cpu/*.c``) where they take the tensors
(attention: fp32 or bf16, a head size that is a multiple of 16 up to 256) and the
torch reference for the rest. ``"triton"`` with CPU tensors runs the kernels in
Triton's interpreter, which ``triton`` only enables when ``TRITON_INTERPRET=1`` is
set before it is first imported (the decorator and Triton's own library functions
are bound then). Tests therefore run the Triton comparisons in a subprocess with
that variable set, and every other caller in the process keeps the CPU paths.
"""

from __future__ import annotations

import ctypes
import os
from typing import NamedTuple

import torch

from kernels.cpu import native
from kernels.cpu.narrow_linear import narrow_linear_available
from kernels.cpu.pair_linear import pair_linear_available
from kernels.cpu.tile_linear import tile_linear_available
from kernels.kv_layout import holds, is_narrowed

BACKENDS = ("auto", "torch", "native", "triton")
ENV_VAR = "CHATSVC_KERNEL_BACKEND"

# New tokens per sequence up to which the native backend runs the C attention (decodes
# and short new turns, bound by reading K/V); longer runs (prefill chunks, bound by the
# matrix products) go to the torch groups, where SDPA's win. The limits are the
# measured crossovers of the two (docs/kernels.md, `python -m bench.cpu_attention`):
# on the vector loops, and where bf16 runs take the tile unit (AMX).
NATIVE_MAX_QUERY = 6
NATIVE_MAX_QUERY_TILES = 32


# In invariant steps the C attention takes every run, whatever its length.
NATIVE_ALL = 2**31 - 1


class KernelChoice(NamedTuple):
    """The kernels of a step on given tensors (``choose_kernels``)."""

    backend: str  # "triton", "native" or "torch": whose kernels run the step
    # New tokens up to which the C attention takes a sequence; 0 off native, and in the
    # choice of an operation without heads.
    native_max_query: int
    # Each token's values independent of the rest of its step (kernels/invariance.py).
    invariant: bool = True


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """The backend the caller's choice (None: the environment's, else ``"auto"``) means for
    tensors on ``device``: ``"triton"``, ``"native"`` or ``"torch"``."""
    choice = backend if backend is not None else os.environ.get(ENV_VAR, "auto")
    if choice not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {choice!r}")
    if choice == "auto":
        if device.type == "cuda":
            return "triton"
        return "native" if device.type == "cpu" and native.library() is not None else "torch"
    if choice == "triton" and device.type not in ("cuda", "cpu"):
        raise ValueError(f"the triton backend runs on CUDA (or CPU, interpreted), not {device}")
    if choice == "native":
        if device.type != "cpu":
            raise ValueError(f"the native backend runs on the CPU, not {device}")
        native.require()
    return choice


def native_takes(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int | None = None,
    kv_dtype: torch.dtype | None = None,
) -> bool:
    """Whether the C kernels take such tensors: on the CPU, fp32 or bf16, KV caches that
    hold that dtype's K/V (``kv_dtype``, None: ``dtype``; ``kv_layout.holds``), and for the
    attention (``head_dim`` given) a head size that is a multiple of 16 (its vector width)
    up to 256."""
    heads_fit = head_dim is None or (head_dim % 16 == 0 and head_dim <= 256)
    kv_fits = kv_dtype is None or holds(kv_dtype, dtype)
    return device.type == "cpu" and dtype in native.DTYPE_CODES and heads_fit and kv_fits


def native_max_query(
    dtype: torch.dtype,
    head_dim: int,
    lib: ctypes.CDLL | None = None,
    kv_dtype: torch.dtype | None = None,
) -> int:
    """New tokens per sequence up to which the native backend runs the C attention:
    ``NATIVE_MAX_QUERY_TILES`` where bf16 runs take the tile unit, else
    ``NATIVE_MAX_QUERY``; every run for a cache narrower than ``dtype`` (``NATIVE_ALL``:
    the torch groups read caches of the query's dtype). ``lib``: a library
    ``kernels.cpu.native`` built (default: its own)."""
    if kv_dtype is not None and is_narrowed(kv_dtype, dtype):
        return NATIVE_ALL
    lib = lib if lib is not None else native.library()
    tiles = lib is not None and dtype == torch.bfloat16 and head_dim % 32 == 0
    if tiles and lib.chatsvc_attention_uses_tiles():
        return NATIVE_MAX_QUERY_TILES
    return NATIVE_MAX_QUERY


def choose_kernels(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int | None = None,
    backend: str | None = None,
    invariant: bool = True,
    kv_dtype: torch.dtype | None = None,
) -> KernelChoice:
    """The kernels that run on tensors of this device and dtype: those of a step
    (``kernels.step.bind.bind_step``) and of every public per-op function in ``kernels``.
    ``head_dim``: the attention's head size, for a step or an attention call; None for
    an operation without heads (the KV write, block copies, the element-wise layers).
    The native backend with tensors its C kernels do not take (fp16, say) runs the torch
    kernels. ``invariant``: kernels whose results for a token do not depend on the rest of
    the step (``kernels.invariance``; on the native backend the C attention then takes
    every run); False: the fastest for each step's shape.

    ``kv_dtype``: the KV caches' (None: ``dtype``). A cache narrower than ``dtype`` (int8,
    or bf16 for fp32: ``kv_layout.is_narrowed``) is read by the native kernels, the torch
    reference's span tasks and Triton's invariant span kernel; Triton's other kernels read
    caches of the query's dtype, so such a step on the triton backend with
    ``invariant=False`` raises ``ValueError``."""
    chosen = resolve_backend(backend, device)
    narrowed = kv_dtype is not None and is_narrowed(kv_dtype, dtype)
    if chosen == "native" and not native_takes(device, dtype, head_dim, kv_dtype):
        chosen = "torch"
    if narrowed and head_dim is not None and chosen == "triton" and not invariant:
        raise ValueError(
            f"a {kv_dtype} KV cache under a {dtype} model is read by Triton's invariant "
            "kernels only (invariant=True)"
        )
    limit = 0
    if chosen == "native" and head_dim is not None:
        limit = NATIVE_ALL if invariant else native_max_query(dtype, head_dim, kv_dtype=kv_dtype)
    return KernelChoice(chosen, limit, invariant)


def tile_linears_available(
    device: torch.device | str, dtype: torch.dtype, backend: str | None = None
) -> bool:
    """Whether linear layers may run on the tile unit (``kernels.cpu.tile_linear``): the native
    backend, bf16, and a library built with AMX."""
    device = torch.device(device)
    return resolve_backend(backend, device) == "native" and tile_linear_available(device, dtype)


def pair_linears_available(
    device: torch.device | str, dtype: torch.dtype, backend: str | None = None
) -> bool:
    """Whether a bf16 model's linears may run on AVX512-BF16 dot pairs
    (``kernels.cpu.pair_linear``): the native backend, bf16, a library built with it."""
    device = torch.device(device)
    return resolve_backend(backend, device) == "native" and pair_linear_available(device, dtype)


def narrow_linears_available(
    device: torch.device | str, dtype: torch.dtype, backend: str | None = None
) -> bool:
    """Whether an fp32 model's linears may read bf16- or int8-stored weights
    (``kernels.cpu.narrow_linear``): the native backend, fp32, a library built with AVX2 + FMA."""
    device = torch.device(device)
    return resolve_backend(backend, device) == "native" and narrow_linear_available(device, dtype)


def arithmetic_identity(device: torch.device | str, backend: str | None = None) -> str:
    """What, beyond the model, its dtypes and its layouts, fixes the bits a step computes
    on ``device``: the backend, the build of its code and torch's (whose kernels run the
    rest of a step, each dispatched by the CPU's vector width or the GPU's kind).

    On the native backend that is the loaded library's sha256: the build is deterministic
    (the same sources, flags and compiler for the same CPU give the same bytes), and
    another build (an edit of the kernels, ``-march=native`` on a CPU of other vector
    units, another compiler's instruction choice such as FMA contraction) may order or
    round a sum otherwise. The disk tier names this in its fingerprint: KV written by
    other code is other bits for the same tokens, and a hit must answer as a miss would."""
    device = torch.device(device)
    chosen = resolve_backend(backend, device)
    parts = [chosen, f"torch {torch.__version__}"]
    if device.type == "cuda":
        parts.append(torch.cuda.get_device_name(device))
    else:
        parts.append(f"cpu {torch.backends.cpu.get_cpu_capability()}")
    if chosen == "native":
        parts.append(f"library {native.library_sha256()}")
    elif chosen == "triton":
        import triton  # only here: TRITON_INTERPRET is read at its first import

        parts.append(f"triton {triton.__version__}")
    return "; ".join(parts)
