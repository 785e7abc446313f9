"""The runner's SamplingMetadata (SamplingRows.metadata): what gets built, and the fast paths that build nothing."""

from __future__ import annotations

import numpy as np
import torch
from sample_helpers import build_md

from bladellm.sampling_params import SamplingParams
from bladellm.worker.sampling_rows import SamplingRows


def test_all_greedy_builds_nothing():
    # Filters on greedy rows are irrelevant and must not switch the random path on.
    md = build_md([SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)] * 3)
    assert md.all_greedy and not md.all_random
    assert md.temperature is md.top_p is md.top_k is md.min_p is None
    assert md.no_penalties and md.no_logits_processing
    assert md.prompt_token_ids is None and md.max_num_logprobs is None
    assert md.min_tokens_banned == {} and md.logit_bias == {}


def test_mixed_rows_build_per_row_tensors():
    params = [SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.7, top_p=0.9),
              SamplingParams(top_k=-1, min_p=0.1, logprobs=3),
              SamplingParams(top_k=40, logprobs=1)]
    md = build_md(params)
    assert not md.all_greedy and not md.all_random
    torch.testing.assert_close(md.temperature, torch.tensor([0.0, 0.7, 1.0, 1.0]))
    assert md.temperature.dtype == md.top_p.dtype == md.min_p.dtype == torch.float32
    torch.testing.assert_close(md.top_p, torch.tensor([1.0, 0.9, 1.0, 1.0]))
    assert md.top_k.dtype == torch.int64 and md.top_k.tolist() == [0, 0, 0, 40]
    torch.testing.assert_close(md.min_p, torch.tensor([0.0, 0.0, 0.1, 0.0]))
    assert md.max_num_logprobs == 3
    assert md.no_logits_processing


def test_unused_filters_stay_none_on_random_rows():
    md = build_md([SamplingParams(temperature=0.8)] * 2)
    assert md.all_random and md.temperature is not None
    assert md.top_p is md.top_k is md.min_p is None


def test_penalty_token_lists_only_for_rows_that_use_them():
    params = [SamplingParams(repetition_penalty=1.2), SamplingParams(),
              SamplingParams(frequency_penalty=0.5)]
    prompts, outputs = [[1, 2], [3, 4], [5, 6]], [[7], [8], [9]]
    md = build_md(params, prompts=prompts, outputs=outputs)
    torch.testing.assert_close(md.repetition_penalty, torch.tensor([1.2, 1.0, 1.0]))
    torch.testing.assert_close(md.frequency_penalty, torch.tensor([0.0, 0.0, 0.5]))
    torch.testing.assert_close(md.presence_penalty, torch.zeros(3))
    assert md.prompt_token_ids == [[1, 2], [], []]
    assert md.output_token_ids == [[7], [], [9]]

    md = build_md([SamplingParams(presence_penalty=0.1)], prompts=[[1]], outputs=[[2]])
    assert md.repetition_penalty is None and md.prompt_token_ids is None


def test_min_tokens_bans_every_eos_id_of_the_model():
    params = [SamplingParams(min_tokens=2), SamplingParams(min_tokens=2, stop_token_ids=[5])]
    rows = SamplingRows(2, eos_token_ids=[0, 2])
    for i, p in enumerate(params):
        rows.set_row(i, p)
    token_ids = np.array([[1, 3, 0], [1, 3, 4]], np.int64)
    md = rows.metadata(np.arange(2), token_ids, np.array([2, 3]), np.array([1, 1]))
    assert md.min_tokens_banned == {0: [0, 2]}  # row 1 already has 2 tokens


def test_logit_bias_and_generators_are_passed_through():
    g = torch.Generator().manual_seed(1)
    md = build_md([SamplingParams(), SamplingParams(logit_bias={3: -2.5}, seed=1)],
                  generators={1: g})
    assert md.logit_bias == {1: {3: -2.5}}
    assert md.generators == {1: g} and not md.no_logits_processing
