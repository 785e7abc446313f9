"""The random draw: one token per row of [R, V] float32 logits, never modifying them.

Inverse CDF with one float64 uniform per row (``uniforms``), so that a row costs one random
number whatever V, and the draw stays exact under temperature, top-k, top-p and min-p:

- rows without a filter: one ``exp2`` pass over the vocabulary (``_exp_weights``), then a
  two-level draw (``draw_from_probs``): a block of ``_BLOCK`` tokens by block sums, then a token
  inside it, so no cumulative sum runs over the vocabulary;
- filtered rows: the draw runs among each row's most likely tokens (``top_candidates``), found
  without sorting the vocabulary. Rows whose kept set the first candidates do not cover (a
  top-p or min-p reaching further, ties at the k-th value) go to a second round sized by a
  histogram of their weights (``_kept_bound``); a full sort of the row only when the candidates
  needed are more than half the vocabulary.

Seeded rows take their uniform from their own generator, the others share one call on the
default generator: a seeded row's tokens depend only on (seed, position), never on the batch.
``ops.apply_temperature``, ``ops.apply_top_k_top_p`` and ``ops.apply_min_p`` state the same
kept sets in mask form; the tests hold ``sample_random`` to them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

_NEG_INF = float("-inf")

# Tokens per block of the two-level searches (a few SIMD vectors).
_BLOCK = 64
# top_candidates searches blocks while n * _BLOCK * this <= V, else runs topk on the whole row.
_TWO_LEVEL_RATIO = 8
# Candidates first tried for a row filtered by top-p or min-p only.
_FIRST_CANDIDATES = 64
# More candidates for a top-k row whose k-th value ties beyond them.
_CANDIDATE_GROWTH = 16
# Candidates come from topk while n * this <= V; beyond, from a sort of the row.
_SORT_RATIO = 2
_BELOW_ONE = 1.0 - 2.0**-53
_LOG2E = math.log2(math.e)


class RowFilters(NamedTuple):
    """Per-row parameters of the rows handed to ``sample_random`` (None: no row uses it)."""

    temperature: torch.Tensor  # [R] float32, every row at or above GREEDY_TEMPERATURE
    top_k: torch.Tensor | None  # [R] int64; 0, negative or >= V = off
    top_p: torch.Tensor | None  # [R] float32; 1.0 = off
    min_p: torch.Tensor | None  # [R] float32; 0.0 = off

    def select(self, rows: torch.Tensor) -> "RowFilters":
        return RowFilters(*(None if t is None else t[rows] for t in self))


def sample_random(logits: torch.Tensor, filters: RowFilters,
                  generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One token per row from softmax(logits / temperature), restricted by top-k, then top-p on
    the top-k-renormalised distribution, then min-p (the sets ``apply_top_k_top_p`` and
    ``apply_min_p`` keep). Rows without a filter draw over the vocabulary; filtered rows only
    among their most likely tokens, found without sorting the vocabulary where possible."""
    num_rows, vocab_size = logits.shape
    u = uniforms(num_rows, generators, logits.device)
    if filters.top_k is None and filters.top_p is None and filters.min_p is None:
        return draw_from_probs(_exp_weights(logits, filters.temperature), u)
    filtered = torch.zeros(num_rows, dtype=torch.bool, device=logits.device)
    if filters.top_k is not None:
        filtered |= (filters.top_k > 0) & (filters.top_k < vocab_size)
    if filters.top_p is not None:
        filtered |= filters.top_p < 1.0
    if filters.min_p is not None:
        filtered |= filters.min_p > 0.0
    num_filtered = int(filtered.sum())
    if num_filtered == 0:
        return draw_from_probs(_exp_weights(logits, filters.temperature), u)
    if num_filtered == num_rows:
        return _draw_filtered(logits, filters, u)
    tokens = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    rows = filtered.nonzero().squeeze(1)
    tokens[rows] = _draw_filtered(logits[rows], filters.select(rows), u[rows])
    rows = (~filtered).nonzero().squeeze(1)
    weights = _exp_weights(logits[rows], filters.temperature[rows])
    tokens[rows] = draw_from_probs(weights, u[rows])
    return tokens


