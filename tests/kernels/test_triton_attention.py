"""Triton paged attention (bladellm/kernels/triton/attention.py) against its twin
``ref.paged_attention``: on a GPU when there is one, otherwise under ``TRITON_INTERPRET=1`` at
small shapes. Batches come from kernel_cases.make_batch: shuffled block ids, spare garbage
blocks, the query a strided view into a fused qkv tensor, as the engine lays them out."""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
# tests/conftest.py sets TRITON_INTERPRET=1 without a GPU, before anything imports triton.
assert ON_GPU or os.environ.get("TRITON_INTERPRET") == "1"
pytest.importorskip("triton")

from bladellm.kernels import kv_int8, ref  # noqa: E402
from bladellm.kernels.triton import attention as ta  # noqa: E402

from kernel_cases import PagedBatch, make_batch  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
# Output rounding, plus (16-bit) the probabilities rounded to v's dtype for the P @ V dot.
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _to_device(b: PagedBatch) -> PagedBatch:
    return PagedBatch(*(getattr(b, f).to(DEVICE) for f in
                        ("query", "k_cache", "v_cache", "block_tables", "query_start_loc",
                         "seq_lens")))


def _run_both(b: PagedBatch, scale: float, **tiles) -> tuple[torch.Tensor, torch.Tensor]:
    got = torch.full(b.query.shape, float("nan"), dtype=b.query.dtype, device=DEVICE)
    ta.paged_attention(got, b.query, b.k_cache, b.v_cache, b.block_tables, b.query_start_loc,
                       b.seq_lens, scale, **tiles)
    want = torch.empty_like(got)
    ref.paged_attention(want, b.query, b.k_cache, b.v_cache, b.block_tables, b.query_start_loc,
                        b.seq_lens, scale)
    return got, want


CASES = {
    # name: (q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, tiles)
    "decode_gqa4": ([1, 1, 1], [5, 17, 32], 8, 2, 16, 4, {}),
    "prefill_no_prefix_mha": ([9], [9], 2, 2, 32, 8, {"block_n": 16}),
    "chunk_after_cached_prefix": ([7], [23], 4, 2, 16, 4, {"block_n": 16}),
    "spec_verify": ([3, 4], [10, 19], 4, 1, 16, 8, {}),
    "mixed_batch_group3": ([1, 5, 12, 3], [20, 5, 30, 3], 6, 2, 24, 8, {}),
    # Several query tiles per request; KV tiles (16) span two blocks of 8 and stop mid-block.
    "long_chunk_many_tiles": ([40, 1], [45, 9], 4, 4, 16, 8, {"block_q": 16, "block_n": 16}),
    # Blocks (32) larger than a KV tile (16).
    "big_blocks": ([2, 6], [50, 6], 2, 1, 16, 32, {"block_n": 16}),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention_matches_twin(case, dtype):
    q_lens, seq_lens, nh, kvh, d, block_size, tiles = CASES[case]
    b = _to_device(make_batch(q_lens, seq_lens, nh, kvh, d, block_size, dtype, seed=len(case)))
    got, want = _run_both(b, d ** -0.5, **tiles)
    tol = TOL[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_kv_cache_matches_twin(dtype):
    """``--kv_cache_quant int8`` caches (rows of int8 values + fp32 scale) are dequantized as
    the twin dequantizes them."""
    b = _to_device(make_batch([1, 6, 3], [13, 6, 21], 4, 2, 16, 4, dtype, seed=6))
    b.k_cache, b.v_cache = kv_int8.pack(b.k_cache), kv_int8.pack(b.v_cache)
    got, want = _run_both(b, 0.25, block_n=16)
    torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [2, 3])
def test_split_kv_matches_twin(num_splits, dtype):
    """Flash-decoding splits: decodes over contexts some splits do not reach, a verification
    run and a short prefill (most of whose splits see no key) merged back exactly."""
    b = _to_device(make_batch([1, 1, 3, 5], [40, 7, 26, 5], 4, 2, 16, 8, dtype, seed=7))
    got, want = _run_both(b, 0.25, block_n=16, num_splits=num_splits)
    torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype])
    given, _ = _run_both(b, 0.25, block_n=16, num_splits=num_splits, max_seq_len=40)
    assert torch.equal(given, got)


