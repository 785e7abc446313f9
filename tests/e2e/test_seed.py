"""``--seed`` seeds the engine's global generators: requests without their own seed sample the
same text on every engine start with the same ``--seed``, and other text under another seed."""

from __future__ import annotations

import torch

from bladellm import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8], [40, 41, 3], [9, 10]]


def _sample(model_dir: str, seed: int) -> list[list[int]]:
    torch.seed()  # a non-deterministic state, as in a fresh process: the engine must reseed
    llm = LLM(model=model_dir, dtype="float32", kv_cache_memory="4MiB", seed=seed)
    assert llm.engine.config.model.seed == seed
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_seed_makes_unseeded_sampling_reproducible(tiny_llama):
    first = _sample(tiny_llama, seed=1)
    assert _sample(tiny_llama, seed=1) == first
    assert _sample(tiny_llama, seed=2) != first
