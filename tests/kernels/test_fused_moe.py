"""Mixture-of-experts kernels: the twin (ref.moe_route / ref.fused_moe) against transformers'
own router and experts modules; the compiled kernel (cpu/moe.cpp) against the twin on every
weight layout (rows, fp32 panels, bf16 pair panels), both dtypes, batch sizes around its row
limit and expert ids another rank owns; and the batch-1 promise: experts no token selected are
never read (their weights poisoned with NaN leave the output finite)."""

from __future__ import annotations

import pytest
import torch

from bladellm.kernels import Kernels, ref


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0,
          scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def experts(E: int, H: int, I: int, dtype: torch.dtype, seed: int = 1):
    return (randn(E, 2 * I, H, dtype=dtype, seed=seed, scale=H ** -0.5),
            randn(E, H, I, dtype=dtype, seed=seed + 1, scale=I ** -0.5))


def route(T: int, E: int, k: int, H: int, seed: int = 3):
    logits = randn(T, E, seed=seed)
    return ref.moe_route(logits, k, renormalize=True)


# ---- the twin against transformers ---------------------------------------------------------

@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_twin_matches_transformers_qwen3_moe_block(norm_topk_prob):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=24, num_experts=8,
                         num_experts_per_tok=3, norm_topk_prob=norm_topk_prob)
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(cfg).eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = randn(1, 11, 32)
    with torch.no_grad():
        want = block(x)[0] if isinstance(block(x), tuple) else block(x)
        logits = torch.nn.functional.linear(x[0], block.gate.weight)
        w, ids = ref.moe_route(logits, 3, norm_topk_prob)
        got = ref.fused_moe(x[0], block.experts.gate_up_proj.contiguous(),
                            block.experts.down_proj.contiguous(), w, ids)
    torch.testing.assert_close(got, want[0], atol=1e-6, rtol=1e-5)


def test_route_renormalizes_only_when_asked():
    logits = randn(5, 6)
    w, ids = ref.moe_route(logits, 2, renormalize=False)
    probs = logits.softmax(-1)
    torch.testing.assert_close(w, probs.gather(1, ids))
    assert (ids == probs.topk(2).indices).all()
    w, _ = ref.moe_route(logits, 2, renormalize=True)
    torch.testing.assert_close(w.sum(-1), torch.ones(5))


def test_twin_skips_ids_outside_its_experts():
    """Expert parallelism: a rank holding experts [0, 2) of 4 computes exactly their share."""
    x = randn(6, 16)
    w13, w2 = experts(4, 16, 8, torch.float32)
    w, ids = route(6, 4, 2, 16)
    full = ref.fused_moe(x, w13, w2, w, ids)
    low = ref.fused_moe(x, w13[:2], w2[:2], w, ids)
    high = ref.fused_moe(x, w13[2:], w2[2:], w, ids - 2)
    torch.testing.assert_close(low + high, full, atol=1e-6, rtol=1e-6)
    assert not torch.equal(low, full)


# ---- compiled against the twin -------------------------------------------------------------

@pytest.fixture(params=["rows", "panels"])
def layout(request, compiled, monkeypatch) -> str:
    """Expert weights kept in rows or packed in (pair) panels, whatever this machine picks."""
    rows = 64 if request.param == "panels" else 0
    monkeypatch.setattr(compiled, "moe_panels_fp32", request.param == "panels")
    monkeypatch.setattr(compiled, "linear_max_rows_pairs", rows)
    return request.param


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    else:
        scale = float(want.float().abs().max())
        assert float((got.float() - want.float()).abs().max()) <= 0.03 * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 2, 5, 16])
def test_compiled_matches_twin(compiled, layout, dtype, T):
    E, H, I, k = 8, 48, 40, 3
    x = randn(T, H, dtype=dtype, seed=T)
    w13, w2 = experts(E, H, I, dtype)
    w, ids = route(T, E, k, H, seed=T + 7)
    packed = compiled.pack_moe_weights(w13, w2)
    if layout == "panels":
        assert packed is not None
    got = compiled.fused_moe(x, w13, w2, w, ids, packed)
    _check(got, ref.fused_moe(x, w13, w2, w, ids))


@pytest.mark.parametrize("H,I", [(101, 70), (64, 32), (130, 97)])
def test_fp32_panels_one_row_path_is_the_batch_path_bit_for_bit(compiled, monkeypatch, H, I):
    """fp32 panels: an expert with one row runs moe.cpp's own GEMV (batch-1 decode), more rows
    bl_linear_panel; a token's output must not depend on which one ran it (odd H and I: a
    last panel only partly filled, odd K), and both match the twin."""
    monkeypatch.setattr(compiled, "moe_panels_fp32", True)
    E, k, T = 7, 3, 5
    x = randn(T, H, seed=21)
    w13, w2 = experts(E, H, I, torch.float32, seed=9)
    w, ids = route(1, E, k, H, seed=4)
    w, ids = w.expand(T, k).contiguous(), ids.expand(T, k).contiguous()  # T rows per expert
    packed = compiled.pack_moe_weights(w13, w2)
    assert packed is not None
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        batch = compiled.fused_moe(x, w13, w2, w, ids, packed)
        singles = [compiled.fused_moe(x[t:t + 1], w13, w2, w[t:t + 1], ids[t:t + 1], packed)
                   for t in range(T)]
    finally:
        torch.set_num_threads(threads)
    for t in range(T):
        assert torch.equal(singles[t][0], batch[t]), t
        _check(singles[t], ref.fused_moe(x[t:t + 1], w13, w2, w[t:t + 1], ids[t:t + 1]))
    _check(batch, ref.fused_moe(x, w13, w2, w, ids))


