"""Integer weight grids shared by every offline algorithm.

Two grids:

* ``GroupQuantSpec`` / ``QuantizedWeight``: the GPTQ grid (AutoGPTQ's ``Quantizer``): unsigned
  ``bits``-bit integers with a per-(group, output channel) scale and integer zero point,
  ``w = scale * (q - zero)``. Symmetric means ``zero = 2**(bits-1)`` and ``scale = 2*absmax/maxq``,
  exactly as AutoGPTQ/GPTQModel compute it, so the written checkpoint dequantizes the same way
  in every engine. Groups run along the input dimension; ``g_idx[i]`` names the group of input
  column ``i`` (a permutation of the plain ``i // group_size`` under act-order).
* ``Int8ChannelWeight``: compressed-tensors' symmetric int8 per-output-channel grid
  (``scale = absmax / 127.5``, ``q = clamp(round(w / scale), -128, 127)``, no zero point), the
  weights of a W8A8 checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GroupQuantSpec:
    bits: int
    group_size: int  # -1: one group spanning all input features (per output channel)
    sym: bool

    @property
    def maxq(self) -> int:
        return 2 ** self.bits - 1

    def groups_of(self, in_features: int) -> int:
        return 1 if self.group_size == -1 else in_features // self.group_size

    def effective_group_size(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size


@dataclass
class QuantizedWeight:
    """A linear weight on the GPTQ grid. ``qweight`` is ``[out, in]`` with values in
    ``[0, maxq]``; ``scales`` and ``zeros`` are ``[groups, out]``; ``g_idx`` is ``[in]``."""
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor
    spec: GroupQuantSpec

    def dequantize(self) -> torch.Tensor:
        g = self.g_idx.long()
        scale = self.scales[g].t()  # [out, in]
        zero = self.zeros[g].t().to(scale.dtype)
        return scale * (self.qweight.to(scale.dtype) - zero)


@dataclass
class Int8ChannelWeight:
    """A symmetric int8 per-output-channel weight: ``w = qweight * scale``; ``scale`` is
    ``[out, 1]``."""
    qweight: torch.Tensor
    scale: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        return self.qweight.to(self.scale.dtype) * self.scale


def find_params(w: torch.Tensor, spec: GroupQuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row scale and (float, integer-valued) zero of ``w`` ``[rows, cols]``: AutoGPTQ's
    ``Quantizer.find_params(weight=True)`` without the MSE search."""
    zeros_ = torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)
    xmin = torch.minimum(w.min(dim=1).values, zeros_)
    xmax = torch.maximum(w.max(dim=1).values, zeros_)
    if spec.sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    both_zero = (xmin == 0) & (xmax == 0)
    xmin = torch.where(both_zero, -torch.ones_like(xmin), xmin)
    xmax = torch.where(both_zero, torch.ones_like(xmax), xmax)
    scale = (xmax - xmin) / spec.maxq
    if spec.sym:
        zero = torch.full_like(scale, (spec.maxq + 1) / 2)
    else:
        # >= 1: the GPTQ v1 checkpoint stores ``zero - 1`` in ``bits`` bits, so a zero of 0
        # (a group with no negative weight) is not representable there
        zero = torch.round(-xmin / scale).clamp(min=1)
    return scale, zero


def quantize_to_int(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    maxq: int) -> torch.Tensor:
    """``w`` ``[rows, cols]`` (or ``[rows]``) with per-row ``scale``/``zero`` -> integers."""
    if w.dim() == 2:
        scale, zero = scale.unsqueeze(1), zero.unsqueeze(1)
    return torch.clamp(torch.round(w / scale) + zero, 0, maxq)


def fake_quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                  maxq: int) -> torch.Tensor:
    q = quantize_to_int(w, scale, zero, maxq)
    if w.dim() == 2:
        scale, zero = scale.unsqueeze(1), zero.unsqueeze(1)
    return scale * (q - zero)


def rtn_quantize(w: torch.Tensor, spec: GroupQuantSpec) -> QuantizedWeight:
    """Round-to-nearest (min-max) group quantization of ``w`` ``[out, in]``."""
    out_features, in_features = w.shape
    w = w.float()
    gs = spec.effective_group_size(in_features)
    groups = spec.groups_of(in_features)
    grouped = w.reshape(out_features, groups, gs).permute(1, 0, 2)  # [groups, out, gs]
    scales = torch.empty(groups, out_features)
    zeros = torch.empty(groups, out_features)
    q = torch.empty_like(w)
    for g in range(groups):
        scale, zero = find_params(grouped[g], spec)
        scales[g], zeros[g] = scale, zero
        q[:, g * gs:(g + 1) * gs] = quantize_to_int(grouped[g], scale, zero, spec.maxq)
    g_idx = torch.arange(in_features, dtype=torch.int32) // gs
    return QuantizedWeight(q.to(torch.int32), scales, zeros.to(torch.int32), g_idx, spec)


def fake_quantize_groups(w: torch.Tensor, spec: GroupQuantSpec) -> torch.Tensor:
    """``rtn_quantize(w, spec).dequantize()`` without materializing the integers (the inner
    loop of AWQ's and SmoothQuant+'s searches)."""
    out_features, in_features = w.shape
    gs = spec.effective_group_size(in_features)
    grouped = w.float().reshape(-1, gs)
    scale, zero = find_params(grouped, spec)
    return fake_quantize(grouped, scale, zero, spec.maxq).reshape(out_features, in_features)


def int8_channel_quantize(w: torch.Tensor) -> Int8ChannelWeight:
    """compressed-tensors' symmetric int8 per-channel observer (min-max): the scale maps
    ``absmax`` to 127.5 (bit range 255 / 2), integers are clamped to [-128, 127]."""
    w = w.float()
    absmax = torch.maximum(w.min(dim=1).values.abs(), w.max(dim=1).values.abs())
    scale = (absmax / 127.5).clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(1)
    q = torch.clamp(torch.round(w / scale), -128, 127).to(torch.int8)
    return Int8ChannelWeight(q, scale)


def fake_quantize_act_per_token(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token symmetric int8 activations, as a W8A8 runtime does them (vLLM's
    ``scaled_int8_quant``: ``scale = absmax / 127`` per token)."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 127.0
    return torch.clamp(torch.round(x / scale), -128, 127) * scale
