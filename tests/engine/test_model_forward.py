"""Our forward pass over the paged KV cache against transformers' LlamaForCausalLM (fp32)."""

from __future__ import annotations

import pytest
import torch

# Both sides are fp32 over the same weights; only summation order differs. Logits are
# O(10), so 2e-3 absolute leaves room for that and still catches any real mistake
# (a wrong position, head or block shifts logits by whole units).
ATOL = 2e-3


@pytest.fixture(params=["native", "torch"], autouse=True)
def kernel_backend(request, monkeypatch):
    """Every test here runs on both CPU paths: the native C kernels and the torch reference."""
    monkeypatch.setenv("CHATSVC_KERNEL_BACKEND", request.param)
    return request.param


PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea. Waves roll in and out, the tide keeps",
]


def _hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        out = hf_model(torch.tensor([token_ids]))
    return out.logits[0].float()  # [S, V]


def _ids(loaded, text: str) -> list[int]:
    return loaded.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_prefill_then_decode_matches_transformers(smollm2_fp32, smollm2_hf_fp32, paged_driver):
    driver = paged_driver(smollm2_fp32.model, block_size=4, seed=1)
    prompts = {f"s{i}": _ids(smollm2_fp32, p) for i, p in enumerate(PROMPTS)}
    full = {k: list(v) for k, v in prompts.items()}

    logits = driver.step(prompts)  # both prompts in one flat prefill batch
    assert logits.shape == (2, smollm2_fp32.config.vocab_size)
    assert logits.dtype == torch.float32
    ours = {seq: [logits[row]] for row, seq in enumerate(full)}
    for _ in range(4):
        nxt = {seq: [int(logits[row].argmax())] for row, seq in enumerate(full)}
        for seq, tok in nxt.items():
            full[seq] += tok
        logits = driver.step(nxt)  # a pure decode step
        for row, seq in enumerate(full):
            ours[seq].append(logits[row])

    # One uncached transformers pass over each final sequence gives every position's logits.
    for seq, tokens in full.items():
        expected = _hf_logits(smollm2_hf_fp32, tokens)[len(prompts[seq]) - 1 :]
        torch.testing.assert_close(torch.stack(ours[seq]), expected, atol=ATOL, rtol=0)
    # The shuffled allocator really produced non-contiguous tables.
    table = driver.tables["s1"]
    assert any(b - a != 1 for a, b in zip(table, table[1:], strict=False))


def test_two_chunk_prefill_reads_first_chunk_through_cache(
    smollm2_fp32, smollm2_hf_fp32, paged_driver
):
    driver = paged_driver(smollm2_fp32.model, block_size=8, seed=2)
    tokens = _ids(smollm2_fp32, PROMPTS[1])
    cut = 11  # not a block boundary: chunk 2 starts inside a partly filled block
    first = driver.step({"s": tokens[:cut]})
    second = driver.step({"s": tokens[cut:]})
    expected = _hf_logits(smollm2_hf_fp32, tokens)
    torch.testing.assert_close(first[0], expected[cut - 1], atol=ATOL, rtol=0)
    torch.testing.assert_close(second[0], expected[-1], atol=ATOL, rtol=0)


def test_mixed_step_decode_and_prefill_together(smollm2_fp32, smollm2_hf_fp32, paged_driver):
    driver = paged_driver(smollm2_fp32.model, block_size=4, seed=3)
    a = _ids(smollm2_fp32, PROMPTS[0])
    b = _ids(smollm2_fp32, PROMPTS[1])
    driver.step({"a": a})
    # One sequence decodes (1 token) while another prefills: the extend path, not decode.
    logits = driver.step({"a": [a[-1]], "b": b})
    torch.testing.assert_close(
        logits[0], _hf_logits(smollm2_hf_fp32, a + [a[-1]])[-1], atol=ATOL, rtol=0
    )
    torch.testing.assert_close(logits[1], _hf_logits(smollm2_hf_fp32, b)[-1], atol=ATOL, rtol=0)


def test_forward_rejects_a_pool_of_the_wrong_shape(smollm2_fp32, paged_driver):
    from chatsvc.engine.forward_batch import ForwardBatch

    model = smollm2_fp32.model
    pool = torch.zeros(4, model.config.num_layers, 2, 16, model.config.num_kv_heads + 1, 64)
    batch = ForwardBatch.from_lists([[1, 2]], [0], [[0, 1]], [[0]], block_size=16)
    try:
        model.forward(batch, pool)
    except ValueError as exc:
        assert "heads" in str(exc)
    else:
        raise AssertionError("a pool with the wrong head count was accepted")


@pytest.mark.parametrize(
    ("slots", "tables", "message"),
    [
        ([[0, -2]], [[0]], "slot_mapping has slots outside"),
        ([[0, 64]], [[0]], "slot_mapping has slots outside"),
        ([[0, 1]], [[4]], "block_tables hold block ids outside"),
        ([[0, 1]], [[-1]], "block_tables hold block ids outside"),
        ([[-1, 63]], [[3]], None),  # padding and the pool's last slot and block are in
    ],
)
def test_forward_checks_slots_and_block_ids_against_the_pool(smollm2_fp32, slots, tables, message):
    from chatsvc.engine.forward_batch import ForwardBatch
    from kernels.kv_layout import new_kv_pool

    model = smollm2_fp32.model
    pool = new_kv_pool(4, model.kv_shape(16), model.dtype, "cpu")
    batch = ForwardBatch.from_lists([[1, 2]], [0], slots, tables, block_size=16)
    if message is None:
        assert model.forward(batch, pool).shape == (1, model.config.vocab_size)
        return
    before = pool.clone()
    with pytest.raises(ValueError, match=message):
        model.forward(batch, pool)
    assert torch.equal(pool, before)  # refused before any K/V was written


