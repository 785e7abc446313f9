"""GPU sampling filters in Triton: temperature, top-k, top-p and min-p applied to ``[R, V]``
float32 logits in one kernel, without sorting the vocabulary. The twin is ``sampling_mask_ref``.

Semantics (those of ``bladellm.sample.ops`` in mask form: ``apply_temperature`` ->
``apply_top_k_top_p`` -> ``apply_min_p``; the tests hold the twin to them):

- temperature: every row divided by its temperature; rows below ``greedy_threshold`` by 1;
- top-k: keep the values at or above the k-th largest (ties kept; k <= 0 or >= V: off);
- top-p: on the top-k-renormalised distribution, drop a token when the tokens *strictly* more
  likely hold ``p`` of the mass or more (p >= 1: off). Tokens tied with a kept one are kept,
  so the kept set is always ``{x >= threshold}`` (ops' sort path breaks such ties by sort order);
- min-p: drop tokens whose probability is below ``min_p`` times the largest (min_p <= 0: off).

One program per row. Each threshold is found by bisection on the 32-bit order-preserving
integer key of the float values: 32 passes over the row (L2-resident on a GPU) counting keys
(top-k) or summing ``exp(x - max)`` (top-p), each monotone in the threshold, so the bisection
lands exactly on the twin's threshold up to fp32 summation order at a knife edge.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _scaled(logits_ptr, row, cols, V, temp):
    """Temperature-scaled values (div_rn: as torch's division) with -0.0 made +0.0, so that
    equal floats have equal keys; masked columns read -inf."""
    x = tl.load(logits_ptr + row + cols, mask=cols < V, other=float("-inf"))
    x = tl.math.div_rn(x, temp)
    return tl.where(x == 0.0, 0.0, x)


@triton.jit
def _key(x):
    """int64 key with ``key(a) < key(b)`` iff ``a < b`` for non-NaN floats."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def _filter_kernel(logits_ptr, out_ptr, temp_ptr, k_ptr, p_ptr, min_p_ptr, V, stride_l,
                   stride_o, greedy_threshold, HAS_TEMP: tl.constexpr, HAS_K: tl.constexpr,
                   HAS_P: tl.constexpr, HAS_MIN_P: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    row = r * stride_l
    offs = tl.arange(0, BLOCK)
    temp = tl.full((), 1.0, tl.float32)
    if HAS_TEMP:
        t = tl.load(temp_ptr + r).to(tl.float32)
        temp = tl.where(t < greedy_threshold, 1.0, t)
    x_max = tl.full((), float("-inf"), tl.float32)
    key_min = tl.full((), 0x7FFFFFFF, tl.int64)
    for v0 in range(0, V, BLOCK):
        x = _scaled(logits_ptr, row, v0 + offs, V, temp)
        x_max = tl.maximum(x_max, tl.max(x, axis=0))
        key_min = tl.minimum(key_min, tl.min(_key(x), axis=0))
    key_max = _key(x_max)

    # Top-k: the largest key t with count(key >= t) >= k is the k-th largest value's key.
    k_key = key_min
    if HAS_K:
        k = tl.load(k_ptr + r).to(tl.int64)
        if (k > 0) & (k < V):
            lo, hi = key_min, key_max + 1  # count(>= lo) = V >= k; count(>= hi) = 0 < k
            for _ in range(33):
                mid = lo + (hi - lo) // 2
                count = tl.zeros((), tl.int64)
                for v0 in range(0, V, BLOCK):
                    cols = v0 + offs
                    x = _scaled(logits_ptr, row, cols, V, temp)
                    count += tl.sum(((_key(x) >= mid) & (cols < V)).to(tl.int64), axis=0)
                ok = count >= k
                lo = tl.where(ok & (hi - lo > 1), mid, lo)
                hi = tl.where(~ok & (hi - lo > 1), mid, hi)
            k_key = lo

    # Top-p: the smallest key K with mass(key > K) < p * total; keep key >= K.
    p_key = key_min
    if HAS_P:
        p = tl.load(p_ptr + r).to(tl.float32)
        if p < 1.0:
            total = tl.zeros((), tl.float32)
            for v0 in range(0, V, BLOCK):
                x = _scaled(logits_ptr, row, v0 + offs, V, temp)
                w = tl.where(_key(x) >= k_key, tl.exp(x - x_max), 0.0)
                total += tl.sum(w, axis=0)
            target = p * total
            lo, hi = key_min - 1, key_max  # mass(> lo) >= total >= target; mass(> hi) = 0
            for _ in range(33):
                mid = lo + (hi - lo) // 2
                # Tokens below the top-k threshold are not left out here: they only count
                # while mid < k_key, where max(k_key, p_key) makes the threshold k_key anyway.
                mass = tl.zeros((), tl.float32)
                for v0 in range(0, V, BLOCK):
                    x = _scaled(logits_ptr, row, v0 + offs, V, temp)
                    w = tl.where(_key(x) > mid, tl.exp(x - x_max), 0.0)
                    mass += tl.sum(w, axis=0)
                ok = mass < target
                hi = tl.where(ok & (hi - lo > 1), mid, hi)
                lo = tl.where(~ok & (hi - lo > 1), mid, lo)
            p_key = hi

    min_w = tl.full((), 0.0, tl.float32)
    if HAS_MIN_P:
        min_w = tl.load(min_p_ptr + r).to(tl.float32)  # prob / max prob = exp(x - max)
    threshold = tl.maximum(k_key, p_key)
    for v0 in range(0, V, BLOCK):
        cols = v0 + offs
        x = _scaled(logits_ptr, row, cols, V, temp)
        keep = (_key(x) >= threshold) & (tl.exp(x - x_max) >= min_w)
        tl.store(out_ptr + r * stride_o + cols, tl.where(keep, x, float("-inf")), mask=cols < V)


def _check(logits: torch.Tensor, *per_row: torch.Tensor | None) -> None:
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError("logits must be float32 [R, V] with contiguous rows")
    for t in per_row:
        if t is not None and t.shape != (logits.shape[0],):
            raise ValueError(f"per-row parameters must be [{logits.shape[0]}], got "
                             f"{tuple(t.shape)}")


def apply_sampling_filters(logits: torch.Tensor, temperature: torch.Tensor | None,
                           top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                           min_p: torch.Tensor | None, greedy_threshold: float, *,
                           inplace: bool = True, block: int = 1024) -> torch.Tensor:
    """Temperature-scaled logits with the tokens top-k, top-p and min-p drop set to -inf
    (semantics above; None: no row uses that parameter). In place, or into a new tensor."""
    _check(logits, temperature, top_k, top_p, min_p)
    out = logits if inplace else torch.empty_like(logits)
    num_rows, vocab_size = logits.shape
    if num_rows == 0 or vocab_size == 0:
        return out
    dummy = logits  # never read: its HAS_* flag is off
    _filter_kernel[(num_rows,)](
        logits, out, temperature if temperature is not None else dummy,
        top_k if top_k is not None else dummy, top_p if top_p is not None else dummy,
        min_p if min_p is not None else dummy, vocab_size, logits.stride(0), out.stride(0),
        greedy_threshold, HAS_TEMP=temperature is not None, HAS_K=top_k is not None,
        HAS_P=top_p is not None, HAS_MIN_P=min_p is not None,
        BLOCK=min(block, triton.next_power_of_2(vocab_size)))
    return out


def sampling_mask_ref(logits: torch.Tensor, temperature: torch.Tensor | None,
                      top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                      min_p: torch.Tensor | None, greedy_threshold: float) -> torch.Tensor:
    """Plain-PyTorch twin of ``apply_sampling_filters`` (a new tensor), by sorting each row;
    masses in float64."""
    _check(logits, temperature, top_k, top_p, min_p)
    num_rows, vocab_size = logits.shape
    x = logits.clone()
    if temperature is not None:
        x /= torch.where(temperature < greedy_threshold, 1.0, temperature).unsqueeze(1)
    keep = torch.ones_like(x, dtype=torch.bool)
    if top_k is not None:
        k = top_k.long()
        on = (k > 0) & (k < vocab_size)
        kth = x.sort(dim=1, descending=True).values.gather(
            1, (torch.where(on, k, 1) - 1).unsqueeze(1))
        keep &= (x >= kth) | ~on.unsqueeze(1)
    w = (x.double() - x.amax(dim=1, keepdim=True).double()).exp()
    if top_p is not None:
        kept_w = w * keep
        total = kept_w.sum(dim=1, keepdim=True)
        # Mass strictly above each token: ascending cumulative sums at the last tie.
        values, order = x.sort(dim=1)
        cum = kept_w.gather(1, order).cumsum(dim=1)
        upto = torch.searchsorted(values, x, right=True)  # tokens <= x
        at_or_below = torch.where(upto > 0, cum.gather(1, (upto - 1).clamp(min=0)), 0.0)
        above = total - at_or_below
        p = top_p.double().unsqueeze(1)
        keep &= (above < p * total) | (p >= 1.0)
    if min_p is not None:
        keep &= w >= min_p.double().unsqueeze(1)
    return x.masked_fill_(~keep, float("-inf"))
