"""Logits processing: repetition / presence / frequency penalties, min_tokens, logit_bias."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from sample_helpers import build_md

from bladellm.sample import ops
from bladellm.sample.sampler import Sampler
from bladellm.sampling_params import SamplingParams

V = 32


def reference_penalties(logits: torch.Tensor, params, prompts, outputs) -> torch.Tensor:
    """Token-by-token float64 reference of the penalty semantics."""
    out = logits.double().clone()
    for row, p in enumerate(params):
        for tok in set(prompts[row]) | set(outputs[row]):
            x = out[row, tok]
            out[row, tok] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for tok, count in Counter(outputs[row]).items():
            out[row, tok] -= p.frequency_penalty * count + p.presence_penalty
    return out


def processed_logits(logits, md):
    return Sampler().process_logits(logits.clone(), md)


def test_penalties_match_hand_computed_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=g) * 3
    params = [
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(presence_penalty=0.7, frequency_penalty=0.4),
        SamplingParams(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=1.3),
        SamplingParams(),  # no penalty: must stay untouched next to rows that have one
    ]
    prompts = [[1, 2, 2, 3], [4, 5], [6, 7, 8, 8], [1, 2, 3]]
    outputs = [[3, 9, 9], [5, 10, 10, 10, 11], [8, 12, 12], [1, 1]]
    md = build_md(params, prompts=prompts, outputs=outputs)
    got = processed_logits(logits, md)
    want = reference_penalties(logits, params, prompts, outputs)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[3], logits[3])
    # Presence/frequency use output tokens only: row 1's prompt-only token 4 is untouched.
    assert got[1, 4] == logits[1, 4]


@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty):
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, V, generator=g) * 4
    prompts = [[0, 3, 3, 17], [5], [30, 31, 2]]
    outputs = [[4, 17, 9], [5, 5, 6], []]
    md = build_md([SamplingParams(repetition_penalty=penalty)] * 3, prompts=prompts,
                  outputs=outputs)
    got = processed_logits(logits, md)
    processor = RepetitionPenaltyLogitsProcessor(penalty=penalty)
    for row in range(3):
        input_ids = torch.tensor([prompts[row] + outputs[row]])
        want = processor(input_ids, logits[row:row + 1].clone())
        torch.testing.assert_close(got[row:row + 1], want)


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.zeros(1, V)
    logits[0, 5], logits[0, 6] = 3.0, 2.0
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0)]
    out = Sampler()(logits, build_md(params, prompts=[[5]], outputs=[[]]))
    assert out.sampled_token_ids.tolist() == [6]  # 3 / 2 = 1.5 < 2
    out = Sampler()(logits, build_md(params, prompts=[[1]], outputs=[[]]))
    assert out.sampled_token_ids.tolist() == [5]


def test_frequency_penalty_counts_occurrences():
    logits = torch.zeros(1, V)
    logits[0, 5], logits[0, 6] = 3.0, 2.0
    params = [SamplingParams(temperature=0.0, frequency_penalty=0.4)]
    # Token 5 seen twice: 3 - 0.8 = 2.2 > 2; three times: 3 - 1.2 = 1.8 < 2.
    out = Sampler()(logits, build_md(params, outputs=[[5, 5]]))
    assert out.sampled_token_ids.tolist() == [5]
    out = Sampler()(logits, build_md(params, outputs=[[5, 5, 5]]))
    assert out.sampled_token_ids.tolist() == [6]


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    eos, stop = 7, 9
    logits = torch.zeros(2, V)
    logits[:, eos], logits[:, stop], logits[:, 3] = 10.0, 9.0, 1.0
    params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop]),
              SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[stop])]
    md = build_md(params, outputs=[[1, 2], [1, 2]], eos=eos)
    assert md.min_tokens_banned == {0: [eos, stop], 1: [eos, stop]}
    assert Sampler()(logits, md).sampled_token_ids[0].item() == 3
    # A random row never draws a banned token, however likely it was.
    many = build_md([params[1]] * 5000, outputs=[[1]] * 5000, eos=eos)
    torch.manual_seed(0)
    drawn = Sampler()(logits[1:].repeat(5000, 1), many).sampled_token_ids
    assert not torch.isin(drawn, torch.tensor([eos, stop])).any()
    # Once min_tokens is reached the ban is lifted.
    md = build_md(params[:1], outputs=[[1, 2, 3]], eos=eos)
    assert md.min_tokens_banned == {}
    assert Sampler()(logits[:1], md).sampled_token_ids.item() == eos


def test_min_tokens_with_ignore_eos_bans_only_stop_tokens():
    params = [SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=[9])]
    assert build_md(params, eos=7).min_tokens_banned == {0: [9]}
    assert build_md([SamplingParams(min_tokens=2, ignore_eos=True)], eos=7).min_tokens_banned == {}


def test_logit_bias_greedy_and_random():
    logits = torch.zeros(3, V)
    logits[:, 0] = 5.0
    params = [SamplingParams(temperature=0.0, logit_bias={4: 6.0}),
              SamplingParams(temperature=0.0, logit_bias={0: -100.0}),
              SamplingParams(temperature=0.0)]
    md = build_md(params)
    got = processed_logits(logits, md)
    assert got[0, 4] == 6.0 and got[1, 0] == -95.0 and torch.equal(got[2], logits[2])
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [4, 1, 0]

    torch.manual_seed(0)
    n = 2000
    random_rows = [SamplingParams(logit_bias={11: 100.0}), SamplingParams(logit_bias={0: -100.0})]
    out = Sampler()(logits[:2].repeat(n, 1), build_md(random_rows * n)).sampled_token_ids
    assert (out[0::2] == 11).all()
    assert (out[1::2] != 0).all()


def test_out_of_range_ids_are_ignored_by_sampler():
    # InputProcessor rejects them (tests/unit/engine/test_input_processor.py); a batch that
    # still holds one must not fail.
    logits = torch.zeros(1, V)
    params = SamplingParams(temperature=0.0, logit_bias={V + 5: 3.0, 2: 1.0}, min_tokens=1,
                            stop_token_ids=[V + 1])
    out = Sampler()(logits, build_md([params], eos=V + 2))
    assert out.sampled_token_ids.tolist() == [2]


def test_penalty_ops_leave_rows_without_tokens_alone():
    logits = torch.randn(2, V)
    got = ops.apply_presence_frequency_penalties(logits.clone(), torch.ones(2), torch.ones(2),
                                                 [[], []])
    assert torch.equal(got, logits)
