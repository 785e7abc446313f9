"""Applying llguidance token bitmasks to logits (plain torch/numpy; no llguidance import).

A bitmask row is ``ceil(V / 32)`` int32 words; bit ``t % 32`` of word ``t // 32`` set means
token ``t`` is allowed. Logit columns past the mask's width (padded vocabularies) are banned.
"""

from __future__ import annotations

import numpy as np
import torch


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def unpack_bitmask(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """[R, W] int32 words -> [R, vocab_size] bool (True = allowed)."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=1,
                         bitorder="little")
    allowed = np.zeros((bitmask.shape[0], vocab_size), np.bool_)
    n = min(vocab_size, bits.shape[1])
    allowed[:, :n] = bits[:, :n]
    return allowed


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor,
                        bitmask: np.ndarray) -> torch.Tensor:
    """Set ``logits[rows[i], t]`` to -inf for every token ``t`` row ``i`` of ``bitmask`` bans.

    ``logits`` is modified in place and returned; rows not listed are untouched.
    """
    allowed = torch.from_numpy(unpack_bitmask(bitmask, logits.shape[1])).to(logits.device)
    rows = rows.to(logits.device)
    sub = logits[rows]
    sub.masked_fill_(~allowed, float("-inf"))
    logits[rows] = sub
    return logits
