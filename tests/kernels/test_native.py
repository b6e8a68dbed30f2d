"""The native CPU attention (kernels/cpu/attention.c): its build, and its results against
the dense oracle where the shared tests (test_reference*.py) do not reach: long
sequences split across threads, key tiles spanning small blocks, the portable C
path, a subset of the batch, and its refusals."""

from __future__ import annotations

import math
import platform
import re
import shutil
from pathlib import Path

import pytest
import torch
from kernel_cases import (
    assert_close,
    extend_inputs,
    extend_oracle,
    make_paged_case,
    share_prefix,
)
from test_kv_int8 import check_int8

import kernels
from kernels.attention_inputs import AttentionInputs
from kernels.backend import (
    NATIVE_MAX_QUERY,
    NATIVE_MAX_QUERY_TILES,
    native_max_query,
    resolve_backend,
)
from kernels.cpu import native
from kernels.cpu.attention import NATIVE_Q_TILE, paged_attention_native
from kernels.invariance import SPAN_TOKENS


def _inputs(case, query, starts, v_cache=None):
    v_cache = case.v_cache if v_cache is None else v_cache
    scale = 1 / math.sqrt(query.shape[-1])
    return AttentionInputs(
        query, case.k_cache, v_cache, case.block_tables, starts, case.context_lens, scale
    )


def _run(case, query, starts, seqs, lib=None, out=None):
    out = torch.full_like(query, float("nan")) if out is None else out
    seqs = torch.tensor(seqs, dtype=torch.int32)
    paged_attention_native(_inputs(case, query, starts), seqs, out, lib=lib)
    return out


def _check(lens, q_lens, block_size, num_kv_heads, group, head_dim, dtype, lib=None, kv_dtype=None):
    case = make_paged_case(lens, block_size, num_kv_heads, head_dim, dtype, kv_dtype=kv_dtype)
    query, starts = extend_inputs(case, q_lens, num_kv_heads * group)
    out = _run(case, query, starts, list(range(len(lens))), lib)
    assert_close(out, extend_oracle(case, query, q_lens), dtype)


def test_the_library_is_built_once_per_source_flags_and_cpu(tmp_path, monkeypatch):
    # The cache on a one-function source: the whole library takes tens of seconds a
    # build, and the kernel tests build it for real.
    source = tmp_path / "answer.c"
    source.write_text("int chatsvc_answer(void) { return 42; }\n")
    monkeypatch.setattr(native, "SOURCES", (source,))
    monkeypatch.setattr(native, "HEADERS", ())
    monkeypatch.setattr(native, "_build_dir", tmp_path / "kernels")
    first = native.build("gcc", native.default_flags())
    assert first.parent == tmp_path / "kernels" and first.exists()
    assert first.name == f"{native.LIBRARY}-{native.library_key('gcc', native.default_flags())}.so"
    built_at = first.stat().st_mtime_ns
    assert native.build("gcc", native.default_flags()) == first
    assert first.stat().st_mtime_ns == built_at  # cached, not rebuilt
    other = native.build("gcc", [*native.default_flags(), "-DCHATSVC_TEST_VARIANT"])
    assert other != first and other.exists()
    source.write_text("int chatsvc_answer(void) { return 43; }\n")
    assert native.build("gcc", native.default_flags()) not in (first, other)
    monkeypatch.setattr(native, "_cpu_signature", lambda: "another CPU")
    assert native.build("gcc", native.default_flags()) not in (first, other)
    assert not list((tmp_path / "kernels").glob("*.partial"))


def test_the_build_compiles_every_c_file_and_keys_every_header():
    here = Path(native.__file__).parent
    assert set(native.SOURCES) == set(here.glob("*.c"))
    assert set(native.HEADERS) == set(here.glob("*.h"))
    included = {
        here / name
        for path in (*native.SOURCES, *native.HEADERS)
        for name in re.findall(r'#include "([^"]+)"', path.read_text())
    }
    assert included <= set(native.HEADERS)


def test_an_edited_header_keys_a_new_library(tmp_path, monkeypatch):
    """The attention's files share attention.h: editing it must not load a library
    built from the old one (``build`` names its file by the key)."""
    sources = tmp_path / "src"
    sources.mkdir()
    for path in (*native.SOURCES, *native.HEADERS):
        shutil.copy(path, sources / path.name)
    monkeypatch.setattr(native, "SOURCES", tuple(sources / p.name for p in native.SOURCES))
    monkeypatch.setattr(native, "HEADERS", tuple(sources / p.name for p in native.HEADERS))
    first = native.library_key("gcc", native.default_flags())
    header = sources / "attention.h"
    header.write_text(header.read_text() + "\n/* edited */\n")
    assert native.library_key("gcc", native.default_flags()) != first


