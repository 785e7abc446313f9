"""The inverse-CDF draw of ``draw.sample_random``: exact distributions, batch independence.

With ``draw.uniforms`` replaced by an evenly spaced grid of N values, a row repeated N times lands
on each token exactly ``round(N * probability)`` times give or take one: the draw is checked
against the reference distribution without sampling noise. The chi-square tests then run the real
uniforms through the whole ``Sampler``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sample_helpers import build_md, reference_distribution

from bladellm.sample import draw, ops
from bladellm.sample.sampler import Sampler
from bladellm.sampling_params import SamplingParams


def grid(n: int) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float64) + 0.5) / n


def filters(n: int, temperature=1.0, top_k=None, top_p=None, min_p=None) -> draw.RowFilters:
    def full(value, dtype=torch.float32):
        return None if value is None else torch.full((n,), value, dtype=dtype)
    return draw.RowFilters(full(temperature), full(top_k, torch.int64), full(top_p), full(min_p))


GRID = 10_000


def grid_distribution(monkeypatch, row: torch.Tensor, n: int = GRID, **kwargs) -> np.ndarray:
    """Fraction of an even grid of n uniforms that ``sample_random`` maps to each token."""
    monkeypatch.setattr(draw, "uniforms", lambda num_rows, generators, device: grid(num_rows))
    tokens = draw.sample_random(row.float().repeat(n, 1), filters(n, **kwargs), {})
    return np.bincount(tokens.numpy(), minlength=row.numel()) / n


def reference_mask_distribution(row: torch.Tensor, temperature=1.0, top_k=None, top_p=None,
                                min_p=None) -> np.ndarray:
    """The distribution the mask-form reference ops keep (ties at the k-th value kept)."""
    x = ops.apply_temperature(row.double()[None].clone(), torch.tensor([temperature]), 1e-5)
    k = None if top_k is None else torch.tensor([top_k])
    p = None if top_p is None else torch.tensor([top_p])
    x = ops.apply_top_k_top_p(x, k, p)
    if min_p is not None:
        x = ops.apply_min_p(x, torch.tensor([min_p]))
    return x.softmax(dim=-1)[0].numpy()


def test_draw_from_probs_is_the_exact_inverse_cdf():
    rng = np.random.default_rng(0)
    n = 50_000
    for vocab_size in (5, 64, 200, 4099):  # below, at, and off a multiple of the block size
        probs = rng.random(vocab_size) * (rng.random(vocab_size) < 0.7)
        probs[-1] = 0.0
        want = probs / probs.sum()
        row = torch.tensor(probs, dtype=torch.float32).repeat(n, 1)
        tokens = draw.draw_from_probs(row, grid(n))
        got = np.bincount(tokens.numpy(), minlength=vocab_size) / n
        assert np.abs(got - want).max() <= 1.0 / n + 1e-6, vocab_size
        assert got[want == 0].sum() == 0
        # The extreme uniforms land on the first and last tokens that have any probability.
        edges = draw.draw_from_probs(row[:2], torch.tensor([0.0, draw._BELOW_ONE]))
        assert edges.tolist() == [np.flatnonzero(want)[0], np.flatnonzero(want)[-1]]


@pytest.mark.parametrize("kwargs", [
    {}, dict(temperature=0.7), dict(top_k=20), dict(top_p=0.8), dict(top_p=0.97),
    dict(min_p=0.05), dict(top_k=30, top_p=0.5, min_p=0.02, temperature=1.3),
    dict(top_k=700),  # k > V / 8: topk over the whole row
    dict(top_p=0.999, temperature=2.0),  # more than 16 * 64 candidates: the row is sorted
])
def test_sample_random_draws_exactly_the_reference_distribution(monkeypatch, kwargs):
    logits = np.random.default_rng(1).normal(scale=3.0, size=1403)
    got = grid_distribution(monkeypatch, torch.tensor(logits), **kwargs)
    want = reference_distribution(logits, kwargs.get("temperature", 1.0),
                                  top_k=kwargs.get("top_k", 0), top_p=kwargs.get("top_p", 1.0),
                                  min_p=kwargs.get("min_p", 0.0))
    assert np.abs(got - want).max() <= 1.0 / GRID + 1e-6
    assert got[want == 0].sum() == 0


@pytest.mark.parametrize("kwargs", [dict(top_k=5), dict(top_k=3, top_p=0.9), dict(top_p=0.6),
                                    dict(min_p=0.5)])
def test_ties_follow_the_mask_reference(monkeypatch, kwargs):
    """Logits rounded to bfloat16 tie often; a 40-way tie at the top outgrows the first
    candidates. Compared per distinct logit value: top-p splits a tie by position, and which
    tied tokens come first is the sort's choice (by id here, arbitrary in the reference)."""
    row = (torch.randn(3000, generator=torch.Generator().manual_seed(2)) * 2).bfloat16().float()
    row[:40] = row.max()
    got = grid_distribution(monkeypatch, row, **kwargs)
    monkeypatch.setattr(ops, "_PARTIAL_SORT_RATIO", 10**9)  # the reference's full sort keeps ties
    want = reference_mask_distribution(row, **kwargs)
    values, group = np.unique(row.numpy(), return_inverse=True)
    got_by_value = np.bincount(group, weights=got, minlength=len(values))
    want_by_value = np.bincount(group, weights=want, minlength=len(values))
    assert np.abs(got_by_value - want_by_value).max() <= 40 / GRID + 1e-6
    assert got_by_value[want_by_value == 0].sum() == 0
    if "top_p" not in kwargs:  # every token tied with a kept one is kept
        assert np.array_equal(got > 0, want > 0)
        assert np.count_nonzero(got) >= 40


