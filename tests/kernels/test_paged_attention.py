"""Compiled paged attention vs its reference twin (and the reference vs dense causal SDPA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bladellm.kernels import ref
from bladellm.kernels.interface import Kernels

from kernel_cases import make_batch, share_prefix

# fp32: same math, different summation order. bf16: inputs and output rounded to bf16.
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5),
             torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}

# (num_heads, num_kv_heads, head_dim, block_size)
SHAPES = [
    (12, 4, 64, 16),   # the 88M model: GQA 3
    (4, 4, 128, 32),   # MHA
    (8, 1, 64, 1),     # MQA, one slot per block
    (6, 3, 48, 16),    # head_dim 48: a multiple of 16 but neither 64 nor 128 (generic path)
    (16, 2, 128, 16),  # GQA 8: the query tile holds only a few tokens
]

# One batch mixes every kind of request the engine sends, in no particular order:
# decodes, speculative verification (1 + k), prefill chunks after cached prefixes, a full
# prefill, contexts ending exactly on a block boundary and one past it.
MIXED_Q_LENS = [1, 4, 37, 1, 70, 1, 6, 32]
MIXED_SEQ_LENS = [1, 33, 37, 64, 200, 65, 128, 129]


def scale_for(head_dim: int) -> float:
    return head_dim ** -0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}-kv{}-d{}-bs{}".format(*s))
def test_mixed_batch_matches_reference(compiled, dtype, shape):
    nh, kvh, d, bs = shape
    batch = make_batch(MIXED_Q_LENS, MIXED_SEQ_LENS, nh, kvh, d, bs, dtype)
    assert batch.query.stride(0) != nh * d  # a strided view, as the model passes it
    got = batch.run(compiled, scale_for(d))
    want = batch.run(Kernels(), scale_for(d))
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


# GQA groups the decode row path takes in chunks of up to four query heads (6 = 4 + 2 at
# head_dim 128, where four rows' accumulators do not fit the registers at once; 7 = 4 + 3),
# and head dims without a specialisation (one row at a time): 80 (an odd number of 16-lane
# vectors) with groups of 5, and 96. Odd key counts in the last tile pair a key with a zero
# one on the bf16 pair path.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(10, 2, 80, 16), (12, 2, 128, 16), (14, 2, 64, 16),
                                   (7, 1, 96, 16)],
                         ids=lambda s: "h{}-kv{}-d{}-bs{}".format(*s))
def test_query_head_groups_and_generic_head_dims(compiled, dtype, shape):
    nh, kvh, d, bs = shape
    batch = make_batch([1, 1, 1, 2, 1, 5, 17], [1, 15, 17, 33, 300, 40, 17], nh, kvh, d, bs,
                       dtype, seed=5)
    torch.testing.assert_close(batch.run(compiled, scale_for(d)),
                               batch.run(Kernels(), scale_for(d)), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_batch_and_long_contexts(compiled, dtype, threads):
    """Many decodes of different lengths, plus single long requests: with few work items the
    kernel splits the keys of one request into partitions and merges them."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for q_lens, seq_lens, kvh in (([1] * 9, [5, 16, 17, 300, 31, 32, 600, 2, 47], 4),
                                      ([1], [1000], 1), ([3], [2049], 1), ([1], [513], 2)):
            batch = make_batch(q_lens, seq_lens, 8, kvh, 64, 16, dtype, seed=len(seq_lens))
            torch.testing.assert_close(batch.run(compiled, 0.125), batch.run(Kernels(), 0.125),
                                       **TOLERANCE[dtype])
    finally:
        torch.set_num_threads(before)


# Requests on common prefixes, as prompt-cache hits leave them (cascade: the kernel reads a
# shared prefix once for all the requests on it). (members, shared keys): a group of decodes,
# one of which ends within the prefix (it shares only its full blocks before its token) and one
# whose whole context is shorter than the prefix; 4-token verifications sharing a prefix; two
# decodes sharing exactly the minimum; a 2-token request and a prefill chunk on the first
# prefix (other query lengths: not grouped with the decodes); a request too short to share.
SHARED_Q_LENS = [1, 1, 1, 1, 1, 4, 4, 1, 1, 2, 37, 1, 1]
SHARED_SEQ_LENS = [300, 257, 129, 70, 400, 200, 180, 96, 300, 130, 300, 63, 260]
SHARED_GROUPS = [([0, 1, 2, 3, 4, 9, 10, 12], 256), ([5, 6], 160), ([7, 8], 64)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}-kv{}-d{}-bs{}".format(*s))
def test_shared_prefixes_match_reference(compiled, dtype, shape, threads):
    nh, kvh, d, bs = shape
    batch = make_batch(SHARED_Q_LENS, SHARED_SEQ_LENS, nh, kvh, d, bs, dtype, seed=3)
    for members, keys in SHARED_GROUPS:
        share_prefix(batch, members, keys, bs)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        plan = compiled.attention_plan(batch.query, batch.k_cache, batch.v_cache,
                                       batch.block_tables, batch.query_start_loc,
                                       batch.seq_lens)
        got = batch.run(compiled, scale_for(d))
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, batch.run(Kernels(), scale_for(d)), **TOLERANCE[dtype])
    # Grouped: decodes 0, 1, 4, 12 on the whole prefix; 2 and 3 (whose contexts end inside it)
    # on what they share; the verifications 5-6; decodes 7-8. Not 9 (2 tokens), 10 (37), 11.
    assert plan["shared_passes"] >= 4, plan
    assert plan["shared_requests"] == 10, plan


