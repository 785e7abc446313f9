"""GPTQ (Frantar et al., 2022) as AutoGPTQ implements it (``GPTQ.fasterquant``).

``HessianAccumulator`` sums ``H = 2/n * sum X^T X`` over the calibration inputs of one linear;
``gptq_quantize`` quantizes the weight column by column in blocks of 128, spreading each column's
rounding error over the columns not yet quantized through the upper Cholesky factor of ``H^-1``.
Group parameters are found when the first column of a group is reached, on the weight as updated
so far (AutoGPTQ takes them from the not-yet-block-updated ``W``: kept, so results match).
With ``act_order`` columns go in order of decreasing ``diag(H)`` and ``g_idx`` maps each
original column to the group of its position in that order.

A linear that no calibration token reached (a mixture-of-experts expert the router never chose;
algorithms/moe.py) has no Hessian: it is quantized by min-max round-to-nearest instead, and
``tokens_seen`` (the calibration tokens each linear saw) says which.
"""

from __future__ import annotations

import torch
from torch import nn

from bladellm.quantization.algorithms.base import LayerResult
from bladellm.quantization.algorithms.layer_io import (LayerInputs, input_hooks, linear,
                                                        run_layer)
from bladellm.quantization.algorithms.layouts import layout_of_layer
from bladellm.quantization.algorithms.quantizer import (GroupQuantSpec, QuantizedWeight,
                                                         find_params, quantize_to_int,
                                                         rtn_quantize)

BLOCK_SIZE = 128


class HessianAccumulator:
    """Running ``2/n * sum_batches X^T X`` of a linear's inputs (n counts sequences, as
    AutoGPTQ's ``add_batch`` does; the scale cancels in GPTQ except through dampening, which
    is relative to ``mean(diag(H))``)."""

    def __init__(self, in_features: int) -> None:
        self.H = torch.zeros(in_features, in_features, dtype=torch.float32)
        self.num_samples = 0
        self.num_tokens = 0

    def add_batch(self, inp: torch.Tensor) -> None:
        batch = inp.shape[0] if inp.dim() == 3 else 1
        x = inp.reshape(-1, inp.shape[-1]).float()
        self.num_tokens += x.shape[0]
        self.H *= self.num_samples / (self.num_samples + batch)
        self.num_samples += batch
        x = (2.0 / self.num_samples) ** 0.5 * x
        self.H += x.t() @ x


def _inverse_hessian_factor(H: torch.Tensor, percdamp: float) -> torch.Tensor:
    damp = percdamp * torch.mean(torch.diag(H))
    idx = torch.arange(H.shape[0])
    H[idx, idx] += damp
    try:
        L = torch.linalg.cholesky(H)
        Hinv = torch.cholesky_inverse(L)
        return torch.linalg.cholesky(Hinv, upper=True)
    except torch.linalg.LinAlgError as exc:  # an error the CLI reports, not a traceback
        raise ValueError(f"--damp_percent {percdamp}: the calibration Hessian is not positive "
                         f"definite even after dampening ({exc}); raise --damp_percent or "
                         f"check the calibration data for non-finite activations") from None


def gptq_quantize(weight: torch.Tensor, H: torch.Tensor, spec: GroupQuantSpec, *,
                  percdamp: float = 0.01, act_order: bool = False,
                  block_size: int = BLOCK_SIZE) -> QuantizedWeight:
    """Quantize ``weight`` ``[out, in]`` given the inputs' Hessian ``H`` ``[in, in]``."""
    W = weight.detach().float().clone()
    H = H.clone()
    rows, columns = W.shape
    maxq = spec.maxq
    group_size = spec.group_size
    if group_size == -1:
        scale, zero = find_params(W, spec)  # per channel, from the original weight
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    perm = invperm = None
    if act_order:
        perm = torch.argsort(torch.diag(H), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
        invperm = torch.argsort(perm)
    Hinv = _inverse_hessian_factor(H, percdamp)
    Qint = torch.zeros_like(W)
    scales: list[torch.Tensor] = []
    zeros: list[torch.Tensor] = []
    for i1 in range(0, columns, block_size):
        i2 = min(i1 + block_size, columns)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if group_size != -1 and col % group_size == 0:
                scale, zero = find_params(W[:, col:col + group_size], spec)
                scales.append(scale)
                zeros.append(zero)
            w = W1[:, i]
            d = Hinv1[i, i]
            q_int = quantize_to_int(w, scale, zero, maxq)
            Qint[:, col] = q_int
            q = scale * (q_int - zero)
            err = (w - q) / d
            W1[:, i:] -= err.unsqueeze(1) @ Hinv1[i, i:].unsqueeze(0)
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    if group_size == -1:
        scales, zeros = [scale], [zero]
    gs = spec.effective_group_size(columns)
    g_idx = torch.arange(columns, dtype=torch.int32) // gs
    if act_order:
        Qint = Qint[:, invperm]
        g_idx = g_idx[invperm]
    return QuantizedWeight(Qint.to(torch.int32), torch.stack(scales),
                           torch.stack(zeros).to(torch.int32), g_idx, spec)


class GPTQ:
    """GPTQ over one decoder layer, group after group (``true_sequential``): each group's
    Hessians come from a forward pass in which the groups before it are already quantized."""
    name = "gptq"
    needs_calibration = True

    def __init__(self, spec: GroupQuantSpec, *, percdamp: float = 0.01,
                 act_order: bool = False) -> None:
        self.spec, self.percdamp, self.act_order = spec, percdamp, act_order
        #: calibration tokens each linear of the last layer saw (by name in the layer)
        self.tokens_seen: dict[str, int] = {}

    def quantize_layer(self, layer: nn.Module, inputs: LayerInputs | None) -> LayerResult:
        assert inputs is not None
        result: LayerResult = {}
        self.tokens_seen = {}
        for group in layout_of_layer(layer).sequential:
            hessians = {n: HessianAccumulator(linear(layer, n).in_features) for n in group}
            with input_hooks(layer, group, lambda n, x, h=hessians: h[n].add_batch(x)):
                run_layer(layer, inputs)
            for n in group:
                lin = linear(layer, n)
                self.tokens_seen[n] = hessians[n].num_tokens
                if hessians[n].num_tokens == 0:  # no Hessian: the stated fallback
                    qw = rtn_quantize(lin.weight.data, self.spec)
                else:
                    qw = gptq_quantize(lin.weight.data, hessians[n].H, self.spec,
                                       percdamp=self.percdamp, act_order=self.act_order)
                lin.weight.data = qw.dequantize().to(lin.weight.dtype)
                result[n] = qw
            del hessians
        return result
