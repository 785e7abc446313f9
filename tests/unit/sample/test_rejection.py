"""Verification rules of sample/rejection.py: exact target distributions, statistically."""

from __future__ import annotations

import torch

from bladellm.sample.rejection import rejection_sample, walk

# Chi-square critical value for 11 degrees of freedom (12 tokens) at p = 0.001.
_CHI2_11_P001 = 31.26


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    return float(((counts.double() - expected) ** 2 / expected).sum())


def test_rejection_sampling_matches_target_with_disagreeing_draft():
    """Draws d ~ q, then rejection_sample: the first emitted token is distributed as p[0]
    (and the second, when the first was accepted, as p[1]) although q disagrees with p."""
    torch.manual_seed(0)
    V = 12
    p = torch.softmax(torch.randn(3, V) * 2, -1)
    q = torch.softmax(torch.randn(2, V) * 2, -1)  # a draft that disagrees often
    gen = torch.Generator().manual_seed(1)
    first = torch.zeros(V)
    accepted = 0
    n = 20000
    for _ in range(n):
        d0 = int(torch.multinomial(q[0], 1, generator=gen))
        d1 = int(torch.multinomial(q[1], 1, generator=gen))
        out, _ = rejection_sample(p, q, [d0, d1], gen)
        first[out[0]] += 1
        accepted += len(out) - 1
    assert _chi2(first, p[0]) < _CHI2_11_P001
    assert 0 < accepted < 2 * n  # some accepted, some rejected


def test_point_mass_walk_is_the_target_draw():
    # Row tokens are the target's draws; guesses [5, 6] and [5, 7] share a prefix.
    row_tokens = [5, 7, 9, 4, 8]  # root, g0 rows (5, 6), g1 rows (5, 7)
    emitted, rows = walk(row_tokens, 0, [[5, 6], [5, 7]], [[1, 2], [3, 4]])
    assert emitted == [5, 7, 8] and rows == [0, 1, 4]  # rows 1 and 3 share a prefix
    emitted, _ = walk([3, 0, 0], 0, [[5, 6]], [[1, 2]])
    assert emitted == [3]  # first guess token rejected: the target's own token


def test_a_token_the_target_cannot_emit_is_never_accepted(monkeypatch):
    """A grammar-banned proposal (p = 0 after the mask) is rejected even when the uniform draw
    is exactly 0; the residual then comes from the allowed tokens."""
    import torch

    from bladellm.sample.rejection import rejection_sample

    monkeypatch.setattr(torch, "rand", lambda n, **kw: torch.zeros(n, dtype=torch.float64))
    p = torch.tensor([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]])
    q = torch.tensor([[1.0, 0.0, 0.0]])
    emitted, last = rejection_sample(p, q, [0])
    assert last == 0 and emitted[0] in (1, 2)
