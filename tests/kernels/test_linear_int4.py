"""The compiled weight-only 4-bit linear (kernels/cpu/linear_int4.cpp) against its twin
(``ref.linear_int4``: unpack the nibbles, ``(q - z) * s``, F.linear), and the twin against an
explicit dequantization; M up to the kernel's limit and past it (the twin takes over), groups
with and without a vector tail, odd N, with and without bias."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bladellm.kernels import ref

CASES = [(1, 64, 128, 32), (3, 17, 96, 32), (4, 100, 256, 64), (8, 33, 40, 10), (7, 9, 48, 48)]


def _inputs(m: int, n: int, k: int, group: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // group, generator=g) * 0.05 + 0.001
    zeros = torch.randint(0, 16, (n, k // group), generator=g).float()
    x = torch.randn(m, k, generator=g)
    bias = torch.randn(n, generator=g)
    return x, codes, scales, zeros, bias


def test_twin_is_the_dequantized_linear():
    x, codes, scales, zeros, bias = _inputs(3, 5, 64, 16, 0)
    q = torch.empty(5, 64)
    for n in range(5):
        for gi in range(4):
            for j in range(8):  # byte j of group gi: columns j (low) and 8 + j (high)
                byte = int(codes[n, gi * 8 + j])
                q[n, gi * 16 + j], q[n, gi * 16 + 8 + j] = byte & 15, byte >> 4
    w = (q - zeros.repeat_interleave(16, 1)) * scales.repeat_interleave(16, 1)
    torch.testing.assert_close(ref.linear_int4(x, codes, scales, zeros, bias, 16),
                               F.linear(x, w, bias))


@pytest.mark.parametrize("m, n, k, group", CASES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_compiled_matches_twin(compiled, m, n, k, group, with_bias, monkeypatch):
    x, codes, scales, zeros, bias = _inputs(m, n, k, group, m * n + k)
    b = bias if with_bias else None
    calls = []
    lib_fn = compiled._linear_int4  # noqa: SLF001 - make sure the compiled code ran

    def spy(*args):
        calls.append(args)
        return lib_fn(*args)

    monkeypatch.setattr(compiled, "_linear_int4", spy)
    got = compiled.linear_int4(x, codes, scales, zeros, b, group)
    assert len(calls) == 1
    want = ref.linear_int4(x, codes, scales, zeros, b, group)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * k ** 0.5)


def test_batched_input_and_rows_past_the_limit(compiled):
    x, codes, scales, zeros, bias = _inputs(2 * (compiled.int4_max_rows + 1), 24, 64, 32, 7)
    x3 = x.view(2, -1, 64)  # [2, M/2, K]: rows of a 3-D input, past the kernel's limit
    got = compiled.linear_int4(x3, codes, scales, zeros, bias, 32)
    torch.testing.assert_close(got, ref.linear_int4(x3, codes, scales, zeros, bias, 32))
    small = x3[:, :2]  # 4 rows: the compiled kernel, a non-contiguous 3-D view
    torch.testing.assert_close(compiled.linear_int4(small, codes, scales, zeros, None, 32),
                               ref.linear_int4(small, codes, scales, zeros, None, 32),
                               rtol=1e-5, atol=1e-4)
