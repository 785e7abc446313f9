"""Logits processing as plain PyTorch functions on [R, V] float32 logits.

``apply_logit_bias`` ... ``apply_presence_frequency_penalties`` may modify ``logits`` in place
and return the result; the sampler hands them a private copy. ``apply_temperature``,
``apply_top_k_top_p`` and ``apply_min_p`` state in mask form which tokens a random row may draw:
they are the reference the tests hold ``draw.sample_random`` to, not a step of the sampler. The
draw itself is in ``draw.py``.
"""

from __future__ import annotations

from itertools import chain

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
    ignored (input processing rejects them, see ``InputProcessor``)."""
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
