"""The GPU linear kernels (Triton, under TRITON_INTERPRET=1 here) on an ``IntWeight`` of every
kind the loaders produce, against its plain dequantization: the repacking (signed codes, act-order
permutation, scales transposed) and the kernels together."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from bladellm.quantization.cpu_kernels import w8a8_reference  # noqa: E402
from bladellm.quantization.gpu_kernels import (TritonW8A8Linear,  # noqa: E402
                                               TritonWeightOnlyLinear)
from bladellm.quantization.int_weight import dequantize  # noqa: E402

from test_quant_kernels import CASES, _weight  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("case", list(CASES))
def test_weight_only_equals_dequantized_linear(case):
    w = _weight(24, 128, seed=3, **CASES[case])
    kernel = TritonWeightOnlyLinear(w)
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(24)
    got = kernel(x.to(DEVICE), bias.to(DEVICE)).cpu()
    torch.testing.assert_close(got, F.linear(x, dequantize(w), bias), rtol=1e-4, atol=1e-4)


def test_w8a8_equals_reference():
    w = _weight(40, 96, bits=8, group=96, zeros=False, signed=True, seed=5)
    kernel = TritonW8A8Linear(w)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(2))
    got = kernel(x.to(DEVICE), None).cpu()
    torch.testing.assert_close(got, w8a8_reference(x, w, None), rtol=1e-5, atol=1e-5)
