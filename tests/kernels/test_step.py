"""kernels.step.bind.bind_step: the one entry that decides which kernels run a step. Each
backend's bound step gives what the public functions give layer by layer, the backends
agree with each other, and a bound step refuses calls that do not fit it."""

from __future__ import annotations

import math
from typing import NamedTuple

import pytest
import torch
from kernel_cases import assert_close, make_paged_case, share_prefix

import kernels
from kernels import backend as backends
from kernels.cpu import native
from kernels.kv_layout import layer_views
from kernels.step.bind import StepDims, bind_step
from kernels.step.native_step import NativeStep
from kernels.step.torch_step import TorchStep

NUM_KV_HEADS, GROUP, HEAD_DIM, BLOCK = 3, 3, 64, 16
NUM_Q_HEADS = NUM_KV_HEADS * GROUP
DIMS = StepDims(NUM_Q_HEADS, 1 / math.sqrt(HEAD_DIM), 1e-5)


class Batch(NamedTuple):
    """What bind_step reads of a batch (the engine's ForwardBatch has these fields)."""

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    is_decode: bool
    max_query_len: int


def _step(dtype, q_lens, lens):
    """A step over a two-layer pool: decodes, short turns (some sharing a prefix) and a
    prefill chunk longer than the native routing limit, unless ``q_lens`` says else."""
    case = make_paged_case(lens, BLOCK, NUM_KV_HEADS, HEAD_DIM, dtype, spare_blocks=0)
    for member in (1, 2):
        share_prefix(case, 0, member, 6)
    starts = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    slots = torch.cat(
        [
            case.block_tables[b, torch.arange(n - q, n) // BLOCK].long() * BLOCK
            + torch.arange(n - q, n) % BLOCK
            for b, (n, q) in enumerate(zip(lens, q_lens, strict=True))
        ]
    )
    batch = Batch(
        slots, case.block_tables, starts, case.context_lens, max(q_lens) == 1, max(q_lens)
    )
    return case, batch


def _layer_inputs(dtype, tokens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, NUM_Q_HEADS + 2 * NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    angles = torch.rand(tokens, 1, HEAD_DIM // 2, generator=gen) * 50
    angles = torch.cat([angles, angles], dim=-1)  # both halves of a head share an angle
    x = torch.randn(tokens, 576, generator=gen).to(dtype)
    weight = torch.randn(576, generator=gen).to(dtype)
    gate_up = torch.randn(tokens, 2 * 256, generator=gen).to(dtype)
    return qkv, angles.cos().to(dtype), angles.sin().to(dtype), x, weight, gate_up


def _run_layers(ops, pool, dtype, tokens):
    """Every operation of a layer, in both layers; the outputs in order."""
    qkv, cos, sin, x, weight, gate_up = _layer_inputs(dtype, tokens)
    outputs = [ops.rms_norm(x, weight), ops.swiglu(gate_up)]
    qk = qkv[:, : NUM_Q_HEADS + NUM_KV_HEADS]  # q and k as views inside a fused projection
    ops.rope_(qk, cos, sin)
    outputs.append(qkv.clone())
    q, k = qkv[:, :NUM_Q_HEADS], qkv[:, NUM_Q_HEADS : NUM_Q_HEADS + NUM_KV_HEADS]
    v = qkv[:, NUM_Q_HEADS + NUM_KV_HEADS :]
    for layer in (0, 1):
        ops.write_kv(layer, k, v)
        outputs.append(pool.clone())
        outputs.append(ops.attention(layer, q))
    return outputs


def _run_public(backend, batch, pool, dtype, tokens):
    """The same operations through the public per-op functions."""
    qkv, cos, sin, x, weight, gate_up = _layer_inputs(dtype, tokens)
    outputs = [
        kernels.rms_norm(x, weight, DIMS.eps, backend=backend),
        kernels.swiglu(gate_up, backend=backend),
    ]
    kernels.apply_rope_(qkv[:, : NUM_Q_HEADS + NUM_KV_HEADS], cos, sin, backend=backend)
    outputs.append(qkv.clone())
    q, k = qkv[:, :NUM_Q_HEADS], qkv[:, NUM_Q_HEADS : NUM_Q_HEADS + NUM_KV_HEADS]
    v = qkv[:, NUM_Q_HEADS + NUM_KV_HEADS :]
    for layer in (0, 1):
        k_cache, v_cache = layer_views(pool, layer)
        kernels.write_kv(k_cache, v_cache, k, v, batch.slot_mapping, backend=backend)
        outputs.append(pool.clone())
        args = (q, k_cache, v_cache, batch.block_tables)
        if batch.is_decode:
            out = kernels.paged_decode_attention(
                *args, batch.context_lens, DIMS.scale, backend=backend
            )
        else:
            out = kernels.paged_extend_attention(
                *args, batch.query_start_loc, batch.context_lens, DIMS.scale, backend=backend
            )
        outputs.append(out)
    return outputs


STEPS = {
    "mixed": ([1, 1, 3, 40, 1], [130, 200, 99, 300, 17]),
    "decode": ([1, 1, 1, 1], [130, 200, 99, 17]),
}


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_bound_step_equals_the_public_functions(backend, step, dtype):
    q_lens, lens = STEPS[step]
    case, batch = _step(dtype, q_lens, lens)
    public_pool = case.pool.clone()
    ops = bind_step(batch, case.pool, DIMS, backend=backend)
    assert ops.backend == backend
    bound = _run_layers(ops, case.pool, dtype, sum(q_lens))
    public = _run_public(backend, batch, public_pool, dtype, sum(q_lens))
    for got, expected in zip(bound, public, strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_and_torch_steps_agree(step, dtype):
    q_lens, lens = STEPS[step]
    case, batch = _step(dtype, q_lens, lens)
    torch_pool = case.pool.clone()
    tokens = sum(q_lens)
    on_native = _run_layers(bind_step(batch, case.pool, DIMS, "native"), case.pool, dtype, tokens)
    on_torch = _run_layers(bind_step(batch, torch_pool, DIMS, "torch"), torch_pool, dtype, tokens)
    for got, expected in zip(on_native, on_torch, strict=True):
        assert_close(got, expected, dtype)


def test_the_backend_is_decided_in_kernels_backend(monkeypatch):
    case, batch = _step(torch.bfloat16, *STEPS["mixed"])
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    assert isinstance(bind_step(batch, case.pool, DIMS), NativeStep)  # auto on a CPU
    monkeypatch.setenv(backends.ENV_VAR, "torch")
    assert isinstance(bind_step(batch, case.pool, DIMS), TorchStep)
    assert isinstance(bind_step(batch, case.pool, DIMS, backend="native"), NativeStep)
    # A dtype the C kernels do not take runs the torch kernels on the native backend.
    half = case.pool.half()
    assert backends.choose_kernels(half.device, half.dtype, HEAD_DIM, "native").backend == "torch"
    assert isinstance(bind_step(batch, half, DIMS, backend="native"), TorchStep)
    with pytest.raises(ValueError, match="backend must be one of"):
        bind_step(batch, case.pool, DIMS, backend="cuda")
    # Invariant steps send every run to the C attention; otherwise the routing limit is
    # the one the public functions use.
    choice = backends.choose_kernels(case.pool.device, torch.bfloat16, HEAD_DIM, "native")
    assert choice == ("native", backends.NATIVE_ALL, True)
    fastest = backends.choose_kernels(
        case.pool.device, torch.bfloat16, HEAD_DIM, "native", invariant=False
    )
    assert fastest.native_max_query == backends.native_max_query(torch.bfloat16, HEAD_DIM)
    assert not fastest.invariant
    assert backends.choose_kernels(case.pool.device, torch.bfloat16, HEAD_DIM, "torch") == (
        "torch",
        0,
        True,
    )


def test_the_arithmetic_identity_names_the_backend_its_build_and_torchs(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    on_native = backends.arithmetic_identity("cpu")
    assert native.library_sha256() in on_native and torch.__version__ in on_native
    on_torch = backends.arithmetic_identity("cpu", "torch")
    assert on_torch != on_native and native.library_sha256() not in on_torch
    # torch's CPU kernels are dispatched by the machine's vector width: part of the name.
    capability = torch.backends.cpu.get_cpu_capability()
    assert capability in on_torch
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2-elsewhere")
    assert backends.arithmetic_identity("cpu", "torch") != on_torch
    # Another build of the C kernels (another edit, CPU or compiler): another identity.
    monkeypatch.setattr(native, "_loaded_sha256", "0" * 64)
    assert backends.arithmetic_identity("cpu") not in (on_native, on_torch)


def test_without_the_native_library_auto_binds_the_torch_step(monkeypatch):
    case, batch = _step(torch.float32, *STEPS["mixed"])
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setattr(native, "_error", "no compiler (test)")
    assert isinstance(bind_step(batch, case.pool, DIMS), TorchStep)
    with pytest.raises(ValueError, match="unavailable"):
        bind_step(batch, case.pool, DIMS, backend="native")


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_a_bound_step_refuses_calls_of_another_shape(backend):
    q_lens, lens = STEPS["mixed"]
    case, batch = _step(torch.bfloat16, q_lens, lens)
    ops = bind_step(batch, case.pool, DIMS, backend=backend)
    before = case.pool.clone()
    short = torch.zeros(sum(q_lens) - 1, NUM_Q_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="46-token step"):
        ops.attention(0, short)
    with pytest.raises(ValueError, match="46-token step"):
        ops.write_kv(0, short[:, :3], short[:, :3])
    with pytest.raises(ValueError, match="46-token step"):
        ops.rope_(short, short[:, :1], short[:, :1])
    full = torch.zeros(sum(q_lens), NUM_Q_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="outside the pool's 2"):
        ops.attention(2, full)
    with pytest.raises(ValueError, match="outside the pool's 2"):
        ops.write_kv(-1, full[:, :3], full[:, :3])
    assert torch.equal(case.pool, before)


def test_binding_refuses_a_batch_or_pool_that_does_not_fit():
    case, batch = _step(torch.bfloat16, [1, 1, 3, 40, 1], [130, 200, 99, 300, 17])
    with pytest.raises(ValueError, match=r"\[B \+ 1\]"):
        bind_step(batch._replace(query_start_loc=batch.query_start_loc[:-1]), case.pool, DIMS)
    with pytest.raises(ValueError, match="must be a multiple of H_kv"):
        bind_step(batch, case.pool, DIMS._replace(num_q_heads=10))
    with pytest.raises(ValueError, match="N, L, 2, block_size"):
        bind_step(batch, case.pool[:, 0], DIMS)
    with pytest.raises(ValueError, match="slot_mapping must be int32 or int64"):
        bind_step(batch._replace(slot_mapping=batch.slot_mapping.float()), case.pool, DIMS)
    with pytest.raises(ValueError, match="fp32/bf16"):
        choice = backends.choose_kernels(case.pool.device, torch.bfloat16, HEAD_DIM, "native")
        NativeStep(batch, case.pool.half(), DIMS, choice)
