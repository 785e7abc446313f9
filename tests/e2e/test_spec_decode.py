"""Speculative decoding (sps) and lookahead decoding never change what the target emits.

Stress configuration as in test_offline_llm: prompt cache on, chunked prefill forced (a token
budget smaller than most prompts), a KV pool small enough to force preemption, and the block
accounting checked after every step. ``--spec_policy always`` makes every request speculate
on every step (the cost rule would rightly never run a self-draft), which is the harder test of
exactness; the cost rule's own choices are checked for look_ahead too.
"""

from __future__ import annotations

import dataclasses
import re

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
                       gamma=3, spec_policy="always")
    assert outs == expected
    assert stats.num_spec_draft_tokens > 0
    assert stats.num_spec_accepted_tokens == stats.num_spec_draft_tokens
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def test_sps_random_smaller_draft_greedy_identical(tiny_llama, tiny_model_factory,
                                                   normal_greedy):
    prompts, params, expected = normal_greedy
    draft = tiny_model_factory("qwen2", seed=7, num_hidden_layers=1)
    outs, stats = _run(tiny_llama, prompts, params, decode_algo="sps", draft_model=draft,
                       gamma=4, spec_policy="always")
    assert outs == expected
    assert stats.num_spec_draft_tokens > 0
    assert stats.num_spec_accepted_tokens < stats.num_spec_draft_tokens  # it disagrees


def test_sps_quantized_copy_as_draft(tiny_llama, normal_greedy, tmp_path):
    """A 4-bit copy of the target as its own draft: the target's tokens. The cost rule's draft
    ratio is measured (the two models' one-token forwards timed at start-up), not taken from
    their multiply-adds, which are equal here. A random tiny model's next-token distributions
    are nearly flat, so 4-bit rounding flips many of its argmaxes (~25 % accepted here)."""
    from quant_checkpoints import quantize_checkpoint

    prompts, params, expected = normal_greedy
    draft = tmp_path / "w4-draft"
    quantize_checkpoint(tiny_llama, draft, "gptq", bits=4, group_size=32)
    llm = LLM(model=tiny_llama, **STRESS, decode_algo="sps", draft_model=str(draft), gamma=3)
    sched = llm.engine.core.scheduler
    target_s, draft_s = llm.engine.core.executor.collective_rpc("spec_forward_times")[0]
    assert target_s > 0 and draft_s > 0
    assert 0 < sched.spec_policy.costs.draft_ratio < 10
    # Every request speculates every step (the rule would rightly decline a draft this poor).
    sched.spec_policy.costs = dataclasses.replace(sched.spec_policy.costs, always=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs == expected
    assert sched.kv_cache_manager.pool.num_used_blocks == 0
    stats = sched.get_stats()
    assert 0 < stats.num_spec_accepted_tokens < stats.num_spec_draft_tokens


@pytest.mark.parametrize("policy", ["always", "cost"])
def test_look_ahead_greedy_identical(tiny_llama, normal_greedy, policy):
    prompts, params, expected = normal_greedy
    outs, stats = _run(tiny_llama, prompts, params, decode_algo="look_ahead",
                       look_ahead_window_size=3, look_ahead_gram_size=3, guess_set_size=3,
                       spec_policy=policy)
    assert outs == expected
    if policy == "always":
        assert stats.num_spec_draft_tokens > 0


def test_sps_cost_rule_greedy_identical(tiny_llama, tiny_model_factory, normal_greedy,
                                        monkeypatch):
    """The cost rule picks which requests the draft runs for, so a request's draft KV skips
    steps and catches up lazily when it is picked again: still the target's tokens. The
    random draft is priced as nearly free so that the rule starts it, stops it once its record
    is poor and, its evidence fading fast here, tries it again a few steps later."""
    from bladellm.core import spec_decode

    monkeypatch.setattr(spec_decode, "IDLE_DECAY", 0.5)
    prompts, params, expected = normal_greedy
    draft = tiny_model_factory("qwen2", seed=7, num_hidden_layers=1)
    llm = LLM(model=tiny_llama, **STRESS, decode_algo="sps", draft_model=draft, gamma=4)
    sched = llm.engine.core.scheduler
    sched.spec_policy.costs = dataclasses.replace(sched.spec_policy.costs, draft_ratio=0.01)
    history: dict[str, str] = {}  # per request and sampling step: d(rafted) or s(kipped)
    schedule = sched.schedule

    def spy(*a, **k):
        out = schedule(*a, **k)
        for r, n in out.num_scheduled_tokens.items():
            if sched.requests[r].num_computed_tokens + n >= sched.requests[r].num_tokens:
                history[r] = history.get(r, "") + ("d" if r in out.spec_propose else "s")
        return out

    sched.schedule = spy
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs == expected
    assert sched.kv_cache_manager.pool.num_used_blocks == 0
    stats = sched.get_stats()
    assert stats.num_spec_draft_tokens > stats.num_spec_accepted_tokens
    # Some request was drafted, skipped, then drafted again: a lazy catch-up over the tokens
    # of the skipped steps.
    assert any(re.search("ds+d", h) for h in history.values()), history


def test_seeded_sampling_with_n_and_logprobs(tiny_llama):
    """Seeded sampling, n > 1, logprobs, stop tokens and min_tokens through verification: a
    self-draft accepts everything, so tokens equal normal decoding's distribution; look_ahead
    (point-mass proposals) emits exactly normal decoding's seeded tokens."""
    prompts = _prompts(384)[:4]
    params = SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=16, n=2, logprobs=2,
                            min_tokens=4)
    base, _ = _run(tiny_llama, prompts, params)
    la, _ = _run(tiny_llama, prompts, params, decode_algo="look_ahead", spec_policy="always")
    assert la == base
    outs, _ = _run(tiny_llama, prompts, params, decode_algo="sps", draft_model=tiny_llama,
                   spec_policy="always")
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
