"""Test-side readers of the formats blade_llm_quantize writes, written independently of
bladellm/quantization/algorithms/writer.py (plain loops over bit fields, from the format descriptions)."""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open


def read_checkpoint(qdir: str) -> dict[str, torch.Tensor]:
    with open(os.path.join(qdir, "model.safetensors.index.json")) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    out = {}
    for name in files:
        with safe_open(os.path.join(qdir, name), "pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


def _fields(word: int, bits: int) -> list[int]:
    word &= 0xFFFFFFFF
    return [(word >> (bits * j)) & ((1 << bits) - 1) for j in range(32 // bits)]


def unpack_qweight(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [in / (32/bits), out] -> int [in, out]: row r*(32/bits)+j in bits j of word r."""
    rows, cols = qweight.shape
    per = 32 // bits
    out = torch.empty(rows * per, cols, dtype=torch.int64)
    for r in range(rows):
        for c in range(cols):
            out[r * per:(r + 1) * per, c] = torch.tensor(_fields(int(qweight[r, c]), bits))
    return out


def unpack_qzeros(qzeros: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [groups, out / (32/bits)] -> the zero points [groups, out] (stored + 1, v1)."""
    groups, cols = qzeros.shape
    per = 32 // bits
    out = torch.empty(groups, cols * per, dtype=torch.int64)
    for g in range(groups):
        for c in range(cols):
            out[g, c * per:(c + 1) * per] = torch.tensor(_fields(int(qzeros[g, c]), bits))
    return out + 1


def dequantize_gptq(t: dict[str, torch.Tensor], prefix: str, bits: int) -> torch.Tensor:
    """[out, in] float32 weight of the linear ``prefix``."""
    q = unpack_qweight(t[prefix + ".qweight"], bits)            # [in, out]
    zeros = unpack_qzeros(t[prefix + ".qzeros"], bits)          # [groups, out]
    scales = t[prefix + ".scales"].float()                      # [groups, out]
    g = t[prefix + ".g_idx"].long()
    w = torch.empty(q.shape, dtype=torch.float32)
    for i in range(q.shape[0]):
        w[i] = scales[g[i]] * (q[i] - zeros[g[i]]).float()
    return w.t().contiguous()


def dequantize_int8(t: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    return t[prefix + ".weight"].float() * t[prefix + ".weight_scale"].float()
