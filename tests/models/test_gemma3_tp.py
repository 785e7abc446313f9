"""Gemma 3 (text) under tensor parallelism 2: greedy tokens identical to transformers in fp32
(eager attention), with prompts longer than the local layers' window, the embedding tied to
the lm_head (vocab-parallel on both), q/k norms per head on each rank's heads, and a rotary
table per layer type; under the stress configuration (prompt cache, chunked prefill,
preemption)."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from bladellm import LLM, SamplingParams
from window_family_models import make_window_family_model

MAX_TOKENS = 12


def _prompts(vocab_size: int) -> list[list[int]]:
    """1 to 60 tokens (the window is 8); most share one of two long prefixes (prompt cache)."""
    rng = random.Random(0)
    shared = [[rng.randrange(3, vocab_size) for _ in range(33)] for _ in range(2)]
    out = []
    for i in range(8):
        tail = [rng.randrange(3, vocab_size) for _ in range(rng.randrange(1, 28))]
        out.append((shared[i % 2][: rng.choice([0, 9, 33])] if i % 4 else []) + tail)
    return out


def _hf_greedy(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_TOKENS, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


@pytest.mark.slow
def test_gemma3_tp2_greedy_identical_to_transformers(tmp_path):
    path = make_window_family_model(tmp_path, "gemma3")
    config = transformers.AutoConfig.from_pretrained(path)
    assert config.tie_word_embeddings and "full_attention" in config.layer_types
    prompts = _prompts(config.vocab_size)
    llm = LLM(model=path, tensor_parallel_size=2, dtype="float32", block_size=4,
              max_num_batched_tokens=32, max_num_seqs=8, num_kv_blocks=60, max_model_len=128)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                            use_tqdm=False)
        stats = llm.engine.core.scheduler.get_stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    finally:
        llm.shutdown()
    want = _hf_greedy(path, prompts)
    for i, (out, exp) in enumerate(zip(outs, want)):
        assert out.outputs[0].token_ids == exp, f"prompt {i} (len {len(prompts[i])})"
    assert len({tuple(w) for w in want}) > 1  # not one degenerate answer
