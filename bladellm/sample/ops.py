"""The sampler's steps as plain PyTorch functions on [R, V] float32 logits.

Logits processing (``apply_logit_bias`` ... ``apply_presence_frequency_penalties``) may modify
``logits`` in place and returns the result; the sampler hands it a private copy. The draw
(``sample_random``) never modifies its input. ``apply_temperature``, ``apply_top_k_top_p`` and
``apply_min_p`` state in mask form which tokens a random row may draw: they are the reference
the tests hold ``sample_random`` to, not a step of the sampler.
"""

from __future__ import annotations

import math
from itertools import chain
from typing import NamedTuple

import torch

_NEG_INF = float("-inf")


def _flat_keys(token_ids: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Flat indices ``row * V + token`` of every token in ``token_ids[row]`` (duplicates kept)."""
    tokens = torch.tensor(list(chain.from_iterable(token_ids)), dtype=torch.int64, device=device)
    lengths = torch.tensor([len(ids) for ids in token_ids], dtype=torch.int64, device=device)
    rows = torch.repeat_interleave(torch.arange(len(token_ids), device=device), lengths,
                                   output_size=tokens.numel())
    return rows * vocab_size + tokens


def _sparse_entries(entries: dict[int, dict[int, float]] | dict[int, list[int]], vocab_size: int):
    """(rows, tokens, values) of a sparse row -> tokens map, dropping out-of-range ids."""
    rows, toks, vals = [], [], []
    for row, per_row in entries.items():
        items = per_row.items() if isinstance(per_row, dict) else ((t, 0.0) for t in per_row)
        for tok, val in items:
            if 0 <= tok < vocab_size:
                rows.append(row)
                toks.append(tok)
                vals.append(val)
    return rows, toks, vals


def apply_logit_bias(logits: torch.Tensor, logit_bias: dict[int, dict[int, float]]) -> torch.Tensor:
    """Add ``logit_bias[row][token]`` to ``logits[row, token]``; ids outside the vocabulary are
    ignored (input processing rejects them, see ``validate_token_ids``)."""
    rows, toks, vals = _sparse_entries(logit_bias, logits.shape[1])
    if rows:
        device = logits.device
        index = (torch.tensor(rows, device=device), torch.tensor(toks, device=device))
        logits.index_put_(index, torch.tensor(vals, dtype=logits.dtype, device=device),
                          accumulate=True)
    return logits


def apply_banned_tokens(logits: torch.Tensor, banned: dict[int, list[int]]) -> torch.Tensor:
    """Set ``logits[row, token]`` to -inf for every banned token (``min_tokens`` not reached)."""
    rows, toks, _ = _sparse_entries(banned, logits.shape[1])
    if rows:
        device = logits.device
        logits[torch.tensor(rows, device=device), torch.tensor(toks, device=device)] = _NEG_INF
    return logits


def apply_repetition_penalty(
    logits: torch.Tensor,
    penalty: torch.Tensor,
    prompt_token_ids: list[list[int]] | None,
    output_token_ids: list[list[int]],
) -> torch.Tensor:
    """HF/CTRL semantics: every token seen in the prompt or the output so far has its logit divided
    by ``penalty`` if positive, multiplied by it otherwise (once, however often it occurs)."""
    vocab_size = logits.shape[1]
    keys = _flat_keys(output_token_ids, vocab_size, logits.device)
    if prompt_token_ids is not None:
        keys = torch.cat([_flat_keys(prompt_token_ids, vocab_size, logits.device), keys])
    if keys.numel() == 0:
        return logits
    flat = logits.view(-1)
    seen = flat[keys]
    p = penalty.to(logits.dtype)[keys // vocab_size]
    # Duplicate keys write the same value, so the unordered index_put_ stays deterministic.
    flat[keys] = torch.where(seen > 0, seen / p, seen * p)
    return logits


def apply_presence_frequency_penalties(
    logits: torch.Tensor,
    presence_penalty: torch.Tensor | None,
    frequency_penalty: torch.Tensor | None,
    output_token_ids: list[list[int]],
) -> torch.Tensor:
    """OpenAI semantics over the output tokens only:
    ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``."""
    vocab_size = logits.shape[1]
    keys = _flat_keys(output_token_ids, vocab_size, logits.device)
    if keys.numel() == 0:
        return logits
    flat = logits.view(-1)
    rows = keys // vocab_size
    if presence_penalty is not None:
        # Written, not accumulated: a token seen twice is penalised once.
        flat[keys] = flat[keys] - presence_penalty.to(logits.dtype)[rows]
    if frequency_penalty is not None:
        flat.index_add_(0, keys, -frequency_penalty.to(logits.dtype)[rows])
    return logits


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor,
                      greedy_threshold: float) -> torch.Tensor:
    """Divide each row by its temperature; greedy rows (temperature below the threshold) by 1."""
    temp = torch.where(temperature < greedy_threshold, 1.0, temperature).to(logits.dtype)
    return logits.div_(temp.unsqueeze(1))


def apply_top_k_only(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keep each row's ``k`` largest logits (``k`` 0 = keep all; ties at the k-th value are kept).

    Uses ``topk(max k)`` instead of a full sort; reading ``k.max()`` is the one host sync.
    """
    vocab_size = logits.shape[1]
    k = k.to(torch.int64)
    off = (k <= 0) | (k >= vocab_size)
    max_k = int(torch.where(off, 1, k).max())
    kth = logits.topk(max_k, dim=-1).values.gather(1, (torch.where(off, 1, k) - 1).unsqueeze(1))
    kth = kth.masked_fill_(off.unsqueeze(1), _NEG_INF)
    return logits.masked_fill_(logits < kth, _NEG_INF)


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None,
                      p: torch.Tensor | None) -> torch.Tensor:
    """Top-k then top-p (nucleus) filtering, masked tokens set to -inf.

    Top-p keeps the smallest set of most likely tokens whose probability (renormalised after
    top-k) reaches ``p``: a token is dropped when the tokens more likely than it already hold
    ``p`` or more. The most likely token is always kept. When every row has a small top-k, only
    the ``max k`` candidates are sorted (``topk``) instead of the whole vocabulary.
    """
    if p is None:
        return logits if k is None else apply_top_k_only(logits, k)
    vocab_size = logits.shape[1]
    if k is not None:
        k = k.to(torch.int64)
        k = torch.where((k <= 0) | (k > vocab_size), vocab_size, k)
        max_k = int(k.max())  # host sync, as in apply_top_k_only
        if max_k * _PARTIAL_SORT_RATIO <= vocab_size:
            return _top_k_top_p_candidates(logits, k, p, max_k)
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if k is not None:
        kth = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, _NEG_INF)
    probs = sorted_logits.softmax(dim=-1)
    # Ascending order: cumsum[j] is the mass of token j and all less likely ones.
    drop = probs.cumsum(dim=-1) <= (1.0 - p.to(probs.dtype)).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, _NEG_INF)
    return logits.scatter_(1, order, sorted_logits)


