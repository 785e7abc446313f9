"""Models with sliding windows (Mistral, Qwen2) through the engine: greedy tokens identical
to transformers in fp32 under the stress configuration (small KV pool, chunked prefill, forced
preemption, prompt cache), prompts longer than the window, with the KV manager freeing the
blocks that fall out of the window."""

from __future__ import annotations

import pytest

from bladellm import LLM, SamplingParams
from test_offline_llm import _hf_greedy, _prompts

# (arch, config overrides, KV blocks, KV cache group windows): every layer sliding frees
# blocks, so a pool of 14 blocks (52 tokens; prompts reach 100 + 24 tokens) still serves all
# requests, preempting. Qwen2 with max_window_layers 1: layer 0 global, layer 1 local, a KV
# cache group each (a block id holds one layer there); the local group frees its blocks.
WINDOWED = {
    "mistral-w8": ("mistral", dict(sliding_window=8), 14, [8]),
    "qwen2-w8-mixed": ("qwen2", dict(use_sliding_window=True, sliding_window=8,
                                     max_window_layers=1), 56, [None, 8]),
    "qwen2-w8-all": ("qwen2", dict(use_sliding_window=True, sliding_window=8,
                                   max_window_layers=0), 14, [8]),
}
STRESS = dict(dtype="float32", block_size=4, max_num_batched_tokens=32, max_num_seqs=8,
              max_model_len=160, debug_block_accounting=True)
MAX_TOKENS = 24


@pytest.mark.parametrize("variant", list(WINDOWED))
def test_greedy_identical_to_transformers_under_stress(tiny_model_factory, variant):
    arch, overrides, num_kv_blocks, windows = WINDOWED[variant]
    model_dir = tiny_model_factory(arch, **overrides)
    llm = LLM(model=model_dir, num_kv_blocks=num_kv_blocks, **STRESS)
    assert llm.engine.core.scheduler.kv_cache_manager.group_windows == windows
    prompts = _prompts(llm.engine.model_info.vocab_size)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                        use_tqdm=False)
    expected = _hf_greedy(model_dir, prompts, MAX_TOKENS)
    for i, (out, exp) in enumerate(zip(outs, expected)):
        assert out.outputs[0].token_ids == exp, f"prompt {i} (len {len(prompts[i])})"
    stats = llm.engine.core.scheduler.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.num_used_blocks == 0
    llm.engine.core.scheduler.check_invariants()
    llm.shutdown()


@pytest.mark.slow
def test_tensor_parallel_with_window_freeing_identical_to_one_rank(tiny_model_factory):
    """Mistral with an 8-token window over 2 ranks, blocks freed past the window: the tokens
    of one rank."""
    arch, overrides, num_kv_blocks, _ = WINDOWED["mistral-w8"]
    model_dir = tiny_model_factory(arch, **overrides)
    prompts = _prompts(384)[:8]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    runs = []
    for tp in (1, 2):
        llm = LLM(model=model_dir, num_kv_blocks=num_kv_blocks, tensor_parallel_size=tp,
                  **STRESS)
        try:
            runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                      use_tqdm=False)])
            assert llm.engine.core.scheduler.get_stats().num_preemptions > 0
        finally:
            llm.shutdown()
    assert runs[0] == runs[1]
