"""Triton fused MoE (bladellm/kernels/triton/moe.py) against its twin ref.fused_moe: on a GPU
when there is one, otherwise under ``TRITON_INTERPRET=1``. fp32 within GEMM rounding; 16-bit
within an ulp of the sum (the kernel sums the top-k slots in fp32 and rounds once)."""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
assert ON_GPU or os.environ.get("TRITON_INTERPRET") == "1"
pytest.importorskip("triton")

from bladellm.kernels import ref  # noqa: E402
from bladellm.kernels.triton import moe  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"


def randn(*shape: int, dtype=torch.float32, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def case(T: int, E: int, k: int, H: int, I: int, dtype, seed: int = 0):
    x = randn(T, H, dtype=dtype, seed=seed)
    w13 = randn(E, 2 * I, H, dtype=dtype, seed=seed + 1, scale=H ** -0.5)
    w2 = randn(E, H, I, dtype=dtype, seed=seed + 2, scale=I ** -0.5)
    w, ids = ref.moe_route(randn(T, E, seed=seed + 3), k, True)
    return x, w13, w2, w, ids


def test_align_by_expert_groups_and_pads():
    ids = torch.tensor([[2, 0], [2, 1], [0, 5]], device=DEVICE)  # 5: another rank's expert
    pairs, experts = moe.align_by_expert(ids, 4, 4)
    n = ids.numel()
    assert experts.tolist() == [0, 1, 2]  # expert 3 has no pair: no block
    assert pairs.tolist() == [1, 4, n, n, 3, n, n, n, 0, 2, n, n]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", [1, 7, 40])
def test_triton_matches_twin(dtype, T):
    x, w13, w2, w, ids = case(T, 6, 2, 32, 48, dtype, seed=T)
    got = moe.fused_moe(x, w13, w2, w, ids)
    want = ref.fused_moe(x, w13, w2, w, ids)
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    else:
        scale = float(want.float().abs().max())
        assert float((got.float() - want.float()).abs().max()) <= 0.03 * scale


def test_triton_skips_foreign_experts():
    x, w13, w2, w, ids = case(5, 8, 3, 32, 16, torch.float32)
    local = ids - 4  # this "rank" holds experts 4..7 as 0..3
    got = moe.fused_moe(x, w13[4:], w2[4:], w, local)
    torch.testing.assert_close(got, ref.fused_moe(x, w13[4:], w2[4:], w, local),
                               atol=1e-5, rtol=1e-4)
    none = moe.fused_moe(x, w13[4:], w2[4:], w, ids + 100)
    assert torch.equal(none, torch.zeros_like(x))