def test_max_query_len_given_or_read_agree():
    b = _to_device(make_batch([2, 5], [7, 12], 4, 2, 16, 4, torch.float32, seed=3))
    given, want = _run_both(b, 0.25, max_query_len=5)
    read, _ = _run_both(b, 0.25)
    assert torch.equal(given, read)
    torch.testing.assert_close(given, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_padding_request_and_out_view_are_respected(num_splits):
    """A request with no query tokens (a padded batch slot) writes nothing, a query row no
    request owns is left alone, and only ``out[:n]`` of a larger buffer is written."""
    b = _to_device(make_batch([3, 1, 1], [8, 6, 5], 4, 2, 16, 4, torch.float16, seed=4))
    b.query_start_loc = torch.tensor([0, 3, 3, 4], dtype=torch.int32, device=DEVICE)
    b.seq_lens = torch.tensor([8, 0, 6], dtype=torch.int32, device=DEVICE)
    b.block_tables = torch.cat([b.block_tables[:1], torch.zeros_like(b.block_tables[:1]),
                                b.block_tables[1:2]])
    buf = torch.full((6, 4, 16), 7.0, dtype=torch.float16, device=DEVICE)
    ta.paged_attention(buf[:5], b.query, b.k_cache, b.v_cache, b.block_tables,
                       b.query_start_loc, b.seq_lens, 0.25, num_splits=num_splits)
    want = torch.empty_like(buf[:5])
    ref.paged_attention(want, b.query, b.k_cache, b.v_cache, b.block_tables,
                        b.query_start_loc, b.seq_lens, 0.25)
    torch.testing.assert_close(buf[:4], want[:4], rtol=2e-3, atol=2e-3)
    assert bool((buf[4:] == 7.0).all())


def test_causal_mask_hides_the_future():
    """Changing keys/values at the last position changes only the last query's output."""
    b = _to_device(make_batch([4], [10], 2, 1, 16, 4, torch.float32, seed=5))
    before = torch.empty_like(b.query)
    ta.paged_attention(before, b.query, b.k_cache, b.v_cache, b.block_tables,
                       b.query_start_loc, b.seq_lens, 0.25)
    last_block = int(b.block_tables[0, 9 // 4])
    b.k_cache[last_block, 9 % 4] += 5.0
    b.v_cache[last_block, 9 % 4] += 5.0
    after = torch.empty_like(b.query)
    ta.paged_attention(after, b.query, b.k_cache, b.v_cache, b.block_tables,
                       b.query_start_loc, b.seq_lens, 0.25)
    assert torch.equal(before[:3], after[:3])
    assert not torch.allclose(before[3], after[3])


def test_rejects_mismatched_heads_and_dtypes():
    b = make_batch([1], [4], 6, 4, 16, 4, torch.float32)
    with pytest.raises(ValueError, match="KV heads"):
        ta.paged_attention(torch.empty_like(b.query), b.query, b.k_cache, b.v_cache,
                           b.block_tables, b.query_start_loc, b.seq_lens, 0.25)
    b = make_batch([1], [4], 4, 2, 16, 4, torch.float32)
    with pytest.raises(ValueError, match="query's float dtype or be int8"):
        ta.paged_attention(torch.empty_like(b.query), b.query, b.k_cache.half(),
                           b.v_cache.half(), b.block_tables, b.query_start_loc, b.seq_lens, 0.25)


def test_triton_set_passes_the_host_maxima(monkeypatch):
    """``TritonKernels.paged_attention`` forwards ``max_query_len`` / ``max_seq_len`` (the
    backend's host ints) to the kernel, which then reads nothing back to size its grid."""
    from bladellm.kernels.triton_set import TritonKernels

    b = _to_device(make_batch([1, 5, 3], [9, 12, 3], 4, 2, 16, 4, torch.float32, seed=5))
    calls = []
    real = ta.paged_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        real(*args, **kwargs)

    monkeypatch.setattr(ta, "paged_attention", spy)
    got = torch.full(b.query.shape, float("nan"), dtype=b.query.dtype, device=DEVICE)
    TritonKernels().paged_attention(got, b.query, b.k_cache, b.v_cache, b.block_tables,
                                    b.query_start_loc, b.seq_lens, 0.3, max_query_len=5,
                                    max_seq_len=12)
    assert calls[0]["max_query_len"] == 5 and calls[0]["max_seq_len"] == 12
    want = torch.empty_like(got)
    ref.paged_attention(want, b.query, b.k_cache, b.v_cache, b.block_tables, b.query_start_loc,
                        b.seq_lens, 0.3)
    torch.testing.assert_close(got, want, atol=TOL[torch.float32], rtol=0)
