"""Triton sampling filters (bladellm/kernels/triton/sampling.py) against their twin, and the twin
against the sampler's mask-form reference (bladellm/sample/ops.py). On a GPU when there is one,
otherwise under ``TRITON_INTERPRET=1`` at small vocabularies."""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
# tests/conftest.py sets TRITON_INTERPRET=1 without a GPU, before anything imports triton.
assert ON_GPU or os.environ.get("TRITON_INTERPRET") == "1"
pytest.importorskip("triton")

from bladellm.kernels.triton import sampling as ts  # noqa: E402
from bladellm.sample import ops  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
GREEDY = 1e-5

# One row per situation: top-k only, top-p only, both, min-p only, a greedy row (temperature
# 0 -> 1) with every filter, k >= V (off) with top-p and min-p.
TEMPERATURE = [0.7, 1.0, 1.3, 1.0, 0.0, 2.0]
TOP_K = [10, 0, 50, 0, 5, 400]
TOP_P = [1.0, 0.9, 0.8, 1.0, 0.5, 0.3]
MIN_P = [0.0, 0.0, 0.0, 0.05, 0.2, 0.01]


def _params(device: str = DEVICE):
    return (torch.tensor(TEMPERATURE, device=device), torch.tensor(TOP_K, device=device),
            torch.tensor(TOP_P, device=device), torch.tensor(MIN_P, device=device))


def _logits(num_rows: int, vocab_size: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab_size, generator=g) * 3


def test_filters_match_twin_exactly():
    logits = _logits(len(TOP_K), 160, 0)  # two vocabulary chunks of 128
    logits[1::2] -= 30.0  # all-negative rows: thresholds among negative floats
    logits = logits.to(DEVICE)
    before = logits.clone()
    got = ts.apply_sampling_filters(logits, *_params(), GREEDY, inplace=False, block=128)
    want = ts.sampling_mask_ref(logits, *_params(), GREEDY)
    assert torch.equal(logits, before)
    assert torch.equal(got, want)
    kept = (got > float("-inf")).sum(dim=1).tolist()
    assert kept[0] == 10 and all(0 < n < 160 for n in kept)


def test_thresholds_are_exact_among_close_values():
    """Adjacent floats (1 + i ulps): a threshold off by one key would keep an extra token."""
    g = torch.Generator().manual_seed(3)
    logits = (1.0 + 2.0**-23 * torch.randperm(200, generator=g).float()).expand(2, -1).contiguous()
    k, p = torch.tensor([7, 0]), torch.tensor([1.0, 0.3])
    logits, k, p = logits.to(DEVICE), k.to(DEVICE), p.to(DEVICE)
    got = ts.apply_sampling_filters(logits, None, k, p, None, GREEDY, inplace=False)
    want = ts.sampling_mask_ref(logits, None, k, p, None, GREEDY)
    assert torch.equal(got, want)
    assert (got[0] > -1e30).sum() == 7 and (got[1] > -1e30).sum() == 60


def test_in_place_without_temperature_or_min_p():
    logits = _logits(2, 100, 1).to(DEVICE)
    k, p = torch.tensor([3, 0], device=DEVICE), torch.tensor([0.95, 0.6], device=DEVICE)
    want = ts.sampling_mask_ref(logits, None, k, p, None, GREEDY)
    out = ts.apply_sampling_filters(logits, None, k, p, None, GREEDY)
    assert out.data_ptr() == logits.data_ptr() and torch.equal(logits, want)


def test_ties_at_the_thresholds_are_all_kept():
    """Top-k keeps every token tied with the k-th; top-p every token tied with a kept one."""
    logits = torch.full((2, 64), -5.0)
    logits[:, :3] = torch.tensor([4.0, 3.0, 3.0])
    logits[:, 10:13] = 3.0  # five tokens tie at the second largest value
    k, p = torch.tensor([2, 0]), torch.tensor([1.0, 0.4])
    logits, k, p = logits.to(DEVICE), k.to(DEVICE), p.to(DEVICE)
    got = ts.apply_sampling_filters(logits, None, k, p, None, GREEDY, inplace=False)
    want = ts.sampling_mask_ref(logits, None, k, p, None, GREEDY)
    assert torch.equal(got, want)
    # Row 0: the top token and all five tied at the 2nd value. Row 1: the top token holds
    # 1 / (1 + 5/e + 58/e^9) = 0.35 < 0.4 of the mass, so each 3.0 token is kept, and all five
    # are (ops' sort path would drop those sorted after the mass reached p).
    assert (got[0] > -1e30).sum() == 6 and (got[1] > -1e30).sum() == 6


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_twin_matches_the_sampler_reference(seed):
    """On tie-free logits the twin keeps what ops.apply_temperature -> apply_top_k_top_p ->
    apply_min_p keeps (the sampler's definition of the kept sets)."""
    logits = _logits(len(TOP_K), 1000, seed)
    temperature, k, p, min_p = _params("cpu")
    want = ops.apply_temperature(logits.clone(), temperature, GREEDY)
    want = ops.apply_min_p(ops.apply_top_k_top_p(want, k, p), min_p)
    got = ts.sampling_mask_ref(logits, temperature, k, p, min_p, GREEDY)
    assert torch.equal(got, want)


def test_rejects_bad_shapes():
    with pytest.raises(ValueError, match="float32"):
        ts.apply_sampling_filters(torch.zeros(2, 8).half(), None, None, None, None, GREEDY)
    with pytest.raises(ValueError, match="per-row"):
        ts.apply_sampling_filters(torch.zeros(2, 8), torch.ones(3), None, None, None, GREEDY)