def test_compiled_takes_foreign_ids_and_large_batches(compiled):
    E, H, I = 4, 32, 16
    x = randn(40, H)
    w13, w2 = experts(E, H, I, torch.float32)
    w, ids = route(40, 2 * E, 2, H)
    ids = ids - E // 2  # ids -2..5: this "rank" holds 0..3
    for T in (1, 3, 40):  # 40: past the row limit per expert only where one gets > 16
        got = compiled.fused_moe(x[:T], w13, w2, w[:T], ids[:T])
        _check(got, ref.fused_moe(x[:T], w13, w2, w[:T], ids[:T]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_one_never_reads_unselected_experts(compiled, layout, dtype):
    E, H, I, k = 16, 32, 24, 2
    x = randn(1, H, dtype=dtype)
    w13, w2 = experts(E, H, I, dtype)
    w, ids = route(1, E, k, H)
    unselected = [e for e in range(E) if e not in ids[0].tolist()]
    w13[unselected] = float("nan")
    w2[unselected] = float("nan")
    packed = compiled.pack_moe_weights(w13, w2)
    got = compiled.fused_moe(x, w13, w2, w, ids, packed)
    assert torch.isfinite(got).all()
    _check(got, ref.fused_moe(x, w13, w2, w, ids))


def test_reference_set_is_the_twin():
    x = randn(3, 16)
    w13, w2 = experts(4, 16, 8, torch.float32)
    w, ids = route(3, 4, 2, 16)
    assert Kernels().pack_moe_weights(w13, w2) is None
    torch.testing.assert_close(Kernels().fused_moe(x, w13, w2, w, ids),
                               ref.fused_moe(x, w13, w2, w, ids), atol=0, rtol=0)


def test_compiled_takes_large_batches_spread_over_experts(compiled, monkeypatch):
    """The GEMMs' row limit applies per expert: 64 tokens over 32 experts run compiled."""
    E, H, I = 32, 32, 16
    x = randn(64, H)
    w13, w2 = experts(E, H, I, torch.float32)
    ids = torch.arange(128).remainder(E).view(64, 2)  # 4 tokens per expert
    w = torch.full((64, 2), 0.5)
    calls = []
    monkeypatch.setattr(Kernels, "fused_moe", lambda *a, **k: calls.append(1))
    got = compiled.fused_moe(x, w13, w2, w, ids)
    assert not calls and got is not None
    monkeypatch.undo()
    _check(got, ref.fused_moe(x, w13, w2, w, ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_grouped_gemm_prefill_sized(compiled, layout, dtype, monkeypatch):
    """A prefill-sized call: hundreds of rows per expert, uneven experts, each expert's outputs
    cut into several work items (a width not a multiple of the panel's) over two threads,
    and ids another rank owns mixed in."""
    if layout == "rows":
        monkeypatch.setattr(compiled, "linear_max_rows", {dtype: 1 << 16})
    else:
        monkeypatch.setattr(compiled, "linear_max_rows_pairs", 1 << 16)
    E, H, I, k, T = 6, 80, 72, 3, 200
    x = randn(T, H, dtype=dtype, seed=11)
    w13, w2 = experts(E, H, I, dtype, seed=5)
    w, ids = route(T, E + 2, k, H, seed=13)
    ids = ids - 1  # -1 and E: another rank's
    packed = compiled.pack_moe_weights(w13, w2)
    calls = []
    monkeypatch.setattr(Kernels, "fused_moe", lambda *a, **kw: calls.append(1))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = compiled.fused_moe(x, w13, w2, w, ids, packed)
    finally:
        torch.set_num_threads(threads)
    assert not calls, "fell back to the twin"
    monkeypatch.undo()
    _check(got, ref.fused_moe(x, w13, w2, w, ids))


def test_compiled_falls_back_above_its_top_k(compiled):
    from bladellm.kernels.compiled import MOE_MAX_TOP_K

    E, H, I = MOE_MAX_TOP_K + 1, 16, 8
    x = randn(2, H)
    w13, w2 = experts(E, H, I, torch.float32)
    w, ids = route(2, E, E, H)
    _check(compiled.fused_moe(x, w13, w2, w, ids), ref.fused_moe(x, w13, w2, w, ids))
