"""The offline LLM against transformers on tiny random models (fp32).

The stress configuration turns everything on at once: prompt cache, chunked prefill (a token
budget smaller than most prompts), a KV pool too small for the batch (forces preemption by
recompute), block accounting checked after every step.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from bladellm import LLM, SamplingParams

NUM_PROMPTS = 16
MAX_TOKENS = 24


def _prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """16 prompts of varied lengths; most share one of two long prefixes."""
    rng = random.Random(seed)
    low = 3  # skip the special tokens
    shared = [[rng.randrange(low, vocab_size) for _ in range(41)] for _ in range(2)]
    prompts = []
    for i in range(NUM_PROMPTS):
        tail = [rng.randrange(low, vocab_size) for _ in range(rng.randrange(1, 60))]
        head = shared[i % 2][: rng.choice([0, 9, 17, 41])] if i % 5 else []
        prompts.append(head + tail)
    return prompts


def _hf_greedy(model_dir: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_tokens, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_identical_to_transformers_under_stress(tiny_model_factory, arch):
    model_dir = tiny_model_factory(arch)
    llm = LLM(model=model_dir, dtype="float32", block_size=4, max_num_batched_tokens=32,
              max_num_seqs=8, num_kv_blocks=48, max_model_len=160,
              debug_block_accounting=True)
    vocab = llm.engine.model_info.vocab_size
    prompts = _prompts(vocab)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = llm.generate(prompts, params, use_tqdm=False)
    expected = _hf_greedy(model_dir, prompts, MAX_TOKENS)
    for i, (out, exp) in enumerate(zip(outs, expected)):
        assert out.outputs[0].token_ids == exp, f"prompt {i} (len {len(prompts[i])})"
    stats = llm.engine.core.scheduler.get_stats()
    # The stress paths really ran: preemption happened and the prompt cache hit.
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0
    # Everything finished: no block is held any more.
    assert stats.num_used_blocks == 0
    llm.engine.core.scheduler.check_invariants()


def test_greedy_identical_with_decodes_on_long_shared_prefixes(tiny_model_factory, monkeypatch):
    """Requests on two cached 80-token prefixes decode together: the compiled attention reads
    each prefix once for all of them (a shared pass, the cascade), and the tokens are still
    transformers' own."""
    import shutil

    from bladellm.kernels.compiled import CompiledKernels
    from bladellm.model.decoder_stack import CompiledDecoderStack

    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the reference attention has no shared pass")
    shared_requests = []
    plain = CompiledKernels.paged_attention

    def spy(self, out, query, k_cache, v_cache, tables, starts, lens, scale, **kwargs):
        plan = self.attention_plan(query, k_cache, v_cache, tables, starts, lens)
        shared_requests.append(plan["shared_requests"])
        return plain(self, out, query, k_cache, v_cache, tables, starts, lens, scale, **kwargs)

    monkeypatch.setattr(CompiledKernels, "paged_attention", spy)
    # The compiled decoder stack calls the same attention kernel from C, out of the spy's
    # sight: decodes go through the modules here.
    monkeypatch.setattr(CompiledDecoderStack, "build", classmethod(lambda cls, *a: None))
    model_dir = tiny_model_factory("llama")
    llm = LLM(model=model_dir, dtype="float32", block_size=16, max_num_seqs=8,
              max_model_len=160)
    rng = random.Random(7)
    vocab = llm.engine.model_info.vocab_size
    prefixes = [[rng.randrange(3, vocab) for _ in range(80)] for _ in range(2)]
    prompts = [prefixes[i % 2] + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 20))]
               for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    llm.generate(prefixes, params.clone(max_tokens=1), use_tqdm=False)  # cache the prefixes
    outs = llm.generate(prompts, params, use_tqdm=False)
    expected = _hf_greedy(model_dir, prompts, 16)
    assert [out.outputs[0].token_ids for out in outs] == expected
    # All 8 decode together after one prefill step (6: margin for a request that a random
    # model ends with EOS on its first token); 0 would mean the kernel never grouped them.
    assert max(shared_requests) >= 6, "the decodes should have shared their prefixes' blocks"
    assert llm.engine.core.scheduler.get_stats().num_used_blocks == 0


