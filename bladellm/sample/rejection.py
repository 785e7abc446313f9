"""Verification of proposed tokens: which of them the target model keeps (docs/speculative.md).

Two exact rules, both applied to the target's distribution AFTER the request's own penalties,
temperature, top-k, top-p and min-p (the logits the normal sampler would draw from):

- ``walk``: proposals without probabilities (n-gram / look_ahead guesses, and any greedy
  request). Every verified position has drawn its own token from the target exactly as normal
  decoding would (argmax, or the request's draw with its per-position seed); a proposal is kept
  while it equals that token. For a draft whose distribution is a point mass on ``d`` this *is*
  the modified rejection sampling of Leviathan et al.: accept with min(1, p(d)/1) = p(d) (the
  chance the target's draw equals ``d``), otherwise a token from the residual (p - q)+ / Z = p
  restricted to tokens != d (the target's draw, given that it is not ``d``). Several guesses
  sharing a prefix are a tree; the walk follows the guess that matches the drawn token, so the
  emitted tokens are distributed exactly as normal decoding's, and a seeded request emits the
  very tokens it would without speculation.
- ``rejection_sample``: a draft model's proposals with their draft distribution q (random
  requests): accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection
  draw from max(p_j - q_j, 0) normalised; if all pass, a bonus token from p_k.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bladellm.sample import ops
from bladellm.sample.metadata import GREEDY_TEMPERATURE


def walk(row_tokens: Sequence[int], root: int, guesses: Sequence[Sequence[int]],
         guess_rows: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Follow the target's tokens through a tree of guesses.

    ``row_tokens[r]`` is the token the target drew at verification row r; ``root`` the row of the
    request's last known token; guess g's token j was fed at row ``guess_rows[g][j]`` (so that
    row's token is the target's choice *after* it). Returns the emitted tokens (accepted guess
    tokens, then the target's next token) and the row each came from.
    """
    emitted, rows = [row_tokens[root]], [root]
    alive = list(range(len(guesses)))
    depth = 0
    while True:
        token = emitted[-1]
        alive = [g for g in alive if len(guesses[g]) > depth and guesses[g][depth] == token]
        if not alive:
            return emitted, rows
        row = guess_rows[alive[0]][depth]
        emitted.append(row_tokens[row])
        rows.append(row)
        depth += 1


def target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                 top_p: torch.Tensor | None, min_p: torch.Tensor | None) -> torch.Tensor:
    """The distribution a random row draws from: softmax after temperature, top-k, top-p and
    min-p, the sets ``draw.sample_random`` keeps (stated in mask form by ``ops``)."""
    x = ops.apply_temperature(logits.float().clone(), temperature, GREEDY_TEMPERATURE)
    if top_k is not None or top_p is not None:
        x = ops.apply_top_k_top_p(x, top_k, top_p)
    if min_p is not None:
        x = ops.apply_min_p(x, min_p)
    return x.softmax(dim=-1)


def rejection_sample(p: torch.Tensor, q: torch.Tensor, draft: Sequence[int],
                     generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Modified rejection sampling for one request.

    ``p`` [k+1, V]: the target's distributions at the k proposal positions and after the last;
    ``q`` [k, V]: the draft's distributions the proposals were drawn from. Returns the emitted
    tokens (accepted proposals, then a residual or bonus token) and the index of the ``p`` row
    the last one came from.
    """
    k = len(draft)
    # A scalar test per proposal, read on the host, with a host generator (seeded requests draw
    # the same on every platform): one copy of the rows from a GPU (none on a CPU).
    p, q = p.cpu(), q.cpu()
    u = torch.rand(k + 1, generator=generator, dtype=torch.float64)
    for j, d in enumerate(draft):
        pd, qd = float(p[j, d]), float(q[j, d])
        # u <= p/q written without dividing; p > 0 so that a token the target cannot emit (a
        # grammar-banned proposal) is never accepted, even when u draws exactly 0.
        if qd > 0 and pd > 0 and u[j] * qd <= pd:
            continue
        residual = (p[j].double() - q[j].double()).clamp_(min=0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: any draw from p is exact
            residual = p[j].double()
        token = int(torch.multinomial(residual, 1, generator=generator))
        return list(draft[:j]) + [token], j
    token = int(torch.multinomial(p[k].double(), 1, generator=generator))
    return list(draft) + [token], k