def uniforms(num_rows: int, generators: dict[int, torch.Generator],
             device: torch.device) -> torch.Tensor:
    """One float64 U[0, 1) per row: a seeded row's from its own generator, the others' from the
    default generator (of ``device``) in one call.

    Per-request generators are host generators (``generators.step_generator``) on every
    platform: a seeded request then draws the same uniforms on a CPU and a GPU, and they reach
    the device in one small asynchronous copy (no host sync)."""
    u = torch.empty(num_rows, dtype=torch.float64, device=device)
    if len(generators) < num_rows:
        u.uniform_()
    if not generators:
        return u
    rows = list(generators)
    seeded = torch.empty(len(rows), dtype=torch.float64)
    for j, row in enumerate(rows):
        seeded[j:j + 1].uniform_(generator=generators[row])
    # Index and values built on the host, sent without waiting for the device.
    index = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
    u[index] = seeded.to(device, non_blocking=True)
    return u


def draw_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token ``i`` of each row with probability ``probs[i] / sum(probs)``, by inverse CDF at ``u``.

    Two levels, so that no cumulative sum runs over the vocabulary: a block of ``_BLOCK`` tokens
    by block sums, then a token inside it with the part of ``u`` left inside that block.
    """
    vocab_size = probs.shape[1]
    block, rest = _inverse_cdf(_block_reduce(probs, torch.sum).double(), u, with_rest=True)
    ids = block * _BLOCK + torch.arange(_BLOCK, device=probs.device)
    inside = probs.gather(1, ids.clamp(max=vocab_size - 1)).double()
    pos, _ = _inverse_cdf(inside.masked_fill_(ids >= vocab_size, 0.0), rest)
    return ids.gather(1, pos).squeeze(1)


def top_candidates(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n`` largest entries of each row and their ids: largest first, equal values by id.

    The order does not depend on how the entries were found, so neither does a draw over them.
    For small ``n`` only the ``n`` blocks with the largest maxima are searched: an entry of any
    other block is at most the n-th largest of those maxima, so it cannot rank above them.
    """
    num_rows, vocab_size = x.shape
    full = vocab_size - vocab_size % _BLOCK
    if 0 < n and n * _BLOCK * _TWO_LEVEL_RATIO <= full:
        blocks = _block_reduce(x[:, :full], torch.amax).topk(n, dim=1, sorted=False).indices
        ids = (blocks.unsqueeze(2) * _BLOCK + torch.arange(_BLOCK, device=x.device)).flatten(1)
        if full < vocab_size:  # the short last block is always searched
            tail = torch.arange(full, vocab_size, device=x.device).expand(num_rows, -1)
            ids = torch.cat([ids, tail], dim=1)
        values, pos = x.gather(1, ids).topk(n, dim=1)
        ids = ids.gather(1, pos)
    else:
        values, ids = x.topk(n, dim=1)
    new_value = values[:, 1:] != values[:, :-1]
    if n < 2 or bool(new_value.all()):
        return values, ids
    # Ties: order by (run of equal values, id) with one sort of distinct int64 keys.
    run = torch.cat([torch.zeros_like(ids[:, :1]), new_value.cumsum(dim=1)], dim=1)
    order = (run * vocab_size + ids).argsort(dim=1)
    return values.gather(1, order), ids.gather(1, order)


