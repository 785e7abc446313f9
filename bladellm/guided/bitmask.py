"""Applying llguidance token bitmasks to logits (plain torch/numpy; no llguidance import).

A bitmask row is ``ceil(V / 32)`` int32 words; bit ``t % 32`` of word ``t // 32`` set means
token ``t`` is allowed.
"""

from __future__ import annotations

import numpy as np
import torch


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def unpack_bitmask(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """[R, W] int32 words -> [R, vocab_size] bool (True = allowed); a view, no copy beyond the
    unpacking itself."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=1,
                         bitorder="little")
    if bits.shape[1] < vocab_size:  # logits wider than the tokenizer's vocabulary: ban the rest
        bits = np.pad(bits, ((0, 0), (0, vocab_size - bits.shape[1])))
    return bits[:, :vocab_size].view(np.bool_)


# bit -> additive bias. A branch-free lookup and add: masked_fill_ with a bool mask branches per
# element, which a JSON mask (~half the vocabulary allowed inside strings) makes unpredictable
# (measured 10.6 vs 2.5 ms for 32 x 49152 logits on one thread).
_BIAS = np.array([-np.inf, 0.0], np.float32)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor,
                        bitmask: np.ndarray) -> torch.Tensor:
    """Set ``logits[rows[i], t]`` to -inf for every token ``t`` row ``i`` of ``bitmask`` bans.

    ``logits`` (float) is modified in place and returned; rows not listed are untouched.
    """
    bits = unpack_bitmask(bitmask, logits.shape[1]).view(np.uint8)
    bias = torch.from_numpy(_BIAS.take(bits)).to(device=logits.device, dtype=logits.dtype)
    if len(rows) == logits.shape[0] and bool((rows == torch.arange(len(rows))).all()):
        return logits.add_(bias)  # every row constrained, in order
    return logits.index_add_(0, rows.to(logits.device), bias)
