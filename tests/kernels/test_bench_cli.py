"""bench/kernels.py without a GPU: says so and exits 0; bad arguments are refused.
bench/cpu_attention.py and bench/torch_attention.py: their timed paths compute the same
attention."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import assert_close

from bench import cpu_attention, torch_attention, triton_spans
from bench import kernels as bench_kernels
from kernels.cpu import native
from kernels.linear import can_prepack


def test_without_cuda_it_reports_and_exits_zero(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_kernels.main([]) == 0
    assert "No CUDA device" in capsys.readouterr().out


def test_triton_spans_without_cuda_reports_and_exits_zero(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert triton_spans.main([]) == 0
    assert "No CUDA device" in capsys.readouterr().out


def test_rejects_heads_that_do_not_group():
    with pytest.raises(SystemExit):
        bench_kernels.parse_args(["--q-heads", "9", "--kv-heads", "4"])


def test_memory_estimate_grows_with_the_batch():
    args = bench_kernels.parse_args([])
    small = bench_kernels.PagedSetup.bytes_needed(1, 1024, args)
    assert bench_kernels.PagedSetup.bytes_needed(16, 1024, args) == 16 * small
    # bf16, 8 KV heads x 128: 4 KiB of K+V per token, times the headroom factor;
    # extend's ideal also holds K/V expanded to the 32 query heads.
    assert small == 1024 * 2 * 8 * 128 * 2 * 3
    expanded = bench_kernels.PagedSetup.bytes_needed(1, 1024, args, expanded=True)
    assert expanded == 1024 * 2 * 8 * 128 * 2 * (3 + 32 // 8)


def test_graph_replays_by_default_and_eager_on_request():
    assert bench_kernels.parse_args([]).graphs is True
    assert bench_kernels.parse_args(["--eager"]).graphs is False


def test_cpu_attention_bench_times_two_paths_that_agree():
    fns = cpu_attention.case_fns(q_len=3, context=70, batch=2, dtype=torch.float32)
    assert_close(fns["native"](), fns["torch"](), torch.float32)


def test_cpu_attention_bench_shared_prefix_cases_agree():
    fns = cpu_attention.case_fns(1, 300, 6, torch.bfloat16, shared=128)
    assert_close(fns["native"]().clone(), fns["torch"](), torch.bfloat16)


def test_cpu_attention_bench_baseline_is_a_second_build_that_agrees(tmp_path, monkeypatch):
    monkeypatch.setattr(native, "_build_dir", tmp_path / "kernels")
    baseline = native.load(native.build("gcc", [*native.default_flags(), "-O1"]))
    fns = cpu_attention.case_fns(3, 70, 2, torch.bfloat16, baseline)
    assert set(fns) == {"torch", "native", "baseline"}
    assert_close(fns["baseline"]().clone(), fns["native"](), torch.bfloat16)


def test_cpu_attention_int8_bench_times_the_same_attention_over_both_kv_dtypes():
    # The engine's call path (bound once, per-layer attention) over the same K/V in bf16
    # and quantized to int8: the answers differ by the quantization only.
    fns = cpu_attention.kv_dtype_fns(context=300, batch=2, dtype=torch.bfloat16)
    assert set(fns) == {"float", "int8"}
    floats, quantized = fns["float"]().float(), fns["int8"]().float()
    assert floats.shape == quantized.shape == (2, 9, 64) and floats.abs().sum() > 0
    torch.testing.assert_close(quantized, floats, atol=0.01, rtol=0.05)


def test_torch_attention_bench_times_two_paths_that_agree():
    fns = torch_attention.case_fns(q_len=5, context=300, batch=2, dtype=torch.float32)
    assert set(fns) == {"grouped", "spans"}
    assert_close(fns["spans"](), fns["grouped"](), torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_bench_layouts_compute_the_same_step(dtype):
    from bench import linear
    from kernels.cpu.narrow_linear import narrow_linear_available

    fns = linear.layout_fns(rows=5, dtype=dtype)
    reference = fns.pop("plain")()
    assert ("onednn" in fns) == can_prepack(torch.device("cpu"), dtype)
    assert ("bf16_blocks" in fns) == ("int8_blocks" in fns) == narrow_linear_available("cpu", dtype)
    int8 = fns.pop("int8_blocks", None)
    for fn in fns.values():
        assert_close(fn(), reference, dtype)
    if int8 is not None:  # quantized: within a few steps of each row's 1/127 grid
        torch.testing.assert_close(int8(), reference, atol=0.1, rtol=0.05)
