"""Triton paged attention with the per-layer features (sliding window, ALiBi, soft-capping)
against the twin: on a GPU when there is one, else under ``TRITON_INTERPRET=1`` at small
shapes. Blocks before every query's window hold NaN (attention_features_cases.py)."""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
assert ON_GPU or os.environ.get("TRITON_INTERPRET") == "1"
pytest.importorskip("triton")

from bladellm.kernels import kv_int8  # noqa: E402
from bladellm.kernels.interface import Kernels  # noqa: E402
from bladellm.kernels.triton import attention as ta  # noqa: E402

from attention_features_cases import batch, feature_sets, poison_outside_window  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"


def _compare(b, features, scale=0.3, atol=2e-5, **tiles):
    want = torch.empty_like(b.query)
    Kernels().paged_attention(want, b.query, b.k_cache, b.v_cache, b.block_tables,
                              b.query_start_loc, b.seq_lens, scale, **features)
    dev = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in features.items()}
    got = torch.full(b.query.shape, float("nan"), dtype=b.query.dtype, device=DEVICE)
    ta.paged_attention(got, b.query.to(DEVICE), b.k_cache.to(DEVICE), b.v_cache.to(DEVICE),
                       b.block_tables.to(DEVICE), b.query_start_loc.to(DEVICE),
                       b.seq_lens.to(DEVICE), scale, **tiles, **dev)
    torch.testing.assert_close(got.cpu(), want, atol=atol, rtol=atol)


@pytest.mark.parametrize("name", list(feature_sets(6)))
def test_mixed_batch(name):
    features = feature_sets(6)[name]
    b = batch([1, 5, 12, 3, 1], [20, 5, 45, 3, 60], 6, 2, 16, 4, torch.float32,
              features.get("sliding_window"))
    _compare(b, features)


@pytest.mark.parametrize("name", ["window", "alibi", "window_softcap"])
def test_split_keys(name):
    features = feature_sets(4)[name]
    b = batch([1, 1], [70, 33], 4, 1, 16, 8, torch.float32, features.get("sliding_window"))
    _compare(b, features, num_splits=3, block_n=16)


def test_int8_cache_window_alibi():
    features = feature_sets(4)["window_alibi"]
    b = batch([1, 7], [50, 30], 4, 2, 16, 4, torch.float32, None)
    b.k_cache, b.v_cache = kv_int8.pack(b.k_cache), kv_int8.pack(b.v_cache)
    poison_outside_window(b, features["sliding_window"], 4)
    _compare(b, features)
