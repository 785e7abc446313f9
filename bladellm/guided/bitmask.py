"""Applying llguidance token bitmasks to logits (no llguidance import; the packed words go to
the worker's kernel set, ``bladellm.kernels``, as they are).

A bitmask row is ``ceil(V / 32)`` int32 words; bit ``t % 32`` of word ``t // 32`` set means
token ``t`` is allowed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    # Neither at import time (torch loads with either): the engine imports this module before it
    # has set the OpenMP policy, which must precede torch (platforms.threads).
    import torch

    from bladellm.kernels.interface import Kernels


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def unpack_bitmask(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """[R, W] int32 words -> [R, vocab_size] bool (True = allowed); a view, no copy beyond the
    unpacking itself. For tests and inspection: the sampler never unpacks."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=1,
                         bitorder="little")
    if bits.shape[1] < vocab_size:  # logits wider than the tokenizer's vocabulary: ban the rest
        bits = np.pad(bits, ((0, 0), (0, vocab_size - bits.shape[1])))
    return bits[:, :vocab_size].view(np.bool_)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: np.ndarray,
                        kernels: Kernels) -> torch.Tensor:
    """Set ``logits[rows[i], t]`` to -inf for every token ``t`` row ``i`` of ``bitmask`` bans.

    ``logits`` (float) is modified in place and returned; rows not listed are untouched, and
    so are the allowed tokens. The packed words are applied as they are (``kernels``'
    ``apply_token_bitmask``: compiled, one thread, writing only banned tokens): unpacking to a
    [rows, vocab] mask and adding a -inf/0 bias took 3 full-vocabulary passes, two of them
    torch ops that wait for a second OpenMP thread, which a loaded machine makes slow
    (docs/kernels.md).
    """
    import torch

    # Built on the host (the grammar's matcher); on a GPU both go over in small async copies.
    # The rows are checked here, on the host, so that no kernel set has to read them back.
    if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= logits.shape[0]):
        raise IndexError(f"apply_token_bitmask: a row is outside [0, {logits.shape[0]})")
    words = torch.from_numpy(np.ascontiguousarray(bitmask, np.int32))
    kernels.apply_token_bitmask(logits, rows.to(logits.device, non_blocking=True),
                                words.to(logits.device, non_blocking=True))
    return logits