# Sort only the top max-k candidates when max k is at most V / this.
_PARTIAL_SORT_RATIO = 8


def _top_k_top_p_candidates(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor,
                            max_k: int) -> torch.Tensor:
    """``apply_top_k_top_p`` on the ``max_k`` most likely tokens of each row (descending)."""
    values, ids = logits.topk(max_k, dim=-1)
    kth = values.gather(1, (k - 1).unsqueeze(1))
    values.masked_fill_(values < kth, _NEG_INF)
    probs = values.softmax(dim=-1)
    # Descending order: mass of the tokens strictly more likely than token j.
    mass_before = probs.cumsum(dim=-1) - probs
    values.masked_fill_(mass_before >= p.to(probs.dtype).unsqueeze(1), _NEG_INF)
    return torch.full_like(logits, _NEG_INF).scatter_(1, ids, values)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the row's highest probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.to(probs.dtype).unsqueeze(1)
    return logits.masked_fill_(probs < threshold, _NEG_INF)


# The draw. Inverse CDF with one uniform per row: a seeded row's token then depends only on its
# generator and its own logits, never on the batch, and the unseeded rows share one call.

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
    default generator in one call."""
    u = torch.empty(num_rows, dtype=torch.float64, device=device)
    if len(generators) < num_rows:
        u.uniform_()
    for row, generator in generators.items():
        u[row:row + 1].uniform_(generator=generator)
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
    / T): on CPU ``exp2_`` is ~1.5x faster than ``exp_``, which also splits rows as short as
    8k tokens across threads (costly when the cores are shared).
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
