"""The masked (tree) attention path: a causal mask reproduces paged attention, and a tree
token sees exactly the context plus the tree tokens its mask allows."""

from __future__ import annotations

import pytest
import torch

from bladellm.attention import tree
from bladellm.kernels import ref


def _cache(num_blocks=8, block_size=4, kvh=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_blocks, block_size, kvh, d, generator=g),
            torch.randn(num_blocks, block_size, kvh, d, generator=g))


def test_causal_mask_equals_paged_attention():
    k_cache, v_cache = _cache()
    table = torch.tensor([3, 5, 1, 6], dtype=torch.int32)
    ctx, t, nh = 9, 5, 4
    g = torch.Generator().manual_seed(1)
    q = torch.randn(t, nh, 8, generator=g)
    k = torch.randn(t, 2, 8, generator=g)
    v = torch.randn(t, 2, 8, generator=g)
    tree = ref.tree_attention(q, k, v, k_cache, v_cache, table, ctx,
                              torch.tril(torch.ones(t, t, dtype=torch.bool)), 0.3)
    # The same tokens stored in the cache at positions ctx..ctx+t-1, through paged attention.
    slots = torch.tensor([int(table[p // 4]) * 4 + p % 4 for p in range(ctx, ctx + t)])
    ref.reshape_and_cache(k, v, k_cache, v_cache, slots)
    out = torch.empty(t, nh, 8)
    ref.paged_attention(out, q, k_cache, v_cache, table[None], torch.tensor([0, t]),
                        torch.tensor([ctx + t]), 0.3)
    torch.testing.assert_close(tree, out)


def test_tree_token_ignores_masked_siblings():
    k_cache, v_cache = _cache()
    table = torch.tensor([2, 4, 0, 0], dtype=torch.int32)
    ctx, t = 6, 3
    g = torch.Generator().manual_seed(2)
    q = torch.randn(t, 4, 8, generator=g)
    k = torch.randn(t, 2, 8, generator=g)
    v = torch.randn(t, 2, 8, generator=g)
    mask = torch.tensor([[1, 0, 0], [0, 1, 0], [0, 1, 1]], dtype=torch.bool)  # two branches
    out = ref.tree_attention(q, k, v, k_cache, v_cache, table, ctx, mask, 0.5)
    k2 = k.clone()
    v2 = v.clone()
    k2[0] += 5.0  # token 0 is invisible to tokens 1 and 2
    v2[0] -= 3.0
    out2 = ref.tree_attention(q, k2, v2, k_cache, v_cache, table, ctx, mask, 0.5)
    torch.testing.assert_close(out[1:], out2[1:])
    assert not torch.allclose(out[0], out2[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nh,kvh", [(4, 2), (6, 2), (3, 3)])
def test_fast_path_matches_reference(dtype, nh, kvh):
    """attention/tree.py against the reference, with the tree's K/V stored in the cache first
    (as the backend does) and a random mask that always lets a token see itself."""
    d, block_size = 8, 4
    k_cache, v_cache = (c.to(dtype)[:, :, :kvh] for c in _cache(num_blocks=12, kvh=3, d=d))
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    table = torch.tensor([7, 2, 9, 4, 11, 0], dtype=torch.int32)
    g = torch.Generator().manual_seed(nh * 10 + kvh)
    for ctx, t in [(1, 1), (5, 7), (13, 9)]:
        q = torch.randn(t, nh, d, generator=g).to(dtype)
        k = torch.randn(t, kvh, d, generator=g).to(dtype)
        v = torch.randn(t, kvh, d, generator=g).to(dtype)
        mask = (torch.rand(t, t, generator=g) < 0.4) | torch.eye(t, dtype=torch.bool)
        slots = torch.tensor([int(table[p // block_size]) * block_size + p % block_size
                              for p in range(ctx, ctx + t)])
        ref.reshape_and_cache(k, v, k_cache, v_cache, slots)
        want = ref.tree_attention(q, k, v, k_cache, v_cache, table, ctx, mask, 0.4)
        got = tree.tree_attention(q, k, v, k_cache, v_cache, table, ctx,
                                  tree.tree_bias(mask, ctx, nh // kvh), 0.4)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