def test_candidates_and_full_sort_draw_the_same_tokens(monkeypatch):
    """A row's token does not depend on how many candidates were searched (which depends on the
    batch): the candidate order is canonical, ties broken by token id."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(48, 5000, generator=g) * 2).bfloat16().float()
    u = torch.rand(48, dtype=torch.float64, generator=g)
    top_k = torch.tensor([0, 7, 40, 200] * 12)

    def run(rows, first_candidates, with_top_k=True):
        monkeypatch.setattr(draw, "uniforms", lambda num_rows, generators, device: u[rows])
        monkeypatch.setattr(draw, "_FIRST_CANDIDATES", first_candidates)
        f = filters(len(u), temperature=0.9, top_p=0.9, min_p=0.01)
        f = f._replace(top_k=top_k if with_top_k else None).select(rows)
        return draw.sample_random(logits[rows], f, {})

    everything = torch.arange(48)
    batch = run(everything, 64)  # 201 candidates, then as many as _kept_bound says
    no_k = everything[0::4]
    assert torch.equal(run(no_k, 5000, with_top_k=False), batch[no_k])  # straight to a sort
    assert torch.equal(run(no_k, 2, with_top_k=False), batch[no_k])  # 3, then _kept_bound
    for start in (1, 2, 3):  # the top-k rows alone: k + 1 candidates only
        rows = everything[start::4]
        assert torch.equal(run(rows, 64), batch[rows])


@pytest.mark.parametrize("kwargs", [dict(top_p=0.9), dict(top_p=0.5, temperature=2.0),
                                    dict(min_p=0.02), dict(top_p=0.95, min_p=0.01)])
def test_kept_bound_is_an_upper_bound_close_to_the_kept_count(kwargs):
    """The second round's candidate count: never too few (else a third round), not many more."""
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(16, 8000, generator=g) * torch.linspace(0.5, 3.0, 16).unsqueeze(1)
    f = filters(16, **kwargs)._replace(top_k=torch.full((16,), 8000))
    bound = draw._kept_bound(logits, f, draw._vocab_mass(logits, f), otherwise=-1)
    kept = [np.count_nonzero(reference_mask_distribution(row, **kwargs)) for row in logits]
    assert max(kept) <= bound <= 1.25 * max(kept) + 8


@pytest.mark.parametrize("vocab_size", [300, 8192 + 37, 65536 + 37])
@pytest.mark.parametrize("n", [1, 5, 51])
def test_top_candidates_are_the_largest_in_canonical_order(vocab_size, n):
    g = torch.Generator().manual_seed(vocab_size + n)
    x = (torch.randn(6, vocab_size, generator=g) * 3).round()  # many ties
    x[:, -3:] = x.max() + 1  # the short last block holds the largest values
    values, ids = draw.top_candidates(x, n)
    assert torch.equal(values, x.topk(n, dim=1).values)
    assert torch.equal(x.gather(1, ids), values)
    for row in range(6):  # equal values by increasing id (which of a tie at the end: any)
        pairs = list(zip((-values[row]).tolist(), ids[row].tolist()))
        assert pairs == sorted(pairs)


def test_seeded_row_with_ties_is_independent_of_batch():
    """Neighbours change the candidate count (top-k 500 vs none) and the path the row takes."""
    row = (torch.randn(4096, generator=torch.Generator().manual_seed(5)) * 1.5).bfloat16().float()
    mine = SamplingParams(temperature=0.8, top_p=0.9, seed=11)

    def tokens(position, others):
        params = list(others)
        params.insert(position, mine)
        g = torch.Generator().manual_seed(len(params))
        logits = torch.randn(len(params), 4096, generator=g)
        logits[position] = row
        out = []
        for step in range(4):
            generators = {position: torch.Generator().manual_seed(11 * 1000 + step)}
            out.append(Sampler()(logits, build_md(params, generators=generators))
                       .sampled_token_ids[position].item())
        return out

    alone = tokens(0, [])
    for position, others in [(1, [SamplingParams(top_k=500)] * 3), (2, [SamplingParams()] * 4),
                             (0, [SamplingParams(temperature=0.0), SamplingParams(top_k=2)])]:
        torch.manual_seed(position)
        assert tokens(position, others) == alone


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """P-value of Pearson's chi-square test (bins with expected count < 5 pooled)."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if obs[exp == 0].sum() > 0:
        return 0.0
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.parametrize("kwargs, wrong", [
    (dict(temperature=0.8), dict(temperature=0.9)),
    (dict(top_k=12), dict(top_k=11)),
    (dict(top_p=0.7), dict(top_p=0.65)),
    (dict(min_p=0.1), dict(min_p=0.13)),
    (dict(temperature=1.2, top_k=25, top_p=0.9, min_p=0.02), dict(temperature=1.2, top_k=25)),
])
def test_chi_square_of_sampler_draws(kwargs, wrong):
    """Real draws (default generator, fixed seed) fit the reference; a close wrong one fails."""
    logits = np.random.default_rng(6).normal(scale=1.5, size=60)
    n = 60_000
    torch.manual_seed(0)
    batch = torch.tensor(logits, dtype=torch.float32).repeat(n, 1)
    tokens = Sampler()(batch, build_md([SamplingParams(**kwargs)] * n)).sampled_token_ids
    counts = np.bincount(tokens.numpy(), minlength=len(logits))

    def ref(kw):
        return reference_distribution(logits, kw.get("temperature", 1.0), top_k=kw.get("top_k", 0),
                                      top_p=kw.get("top_p", 1.0), min_p=kw.get("min_p", 0.0))

    assert counts[ref(kwargs) == 0].sum() == 0
    assert chi_square_p_value(counts, ref(kwargs)) > 1e-3
    assert chi_square_p_value(counts, ref(wrong)) < 1e-6
