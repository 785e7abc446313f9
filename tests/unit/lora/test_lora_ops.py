"""The segmented gather-matmul equals the per-token definition (BGMV) for any token → slot mix."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bladellm.lora.ops import LoRAMapping, bgmv_reference, sgmv_shrink_expand


@pytest.mark.parametrize("slots", [
    [0, 0, 1, -1, 2, 1, 1, -1, 0],  # mixed, base tokens in between
    [3] * 7,  # one adapter (a long prefill)
    [2, -1, -1],
    [0, 1, 2, 3],  # every slot active: a view of the stacks, no gather
    [1, 3, 3, -1],  # slots 1 and 3: gathered
    [0, 1, 2, 3, 3, 2, 1, 0],  # equal segments: no padding
])
def test_sgmv_matches_bgmv_reference(slots):
    gen = torch.Generator().manual_seed(0)
    S, R, d_in, d_out = 4, 3, 10, 14
    x = torch.randn(len(slots), d_in, generator=gen)
    a = torch.randn(S, d_in, R, generator=gen)
    b = torch.randn(S, R, d_out, generator=gen)
    y = torch.randn(len(slots), d_out, generator=gen)
    expected = y.double() + bgmv_reference(x, a, b, torch.tensor(slots))
    mapping = LoRAMapping.build(np.array(slots), S)
    sgmv_shrink_expand(x, a, b, y, mapping)
    torch.testing.assert_close(y.double(), expected, atol=1e-5, rtol=1e-5)


def test_no_adapter_tokens_means_no_mapping():
    assert LoRAMapping.build(np.array([-1, -1]), 4) is None


def test_lower_precision_stacks_keep_the_output_dtype():
    x = torch.randn(5, 8)
    a = torch.randn(2, 8, 4).bfloat16()
    b = torch.randn(2, 4, 6).bfloat16()
    y = torch.zeros(5, 6)
    sgmv_shrink_expand(x, a, b, y, LoRAMapping.build(np.array([0, 1, 1, -1, 0]), 2))
    ref = bgmv_reference(x, a.float(), b.float(), torch.tensor([0, 1, 1, -1, 0]))
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, atol=0.1, rtol=0.05)
