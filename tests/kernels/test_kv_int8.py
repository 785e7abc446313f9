"""int8 KV cache (``--kv_cache_quant int8``): the compiled writer and paged attention against
their reference twins, and the twin against plain fp32 attention over the dequantized cache."""

from __future__ import annotations

import pytest
import torch

from bladellm.kernels import kv_int8, ref
from bladellm.kernels.interface import Kernels

from kernel_cases import PagedBatch, make_batch, share_prefix

# The same fp32 math after an exact dequantization: only the summation order differs (K/V rows
# here reach |x| ~ 30, scores ~ 100: 10x test_paged_attention's absolute tolerance).
TOLERANCE = {torch.float32: dict(atol=2e-4, rtol=2e-4),
             torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}

# (num_heads, num_kv_heads, head_dim, block_size)
SHAPES = [
    (12, 4, 64, 16),   # the 88M model: GQA 3
    (9, 3, 64, 16),    # SmolLM2-135M: GQA 3, 3 KV heads
    (4, 4, 128, 32),   # MHA, head_dim 128
    (8, 1, 64, 1),     # MQA, one slot per block
    (6, 3, 48, 8),     # head_dim 48: the generic (not unrolled) path
    (16, 2, 128, 16),  # GQA 8
]
MIXED_Q_LENS = [1, 4, 37, 1, 70, 1, 6, 32]
MIXED_SEQ_LENS = [1, 33, 37, 64, 200, 65, 128, 129]


def _int8_batch(q_lens, seq_lens, nh, kvh, d, bs, dtype, seed=0) -> PagedBatch:
    """``make_batch`` with its caches quantized (rows of mixed magnitude, one all-zero row)."""
    b = make_batch(q_lens, seq_lens, nh, kvh, d, bs, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    spread = torch.rand(b.k_cache.shape[:-1] + (1,), generator=g) * 8  # per-row magnitudes
    k, v = b.k_cache.float() * spread, b.v_cache.float() * spread
    k[0, 0, 0] = 0.0  # absmax 0: scale 0, reads back as zeros
    return PagedBatch(b.query, kv_int8.pack(k.to(dtype)), kv_int8.pack(v.to(dtype)),
                      b.block_tables, b.query_start_loc, b.seq_lens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}-kv{}-d{}-bs{}".format(*s))
def test_int8_attention_matches_reference(compiled, dtype, shape):
    nh, kvh, d, bs = shape
    batch = _int8_batch(MIXED_Q_LENS, MIXED_SEQ_LENS, nh, kvh, d, bs, dtype)
    assert batch.k_cache.dtype == torch.int8 and batch.k_cache.shape[-1] == d + 4
    got = batch.run(compiled, d ** -0.5)
    want = batch.run(Kernels(), d ** -0.5)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


@pytest.mark.parametrize("threads", [1, 2])
def test_int8_shared_prefixes(compiled, threads):
    """Decodes on common prefix blocks (one shared pass dequantizes each prefix tile once for
    all of them) next to decodes on their own blocks."""
    q_lens, seq_lens = [1] * 10, [300, 250, 260, 301, 90, 300, 200, 150, 70, 33]
    batch = _int8_batch(q_lens, seq_lens, 9, 3, 64, 16, torch.float32, seed=5)
    share_prefix(batch, [0, 1, 2, 3], 240, 16)
    share_prefix(batch, [4, 5, 6], 80, 16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = batch.run(compiled, 0.125)
        plan = compiled.attention_plan(batch.query, batch.k_cache, batch.v_cache,
                                       batch.block_tables, batch.query_start_loc,
                                       batch.seq_lens)
    finally:
        torch.set_num_threads(before)
    assert plan["shared_requests"] == 7, plan
    torch.testing.assert_close(got, batch.run(Kernels(), 0.125), **TOLERANCE[torch.float32])


@pytest.mark.parametrize("threads", [1, 2])
def test_int8_decodes_and_split_long_contexts(compiled, threads):
    """Decode batches and single long requests (keys split into partitions and merged)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for q_lens, seq_lens, kvh in (([1] * 9, [5, 16, 17, 300, 31, 32, 600, 2, 47], 4),
                                      ([1], [1000], 1), ([3], [2049], 1), ([1], [513], 2)):
            batch = _int8_batch(q_lens, seq_lens, 8, kvh, 64, 16, torch.float32,
                                seed=len(seq_lens))
            torch.testing.assert_close(batch.run(compiled, 0.125), batch.run(Kernels(), 0.125),
                                       **TOLERANCE[torch.float32])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_int8_equals_fp32_attention_on_dequantized_cache(dtype):
    """The twin reads an int8 cache exactly as fp32 attention reads its dequantized copy."""
    batch = _int8_batch(MIXED_Q_LENS, MIXED_SEQ_LENS, 12, 4, 64, 16, dtype)
    dense = PagedBatch(batch.query.float(), kv_int8.dequantize(batch.k_cache),
                       kv_int8.dequantize(batch.v_cache), batch.block_tables,
                       batch.query_start_loc, batch.seq_lens)
    torch.testing.assert_close(batch.run(Kernels(), 0.125).float(),
                               dense.run(Kernels(), 0.125), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 48])
def test_cache_write_bit_identical_to_reference(compiled, dtype, d):
    """The compiled writer quantizes exactly like the twin (same int8 values, same scales),
    from strided key/value views as the model passes them; padding slots (-1) are skipped."""
    g = torch.Generator().manual_seed(d)
    kvh, n = 3, 37
    qkv = (torch.randn(n, 6 + 2 * kvh, d, generator=g) * 5).to(dtype)
    key, value = qkv[:, 6:6 + kvh], qkv[:, 6 + kvh:]
    key[3, 1] = 0
    slots = torch.randperm(64, generator=g)[:n]
    slots[-1] = -1
    caches = [torch.zeros(8, 8, kvh, d + 4, dtype=torch.int8) for _ in range(4)]
    ref.reshape_and_cache(key[:-1], value[:-1], caches[0], caches[1], slots[:-1])
    compiled.reshape_and_cache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_quantization_error_is_within_half_a_step():
    """|x - dequant(quant(x))| <= scale / 2 per row (round to nearest), exact zeros kept."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 4, 64, generator=g) * torch.rand(50, 4, 1, generator=g) * 10
    x[7, 2] = 0.0
    packed = kv_int8.pack(x)
    _, scales = kv_int8.split(packed)
    err = (kv_int8.dequantize(packed) - x).abs()
    assert torch.all(err <= scales.unsqueeze(-1) * 0.5 + 1e-6)
    assert torch.equal(kv_int8.dequantize(packed[7, 2]), torch.zeros(64))
    torch.testing.assert_close(scales, x.abs().amax(-1) / 127)
