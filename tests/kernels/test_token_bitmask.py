"""Structured output's packed token bitmask: the compiled kernel and its reference twin ban
exactly the tokens the unpacked mask bans, leave everything else bit-identical (allowed tokens,
unlisted rows), and agree with the old unpack-then-mask path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bladellm.guided.bitmask import unpack_bitmask
from bladellm.kernels import Kernels, ref

# (vocab, words): exact fit, a partial last word, logits wider than the mask (banned tail),
# a mask wider than the logits (extra bits ignored), the demo model's size.
SHAPES = [(96, 3), (100, 4), (100, 3), (70, 4), (49152, 1536)]


def _case(vocab: int, words: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, vocab, generator=g)
    logits[1, :3] = torch.tensor([-0.0, float("inf"), float("nan")])
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, words), dtype=torch.int32, generator=g)
    bitmask[0] = -1  # all allowed
    bitmask[1, : words // 2] = 0  # banned words next to mixed ones
    bitmask[2] = 0  # nothing allowed
    rows = torch.tensor([5, 1, 0, 3])
    return logits, rows, bitmask


def _expected(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The unpacked [rows, vocab] bool mask applied with torch.where."""
    want = logits.clone()
    allowed = torch.from_numpy(unpack_bitmask(bitmask.numpy(), logits.shape[1]).copy())
    want[rows] = torch.where(allowed, want[rows], torch.tensor(float("-inf")))
    return want


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (-0.0 stays -0.0; NaN stays NaN)."""
    return bool(torch.equal(a.view(torch.int32), b.view(torch.int32)))


@pytest.mark.parametrize("vocab,words", SHAPES)
def test_reference_matches_unpacked_mask(vocab, words):
    logits, rows, bitmask = _case(vocab, words)
    got = logits.clone()
    ref.apply_token_bitmask(got, rows, bitmask)
    assert _same(got, _expected(logits, rows, bitmask))


@pytest.mark.parametrize("vocab,words", SHAPES)
def test_compiled_matches_reference(compiled, vocab, words):
    logits, rows, bitmask = _case(vocab, words, seed=vocab)
    got, want = logits.clone(), logits.clone()
    compiled.apply_token_bitmask(got, rows, bitmask)
    ref.apply_token_bitmask(want, rows, bitmask)
    assert _same(got, want)
    assert torch.isneginf(got[0]).all()  # bitmask row 2: nothing allowed
    width = min(vocab, 32 * words)  # bitmask row 0 (all allowed) on row 5: only a tail banned
    assert _same(got[5, :width], logits[5, :width]) and torch.isneginf(got[5, width:]).all()
    assert _same(got[2], logits[2]) and _same(got[4], logits[4])  # unlisted rows untouched


def test_compiled_takes_a_strided_view_and_falls_back(compiled):
    base = torch.randn(4, 2, 100)
    logits = base[:, 0]  # rows 200 floats apart
    rows, bitmask = torch.tensor([2, 0], dtype=torch.int32), torch.zeros(2, 4, dtype=torch.int32)
    bitmask[0, 1] = 0b101
    want = logits.clone()
    ref.apply_token_bitmask(want, rows, bitmask)
    compiled.apply_token_bitmask(logits, rows, bitmask)
    assert _same(logits.contiguous(), want)
    assert torch.equal(torch.isfinite(base[2, 0]).nonzero().flatten(), torch.tensor([32, 34]))
    half = want.to(torch.bfloat16)  # not fp32: the reference runs
    expected = half.clone()
    ref.apply_token_bitmask(expected, rows, bitmask)
    compiled.apply_token_bitmask(half, rows, bitmask)
    assert torch.equal(half, expected)


@pytest.mark.parametrize("kernels", ["ref", "compiled"])
def test_row_out_of_range_raises(kernels, request):
    k = Kernels() if kernels == "ref" else request.getfixturevalue("compiled")
    with pytest.raises(IndexError):
        k.apply_token_bitmask(torch.zeros(2, 64), torch.tensor([2]),
                              torch.zeros(1, 2, dtype=torch.int32))


def test_numpy_entry_point_uses_the_packed_words():
    """``bladellm.guided.bitmask.apply_token_bitmask`` (the sampler's) on a numpy bitmask, with
    the set a CPU worker resolves for ``--kernels auto``."""
    from bladellm.guided.bitmask import apply_token_bitmask
    from bladellm.kernels import resolve_kernels

    logits, rows, bitmask = _case(100, 4, seed=3)
    got = apply_token_bitmask(logits.clone(), rows, np.ascontiguousarray(bitmask.numpy()),
                              resolve_kernels("auto", "cpu"))
    assert _same(got, _expected(logits, rows, bitmask))


def test_bitmask_on_another_device_stays_there():
    """On a GPU the sampler's logits, rows and words are all on the device: the reference must
    build its shifts there too, and must not read the rows back (the ``meta`` device has no
    data: any host read or host tensor mixed in raises)."""
    from bladellm.guided.bitmask import apply_token_bitmask

    logits = torch.zeros(3, 100, device="meta")
    got = apply_token_bitmask(logits, torch.tensor([0, 2]), np.zeros((2, 4), np.int32), Kernels())
    assert got.device.type == "meta" and got.shape == (3, 100)
    ref.apply_token_bitmask(logits, torch.tensor([0, 2], device="meta"),
                            torch.zeros(2, 4, dtype=torch.int32, device="meta"))


def test_entry_point_checks_rows_on_the_host():
    from bladellm.guided.bitmask import apply_token_bitmask

    with pytest.raises(IndexError):
        apply_token_bitmask(torch.zeros(2, 64, device="meta"), torch.tensor([2]),
                            np.zeros((1, 2), np.int32), Kernels())