def _draw_filtered(logits: torch.Tensor, filters: RowFilters, u: torch.Tensor) -> torch.Tensor:
    """``sample_random`` on rows that all have a filter: draw among each row's ``n`` most likely
    tokens, ``n`` = 1 + the largest top-k (or ``_FIRST_CANDIDATES``). The rows whose kept set
    those do not cover draw again from as many as ``_kept_bound`` says they need; a sort of the
    row, which always covers, only when that is most of the vocabulary."""
    num_rows, vocab_size = logits.shape
    top_k = filters.top_k
    top_k = (torch.full((num_rows,), vocab_size, device=logits.device) if top_k is None else
             torch.where((top_k <= 0) | (top_k > vocab_size), vocab_size, top_k))
    filters = filters._replace(top_k=top_k)
    n = 1 + int(torch.where(top_k < vocab_size, top_k, _FIRST_CANDIDATES).max())
    tokens = rows = None  # rows: which of the R rows x still holds (None: all of them)
    x, mass = logits, _vocab_mass(logits, filters)
    while True:
        if n * _SORT_RATIO <= vocab_size:
            values, ids = top_candidates(x, n)
        else:
            n = vocab_size
            values, ids = x.sort(dim=1, descending=True, stable=True)
        drawn, covered = _draw_candidates(values, ids, filters, mass, u, vocab_size)
        if n >= vocab_size or bool(covered.all()):
            if rows is None:
                return drawn
            tokens[rows] = drawn
            return tokens
        if rows is None:
            rows = torch.arange(num_rows, device=logits.device)
            tokens = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
        tokens[rows[covered]] = drawn[covered]
        left = ~covered
        rows, x, filters, u = rows[left], x[left], filters.select(left), u[left]
        mass = None if mass is None else mass[left]
        n = max(n * 2, 1 + _kept_bound(x, filters, mass, otherwise=n * _CANDIDATE_GROWTH))


def _kept_bound(logits: torch.Tensor, filters: RowFilters, mass: torch.Tensor | None,
                otherwise: int) -> int:
    """An upper bound on how many tokens any row keeps (``otherwise`` for top-k rows, which are
    only here for ties). Top-p: the tokens in the value buckets (1/8 apart, relative) that reach
    ``p`` of the mass from the top; min-p: the tokens at or above it. One pass, no sort."""
    vocab_size = logits.shape[1]
    if bool((filters.top_k < vocab_size).any()):
        return otherwise
    weights = _exp_weights(logits, filters.temperature)  # in (0, 1]: its bits sort like it
    bound = torch.full((logits.shape[0],), vocab_size, device=logits.device)
    if filters.min_p is not None:
        at_least = weights >= filters.min_p.to(weights.dtype).unsqueeze(1)
        bound = torch.where(filters.min_p > 0.0, at_least.sum(dim=1), bound)
    if filters.top_p is not None:
        bucket = (weights.view(torch.int32) >> 20).long()  # 1.0 -> 1016
        shape = (logits.shape[0], 1024)
        hist = torch.zeros(shape, device=logits.device).scatter_add_(1, bucket, weights)
        count = torch.zeros(shape, device=logits.device).scatter_add_(
            1, bucket, torch.ones(1, device=logits.device).expand_as(weights))
        # Slightly above p: float sums must not stop a bucket early.
        target = (filters.top_p.double() * mass * (1 + 1e-5)).unsqueeze(1)
        below = (hist.flip(1).cumsum(dim=1).double() < target).sum(dim=1, keepdim=True)
        needed = count.flip(1).cumsum(dim=1).gather(1, below.clamp_(max=1023)).squeeze(1)
        bound = torch.where(filters.top_p < 1.0, torch.minimum(bound, needed.long()), bound)
    return int(bound.max())


