"""Speculative decoding (sps) and lookahead decoding never change what the target emits.

Stress configuration as in test_offline_llm: prompt cache on, chunked prefill forced (a token
budget smaller than most prompts), a KV pool small enough to force preemption, and the block
accounting checked after every step.
"""

from __future__ import annotations

import pytest

from bladellm import LLM, SamplingParams
from test_offline_llm import _prompts  # noqa: E402  (tests/e2e is on sys.path via rootdir)

MAX_TOKENS = 24
STRESS = dict(dtype="float32", block_size=4, max_num_batched_tokens=32, max_num_seqs=8,
              num_kv_blocks=64, max_model_len=160, debug_block_accounting=True)


def _run(model_dir: str, prompts, params, **kwargs):
    llm = LLM(model=model_dir, **STRESS, **kwargs)
    outs = llm.generate(prompts, params, use_tqdm=False)
    core = llm.engine.core
    stats = core.scheduler.get_stats()
    assert core.scheduler.kv_cache_manager.pool.num_used_blocks == 0  # pool back to empty
    return [o.outputs[0].token_ids for o in outs], stats


@pytest.fixture(scope="module")
def normal_greedy(tiny_llama):
    llm_prompts = _prompts(384)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs, stats = _run(tiny_llama, llm_prompts, params)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    return llm_prompts, params, outs


def test_sps_self_draft_accepts_everything(tiny_llama, normal_greedy):
    prompts, params, expected = normal_greedy
    outs, stats = _run(tiny_llama, prompts, params, decode_algo="sps", draft_model=tiny_llama,
                       gamma=3)
    assert outs == expected
    assert stats.num_spec_draft_tokens > 0
    assert stats.num_spec_accepted_tokens == stats.num_spec_draft_tokens
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def test_sps_random_smaller_draft_greedy_identical(tiny_llama, tiny_model_factory,
                                                   normal_greedy):
    prompts, params, expected = normal_greedy
    draft = tiny_model_factory("qwen2", seed=7, num_hidden_layers=1)
    outs, stats = _run(tiny_llama, prompts, params, decode_algo="sps", draft_model=draft,
                       gamma=4)
    assert outs == expected
    assert stats.num_spec_draft_tokens > 0
    assert stats.num_spec_accepted_tokens < stats.num_spec_draft_tokens  # it disagrees


def test_look_ahead_greedy_identical(tiny_llama, normal_greedy):
    prompts, params, expected = normal_greedy
    outs, stats = _run(tiny_llama, prompts, params, decode_algo="look_ahead",
                       look_ahead_window_size=3, look_ahead_gram_size=3, guess_set_size=3)
    assert outs == expected
    assert stats.num_spec_draft_tokens > 0


def test_seeded_sampling_with_n_and_logprobs(tiny_llama):
    """Seeded sampling, n > 1, logprobs, stop tokens and min_tokens through verification: a
    self-draft accepts everything, so tokens equal normal decoding's distribution; look_ahead
    (point-mass proposals) emits exactly normal decoding's seeded tokens."""
    prompts = _prompts(384)[:4]
    params = SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=16, n=2, logprobs=2,
                            min_tokens=4)
    base, _ = _run(tiny_llama, prompts, params)
    la, _ = _run(tiny_llama, prompts, params, decode_algo="look_ahead")
    assert la == base
    outs, _ = _run(tiny_llama, prompts, params, decode_algo="sps", draft_model=tiny_llama)
    assert all(len(o) >= 4 for o in outs)


def test_draft_vocab_mismatch_names_both_sizes(tiny_llama, tmp_path):
    import json
    import shutil

    d = tmp_path / "draft"
    shutil.copytree(tiny_llama, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["vocab_size"] = 500
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"--draft.model.*500.*384"):
        LLM(model=tiny_llama, dtype="float32", decode_algo="sps", draft_model=str(d))


@pytest.mark.parametrize("algo", ["sps", "look_ahead"])
def test_lora_with_speculation_is_refused(algo):
    from bladellm.config import EngineConfig

    extra = {"draft_model": "/some/draft"} if algo == "sps" else {}
    with pytest.raises(ValueError, match="--enable_lora: cannot be combined"):
        EngineConfig.from_kwargs(model="m", enable_lora=True, decode_algo=algo, **extra)
