"""Kernels.linear (the compiled small-M GEMV, oneDNN / F.linear above its crossover) vs
F.linear: equal within GEMM rounding (fp32 accumulation, one rounding to the dtype), on every
supported dtype, M around the crossover, odd N and K, with and without bias, and the
reference path for what the kernel does not take."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from bladellm.kernels import Kernels, load_kernels
from bladellm.kernels.compiled import LINEAR_MAX_ROWS_PANEL

DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(1280, 768), (67, 100), (5, 33), (130, 7), (1, 64), (17, 2048)]  # (N, K)


def randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def check_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                b: torch.Tensor | None) -> None:
    """got vs the exact (fp64) product: fp32 within accumulation rounding; bf16 within one
    rounding of the fp32 sum (half an ulp, plus the accumulation error)."""
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == x.dtype and got.shape == exact.shape
    K = x.shape[-1]
    scale = float(exact.abs().max()) + 1.0
    if x.dtype == torch.float32:
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=2e-6 * K ** 0.5 * scale)
    else:
        torch.testing.assert_close(got.double(), exact, rtol=2 ** -8, atol=1e-5 * K * scale)
    err = (got.double() - exact).abs()
    if x.dtype == torch.float32:
        # Any fp32 GEMM, whatever its summation order (MKL, oneDNN's blocked kernels on AVX2
        # vs AVX-512, ours), meets the classic forward error bound |err| <= gamma_{K+1} |x||w|
        # (+|b|), gamma_n = n u / (1 - n u); a product accumulated in lower precision does not.
        u = 2.0 ** -24
        gamma = (K + 1) * u / (1 - (K + 1) * u)
        bound = F.linear(x.double().abs(), w.double().abs(),
                         None if b is None else b.double().abs()) * gamma
        assert bool((err <= bound + 1e-30).all()), float((err - bound).max())
        return
    # bf16: no worse than F.linear itself (beyond a unit in the last place), i.e. accumulated
    # in fp32 and rounded once.
    want = F.linear(x, w, b).double()
    ulp = exact.abs() * 2 ** -7 + 1e-30
    assert float((err - (want - exact).abs() - ulp).max()) <= 1e-6 * scale


# The panel layout's row limit in these tests: the production one (LINEAR_MAX_ROWS_PANEL) is
# above any step, so a low one lets the tests cross it (past it linear falls back to F.linear).
PANEL_ROWS = 64


@pytest.fixture(params=["panel", "rows"])
def layout(request, compiled, monkeypatch) -> str:
    """fp32 weights packed in panels and bf16 weights in pair panels (what AVX2 machines do) or
    kept in rows with a oneDNN copy (elsewhere): both are tested on every machine (the pair
    panels on vdpbf16ps where the CPU has AVX512-BF16, on widened FMAs elsewhere)."""
    rows = PANEL_ROWS if request.param == "panel" else 0
    monkeypatch.setattr(compiled, "linear_max_rows_panel", rows)
    monkeypatch.setattr(compiled, "linear_max_rows_pairs", rows)
    return request.param


def rows_around(compiled, dtype: torch.dtype) -> list[int]:
    top = compiled.linear_max_rows[dtype]
    return sorted({1, 2, 3, 4, 5, max(1, top - 1), top, top + 1, 33})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(compiled, dtype, shape, bias):
    N, K = shape
    w = randn(N, K, dtype=dtype, seed=1)
    b = randn(N, dtype=dtype, seed=2) if bias else None
    for M in rows_around(compiled, dtype):
        x = randn(M, K, dtype=dtype, seed=M)
        check_close(compiled.linear(x, w, b), x, w, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1280, 768), (67, 100), (33, 7)])
def test_linear_with_packed_weight(compiled, layout, dtype, shape):
    """What pack_linear_weight made at load time (if anything) gives the same products, on
    both sides of every crossover (a panel's zero-padded tail included: N % 32 != 0)."""
    N, K = shape
    w = randn(N, K, dtype=dtype, seed=1)
    b = randn(N, dtype=dtype, seed=2)
    packed = compiled.pack_linear_weight(w)
    # The runner decides from the bound, before packing, whether the copies fit.
    assert compiled.packed_bytes(packed) <= compiled.packed_bytes_bound(w)
    if layout == "panel" and dtype == torch.float32:
        assert compiled.packed_bytes(packed) == compiled.packed_bytes_bound(w)
        assert packed.panel is not None and packed.narrow is None and packed.pairs is None
        assert packed.panel.shape == (-(-N // compiled.panel_width), K, compiled.panel_width)
    elif layout == "panel":
        assert compiled.packed_bytes(packed) == compiled.packed_bytes_bound(w)
        assert packed.pairs is not None and packed.onednn is None and packed.panel is None
        width = compiled.pair_panel_width
        assert packed.pairs.shape == (-(-N // width), -(-K // 2), width, 2)
    else:
        assert packed is None or (packed.panel is None and packed.pairs is None)
    rows = rows_around(compiled, dtype) + [7, 13, PANEL_ROWS, PANEL_ROWS + 1, 256]
    for M in sorted(set(rows)):
        x = randn(M, K, dtype=dtype, seed=M)
        check_close(compiled.linear(x, w, b, packed), x, w, b)
        check_close(compiled.linear(x, w, None, packed), x, w, None)


def test_panel_layout_takes_every_step_without_a_onednn_copy(compiled, monkeypatch):
    """At the production limit the panels take every step the scheduler can make (its token
    budget included), so no oneDNN copy is kept; big batches give F.linear's products and the
    rows of a 300-row batch are those of the same rows alone."""
    monkeypatch.setattr(compiled, "linear_max_rows_panel", LINEAR_MAX_ROWS_PANEL)
    from bladellm.config import SchedulerConfig

    assert LINEAR_MAX_ROWS_PANEL >= SchedulerConfig().max_num_batched_tokens
    w = randn(200, 96, dtype=torch.float32, seed=1)
    b = randn(200, dtype=torch.float32, seed=2)
    packed = compiled.pack_linear_weight(w)
    assert packed.onednn is None and packed.panel is not None
    assert compiled.packed_bytes(packed) == packed.panel.numel() * 4
    x = randn(300, 96, dtype=torch.float32, seed=3)
    full = compiled.linear(x, w, b, packed)
    check_close(full, x, w, b)
    for M in (1, 3, 65, 257):
        assert torch.equal(compiled.linear(x[:M], w, b, packed), full[:M])


@pytest.mark.parametrize("dtype", DTYPES)
def test_panel_rows_do_not_depend_on_the_batch(compiled, layout, dtype):
    """Each output of the panel kernels (fp32 panels, bf16 pair panels) is one chain along K
    whatever the tile it ran in: a row's result is the same bits alone or in a batch of any
    size (speculative decoding's verification and a plain decode see the same logits)."""
    if layout != "panel":
        pytest.skip("the panel kernels only")
    w = randn(200, 97, dtype=dtype, seed=1)  # K odd: the pair panels' padded last pair
    b = randn(200, dtype=dtype, seed=2)
    packed = compiled.pack_linear_weight(w)
    x = randn(PANEL_ROWS, 97, dtype=dtype, seed=3)
    full = compiled.linear(x, w, b, packed)
    check_close(full, x, w, b)
    for M in (1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 31):
        assert torch.equal(compiled.linear(x[:M], w, b, packed), full[:M])
    assert torch.equal(compiled.linear(x[5:6], w, b, packed), full[5:6])
    too_many = randn(PANEL_ROWS + 1, 97, dtype=dtype)
    if dtype == torch.float32:
        with pytest.raises(ValueError, match="linear_panel takes"):
            compiled.linear_panel(too_many, packed.panel, 200, b)
    else:
        with pytest.raises(ValueError, match="linear_pairs takes"):
            compiled.linear_pairs(too_many, packed.pairs, 200, b)


def test_pair_panels_over_many_rows(compiled, monkeypatch):
    """A step of more rows than the widened-x buffer holds at once (without AVX512-BF16, x is
    widened a block of ~2^20 / K rows at a time): every block's rows are right and equal to
    the same rows alone."""
    monkeypatch.setattr(compiled, "linear_max_rows_pairs", LINEAR_MAX_ROWS_PANEL)
    N, K = 40, 4099  # 255 rows per block
    w = randn(N, K, dtype=torch.bfloat16, seed=1)
    b = randn(N, dtype=torch.bfloat16, seed=2)
    pairs = compiled.pack_pairs(w)
    x = randn(600, K, dtype=torch.bfloat16, seed=3)
    full = compiled.linear_pairs(x, pairs, N, b)
    check_close(full, x, w, b)
    for lo, hi in ((0, 1), (250, 260), (599, 600)):
        assert torch.equal(compiled.linear_pairs(x[lo:hi], pairs, N, b), full[lo:hi])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_exact_bf16_copy_is_bit_identical(compiled, layout, shape, bias):
    """An fp32 weight of exact bf16 values (a bf16 checkpoint served in fp32) gets a bf16 copy
    that small batches stream instead (in rows, or packed in panels): the products are those
    of the fp32 kernel, bit for bit (widening bf16 is exact and the FMA order is the same),
    and within GEMM rounding of F.linear at every M, the kernel's and oneDNN's alike."""
    N, K = shape
    w = randn(N, K, dtype=torch.bfloat16, seed=1).float()
    b = randn(N, dtype=torch.float32, seed=2) if bias else None
    packed = compiled.pack_linear_weight(w)
    copy = packed.bf16_copy
    assert copy is not None and copy.dtype == torch.bfloat16
    assert copy is (packed.panel if layout == "panel" else packed.narrow)
    assert w.numel() * 2 <= compiled.packed_bytes(packed) <= compiled.packed_bytes_bound(w)
    if layout == "panel":
        top = compiled.linear_max_rows_panel
        fp32_panel = compiled.pack_panels(w)
        fp32 = lambda x: compiled.linear_panel(x, fp32_panel, N, b)  # noqa: E731
    else:
        top = min(compiled.linear_max_rows_narrow, compiled.linear_max_rows[torch.float32])
        fp32 = lambda x: compiled.linear(x, w, b)  # noqa: E731 - the fp32 kernel, no copy
    for M in sorted({1, 2, 3, 4, 5, 16, top, top + 1, 33}):
        x = randn(M, K, dtype=torch.float32, seed=M)
        got = compiled.linear(x, w, b, packed)
        check_close(got, x, w, b)
        if M <= top:
            assert torch.equal(got, fp32(x))


def test_linear_no_bf16_copy_of_inexact_weights(compiled, layout):
    """A weight with any value bf16 cannot hold keeps no bf16 copy (it would change results);
    a bf16 weight needs none."""
    w = randn(64, 32, dtype=torch.bfloat16, seed=1).float()
    w[5, 7] += 2 ** -20
    packed = compiled.pack_linear_weight(w)
    assert packed is None or packed.narrow is None
    assert packed is None or packed.panel is None or packed.panel.dtype == torch.float32
    packed = compiled.pack_linear_weight(w.to(torch.bfloat16))
    assert packed is None or packed.narrow is None


def test_stale_bf16_copy_is_not_used(compiled, layout):
    """A packed form made for another weight (the layer's weight was replaced, e.g. by a
    LoRA merge) is ignored."""
    w = randn(64, 32, dtype=torch.bfloat16, seed=1).float()
    packed = compiled.pack_linear_weight(w)
    other = randn(64, 32, dtype=torch.float32, seed=9)
    x = randn(1, 32, dtype=torch.float32)
    check_close(compiled.linear(x, other, None, packed), x, other, None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_views_and_leading_dims(compiled, dtype):
    w = randn(96, 80, dtype=dtype, seed=1)
    wide = randn(3, 200, dtype=dtype, seed=3)
    x = wide[:, 40:120]  # rows 200 apart
    check_close(compiled.linear(x, w), x, w, None)
    x3 = randn(2, 2, 80, dtype=dtype, seed=4)  # [batch, seq, K]
    got = compiled.linear(x3, w)
    assert got.shape == (2, 2, 96)
    check_close(got.view(4, 96), x3.view(4, 80), w, None)
    x1 = randn(80, dtype=dtype, seed=5)  # 1-D
    got = compiled.linear(x1, w)
    assert got.shape == (96,)
    check_close(got.view(1, 96), x1.view(1, 80), w, None)


def test_linear_unsupported_inputs_fall_back_to_reference(compiled):
    """float16, a non-contiguous weight, large M, dtype mixes: exactly F.linear's result (or
    its error)."""
    x = randn(2, 64, dtype=torch.float16)
    w = randn(32, 64, dtype=torch.float16, seed=1)
    assert torch.equal(compiled.linear(x, w), F.linear(x, w))
    x = randn(2, 64, dtype=torch.float32)
    wt = randn(64, 32, dtype=torch.float32, seed=1).t()  # [32, 64], column-major
    assert torch.equal(compiled.linear(x, wt), F.linear(x, wt))
    big = randn(compiled.linear_max_rows[torch.float32] + 1, 64, dtype=torch.float32)
    w = randn(32, 64, dtype=torch.float32, seed=1)
    assert torch.equal(compiled.linear(big, w), F.linear(big, w))
    with pytest.raises(RuntimeError):
        compiled.linear(x, w.to(torch.bfloat16))
    empty = torch.empty(0, 64)
    assert compiled.linear(empty, w).shape == (0, 32)


def test_reference_linear_is_f_linear():
    x, w, b = randn(3, 40, dtype=torch.float32), randn(8, 40, dtype=torch.float32, seed=1), \
        randn(8, dtype=torch.float32, seed=2)
    kernels = Kernels()
    assert kernels.pack_linear_weight(w) is None
    assert torch.equal(kernels.linear(x, w, b), F.linear(x, w, b))


def test_linear_threads(compiled):
    """The OpenMP split over N gives the same bits as one thread."""
    w = randn(4099, 300, dtype=torch.bfloat16, seed=1)
    x = randn(3, 300, dtype=torch.bfloat16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = compiled.linear(x, w)
        torch.set_num_threads(2)
        two = compiled.linear(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_unquantized_linear_method_uses_kernels(compiled):
    from bladellm.model.layers import linear as linear_mod

    method = linear_mod.UnquantizedLinearMethod(compiled)
    layer = torch.nn.Module()
    method.create_weights(layer, 64, [48, 16], torch.bfloat16, None)
    layer.weight.data.copy_(randn(64, 64, dtype=torch.bfloat16, seed=1))
    x = randn(1, 64, dtype=torch.bfloat16)
    check_close(method.apply(layer, x), x, layer.weight, None)
    method.process_weights_after_loading(layer)
    check_close(method.apply(layer, randn(40, 64, dtype=torch.bfloat16)),
                randn(40, 64, dtype=torch.bfloat16), layer.weight, None)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
@pytest.mark.parametrize("isa", ["avx512", "avx2", "generic"])
def test_other_isa_builds_linear(tmp_path, isa):
    """Without vdpbf16ps (bf16 widened to fp32 FMAs) and narrower vectors: what AVX2-only CI
    machines run."""
    flags = set(open("/proc/cpuinfo").read().split())
    needs = {"avx512": {"avx512bw"}, "avx2": {"avx2", "fma"}, "generic": set()}[isa]
    if not needs <= flags:
        pytest.skip(f"CPU without {isa}")
    kernels = load_kernels(mode="auto", cache_root=tmp_path, isa=isa)
    assert kernels.name == "compiled" and not kernels.linear_dpbf16
    for dtype in DTYPES:
        for N, K in SHAPES:
            w = randn(N, K, dtype=dtype, seed=1)
            b = randn(N, dtype=dtype, seed=2)
            for M in (1, 3, 4, 5):
                x = randn(M, K, dtype=dtype, seed=M)
                check_close(kernels.linear(x, w, b), x, w, b)
    # Both panel layouts at this build's vector width (AVX-512: 64-wide fp32 panels, 32-wide
    # pair panels on widened FMAs), whether or not this ISA takes them by default.
    kernels.linear_max_rows_panel = kernels.linear_max_rows_pairs = PANEL_ROWS
    for N, K in SHAPES:
        w = randn(N, K, dtype=torch.float32, seed=1)
        wb = w.to(torch.bfloat16)
        panel, pairs = kernels.pack_panels(w), kernels.pack_pairs(wb)
        for M in (1, 4, 7, 13):
            x = randn(M, K, dtype=torch.float32, seed=M)
            check_close(kernels.linear_panel(x, panel, N), x, w, None)
            check_close(kernels.linear_pairs(x.to(torch.bfloat16), pairs, N), x.to(torch.bfloat16),
                        wb, None)
