"""Greedy, fast paths, seeded reproducibility and logprobs of the Sampler."""

from __future__ import annotations

import pytest
import torch
from sample_helpers import build_md

from bladellm.sample.sampler import Sampler
from bladellm.sampling_params import SamplingParams

V = 1000


def test_greedy_is_argmax_and_touches_no_rng():
    logits = torch.randn(16, V, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    md = build_md([SamplingParams(temperature=0.0)] * 16)
    assert md.all_greedy and md.temperature is None and md.no_logits_processing
    state = torch.get_rng_state()
    out = Sampler()(logits, md)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None and out.logprobs_token_ids is None and out.sampled_ranks is None
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(logits, before)


def test_mixed_batch_greedy_rows_take_argmax_and_logits_are_not_modified():
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.5, top_p=0.9, top_k=50,
                             min_p=0.01, presence_penalty=0.5) for i in range(8)]
    md = build_md(params, outputs=[[1, 2, 3]] * 8)
    assert not md.all_greedy and not md.all_random
    out = Sampler()(logits, md)
    processed = logits.clone()
    processed[:, [1, 2, 3]] -= 0.5
    assert torch.equal(out.sampled_token_ids[1::2], processed[1::2].argmax(-1))
    assert torch.equal(logits, before)


def run_seeded_row(seed: int, position: int, others: list[SamplingParams],
                   row_logits: torch.Tensor, steps: int = 5) -> list[int]:
    """Sample `steps` tokens for one seeded row placed at `position` among `others`."""
    params = list(others)
    params.insert(position, SamplingParams(temperature=1.0, top_p=0.95, seed=seed))
    generators = {position: torch.Generator().manual_seed(seed)}
    for i, p in enumerate(params):  # other seeded rows get their own generators
        if p.seed is not None and i != position:
            generators[i] = torch.Generator().manual_seed(p.seed)
    other_logits = torch.randn(len(params), V, generator=torch.Generator().manual_seed(99 + len(params)))
    tokens = []
    for _ in range(steps):
        logits = other_logits.clone()
        logits[position] = row_logits
        md = build_md(params, generators=generators)
        tokens.append(Sampler()(logits, md).sampled_token_ids[position].item())
    return tokens


def test_seeded_row_is_reproducible_regardless_of_batch_and_position():
    row_logits = torch.randn(V, generator=torch.Generator().manual_seed(7)) * 0.5
    torch.manual_seed(123)
    alone = run_seeded_row(42, 0, [], row_logits)
    assert len(set(alone)) > 1  # a flat distribution: draws differ step to step
    batches = [
        (0, [SamplingParams()] * 3),
        (2, [SamplingParams(), SamplingParams(temperature=0.0)]),
        (5, [SamplingParams(top_k=5, seed=1)] * 7),
        (1, [SamplingParams(temperature=0.0)] * 2),
    ]
    for i, (position, others) in enumerate(batches):
        torch.manual_seed(1000 + i)  # the default generator's state must not matter
        assert run_seeded_row(42, position, others, row_logits) == alone, (position, others)
    assert run_seeded_row(43, 0, [], row_logits) != alone


def test_unseeded_rows_follow_the_default_generator():
    logits = torch.zeros(4, V)
    md = build_md([SamplingParams()] * 4)
    torch.manual_seed(5)
    a = Sampler()(logits, md).sampled_token_ids
    torch.manual_seed(5)
    b = Sampler()(logits, md).sampled_token_ids
    c = Sampler()(logits, md).sampled_token_ids
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("greedy", [True, False])
def test_logprobs_are_raw_log_softmax_with_sorted_top_k_and_ranks(greedy):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, V, generator=g) * 3
    params = [SamplingParams(temperature=0.0 if greedy else 3.0, logprobs=5,
                             repetition_penalty=1.7, logit_bias={int(i): 5.0 for i in range(4)})
              for _ in range(64)]
    params[0] = params[0].clone(logprobs=2)
    md = build_md(params, prompts=[[10, 11, 12]] * 64, outputs=[[13]] * 64)
    assert md.max_num_logprobs == 5
    torch.manual_seed(0)
    out = Sampler()(logits, md)
    ref = torch.log_softmax(logits.double(), dim=-1)  # the RAW logits: no bias, no penalty
    sampled = out.sampled_token_ids
    assert out.logprobs_token_ids.shape == out.logprobs.shape == (64, 6)
    assert out.logprobs_token_ids.dtype == torch.int64
    assert torch.equal(out.logprobs_token_ids[:, 0], sampled)
    torch.testing.assert_close(out.logprobs[:, 0].double(), ref.gather(1, sampled[:, None])[:, 0],
                               rtol=1e-5, atol=1e-5)
    top = ref.topk(5, dim=-1)
    assert torch.equal(out.logprobs_token_ids[:, 1:], top.indices)
    torch.testing.assert_close(out.logprobs[:, 1:].double(), top.values, rtol=1e-5, atol=1e-5)
    assert (out.logprobs[:, 1:].diff(dim=-1) <= 0).all()
    want_ranks = (ref > ref.gather(1, sampled[:, None])).sum(-1) + 1
    assert torch.equal(out.sampled_ranks, want_ranks)
    if not greedy:
        assert out.sampled_ranks.max() > 1  # the check above saw ranks other than 1


def test_zero_logprobs_returns_only_the_sampled_token():
    logits = torch.randn(3, 50)
    out = Sampler()(logits, build_md([SamplingParams(temperature=0.0, logprobs=0)] * 3))
    assert out.logprobs.shape == (3, 1)
    assert torch.equal(out.sampled_ranks, torch.ones(3, dtype=torch.int64))
    torch.testing.assert_close(out.logprobs[:, 0], logits.log_softmax(-1).max(-1).values)


def test_grammar_bitmask_copy_or_in_place_gives_the_same_tokens():
    """A packed grammar bitmask on some rows: without ``inplace`` the caller's logits stay as
    they were; with it (the model runner) they are masked in place; the tokens are the same."""
    import numpy as np

    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(7))
    before = logits.clone()
    words = (V + 31) // 32
    bitmask = np.zeros((2, words), np.int32)
    bitmask[0, 3] = 0b1010  # row 2 may only sample tokens 97 and 99
    bitmask[1, :] = -1  # row 0: everything allowed
    md = build_md([SamplingParams(temperature=0.0)] * 4)
    md.grammar_rows, md.grammar_bitmask = torch.tensor([2, 0]), bitmask
    copied = Sampler()(logits, md)
    assert torch.equal(logits, before)
    in_place = Sampler()(logits, md, inplace=True)
    assert torch.equal(copied.sampled_token_ids, in_place.sampled_token_ids)
    assert int(in_place.sampled_token_ids[2]) == (97 if before[2, 97] > before[2, 99] else 99)
    assert torch.equal(in_place.sampled_token_ids[[0, 1, 3]], before[[0, 1, 3]].argmax(-1))
    assert torch.isfinite(logits[2]).sum() == 2 and torch.equal(logits[[0, 1, 3]],
                                                                  before[[0, 1, 3]])
