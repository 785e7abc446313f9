"""Each new family through the whole engine (offline ``LLM``) under the stress configuration of
tests/e2e/test_offline_llm.py: prompt cache, chunked prefill (a token budget smaller than most
prompts), a KV pool too small for the batch (preemption by recompute), block accounting checked
after every step. Greedy tokens must be identical to transformers' ``generate`` in float32."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from bladellm import LLM, SamplingParams
from family_models import family_dirs

@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    return family_dirs(tmp_path_factory)


NUM_PROMPTS, MAX_TOKENS = 12, 16


def _prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Prompts of varied lengths; most share one of two long prefixes."""
    rng = random.Random(seed)
    shared = [[rng.randrange(3, vocab_size) for _ in range(41)] for _ in range(2)]
    prompts = []
    for i in range(NUM_PROMPTS):
        tail = [rng.randrange(3, vocab_size) for _ in range(rng.randrange(1, 50))]
        head = shared[i % 2][: rng.choice([0, 9, 17, 41])] if i % 5 else []
        prompts.append(head + tail)
    return prompts


def _hf_greedy(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_TOKENS, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["opt", "opt-post-ln-proj", "phi3-longrope", "glm4",
                                     "chatglm"])
def test_greedy_identical_to_transformers_under_stress(family_dir, variant):
    model_dir = family_dir(variant)
    oracle_dir = family_dir("glm-rope-ratio") if variant == "chatglm" else model_dir
    llm = LLM(model=model_dir, dtype="float32", block_size=4, max_num_batched_tokens=32,
              max_num_seqs=8, num_kv_blocks=40, max_model_len=128, debug_block_accounting=True)
    prompts = _prompts(llm.engine.model_info.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = llm.generate(prompts, params, use_tqdm=False)
    expected = _hf_greedy(oracle_dir, prompts)
    for i, (out, exp) in enumerate(zip(outs, expected)):
        assert out.outputs[0].token_ids == exp, f"prompt {i} (len {len(prompts[i])})"
    stats = llm.engine.core.scheduler.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.num_used_blocks == 0
