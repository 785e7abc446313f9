"""Triton elementwise kernels (bladellm/kernels/triton/elementwise.py) against their twins in
bladellm/kernels/ref.py: on a GPU when there is one, otherwise under ``TRITON_INTERPRET=1``.

Under the interpreter float16 rounds to nearest even, as a GPU does, so float16 results are held
to the twin's bits (or a single ulp where fp32 sums or ``exp`` differ). The interpreter's
float32 -> bfloat16 cast truncates instead, so bf16 is held to one ulp per rounding there and to
the twin's bits on a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
# tests/conftest.py sets TRITON_INTERPRET=1 without a GPU, before anything imports triton.
assert ON_GPU or os.environ.get("TRITON_INTERPRET") == "1"
pytest.importorskip("triton")

from bladellm.kernels import ref  # noqa: E402
from bladellm.kernels.triton import elementwise as ew  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _ulps(got: torch.Tensor, want: torch.Tensor, unit: torch.dtype) -> torch.Tensor:
    """|got - want| in units of the last place of ``unit`` (at want's magnitude)."""
    eps = torch.finfo(unit).eps
    spacing = want.float().abs().clamp_min(torch.finfo(unit).tiny) * eps
    return (got.float() - want.float()).abs() / spacing


def assert_bits_or_ulp(got: torch.Tensor, want: torch.Tensor, *, max_ulps: float,
                       min_exact: float, unit: torch.dtype | None = None) -> None:
    """Equal in dtype and shape, within ``max_ulps`` (of ``unit``, default the dtype: the
    precision of the last rounding that matters) everywhere, bit-identical in at least the
    fraction ``min_exact`` of elements."""
    assert got.dtype == want.dtype and got.shape == want.shape
    ulps = _ulps(got, want, unit or want.dtype)
    assert float(ulps.max()) <= max_ulps, f"max {float(ulps.max()):.2f} ulps"
    exact = float((got == want).float().mean())
    assert exact >= min_exact, f"only {exact:.4f} of elements are bit-identical"


def _strict(dtype: torch.dtype) -> bool:
    return dtype != torch.bfloat16 or ON_GPU


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


# ---- KV-cache store ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_kv_heads, head_dim, block_size", [(2, 16, 4), (3, 24, 8)])
def test_reshape_and_cache_matches_twin(dtype, num_kv_heads, head_dim, block_size):
    num_blocks, n = 6, 9
    g = torch.Generator().manual_seed(head_dim)
    # Strided key/value: views into a fused qkv output, as the backend passes them.
    qkv = _randn(n, 4 + 2 * num_kv_heads, head_dim, dtype=dtype, seed=1)
    key, value = qkv[:, 4:4 + num_kv_heads], qkv[:, 4 + num_kv_heads:]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n].to(DEVICE)
    caches = _randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, seed=2)
    want = caches.clone()
    ew.reshape_and_cache(key, value, caches[0], caches[1], slots)
    ref.reshape_and_cache(key, value, want[0], want[1], slots)
    # Equal everywhere: the mapped slots hold the rows, every other slot is untouched.
    assert torch.equal(caches, want)
    assert torch.equal(caches[1].view(-1, num_kv_heads, head_dim)[slots], value)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_int8_matches_twin_bit_for_bit(dtype):
    """``--kv_cache_quant int8`` rows: int8 values, round half to even, the fp32 scale after
    them; an all-zero row gets scale 0."""
    num_kv_heads, head_dim, block_size, n = 3, 16, 4, 7
    qkv = _randn(n, 2 + 2 * num_kv_heads, head_dim, dtype=dtype, seed=12, scale=2.0)
    key, value = qkv[:, 2:2 + num_kv_heads], qkv[:, 2 + num_kv_heads:]
    key[0, 1] = 0.0
    key[1, 0, :3] = torch.tensor([1.0, 0.5, -0.5])  # amax 1: ties at +-63.5 go to +-64
    key[1, 0, 3:] = 0.25
    slots = torch.tensor([5, 0, 11, 3, 8, 2, 15], device=DEVICE)
    caches = torch.randint(-128, 128, (2, 5, block_size, num_kv_heads, head_dim + 4),
                           dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    caches = caches.to(DEVICE)
    want = caches.clone()
    ew.reshape_and_cache(key, value, caches[0], caches[1], slots)
    ref.reshape_and_cache(key, value, want[0], want[1], slots)
    assert torch.equal(caches, want)


def test_reshape_and_cache_rejects_mismatched_shapes():
    caches = torch.zeros(2, 4, 4, 2, 16)
    with pytest.raises(ValueError, match="do not fit"):
        ew.reshape_and_cache(torch.zeros(3, 2, 8), torch.zeros(3, 2, 8), caches[0], caches[1],
                             torch.arange(3))


# ---- RMSNorm -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_fp32", [False, True])
def test_rms_norm_matches_twin(dtype, weight_fp32):
    x = _randn(7, 48, dtype=dtype, seed=3, scale=3.0)
    weight = _randn(48, dtype=torch.float32 if weight_fp32 else dtype, seed=4)
    got = ew.rms_norm(x, weight, 1e-6)
    want = ref.rms_norm(x, weight, 1e-6)
    # fp32 sums in another order can move rsqrt by an ulp, which a 16-bit rounding rarely shows.
    # The normalised value is rounded to x's dtype before an fp32 weight scales it.
    if _strict(dtype):
        assert_bits_or_ulp(got, want, max_ulps=4 if dtype == torch.float32 else 1,
                           min_exact=0.5 if dtype == torch.float32 else 0.97, unit=dtype)
    else:
        assert_bits_or_ulp(got, want, max_ulps=2, min_exact=0.1, unit=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_matches_twin(dtype):
    # 3-D input with strided rows: the layer may hand in a view.
    base = _randn(2, 5, 80, dtype=dtype, seed=5, scale=2.0)
    x = base[:, :, :40]
    residual = _randn(2, 5, 40, dtype=dtype, seed=6)
    weight = _randn(40, dtype=dtype, seed=7)
    x_before, res_before = x.clone(), residual.clone()
    got, got_res = ew.fused_add_rms_norm(x, residual, weight, 1e-5)
    want, want_res = ref.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(x, x_before) and torch.equal(residual, res_before)
    if _strict(dtype):
        assert torch.equal(got_res, want_res)  # one correctly rounded add
        assert_bits_or_ulp(got, want, max_ulps=4 if dtype == torch.float32 else 1,
                           min_exact=0.5 if dtype == torch.float32 else 0.97)
    else:
        assert_bits_or_ulp(got_res, want_res, max_ulps=1, min_exact=0.1)
        assert_bits_or_ulp(got, want, max_ulps=3, min_exact=0.1)


def test_rms_norm_rejects_bad_weight():
    with pytest.raises(ValueError, match="weight"):
        ew.rms_norm(torch.zeros(2, 8), torch.ones(4), 1e-6)


# ---- Rotary --------------------------------------------------------------------------------------

def _cos_sin(max_pos: int, rotary_dim: int, dtype: torch.dtype):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]
    return freqs.cos().to(dtype).to(DEVICE), freqs.sin().to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, rotary_dim", [
    (4, 2, 16, 16),   # GQA, full rotary
    (3, 1, 32, 16),   # partial rotary (dims 16..31 pass through), heads not a power of two
])
def test_rotary_in_place_matches_twin(dtype, num_heads, num_kv_heads, head_dim, rotary_dim):
    t = 6
    cos, sin = _cos_sin(64, rotary_dim, dtype)
    qkv = _randn(t, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=8)
    q, k = qkv[:, :num_heads * head_dim], qkv[:, num_heads * head_dim:
                                               (num_heads + num_kv_heads) * head_dim]
    positions = torch.tensor([0, 1, 7, 8, 40, 63], device=DEVICE)
    want_q, want_k = ref.rotary_embedding(positions, q, k, cos, sin, head_dim, rotary_dim,
                                          inplace=False)
    v_before = qkv[:, (num_heads + num_kv_heads) * head_dim:].clone()
    got_q, got_k = ew.rotary_embedding(positions, q, k, cos, sin, head_dim, rotary_dim)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim:], v_before)  # v untouched
    if _strict(dtype):
        # fp32: the GPU compiler may contract a product and a sum into one FMA.
        exact = dtype != torch.float32 or not ON_GPU
        for got, want in ((q, want_q), (k, want_k)):
            assert_bits_or_ulp(got, want, max_ulps=0 if exact else 2,
                               min_exact=1.0 if exact else 0.9)
    else:
        for got, want in ((q, want_q), (k, want_k)):
            # Three truncations instead of roundings: at most a few ulps of a rotated value.
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
            assert float((got == want).float().mean()) > 0.5