def test_a_wrapper_of_the_same_compiler_keys_another_library(tmp_path):
    """A `CC` script that runs gcc with flags of its own reports gcc's version: its
    library must not be taken for gcc's (nor gcc's for its)."""
    wrapper = tmp_path / "gcc-no-avx512"
    wrapper.write_text('#!/bin/sh\nexec gcc "$@" -mno-avx512f\n')
    wrapper.chmod(0o755)
    flags = native.default_flags()
    assert native._compiler_version(str(wrapper)) == native._compiler_version("gcc")
    assert native.library_key(str(wrapper), flags) != native.library_key("gcc", flags)
    assert native.library_key("gcc", flags) == native.library_key("gcc", flags)


def test_a_failed_build_raises_with_the_compiler_message(tmp_path, monkeypatch):
    monkeypatch.setattr(native, "_build_dir", tmp_path / "kernels")
    with pytest.raises(RuntimeError, match="gcc failed"):
        native.build("gcc", [*native.default_flags(), "-fno-such-flag"])
    assert not list((tmp_path / "kernels").glob("*"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_len", [1, 3, NATIVE_Q_TILE, 21])
def test_one_long_sequence_is_split_across_threads_and_merged(q_len, dtype):
    # ~100 blocks of 16 and few query tiles: the kernel slices the keys (flash-decoding).
    _check([1600], [q_len], 16, 2, 3, 64, dtype)


@pytest.mark.parametrize("kv_int8", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_len", [1, 5])
@pytest.mark.parametrize("context", [130, SPAN_TOKENS + 1, SPAN_TOKENS + 44])
def test_a_lone_sequence_is_cut_by_kv_head_with_the_same_bits(context, q_len, kv_int8, dtype):
    # One item for two threads (130 keys), or two spans of which the first holds most of
    # the work (a span's keys and a few): each is cut into one per KV head, the spans'
    # pieces merged. Every head's rows must be written (out starts as NaN) and be the bits
    # one thread gives with the whole items.
    case = make_paged_case([context], 16, 3, 64, dtype, kv_dtype=torch.int8 if kv_int8 else None)
    query, starts = extend_inputs(case, [q_len], 9)
    scale = 1 / math.sqrt(64)
    inputs = AttentionInputs(
        query, case.k_cache, case.v_cache, case.block_tables, starts, case.context_lens, scale
    )
    outs = []
    threads = torch.get_num_threads()
    try:
        # Two threads first: a piece's partial rows left unwritten would otherwise find
        # the one-thread call's rows in the reused memory.
        for num_threads in (2, 1):
            torch.set_num_threads(num_threads)
            out = torch.full_like(query, float("nan"))
            seqs = torch.zeros(1, dtype=torch.int32)
            paged_attention_native(inputs, seqs, out, scales=case.scales)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert not outs[0].isnan().any()
    assert torch.equal(
        outs[0].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
        outs[1].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
    )
    if not kv_int8:
        assert_close(outs[0], extend_oracle(case, query, [q_len]), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 4, 32])
def test_key_tiles_across_small_and_large_blocks(block_size, dtype):
    # Odd lengths: the bf16 path's last key pair and 32-key step are part empty.
    _check([37, 5, 70], [1, 5, 2], block_size, 2, 4, 64, dtype)


@pytest.mark.parametrize("head_dim", [16, 48, 128])
def test_head_sizes(head_dim):
    _check([23, 40], [1, 4], 8, 2, 2, head_dim, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("without", ["amx-tile", "avx512bf16", "avx512f", "avx2"])
def test_the_paths_of_other_cpus_match_the_oracle(without, dtype, variant_library):
    """The default build takes the best path this CPU has; the others need their own
    builds: without AVX512-BF16, bf16 is widened to fp32 on AVX-512; without AVX-512,
    on AVX2; without AVX2 either, plain C (elsewhere than x86 the default build is that
    path)."""
    flags = {"avx2": ["-mno-avx512f", "-mno-avx2"]}.get(without, [f"-mno-{without}"])
    lib = variant_library(flags if platform.machine() == "x86_64" else [])
    _check([1, 40, 300], [1, 6, 2], 8, 2, 3, 64, dtype, lib)
    _check([900], [5], 16, 1, 4, 128, dtype, lib)
    check_int8([1, 40, 300], [1, 6, 2], 8, 2, 3, 64, dtype, lib)  # the same loops, int8 KV
    # bf16 KV under fp32 queries (CHATSVC_KV_DTYPE=bf16): the same loops again.
    _check([1, 40, 300], [1, 6, 2], 8, 2, 3, 64, torch.float32, lib, torch.bfloat16)


def _shared_prefix_case(dtype):
    """Two tenants' system prompts (8 and 12 blocks of 16) under 13 sequences, and the
    cases at the edges of sharing: new tokens that start inside the shared blocks, a
    prefix too short to share, one shared by a single sequence, one shared only in part."""
    lens = [300, 520, 129, 700, 410, 260, 333, 640, 205, 900, 450, 390, 40]
    q_lens = [1, 1, 1, 4, 1, 2, 1, 1, 5, 1, 1, 3, 1]
    case = make_paged_case(lens, 16, 3, 64, dtype, spare_blocks=0)
    for member in (1, 2, 3, 4, 5, 6, 7):  # seq 2: new token at 128, right after the 8 blocks
        share_prefix(case, 0, member, 8)
    for member in (9, 10):
        share_prefix(case, 8, member, 12)
    share_prefix(case, 8, 11, 5)  # five blocks with the second tenant: under half of 12
    share_prefix(case, 0, 12, 2)  # 32 tokens: below the kernel's minimum
    return case, q_lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("build", ["default", "-mno-amx-tile"])
def test_sequences_sharing_prefix_blocks_match_the_oracle(build, dtype, variant_library):
    """Shared prefixes go through one tile-unit item per group (bf16 with AMX) and are
    merged with each sequence's own keys; the other builds and dtypes ignore sharing."""
    lib = None
    if build != "default" and platform.machine() == "x86_64":
        lib = variant_library([build])
    case, q_lens = _shared_prefix_case(dtype)
    query, starts = extend_inputs(case, q_lens, 9)
    out = _run(case, query, starts, list(range(len(q_lens))), lib)
    assert_close(out, extend_oracle(case, query, q_lens), dtype)
    # A subset whose members are not neighbours in the batch, in another order.
    seqs = [10, 3, 9, 1, 5]
    out = _run(case, query, starts, seqs, lib)
    expected = extend_oracle(case, query, q_lens)
    for b in seqs:
        rows = slice(int(starts[b]), int(starts[b + 1]))
        assert_close(out[rows], expected[rows], dtype)


def test_runs_route_to_the_c_kernel_up_to_its_limit_for_the_cpus_paths(variant_library):
    lib = native.library()
    tiles = bool(lib.chatsvc_attention_uses_tiles())
    assert native_max_query(torch.bfloat16, 64, lib) == (
        NATIVE_MAX_QUERY_TILES if tiles else NATIVE_MAX_QUERY
    )
    assert native_max_query(torch.float32, 64, lib) == NATIVE_MAX_QUERY
    assert native_max_query(torch.bfloat16, 48, lib) == NATIVE_MAX_QUERY
    if platform.machine() == "x86_64":
        vector = variant_library(["-mno-amx-tile"])
        assert not vector.chatsvc_attention_uses_tiles()
        assert native_max_query(torch.bfloat16, 64, vector) == NATIVE_MAX_QUERY


def test_runs_as_long_as_the_limit_match_the_oracle_and_the_torch_path():
    # The longest runs the native backend sends to the C kernel (the tile path with AMX),
    # beside one just past the limit (torch groups), through the backend entry point.
    limit = native_max_query(torch.bfloat16, 64)
    q_lens = [limit, limit + 1, 1]
    case = make_paged_case([limit + 40, limit + 300, 70], 16, 3, 64, torch.bfloat16)
    query, starts = extend_inputs(case, q_lens, 9)
    args = (query, case.k_cache, case.v_cache, case.block_tables, starts, case.context_lens)
    native_out = kernels.paged_extend_attention(*args, 0.125, backend="native")
    assert_close(native_out, extend_oracle(case, query, q_lens), torch.bfloat16)
    torch_out = kernels.paged_extend_attention(*args, 0.125, backend="torch")
    assert_close(native_out, torch_out, torch.bfloat16)


def test_rows_of_sequences_not_listed_are_left_alone():
    case = make_paged_case([30, 12, 50], 8, 2, 64)
    q_lens = [2, 3, 1]
    query, starts = extend_inputs(case, q_lens, 6)
    out = _run(case, query, starts, [2, 0])
    expected = extend_oracle(case, query, q_lens)
    assert torch.isnan(out[2:5]).all()  # sequence 1's rows
    assert_close(out[:2], expected[:2], torch.float32)
    assert_close(out[5:], expected[5:], torch.float32)


def test_refusals_leave_the_output_untouched():
    case = make_paged_case([30], 8, 2, 64)
    query, starts = extend_inputs(case, [2], 6)
    out = torch.zeros_like(query)
    with pytest.raises(ValueError, match="head_dim a multiple of 16"):
        _run(case, query.half(), starts, [0], out=out.half())
    with pytest.raises(ValueError, match="share strides"):
        inputs = _inputs(case, query, starts, v_cache=case.v_cache.contiguous())
        paged_attention_native(inputs, torch.tensor([0], dtype=torch.int32), out)
    with pytest.raises(ValueError, match="query-shaped"):
        _run(case, query, starts, [0], out=out[:1])
    assert not out.any()


def test_dtypes_the_kernel_does_not_take_run_on_the_torch_path():
    case = make_paged_case([30, 9], 8, 2, 64, torch.float16)
    query = torch.randn(2, 6, 64).half()
    args = (query, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.125)
    native_out = kernels.paged_decode_attention(*args, backend="native")
    assert torch.equal(native_out, kernels.paged_decode_attention(*args, backend="torch"))


def test_without_a_compiler_the_cpu_falls_back_to_torch(monkeypatch):
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setattr(native, "_error", None)
    monkeypatch.setenv("CC", "no-such-compiler")
    assert native.library() is None
    assert "no-such-compiler" in native.unavailable_reason()
    assert resolve_backend(None, torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="unavailable"):
        resolve_backend("native", torch.device("cpu"))
