"""Per-layer attention features (sliding window, ALiBi, logit soft-capping) in the compiled
CPU kernel against the reference twin, and the twin against a dense definition. Blocks before
every query's window hold NaN: no path may read them (the KV manager frees them)."""

from __future__ import annotations

import pytest
import torch

from bladellm.kernels import kv_int8, ref
from bladellm.kernels.interface import Kernels

from attention_features_cases import alibi, batch, feature_sets, run

TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5),
             torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}
# Decodes, verifications, prefill chunks after a prefix, a long prefill (several key tiles and
# rows whose window starts mid-tile), a context on a block boundary.
Q_LENS = [1, 4, 37, 1, 70, 1, 6, 32]
SEQ_LENS = [1, 33, 37, 64, 200, 65, 128, 129]
SHAPES = [(12, 4, 64, 16), (8, 1, 64, 1), (6, 3, 48, 16), (16, 2, 128, 16), (5, 5, 32, 8)]


def dense(q_lens, seq_lens, b, scale, sliding_window=None, alibi_slopes=None, soft_cap=None):
    """Each request's context gathered whole, scores written out term by term."""
    bs, kvh = b.k_cache.shape[1], b.k_cache.shape[2]
    out = torch.zeros(b.query.shape, dtype=torch.float32)
    start = 0
    for r, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        keys = []
        for p in range(seq_len):
            blk = int(b.block_tables[r, p // bs])
            keys.append((b.k_cache[blk, p % bs].float(), b.v_cache[blk, p % bs].float()))
        for j in range(q_len):
            pos = seq_len - q_len + j
            for h in range(b.query.shape[1]):
                kv_h = h // (b.query.shape[1] // kvh)
                s = []
                for p in range(seq_len):
                    if p > pos or (sliding_window is not None and pos - p >= sliding_window):
                        s.append(float("-inf"))
                        continue
                    x = float(b.query[start + j, h].float() @ keys[p][0][kv_h]) * scale
                    if soft_cap is not None:
                        x = soft_cap * float(torch.tanh(torch.tensor(x / soft_cap)))
                    if alibi_slopes is not None:
                        x += float(alibi_slopes[h]) * (p - pos)
                    s.append(x)
                w = torch.tensor(s).softmax(0)
                out[start + j, h] = sum(w[p] * keys[p][1][kv_h] for p in range(seq_len)
                                        if w[p] > 0)
        start += q_len
    return out


@pytest.mark.parametrize("name", list(feature_sets(4)))
def test_reference_matches_dense_definition(name):
    q_lens, seq_lens = [1, 5, 9], [30, 21, 9]
    features = feature_sets(4)[name]
    b = batch(q_lens, seq_lens, 4, 2, 16, 4, torch.float32, features.get("sliding_window"))
    got = run(Kernels(), b, 0.3, features)
    torch.testing.assert_close(got, dense(q_lens, seq_lens, b, 0.3, **features),
                               atol=1e-5, rtol=1e-5)


def test_window_wider_than_context_is_plain_causal():
    b = batch(Q_LENS, SEQ_LENS, 4, 2, 16, 8, torch.float32, None)
    torch.testing.assert_close(run(Kernels(), b, 0.25, dict(sliding_window=10_000)),
                               run(Kernels(), b, 0.25, {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}-kv{}-d{}-bs{}".format(*s))
@pytest.mark.parametrize("name", list(feature_sets(4)))
def test_compiled_matches_reference(compiled, dtype, shape, name):
    nh, kvh, d, bs = shape
    features = feature_sets(nh)[name]
    b = batch(Q_LENS, SEQ_LENS, nh, kvh, d, bs, dtype, features.get("sliding_window"))
    got = run(compiled, b, d ** -0.5, features)
    want = run(Kernels(), b, d ** -0.5, features)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", ["window", "alibi", "window_softcap"])
def test_compiled_long_decodes_split_into_partitions(compiled, threads, name):
    """Few long decodes: the kernel splits keys into partitions (some wholly before the
    window) and merges them."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        features = feature_sets(8)[name]
        for q_lens, seq_lens in (([1], [1000]), ([3], [2049]), ([1, 1], [513, 700])):
            b = batch(q_lens, seq_lens, 8, 2, 64, 16, torch.float32,
                      features.get("sliding_window"))
            torch.testing.assert_close(run(compiled, b, 0.125, features),
                                       run(Kernels(), b, 0.125, features),
                                       **TOLERANCE[torch.float32])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("name", ["window", "alibi", "softcap", "window_alibi"])
def test_compiled_int8_cache(compiled, name):
    features = feature_sets(8)[name]
    b = batch(Q_LENS, SEQ_LENS, 8, 2, 64, 16, torch.float32, None)
    b.k_cache, b.v_cache = kv_int8.pack(b.k_cache), kv_int8.pack(b.v_cache)
    from attention_features_cases import poison_outside_window
    poison_outside_window(b, features.get("sliding_window"), 16)
    torch.testing.assert_close(run(compiled, b, 0.125, features),
                               run(Kernels(), b, 0.125, features), atol=2e-5, rtol=2e-5)


def test_compiled_declines_slopes_of_the_wrong_length(compiled):
    """Slopes not one per query head: the compiled set hands the call to the twin, which
    raises rather than read past the end."""
    b = batch([1], [5], 4, 2, 16, 4, torch.float32, None)
    with pytest.raises(RuntimeError):
        run(compiled, b, 0.25, dict(alibi_slopes=alibi(3)))


def test_tree_attention_honours_features():
    """A chain-shaped tree is a causal run: tree attention with features equals paged
    attention of the same tokens with them (fast path and twin)."""
    from bladellm.attention import tree

    torch.manual_seed(0)
    nh, kvh, d, bs, ctx, t = 4, 2, 16, 4, 23, 5
    k_cache = torch.randn(12, bs, kvh, d)
    v_cache = torch.randn(12, bs, kvh, d)
    table = torch.randperm(12)[:8].int()
    q, k, v = torch.randn(t, nh, d), torch.randn(t, kvh, d), torch.randn(t, kvh, d)
    slots = torch.tensor([int(table[p // bs]) * bs + p % bs for p in range(ctx, ctx + t)])
    ref.reshape_and_cache(k, v, k_cache, v_cache, slots)
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    for features in feature_sets(nh).values():
        want = torch.empty(t, nh, d)
        ref.paged_attention(want, q, k_cache, v_cache, table[None], torch.tensor([0, t]),
                            torch.tensor([ctx + t]), 0.3, **features)
        got = ref.tree_attention(q, k, v, k_cache, v_cache, table, ctx, mask, 0.3, **features)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        fast = tree.tree_attention(q, k, v, k_cache, v_cache, table, ctx,
                                   tree.tree_bias(mask, ctx, nh // kvh), 0.3, **features)
        torch.testing.assert_close(fast, want, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_avx2_build_matches_reference(kernel_cache):
    """The 8-lane (AVX2) build of the features path, on a machine that runs a wider one."""
    import shutil

    from bladellm.kernels import load_kernels

    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    avx2 = load_kernels(mode="auto", cache_root=kernel_cache, isa="avx2")
    if avx2.name != "compiled":
        pytest.skip("this machine cannot run the AVX2 build")
    for nh, kvh, d, bs in SHAPES:
        for name, features in feature_sets(nh).items():
            b = batch(Q_LENS, SEQ_LENS, nh, kvh, d, bs, torch.float32,
                      features.get("sliding_window"))
            torch.testing.assert_close(run(avx2, b, d ** -0.5, features),
                                       run(Kernels(), b, d ** -0.5, features),
                                       **TOLERANCE[torch.float32])