def _exp_weights(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """exp((logits - row max) / temperature): softmax without the division by its sum.

    One new [R, V] tensor (a second one costs page faults on CPU), as 2 ** ((x - max) * log2(e)
    / T): on CPU ``exp2_`` is faster than ``exp_`` (docs/kernels.md), which also splits rows as
    short as 8k tokens across threads (costly when the cores are shared).
    """
    scale = (_LOG2E / temperature.to(logits.dtype)).unsqueeze(1)
    shift = logits.amax(dim=1, keepdim=True).mul_(scale).neg_()
    return torch.addcmul(shift, logits, scale).exp2_()  # one pass for (x - max) * scale


def _vocab_mass(logits: torch.Tensor, filters: RowFilters) -> torch.Tensor | None:
    """Per row, the sum of ``_exp_weights`` over the vocabulary for rows whose top-p is relative
    to the whole vocabulary (no top-k), 1.0 for the others; None without top-p."""
    if filters.top_p is None:
        return None
    num_rows, vocab_size = logits.shape
    mass = torch.ones(num_rows, dtype=torch.float64, device=logits.device)
    rows = ((filters.top_k >= vocab_size) & (filters.top_p < 1.0)).nonzero().squeeze(1)
    if rows.numel() == num_rows:
        mass = _exp_weights(logits, filters.temperature).sum(dim=1).double()
    elif rows.numel():
        weights = _exp_weights(logits[rows], filters.temperature[rows])
        mass[rows] = weights.sum(dim=1).double()
    return mass


def _draw_candidates(values: torch.Tensor, ids: torch.Tensor, filters: RowFilters,
                     mass: torch.Tensor | None, u: torch.Tensor,
                     vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw among candidates in ``top_candidates`` order (``filters.top_k``: V = off). Also says
    per row whether they cover its kept set: every other token is less likely than all kept."""
    scale = (_LOG2E / filters.temperature.double()).unsqueeze(1)
    weights = (values.double() - values[:, :1].double()).mul_(scale).exp2_()  # the first: 1
    keep = weights > 0.0
    k_on = (filters.top_k < vocab_size).unsqueeze(1)
    kth = values.gather(1, filters.top_k.clamp(max=values.shape[1]).unsqueeze(1) - 1)
    keep &= values >= kth.masked_fill_(~k_on, _NEG_INF)  # ties at the k-th value are kept
    if filters.top_p is not None:
        kept = weights * keep
        total = torch.where(k_on, kept.sum(dim=1, keepdim=True), mass.unsqueeze(1))
        before = kept.cumsum(dim=1) - kept  # mass of the more likely candidates
        p = filters.top_p.double().unsqueeze(1)
        keep &= (before < p * total) | (p >= 1.0)
    if filters.min_p is not None:
        keep &= weights >= filters.min_p.double().unsqueeze(1)
    pos, _ = _inverse_cdf(weights * keep, u)
    # Covered: no token outside ties with a kept one, nor with the k-th (top-p's total).
    least_kept = values.masked_fill(~keep, float("inf")).amin(dim=1, keepdim=True)
    last = values[:, -1:]
    covered = (last < least_kept) & ((last < kth) | ~k_on)
    return ids.gather(1, pos).squeeze(1), covered.squeeze(1)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor,
                 with_rest: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per row the index ``i`` [R, 1] with ``cumsum[i - 1] <= u * total < cumsum[i]`` (never a
    zero weight when the total is positive). ``with_rest``: also where ``u * total`` lies in
    that interval, as a fraction in [0, 1): a uniform independent of ``i``, for a second level."""
    cum = weights.cumsum(dim=1)
    total = cum[:, -1:]
    # u < 1, but u * total may round up to total: stay strictly below it.
    x = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    i = torch.searchsorted(cum, x, right=True).clamp_(max=weights.shape[1] - 1)
    if not with_rest:
        return i, None
    below = torch.where(i > 0, cum.gather(1, (i - 1).clamp_(min=0)), 0.0)
    rest = ((x - below) / weights.gather(1, i)).clamp_(0.0, _BELOW_ONE)
    return i, rest.squeeze(1)


def _block_reduce(x: torch.Tensor, op) -> torch.Tensor:
    """``op`` (torch.sum, torch.amax) over blocks of ``_BLOCK`` tokens; a short last block too."""
    num_rows, vocab_size = x.shape
    full = vocab_size - vocab_size % _BLOCK
    parts = []
    if full:
        parts.append(op(x[:, :full].reshape(num_rows, -1, _BLOCK), dim=2))
    if full < vocab_size:
        parts.append(op(x[:, full:], dim=1, keepdim=True))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
