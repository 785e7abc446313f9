"""The int8 KV-cache row format (``--kv_cache_quant int8``), shared by the reference twins and
the compiled kernels (``cpu/attention_tiles.h``, ``cpu/elementwise.cpp``).

Every (token, kv head) row of K and of V is quantized on its own: symmetric absmax,
``scale = max|x| / 127``, ``q = round_half_even(x * (127 / max|x|))`` clamped to [-127, 127],
read back as ``q * scale`` (one fp32 multiply). The row's fp32 scale is packed right after its
``head_dim`` int8 values, so a cache tensor is int8 ``[..., head_dim + 4]`` and stays one tensor
per layer: the block tables, the prompt cache and every caller that passes caches around are
unchanged. Per-row scales make a token's stored bytes depend on that token alone, never on the
other tokens of its block, so a shared (prompt-cached) block is never rewritten and a
recomputed (preempted) request writes exactly the bytes it wrote before.

Rows whose ``head_dim`` is not a multiple of 4 cannot carry an aligned fp32 scale; the config of
such a model is refused (see ``check_head_dim``).
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # one fp32 scale per row
QMAX = 127.0


def is_int8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def row_width(head_dim: int) -> int:
    """Last dim of an int8 cache tensor for ``head_dim``."""
    return head_dim + SCALE_BYTES


def check_head_dim(head_dim: int) -> None:
    if head_dim % 4:
        raise ValueError(f"--kv_cache_quant int8: head_dim {head_dim} is not a multiple of 4 "
                         "(the per-row fp32 scale would be unaligned); use no_quant")


def split(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values int8 ``[..., d]``, scales fp32 ``[...]``): views into a packed int8 cache."""
    d = cache.shape[-1] - SCALE_BYTES
    return cache[..., :d], cache[..., d:].view(torch.float32)[..., 0]


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x [..., d]`` (any float dtype) -> (int8 ``[..., d]``, fp32 scales ``[...]``).
    The compiled writer does the same fp32 operations in the same order, bit for bit."""
    x = x.float()
    amax = x.abs().amax(-1)
    # Tensor / tensor here too: torch on CUDA turns a division by a Python scalar into a
    # multiplication by its reciprocal, which would make the twin's bits depend on the device.
    scale = amax / torch.full_like(amax, QMAX)
    # A tensor / tensor true division: ``QMAX / amax`` would be ``amax.reciprocal() * QMAX``
    # (two roundings), which the compiled writer does not do.
    inv = torch.where(amax > 0, torch.full_like(amax, QMAX) / amax, torch.zeros_like(amax))
    q = torch.round(x * inv.unsqueeze(-1)).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def pack(x: torch.Tensor) -> torch.Tensor:
    """Rows ``x [..., d]`` -> packed int8 rows ``[..., d + 4]``."""
    q, scale = quantize(x)
    out = torch.empty((*x.shape[:-1], row_width(x.shape[-1])), dtype=torch.int8,
                      device=x.device)
    values, scales = split(out)
    values.copy_(q)
    scales.copy_(scale)
    return out


def dequantize(cache_rows: torch.Tensor) -> torch.Tensor:
    """Packed int8 rows ``[..., d + 4]`` -> fp32 ``[..., d]``."""
    values, scales = split(cache_rows)
    return values.float() * scales.unsqueeze(-1)


def to_float(cache_rows: torch.Tensor) -> torch.Tensor:
    """fp32 view of cache rows of either format (int8 packed or a float dtype)."""
    return dequantize(cache_rows) if is_int8(cache_rows) else cache_rows.float()


def round_trip(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """``x`` as reading it back from ``cache`` after storing it gives (fp32 for an int8 cache,
    ``x`` itself otherwise)."""
    return dequantize(pack(x)) if is_int8(cache) else x
