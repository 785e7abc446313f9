"""The paged attention backend (compiled kernels and their PyTorch twins) vs naive dense
attention on random paged layouts, requests in any order with any query length."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from bladellm.attention import get_attn_backend
from bladellm.attention.backend import AttentionMetadata
from bladellm.attention.paged_backend import PagedAttentionBackend
from bladellm.kernels import Kernels, resolve_kernels

# The set a CPU worker resolves for --kernels auto (compiled, or the reference where it cannot).
KERNELS = resolve_kernels("auto", "cpu")


def build_case(reqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
               block_size: int, dtype=torch.float32, seed: int = 0, extra_table_cols: int = 0):
    """reqs: (query_len, seq_len) per request, in any order. Returns the backend inputs, the
    full per-request K/V (for the reference) and the metadata. The cached prefix of each request
    is written straight into randomly chosen, non-contiguous blocks."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_needed = [math.ceil(s / block_size) for _, s in reqs]
    num_blocks = sum(blocks_needed) + 3
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen,
                        dtype=torch.float32).to(dtype)  # garbage in unused slots on purpose
    tables, full_k, full_v, qs, ks, vs, slots, qsl = [], [], [], [], [], [], [], [0]
    for (q_len, s_len), n in zip(reqs, blocks_needed):
        table = [pool.pop() for _ in range(n)]
        tables.append(table)
        k = torch.randn(s_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(s_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        full_k.append(k)
        full_v.append(v)
        for pos in range(s_len):
            slot = table[pos // block_size] * block_size + pos % block_size
            if pos < s_len - q_len:  # cached prefix
                cache[0].view(-1, num_kv_heads, head_dim)[slot] = k[pos]
                cache[1].view(-1, num_kv_heads, head_dim)[slot] = v[pos]
            else:
                slots.append(slot)
        qs.append(torch.randn(q_len, num_heads, head_dim, generator=gen).to(dtype))
        ks.append(k[s_len - q_len:])
        vs.append(v[s_len - q_len:])
        qsl.append(qsl[-1] + q_len)
    width = max(len(t) for t in tables) + extra_table_cols
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    seq_lens = np.array([s for _, s in reqs], dtype=np.int32)
    qsl = np.array(qsl, dtype=np.int32)
    md = AttentionMetadata(
        num_reqs=len(reqs), num_actual_tokens=int(qsl[-1]),
        max_query_len=max(q for q, _ in reqs), max_seq_len=int(seq_lens.max()),
        query_start_loc=torch.from_numpy(qsl), seq_lens=torch.from_numpy(seq_lens),
        block_tables=block_tables, slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, md, full_k, full_v


def dense_reference(q, full_k, full_v, md, scale):
    """Per request, per query position: softmax over keys at positions <= its own, float64."""
    out = []
    for i in range(md.num_reqs):
        qi = q[md.query_start_loc_cpu[i]:md.query_start_loc_cpu[i + 1]].double()
        k, v = full_k[i].double(), full_v[i].double()
        group = qi.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        s_len, q_len = k.shape[0], qi.shape[0]
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
        pos_q = torch.arange(q_len)[:, None] + s_len - q_len
        scores = scores.masked_fill(torch.arange(s_len)[None, :] > pos_q, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(out)


# (query_len, seq_len), interleaved: decodes, a full prefill, a chunk after a 24-token prefix,
# verification-sized queries (1 + k) after long contexts, a short prefill.
MIXED = [(1, 1), (13, 13), (1, 9), (6, 30), (1, 37), (3, 40), (1, 16), (5, 17), (4, 4)]


@pytest.fixture(params=["torch", "paged"])
def backend(request):
    """Both kernel sets: the reference twins and what this CPU compiled (or fell back to)."""
    return get_attn_backend(request.param, KERNELS)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(8, 2), (4, 1), (4, 4)], ids=["gqa", "mqa", "mha"])
def test_mixed_decode_and_prefill_with_prefix(backend, block_size, heads):
    num_heads, num_kv_heads = heads
    q, k, v, cache, md, full_k, full_v = build_case(MIXED, num_heads, num_kv_heads, 16,
                                                    block_size, seed=block_size)
    scale = 16 ** -0.5
    out = backend.forward(q, k, v, cache, md, scale)
    torch.testing.assert_close(out.double(), dense_reference(q, full_k, full_v, md, scale),
                               atol=1e-5, rtol=1e-5)
    # This step's K/V landed at slot_mapping.
    flat_k = cache[0].reshape(-1, num_kv_heads, 16)
    flat_v = cache[1].reshape(-1, num_kv_heads, 16)
    torch.testing.assert_close(flat_k[md.slot_mapping], k)
    torch.testing.assert_close(flat_v[md.slot_mapping], v)


@pytest.mark.parametrize("reqs", [[(1, 5), (1, 64), (1, 2)],  # decodes only
                                  [(7, 20), (3, 3), (2, 40)]],  # prefills only
                         ids=["decode-only", "prefill-only"])
def test_pure_batches_and_padded_block_tables(backend, reqs):
    q, k, v, cache, md, full_k, full_v = build_case(reqs, 6, 3, 8, 4, seed=3,
                                                    extra_table_cols=5)
    out = backend.forward(q, k, v, cache, md, 0.3)
    torch.testing.assert_close(out.double(), dense_reference(q, full_k, full_v, md, 0.3),
                               atol=1e-5, rtol=1e-5)


def test_bfloat16_cache_keeps_dtype(backend):
    q, k, v, cache, md, full_k, full_v = build_case(MIXED, 8, 2, 16, 4, dtype=torch.bfloat16)
    out = backend.forward(q, k, v, cache, md, 0.25)
    assert out.dtype == torch.bfloat16 and cache.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), dense_reference(q, full_k, full_v, md, 0.25),
                               atol=3e-2, rtol=3e-2)


def test_padding_tokens_beyond_actual_tokens_are_ignored(backend):
    q, k, v, cache, md, full_k, full_v = build_case([(1, 10), (5, 12)], 4, 2, 8, 4)
    pad = 3
    qp = torch.cat([q, torch.randn(pad, 4, 8)])
    kp, vp = torch.cat([k, torch.randn(pad, 2, 8)]), torch.cat([v, torch.randn(pad, 2, 8)])
    before = cache.clone()
    out = backend.forward(qp, kp, vp, cache, md, 0.35)
    assert out.shape == qp.shape and torch.all(out[-pad:] == 0)
    torch.testing.assert_close(out[:-pad].double(), dense_reference(q, full_k, full_v, md, 0.35),
                               atol=1e-5, rtol=1e-5)
    changed = (cache != before).reshape(2, -1, 2, 8).any(-1).any(-1).any(0).nonzero().flatten()
    assert set(changed.tolist()) <= set(md.slot_mapping.tolist())


def test_selector():
    assert get_attn_backend(None, KERNELS).name == "paged"
    assert get_attn_backend(None, KERNELS).kernels is KERNELS  # the worker's set, handed down
    assert get_attn_backend("torch", KERNELS).name == "torch"
    assert isinstance(get_attn_backend("torch", KERNELS), PagedAttentionBackend)
    assert get_attn_backend("torch", KERNELS).kernels.name == "ref"
    with pytest.raises(ValueError, match="--attn_cls.*torch"):
        get_attn_backend("flashinfer", KERNELS)


def test_triton_backend_needs_the_triton_kernel_set():
    """``--attn_cls triton`` over a set that is not Triton's is refused naming both flags."""
    for flag in ("--attn_cls", "--draft.attn_cls"):
        with pytest.raises(ValueError, match=f"{flag} triton.*--kernels"):
            get_attn_backend("triton", Kernels(), flag)
        with pytest.raises(ValueError, match=f"{flag} triton.*--kernels"):
            get_attn_backend("triton", KERNELS, flag)


# Decode seq_lens around block boundaries (block_size 4): exact multiples, one past, one short.
BOUNDARY_DECODES = [(1, s) for s in (4, 5, 3, 8, 9, 16, 17, 1, 31, 12)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decodes_at_block_boundaries(backend, dtype):
    q, k, v, cache, md, full_k, full_v = build_case(BOUNDARY_DECODES, 8, 2, 16, 4, dtype=dtype,
                                                    seed=7)
    out = backend.forward(q, k, v, cache, md, 0.25)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), dense_reference(q, full_k, full_v, md, 0.25),
                               atol=tol, rtol=tol)


def test_backend_hands_the_kernels_the_host_maxima():
    """The metadata's host ints reach the kernel set: a set that sizes its launch from them
    (Triton) need not read ``query_start_loc`` / ``seq_lens`` back from the device per layer."""
    seen = []

    class Spy(Kernels):
        def paged_attention(self, *args, **kwargs):
            seen.append(kwargs)
            super().paged_attention(*args, **kwargs)

    q, k, v, cache, md, full_k, full_v = build_case([(1, 10), (5, 12), (2, 7)], 4, 2, 8, 4)
    out = PagedAttentionBackend(Spy(), "torch").forward(q, k, v, cache, md, 0.35)
    assert [(kw["max_query_len"], kw["max_seq_len"]) for kw in seen] == [(5, 12)]
    assert all(type(kw["max_query_len"]) is int for kw in seen)
    torch.testing.assert_close(out.double(), dense_reference(q, full_k, full_v, md, 0.35),
                               atol=1e-5, rtol=1e-5)
    KERNELS.paged_attention(out, q, cache[0], cache[1], md.block_tables, md.query_start_loc,
                            md.seq_lens, 0.35, max_query_len=5, max_seq_len=12)  # accepted
