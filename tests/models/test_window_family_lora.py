"""LoRA on Gemma 3: greedy tokens with an adapter on every projection equal transformers + PEFT
in fp32, next to base-model requests in one batch. Bloom (fused per-head query_key_value) is
refused at start-up naming the flag."""

from __future__ import annotations

import pytest

from bladellm import LLM, SamplingParams
from tiny_lora import make_adapter, peft_greedy
from window_family_models import make_window_family_model

TARGETS = {
    "gemma3": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}


@pytest.mark.parametrize("family", list(TARGETS))
def test_adapter_greedy_matches_peft(tmp_path, family):
    base = make_window_family_model(tmp_path / "base", family)
    adapter = make_adapter(base, tmp_path / "adapter", r=8, targets=TARGETS[family], seed=3)
    prompts = [list(range(5, 26)), list(range(30, 41))]
    llm = LLM(model=base, dtype="float32", block_size=4, max_num_batched_tokens=16,
              max_model_len=64, num_kv_blocks=40, enable_lora=True, max_lora_rank=8)
    try:
        lora = llm.lora_request("a", adapter)
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompts * 2, params, use_tqdm=False,
                            lora_request=[lora, lora, None, None])
    finally:
        llm.shutdown()
    want = [peft_greedy(base, adapter, p, 6) for p in prompts] + \
        [peft_greedy(base, None, p, 6) for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == want
    assert want[:2] != want[2:]  # the adapter changes the output


def test_bloom_lora_refused_naming_the_flag(tmp_path):
    base = make_window_family_model(tmp_path / "base", "bloom")
    with pytest.raises(ValueError, match="--enable_lora.*BloomForCausalLM"):
        LLM(model=base, dtype="float32", enable_lora=True, max_lora_rank=8)
