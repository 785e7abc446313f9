"""The one internal form every checkpoint format is unpacked into, and its reference dequantizer.

``IntWeight`` holds a linear weight ``[N, K]`` (output x input features) as integers with a scale
and an optional zero point per (output row, group of input columns):

    w[n, k] = (q[n, k] - zeros[n, g_idx[k]]) * scales[n, g_idx[k]]

``g_idx[k]`` is ``k // group_size`` except for GPTQ act-order checkpoints, whose groups are
scattered over the input columns. ``dequantize`` is the plain-PyTorch twin every kernel is tested
against; the format unpackers (gptq.py, awq.py, compressed_tensors.py) only reorder bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class IntWeight:
    q: torch.Tensor  # int16 [N, K]: wide enough for signed and unsigned 8-bit values
    scales: torch.Tensor  # float32 [N, G]
    zeros: torch.Tensor | None  # int16 [N, G]; None: symmetric, zero point 0 (signed q)
    g_idx: torch.Tensor  # int64 [K]: the group of each input column
    bits: int

    @property
    def num_groups(self) -> int:
        return self.scales.shape[1]

    def is_grouped_in_order(self) -> tuple[bool, int]:
        """(columns are in contiguous equal groups in order, their size)."""
        k, g = self.q.shape[1], self.num_groups
        if k % g:
            return False, 0
        size = k // g
        expect = torch.arange(k, dtype=torch.int64) // size
        return bool(torch.equal(self.g_idx, expect)), size


def dequantize(w: IntWeight) -> torch.Tensor:
    """The float32 weight ``[N, K]``: the reference every kernel and unpacker is checked against.
    ``q - zero`` is exact in float32, so the result is one rounding of ``(q - z) * s``."""
    q = w.q.to(torch.float32)
    scales = w.scales[:, w.g_idx]
    if w.zeros is not None:
        q = q - w.zeros[:, w.g_idx].to(torch.float32)
    return q * scales


def default_g_idx(in_features: int, group_size: int) -> torch.Tensor:
    return torch.arange(in_features, dtype=torch.int64) // group_size


def unpack_int32(packed: torch.Tensor, bits: int, dim: int,
                 order: list[int] | None = None) -> torch.Tensor:
    """Unsigned ``bits``-bit values packed little-endian into int32 words along ``dim``
    (value ``i`` of a word at bits ``[bits*i, bits*(i+1))``), as int16 with ``dim`` grown by
    ``32 // bits``. ``order[j]``: the position in the word of the ``j``-th value (AWQ interleaves
    them); None = in order."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int32) * bits
    if order is not None:
        shifts = shifts[torch.tensor(order)]
    x = packed.to(torch.int32).movedim(dim, -1).unsqueeze(-1)
    values = (x >> shifts) & ((1 << bits) - 1)  # arithmetic shift, then mask: sign-safe
    values = values.flatten(-2).to(torch.int16)
    return values.movedim(-1, dim).contiguous()