def test_bf16_model_tracks_fp32(smollm2_fp32, paged_driver):
    from chatsvc.engine.loader import load_model

    bf16 = load_model("smollm2", dtype="bf16", max_positions=256)
    assert bf16.model.dtype == torch.bfloat16
    tokens = _ids(smollm2_fp32, PROMPTS[0])
    ref = paged_driver(smollm2_fp32.model, seed=6).step({"s": tokens})[0]
    got = paged_driver(bf16.model, seed=6).step({"s": tokens})[0]
    assert got.dtype == torch.float32  # logits are fp32 whatever the compute dtype
    # bf16 keeps ~3 significant digits: the distributions agree, the top token too.
    assert float(torch.nn.functional.cosine_similarity(got, ref, dim=0)) > 0.99
    assert int(got.argmax()) == int(ref.argmax())


def test_weight_layouts_agree_in_bf16(smollm2_fp32, paged_driver, kernel_backend):
    """The tile layout (bf16 on CPUs with AMX, native kernels) against oneDNN's: the
    same sums in another order, so logits agree to bf16 rounding."""
    from chatsvc.engine.loader import load_model
    from kernels.cpu.tile_linear import tile_linear_available

    if kernel_backend != "native" or not tile_linear_available("cpu", torch.bfloat16):
        with pytest.raises(ValueError, match="'tiles' weight layout is not available"):
            load_model("smollm2", dtype="bf16", max_positions=256, prepack_weights="tiles")
        return
    tiles = load_model("smollm2", dtype="bf16", max_positions=256)
    assert tiles.model.weight_layout == "tiles"
    onednn = load_model("smollm2", dtype="bf16", max_positions=256, prepack_weights="onednn")
    tokens = _ids(smollm2_fp32, PROMPTS[1])
    got = paged_driver(tiles.model, seed=6).step({"s": tokens})[0]
    ref = paged_driver(onednn.model, seed=6).step({"s": tokens})[0]
    assert float(torch.nn.functional.cosine_similarity(got, ref, dim=0)) > 0.999
    assert int(got.argmax()) == int(ref.argmax())


def test_an_fp32_model_reads_its_bf16_checkpoint_in_bf16(
    smollm2_fp32, paged_driver, kernel_backend
):
    """Served in fp32, the bf16 checkpoint's matrices stay bf16 (bf16_blocks: half the bytes
    a step reads) where the native kernels have AVX2; the logits are oneDNN's fp32 ones
    but for the order of the sums."""
    from chatsvc.engine.loader import load_model
    from kernels.backend import narrow_linears_available

    # The layout was chosen at load (the session's backend: native unless the environment
    # says torch); this test's backend runs the attention and element-wise kernels.
    if kernel_backend == "native":
        expected = narrow_linears_available("cpu", torch.float32)
        assert (smollm2_fp32.model.weight_layout == "bf16_blocks") == expected
    onednn = load_model("smollm2", dtype="fp32", max_positions=256, prepack_weights="onednn")
    tokens = _ids(smollm2_fp32, PROMPTS[1])
    got = paged_driver(smollm2_fp32.model, seed=6).step({"s": tokens})[0]
    ref = paged_driver(onednn.model, seed=6).step({"s": tokens})[0]
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=1e-4)
    assert int(got.argmax()) == int(ref.argmax())


def test_the_forward_pass_reaches_kernels_only_through_its_bound_step(
    smollm2_fp32, paged_driver, kernel_backend, monkeypatch
):
    """The kernels of a step are decided once (``kernels.backend.choose_kernels``, asked
    by ``kernels.step.bind.bind_step``), and no layer calls a public per-op kernel function,
    on both CPU paths, for a prefill, a mixed step and a decode."""
    import kernels
    from kernels import backend as backends

    decisions = []
    choose = backends.choose_kernels

    def counted(*args, **kwargs):
        choice = choose(*args, **kwargs)
        decisions.append(choice.backend)
        return choice

    def refused(*args, **kwargs):
        raise AssertionError("a layer called a public per-op kernel function")

    monkeypatch.setattr(backends, "choose_kernels", counted)
    for name in ("write_kv", "paged_decode_attention", "paged_extend_attention"):
        monkeypatch.setattr(kernels, name, refused)
    for name in ("rms_norm", "apply_rope_", "swiglu"):
        monkeypatch.setattr(kernels, name, refused)
    driver = paged_driver(smollm2_fp32.model, block_size=4, seed=7)
    a = _ids(smollm2_fp32, PROMPTS[0])
    b = _ids(smollm2_fp32, PROMPTS[1])
    driver.step({"a": a})
    driver.step({"a": [a[-1]], "b": b})
    logits = driver.step({"a": [5], "b": [6]})
    assert decisions == [kernel_backend] * 3
    assert torch.isfinite(logits).all()