def test_seeded_sampling_independent_of_batch(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32", block_size=4, max_num_batched_tokens=64)
    target = [5, 6, 7, 8, 9, 10, 11]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20)
    alone = llm.generate([target], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [[20 + i] * (3 + 5 * i) for i in range(7)]
    mixed_params = [SamplingParams(temperature=0.7, max_tokens=30)] * 7
    batch = llm.generate(others[:3] + [target] + others[3:], mixed_params[:3] + [seeded]
                         + mixed_params[3:], use_tqdm=False)
    assert batch[3].outputs[0].token_ids == alone
    # A different seed gives a different continuation (the seed is actually used).
    other = llm.generate([target], seeded.clone(seed=99), use_tqdm=False)[0]
    assert other.outputs[0].token_ids != alone


def test_n_greater_than_one_shares_prompt_blocks(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32", block_size=4)
    prompt = list(range(3, 3 + 40))
    out = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12,
                                                ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 12 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # Siblings got the prompt's full blocks from the cache instead of recomputing them.
    stats = llm.engine.core.scheduler.get_stats()
    assert stats.prefix_cache_hits >= 2 * (len(prompt) // 4 - 1) * 4


def test_logprobs_match_transformers_log_softmax(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32")
    prompt = [5, 17, 33, 60, 12, 9]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, logprobs=5,
                                                ignore_eos=True), use_tqdm=False)[0].outputs[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)[len(prompt) - 1: -1]
    assert len(out.logprobs) == 8
    for step, (tok, entries) in enumerate(zip(out.token_ids, out.logprobs)):
        assert entries[0].token_id == tok
        assert entries[0].logprob == pytest.approx(ref[step, tok].item(), abs=1e-4)
        top = torch.topk(ref[step], 5)
        assert [e.token_id for e in entries[1:]] == top.indices.tolist()
        for e, v in zip(entries[1:], top.values.tolist()):
            assert e.logprob == pytest.approx(v, abs=1e-4)


def test_stop_string_split_across_tokens(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32")
    tok = llm.get_tokenizer()
    prompt = "The quick brown fox"
    base = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24,
                                                 ignore_eos=True), use_tqdm=False)[0]
    ids = base.outputs[0].token_ids
    pieces = [tok.decode(ids[:i]) for i in range(len(ids) + 1)]
    # Find a token boundary with text on both sides and take 2 chars before + 2 after it.
    for i in range(2, len(ids) - 1):
        left, right = pieces[i], pieces[i + 1]
        if len(left) >= 2 and len(right) >= len(left) + 2 and right.startswith(left):
            stop = left[-2:] + right[len(left): len(left) + 2]
            if stop.strip() and base.outputs[0].text.find(stop) == len(left) - 2:
                break
    else:
        pytest.skip("no suitable token boundary in this continuation")
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, stop=[stop],
                                                ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.text == base.outputs[0].text[: base.outputs[0].text.find(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text


def test_bad_prompt_leaves_nothing_in_engine(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32", max_model_len=64)
    with pytest.raises(ValueError):
        llm.generate([[5, 6, 7], list(range(3, 3 + 70))], SamplingParams(max_tokens=4),
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_failed_step_fails_its_requests_not_the_engine(tiny_llama):
    """A step that keeps failing whatever runs in it fails its requests (each one alone fails
    too: they are all culprits), not the engine; a failure that does not repeat when the step
    is re-run (issue 37: the engine re-runs a failed step to find its culprit) fails nobody."""
    llm = LLM(model=tiny_llama, dtype="float32", debug_block_accounting=True)
    runner = llm.engine.core.executor.worker.model_runner
    real = runner.execute_model
    calls = {"n": 0}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    reference = llm.generate([[5, 6, 7], [8, 9, 10]], params, use_tqdm=False)

    def broken_from_the_second_step(sched):
        calls["n"] += 1
        if calls["n"] >= 2:
            raise RuntimeError("injected kernel failure")
        return real(sched)

    runner.execute_model = broken_from_the_second_step
    outs = llm.generate([[5, 6, 7], [8, 9, 10]], params, use_tqdm=False)
    assert all(o.error and "injected kernel failure" in o.error for o in outs)
    assert all(o.outputs[0].finish_reason == "error" for o in outs)
    assert llm.engine.core.scheduler.get_stats().num_used_blocks == 0

    def fails_once(sched):
        calls["n"] += 1
        if calls["n"] == 2:  # the second step blows up once
            raise RuntimeError("injected transient failure")
        return real(sched)

    calls["n"] = 0
    runner.execute_model = fails_once
    outs = llm.generate([[5, 6, 7], [8, 9, 10]], params, use_tqdm=False)
    assert [o.error for o in outs] == [None, None]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference]
    assert llm.engine.core.scheduler.get_stats().num_used_blocks == 0
    # The engine keeps serving afterwards.
    runner.execute_model = real
    again = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0]
    assert again.error is None and len(again.outputs[0].token_ids) == 8


def test_weights_are_prepacked_only_when_the_copies_fit(tiny_model_factory, monkeypatch):
    """The runner packs the linear weights only while the most the copies can take (the
    kernels' ``packed_bytes_bound``) is at most a quarter of the memory the weights leave; the
    copies it makes stay within that bound, and unpacked weights give the same tokens."""
    from bladellm.worker import model_runner as runner_mod

    model_dir = tiny_model_factory("llama")
    args = dict(model=model_dir, dtype="float32", block_size=4, max_num_seqs=4, num_kv_blocks=96,
                max_model_len=160)
    llm = LLM(**args)
    kernels = llm.engine.core.executor.worker.kernels  # the set the worker resolved
    runner = llm.engine.core.executor.worker.model_runner
    packable = [m for m in runner.model.modules() if hasattr(m, "packed_weight")]
    bound = sum(kernels.packed_bytes_bound(m.weight) for m in packable)
    if kernels.name == "ref":
        assert bound == 0 and runner.packed_weight_bytes == 0
        return
    assert 0 < runner.packed_weight_bytes <= bound
    weights = runner_mod.model_weight_bytes(runner.model)
    prompts = _prompts(llm.engine.model_info.vocab_size)[:3]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    packed_out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.shutdown()
    # Both sides of the limit: just enough spare memory packs, one word less does not.
    monkeypatch.setattr(runner_mod, "total_memory_bytes", lambda: weights + 4 * bound)
    llm = LLM(**args)
    assert llm.engine.core.executor.worker.model_runner.packed_weight_bytes > 0
    llm.shutdown()
    monkeypatch.setattr(runner_mod, "total_memory_bytes", lambda: weights + 4 * bound - 4)
    llm = LLM(**args)
    runner = llm.engine.core.executor.worker.model_runner
    assert runner.packed_weight_bytes == 0
    assert all(getattr(m, "packed_weight", None) is None for m in runner.model.modules())
    assert [o.outputs[0].token_ids
            for o in llm.generate(prompts, params, use_tqdm=False)] == packed_out
    llm.shutdown()


def test_bf16_checkpoint_served_in_fp32_identical_to_transformers(tiny_model_factory, tmp_path):
    """A checkpoint whose weights are all bf16 values (as a bf16 checkpoint is) served at
    --dtype float32: small batches read the weights' exact bf16 copies, and greedy tokens are
    still those of transformers in fp32, under the stress configuration."""
    import shutil
    from pathlib import Path

    src = Path(tiny_model_factory("llama"))
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    model_dir = tmp_path / "bf16-values"
    model.save_pretrained(model_dir, safe_serialization=True)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, model_dir / f.name)
    llm = LLM(model=str(model_dir), dtype="float32", block_size=4, max_num_batched_tokens=32,
              max_num_seqs=8, num_kv_blocks=48, max_model_len=160,
              debug_block_accounting=True)
    runner = llm.engine.core.executor.worker.model_runner
    head = runner.model.lm_head.packed_weight
    if head is not None:  # compiled kernels: the copies exist and are bf16 (in panels on AVX2)
        assert head.bf16_copy is not None and head.bf16_copy.dtype == torch.bfloat16
        assert all(m.packed_weight.bf16_copy is not None
                   and m.packed_weight.bf16_copy.dtype == torch.bfloat16
                   for m in runner.model.modules() if hasattr(m, "quant_method"))
    prompts = _prompts(llm.engine.model_info.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = llm.generate(prompts, params, use_tqdm=False)
    expected = _hf_greedy(str(model_dir), prompts, MAX_TOKENS)
    for i, (out, exp) in enumerate(zip(outs, expected)):
        assert out.outputs[0].token_ids == exp, f"prompt {i} (len {len(prompts[i])})"
    assert llm.engine.core.scheduler.get_stats().num_used_blocks == 0
