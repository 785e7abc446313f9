"""Greedy tokens with LoRA adapters equal transformers + PEFT (fp32), with four adapters of
different ranks and targets and base-model requests in one mixed batch, the prompt cache on,
preemption forced, and fewer device slots / host copies than adapters (so both LRU tiers evict)."""

from __future__ import annotations

import pytest

from bladellm import LLM, SamplingParams
from tiny_lora import make_adapter, peft_greedy, peft_prompt_logprobs

MAX_TOKENS = 8
ADAPTERS = {  # name: (rank, targets, extra LoraConfig options)
    "qv-r4": (4, ["q_proj", "v_proj"], {}),
    "all-r16": (16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj"], {"use_rslora": True}),
    "mlp-r8": (8, ["gate_proj", "down_proj"], {"alpha": 4.0}),
    "ko-r2": (2, ["k_proj", "o_proj", "up_proj"], {"fan_in_fan_out": True}),
}


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(tiny_llama, root / name, r=r, targets=t, seed=i, **extra)
            for i, (name, (r, t, extra)) in enumerate(ADAPTERS.items())}


def test_mixed_adapter_batch_matches_peft(tiny_llama, adapters):
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(9, 30))] for _ in range(3)]
    jobs = []  # (adapter name or None, prompt)
    for name in [None, *adapters]:
        for prompt in prompts:
            jobs.append((name, prompt))
    jobs.append(("all-r16", prompts[0]))  # same adapter + prompt twice: a prompt-cache hit
    rng.shuffle(jobs)

    llm = LLM(model=tiny_llama, dtype="float32", block_size=4, max_num_batched_tokens=48,
              max_num_seqs=12, num_kv_blocks=42, max_model_len=160, enable_lora=True,
              max_loras=2, max_cpu_loras=3, max_lora_rank=16, debug_block_accounting=True)
    loras = {name: llm.lora_request(name, path) for name, path in adapters.items()}
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([p for _, p in jobs], params, use_tqdm=False,
                        lora_request=[loras[n] if n else None for n, _ in jobs])

    expected = {}
    for name, prompt in jobs:
        key = (name, tuple(prompt))
        if key not in expected:
            expected[key] = peft_greedy(tiny_llama, adapters.get(name), prompt, MAX_TOKENS)
    for (name, prompt), out in zip(jobs, outs):
        assert out.outputs[0].token_ids == expected[(name, tuple(prompt))], name
    # The adapters really changed the output (else the test could not fail).
    for name in adapters:
        assert expected[(name, tuple(prompts[0]))] != expected[(None, tuple(prompts[0]))] or \
            expected[(name, tuple(prompts[1]))] != expected[(None, tuple(prompts[1]))], name
    stats = llm.engine.core.scheduler.get_stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0


def test_prompt_logprobs_with_an_adapter_match_peft(tiny_llama, adapters):
    """Prompt logprobs come from the request's own prefill, which runs its adapter: they are
    the adapter's (across prefill chunks), not the base model's."""
    llm = LLM(model=tiny_llama, dtype="float32", block_size=4, max_num_batched_tokens=8,
              max_model_len=64, enable_lora=True, max_lora_rank=16)
    name = "all-r16"
    prompt = [7 + 11 * i % 290 for i in range(21)]
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=2),
                          lora_request=llm.lora_request(name, adapters[name]), use_tqdm=False)
    ref = peft_prompt_logprobs(tiny_llama, adapters[name], prompt)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos, entry in enumerate(out.prompt_logprobs[1:]):
        row, token = ref[pos], prompt[pos + 1]
        assert entry[0].token_id == token
        assert entry[0].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[0].rank == int((row > row[token]).sum()) + 1
        assert [e.token_id for e in entry[1:]] == row.topk(2).indices.tolist()
    base = peft_prompt_logprobs(tiny_llama, None, prompt)
    assert (ref - base).abs().max() > 1e-3  # the adapter changes them (else no test)