def test_shared_prefix_plan_groups_only_common_blocks(compiled):
    """No pass without a common prefix of at least 64 keys; a pass per prefix otherwise."""
    q_lens, seq_lens = [1] * 8, [200] * 8
    batch = make_batch(q_lens, seq_lens, 9, 3, 64, 16, torch.float32)
    args = (batch.query, batch.k_cache, batch.v_cache, batch.block_tables,
            batch.query_start_loc, batch.seq_lens)
    assert compiled.attention_plan(*args)["shared_passes"] == 0
    share_prefix(batch, [0, 1, 2, 3], 48, 16)  # 3 blocks: under the 64-key minimum
    assert compiled.attention_plan(*args)["shared_passes"] == 0
    share_prefix(batch, [0, 1, 2, 3], 128, 16)
    share_prefix(batch, [4, 5, 6, 7], 192, 16)
    plan = compiled.attention_plan(*args)
    assert plan["shared_passes"] == 2 and plan["shared_requests"] == 8, plan


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_prefill_matches_dense_causal_sdpa(compiled, dtype):
    """A full prefill of one request through the paged cache equals plain causal SDPA over the
    same tokens (GQA by enable_gqa)."""
    nh, kvh, d, bs, L = 8, 2, 64, 16, 77
    batch = make_batch([L], [L], nh, kvh, d, bs, dtype)
    blocks = batch.block_tables[0, :-(-L // bs)].long()
    k = batch.k_cache.index_select(0, blocks).reshape(-1, kvh, d)[:L]
    v = batch.v_cache.index_select(0, blocks).reshape(-1, kvh, d)[:L]
    dense = F.scaled_dot_product_attention(
        batch.query.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None],
        v.float().transpose(0, 1)[None], is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    for kernels in (compiled, Kernels()):
        torch.testing.assert_close(batch.run(kernels, scale_for(d)).float(), dense,
                                   **TOLERANCE[dtype])


def test_query_tokens_see_only_their_past(compiled):
    """Changing the cache after a query's position must not change that query's output."""
    batch = make_batch([8], [40], 4, 2, 64, 16, torch.float32)
    before = batch.run(compiled, 0.125)
    # Position 35 = query 3 of 8 (queries sit at 32..39): disturb keys/values at 36..39.
    block = int(batch.block_tables[0, 2])
    batch.k_cache[block, 4:8] += 10.0
    batch.v_cache[block, 4:8] -= 10.0
    after = batch.run(compiled, 0.125)
    torch.testing.assert_close(after[:4], before[:4], atol=0, rtol=0)
    assert not torch.allclose(after[4:], before[4:])


def test_unsupported_head_dim_and_int64_tables_fall_back_or_convert(compiled):
    """head_dim 40 (not a multiple of 16) runs the reference; int64 metadata is accepted."""
    batch = make_batch([1, 5], [20, 5], 4, 2, 40, 16, torch.float32)
    torch.testing.assert_close(batch.run(compiled, 0.2), batch.run(Kernels(), 0.2),
                               atol=0, rtol=0)
    batch = make_batch([1, 5], [20, 5], 4, 2, 64, 16, torch.float32)
    want = batch.run(compiled, 0.2)
    batch.block_tables = batch.block_tables.long()
    batch.query_start_loc = batch.query_start_loc.long()
    batch.seq_lens = batch.seq_lens.long()
    torch.testing.assert_close(batch.run(compiled, 0.2), want, atol=0, rtol=0)


def test_reference_handles_float16():
    batch = make_batch([3], [9], 2, 1, 32, 4, torch.float16)
    out = batch.run(Kernels(), 0.3)
    batch32 = make_batch([3], [9], 2, 1, 32, 4, torch.float32)
    torch.testing.assert_close(out.float(), batch32.run(Kernels(), 0.3), atol=2e-3, rtol=2e-3)


def test_reshape_and_cache_matches_reference(compiled):
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        qkv = torch.randn(6, 4 + 2 + 2, 64, generator=g).to(dtype)
        key, value = qkv[:, 4:6], qkv[:, 6:8]  # strided views of the fused projection
        for slots in (torch.tensor([5, 0, 63, 17, 18, 40]),
                      torch.tensor([5, 0, 63, 17, 18, 40], dtype=torch.int32)):
            caches = [torch.zeros(2, 4, 16, 2, 64, dtype=dtype) for _ in range(2)]
            compiled.reshape_and_cache(key, value, caches[0][0], caches[0][1], slots)
            ref.reshape_and_cache(key, value, caches[1][0], caches[1][1], slots)
            assert torch.equal(caches[0], caches[1])
            flat = caches[0][0].view(-1, 2, 64)
            assert torch.equal(flat[slots.long()], key)


def test_empty_step_is_a_no_op(compiled):
    """No requests (or no tokens) at all: nothing is read or written, nothing crashes."""
    out, query = torch.empty(0, 4, 64), torch.empty(0, 4, 64)
    cache = torch.zeros(2, 16, 2, 64)
    compiled.paged_attention(out, query, cache, cache, torch.zeros(0, 4, dtype=torch.int32),
                             torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                             0.125)
    compiled.reshape_and_cache(torch.empty(0, 2, 64), torch.empty(0, 2, 64), cache, cache,
                               torch.empty(0, dtype=torch.int64))
    assert not cache.any()
    assert compiled.rms_norm(torch.empty(0, 64), torch.ones(64), 1e-6).shape == (0, 64)
    assert compiled.silu_and_mul(torch.empty(0, 128)).shape == (0, 64)