def test_rotary_not_in_place_leaves_inputs():
    dtype = torch.float16
    cos, sin = _cos_sin(16, 16, dtype)
    q, k = _randn(3, 32, dtype=dtype, seed=9), _randn(3, 16, dtype=dtype, seed=10)
    q0, k0 = q.clone(), k.clone()
    positions = torch.tensor([3, 0, 15], device=DEVICE)
    got_q, got_k = ew.rotary_embedding(positions, q, k, cos, sin, 16, 16, inplace=False)
    want_q, want_k = ref.rotary_embedding(positions, q, k, cos, sin, 16, 16, inplace=False)
    assert torch.equal(q, q0) and torch.equal(k, k0)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert not torch.equal(got_q, q0)  # position 3 and 15 rows did rotate


def test_rotary_rejects_mixed_dtypes():
    cos, sin = _cos_sin(8, 16, torch.float32)
    with pytest.raises(ValueError, match="share a dtype"):
        ew.rotary_embedding(torch.zeros(2, dtype=torch.long), torch.zeros(2, 16).half(),
                            torch.zeros(2, 16).half(), cos, sin, 16, 16)


# ---- SiLU and mul --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, block", [((5, 2 * 40), 16), ((2, 3, 2 * 8), 1024)])
def test_silu_and_mul_matches_twin(dtype, shape, block):
    x = _randn(*shape, dtype=dtype, seed=11, scale=4.0)
    got = ew.silu_and_mul(x, block=block)
    want = ref.silu_and_mul(x)
    # exp differs from torch's by an ulp of fp32, which a 16-bit rounding rarely shows.
    if _strict(dtype):
        assert_bits_or_ulp(got, want, max_ulps=4 if dtype == torch.float32 else 1,
                           min_exact=0.5 if dtype == torch.float32 else 0.95)
    else:
        assert_bits_or_ulp(got, want, max_ulps=2, min_exact=0.1)
