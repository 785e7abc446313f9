"""Empirical distributions of the random path match the renormalised reference distribution.

Each configuration is drawn N times by repeating its row N times in one batch (fixed seed). The
bound on the total-variation distance is ~3x the expected sampling noise, while every deliberately
wrong reference sits well above it, so a mistake in the math fails the test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sample_helpers import build_md, empirical, reference_distribution, total_variation

from bladellm.sample import ops
from bladellm.sample.sampler import Sampler
from bladellm.sampling_params import SamplingParams

N = 40_000
TV_BOUND = 0.015
# Distinct probabilities, shuffled so that "sorted order" is not "index order".
PROBS = np.array([0.30, 0.22, 0.16, 0.12, 0.09, 0.06, 0.03, 0.02])
PERM = np.array([5, 2, 7, 0, 3, 6, 1, 4])
LOGITS = np.log(PROBS[PERM])
V = len(LOGITS)


def draw(params: SamplingParams, seed: int = 0, logits=LOGITS, n: int = N) -> np.ndarray:
    torch.manual_seed(seed)
    batch = torch.tensor(logits, dtype=torch.float32).repeat(n, 1)
    out = Sampler()(batch, build_md([params] * n))
    return empirical(out.sampled_token_ids, len(logits))


def check(emp, right, *wrongs):
    assert total_variation(emp, right) < TV_BOUND
    # Tokens the reference filters out are never drawn.
    assert np.all(emp[right == 0] == 0)
    for wrong in wrongs:
        assert total_variation(emp, wrong) > 3 * TV_BOUND


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature(temperature):
    emp = draw(SamplingParams(temperature=temperature))
    others = [reference_distribution(LOGITS, t) for t in (0.5, 1.0, 2.0) if t != temperature]
    check(emp, reference_distribution(LOGITS, temperature), *others)


def test_top_k():
    emp = draw(SamplingParams(top_k=3))
    check(emp, reference_distribution(LOGITS, top_k=3),
          reference_distribution(LOGITS, top_k=2), reference_distribution(LOGITS, top_k=4),
          reference_distribution(LOGITS))


def test_top_p_keeps_the_token_that_crosses_p():
    # 0.30 + 0.22 = 0.52 < 0.6, so the 0.16 token is needed to reach 0.6: three tokens survive.
    emp = draw(SamplingParams(top_p=0.6))
    right = reference_distribution(LOGITS, top_p=0.6)
    assert np.count_nonzero(right) == 3
    check(emp, right, reference_distribution(LOGITS, top_p=0.6, top_p_inclusive=False),
          reference_distribution(LOGITS, top_p=0.7))


def test_min_p():
    # Threshold 0.25 * 0.30 = 0.075: five tokens survive.
    emp = draw(SamplingParams(min_p=0.25))
    right = reference_distribution(LOGITS, min_p=0.25)
    assert np.count_nonzero(right) == 5
    absolute = np.where(PROBS[PERM] >= 0.25, PROBS[PERM], 0.0)  # wrong: threshold not relative
    check(emp, right, absolute / absolute.sum(), reference_distribution(LOGITS, min_p=0.35),
          reference_distribution(LOGITS))


def test_all_filters_together_in_order():
    params = SamplingParams(temperature=0.7, top_k=6, top_p=0.85, min_p=0.05)
    emp = draw(params)
    right = reference_distribution(LOGITS, 0.7, top_k=6, top_p=0.85, min_p=0.05)
    # Wrong orders/omissions: top-p before temperature, no top-k, exclusive top-p.
    check(emp, right,
          reference_distribution(LOGITS, 0.7, top_k=6, min_p=0.05),
          reference_distribution(LOGITS, 0.7, top_k=6, top_p=0.85, min_p=0.05,
                                 top_p_inclusive=False))


def test_rows_with_different_params_in_one_batch():
    """Per-row parameters reach their own row, on the sort path (top-p) and alongside greedy."""
    configs = [SamplingParams(temperature=2.0), SamplingParams(top_k=2),
               SamplingParams(top_p=0.6), SamplingParams(temperature=0.0),
               SamplingParams(min_p=0.35)]
    refs = [reference_distribution(LOGITS, 2.0), reference_distribution(LOGITS, top_k=2),
            reference_distribution(LOGITS, top_p=0.6), np.eye(V)[np.argmax(LOGITS)],
            reference_distribution(LOGITS, min_p=0.35)]
    n = 20_000
    torch.manual_seed(1)
    params = configs * n  # interleaved: row i has config i % 5
    logits = torch.tensor(LOGITS, dtype=torch.float32).repeat(len(params), 1)
    tokens = Sampler()(logits, build_md(params)).sampled_token_ids
    for i, ref in enumerate(refs):
        emp = empirical(tokens[i::len(configs)], V)
        assert total_variation(emp, ref) < 0.02, i
        assert np.all(emp[ref == 0] == 0), i


def test_large_vocab_top_k_top_p_against_reference():
    """A realistic row (V = 256, random logits) through the top-k-only and candidate paths."""
    rng = np.random.default_rng(0)
    logits = rng.normal(scale=2.0, size=256)
    for params, kwargs in [(SamplingParams(top_k=20), dict(top_k=20)),
                           (SamplingParams(top_k=30, top_p=0.5), dict(top_k=30, top_p=0.5))]:
        emp = draw(params, logits=logits, n=20_000)
        right = reference_distribution(logits, **kwargs)
        assert np.all(emp[right == 0] == 0)
        assert total_variation(emp, right) < 0.04


def test_candidate_top_k_top_p_equals_full_sort(monkeypatch):
    """The topk(max k) shortcut keeps exactly the tokens (and logits) the full sort keeps."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 4096, generator=g) * 2
    k = torch.tensor([1, 5, 40, 64, 64, 17])
    p = torch.tensor([0.9, 1.0, 0.5, 0.95, 0.3, 0.8])
    fast = ops.apply_top_k_top_p(logits.clone(), k, p)
    monkeypatch.setattr(ops, "_PARTIAL_SORT_RATIO", 10**9)
    full = ops.apply_top_k_top_p(logits.clone(), k, p)
    assert torch.equal(fast.isfinite(), full.isfinite())
    assert torch.equal(fast[fast.isfinite()], logits[fast.isfinite()])
    assert fast.isfinite().sum(-1)[1] == 5 and fast.isfinite().sum(-1)[0] == 1
