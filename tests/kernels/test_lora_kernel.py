"""Kernels.lora_sgmv (the compiled fused multi-LoRA shrink + expand) and its reference twin vs
the per-token definition (``bgmv_reference``, fp64): fused layers with unequal slices, ranks and
widths that are not multiples of the vector width, segments longer than a work item, base-model
tokens left alone, fp32 and bf16, the threaded path for large calls, and the reference path for
what the kernel does not take."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bladellm.kernels import Kernels
from bladellm.lora.ops import LoRAMapping, bgmv_reference, lora_delta

# (in, output slices, rank)
LAYERS = [(576, (576, 192, 192), 16), (40, (24, 8), 5), (33, (17,), 3), (64, (128, 128), 8)]


def make(d_in: int, sizes: tuple[int, ...], rank: int, slots: list[int], dtype: torch.dtype,
         num_slots: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    n, d_out = len(sizes), sum(sizes)
    offs = [0, *np.cumsum(sizes).tolist()]
    a = torch.randn(num_slots, d_in, n * rank, generator=gen)
    b = torch.zeros(num_slots, n * rank, d_out)  # block-diagonal, as LoRALinear stores it
    for j in range(n):
        b[:, j * rank:(j + 1) * rank, offs[j]:offs[j + 1]] = torch.randn(
            num_slots, rank, sizes[j], generator=gen)
    x = torch.randn(len(slots), d_in, generator=gen)
    y = torch.randn(len(slots), d_out, generator=gen)
    return (x.to(dtype), a.to(dtype), b.to(dtype), y.to(dtype),
            torch.tensor(offs, dtype=torch.int64))


def check(kernels: Kernels, d_in, sizes, rank, slots, dtype, direct: bool) -> None:
    x, a, b, y, offs = make(d_in, sizes, rank, slots, dtype)
    mapping = LoRAMapping.build(np.array(slots), a.shape[0])
    exact = y.double() + bgmv_reference(x, a, b, torch.tensor(slots))
    if direct:
        kernels.lora_sgmv(y, x, a, b, mapping.dest, mapping.seg_start, mapping.slots, rank, offs)
    else:
        lora_delta(x, a, b, y, mapping, kernels, rank, offs)
    scale = float(exact.abs().max())
    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-5 * scale)
    else:  # one rounding of the fp32 sum to bf16, plus the bf16 inputs' products
        torch.testing.assert_close(y.double(), exact, rtol=2 ** -7, atol=1e-2 * scale)
    base = [t for t, s in enumerate(slots) if s < 0]
    if base:  # base-model tokens are not touched at all
        assert torch.equal(y[base], make(d_in, sizes, rank, slots, dtype)[3][base])


SLOTS = [
    [0, 0, 1, -1, 2, 1, 1, -1, 0],
    [3] * 11,  # one segment, 3 work items (4 + 4 + 3)
    [2, -1, -1],
    [1, 3, 3, -1, 3, 3, 3, 1, 0, 2, 2],
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("slots", SLOTS)
def test_compiled_matches_per_token_definition(compiled, layer, slots, dtype):
    check(compiled, *layer, slots, dtype, direct=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots", SLOTS[:2])
def test_reference_twin_matches_per_token_definition(slots, dtype):
    check(Kernels(), 40, (24, 8), 5, slots, dtype, direct=True)


def test_large_call_uses_the_thread_team_and_stays_exact(compiled):
    # 600 tokens x (576 x 48 + 16 x 960) MACs is above the kernel's threading threshold.
    rng = np.random.default_rng(0)
    slots = rng.integers(-1, 4, size=600).tolist()
    check(compiled, 576, (576, 192, 192), 16, slots, torch.float32, direct=True)


def test_lora_delta_dispatches_to_the_compiled_kernel(compiled):
    check(compiled, 576, (576, 192, 192), 16, SLOTS[0], torch.float32, direct=False)


def test_unsupported_dtype_mix_runs_the_reference(compiled):
    # fp32 activations with bf16 adapter stacks: the kernel takes matching dtypes only.
    x, a, b, y, offs = make(40, (24, 8), 5, SLOTS[0], torch.float32)
    a, b = a.bfloat16(), b.bfloat16()
    mapping = LoRAMapping.build(np.array(SLOTS[0]), 4)
    want = y.clone()
    Kernels().lora_sgmv(want, x, a, b, mapping.dest, mapping.seg_start, mapping.slots, 5,
                        tuple(offs.tolist()))
    compiled.lora_sgmv(y, x, a, b, mapping.dest, mapping.seg_start, mapping.slots, 5, offs)
    assert torch.equal(y, want)


def test_mixed_dtypes_take_the_batched_pytorch_path(compiled, monkeypatch):
    # bf16 activations with fp32 stacks (--lora_dtype float32 on a bf16 model): not the kernel.
    x, a, b, y, offs = make(40, (24, 8), 5, SLOTS[0], torch.bfloat16)
    a, b = a.float(), b.float()
    mapping = LoRAMapping.build(np.array(SLOTS[0]), 4)
    monkeypatch.setattr(compiled, "lora_sgmv", lambda *args: pytest.fail("kernel called"))
    exact = y.double() + bgmv_reference(x, a, b, torch.tensor(SLOTS[0]))
    lora_delta(x, a, b, y, mapping, compiled, 5, offs)
    scale = float(exact.abs().max())
    torch.testing.assert_close(y.double(), exact, rtol=2 ** -7, atol=1e-2 * scale)
