"""LoRA on Gemma 2, Gemma 3 and Bloom: greedy tokens with an adapter on every projection equal
transformers + PEFT in fp32, next to base-model requests in one batch. Bloom's PEFT
``query_key_value`` holds its rows per head ([head][q | k | v][head_dim]), as the base weight
does; also under tensor parallelism over uneven heads (4 over 3 ranks)."""

from __future__ import annotations

import pytest

from bladellm import LLM, SamplingParams
from tiny_lora import make_adapter, peft_greedy
from window_family_models import make_window_family_model

_GEMMA = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TARGETS = {
    "gemma2": _GEMMA,
    "gemma3": _GEMMA,
    "bloom": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
}
CASES = {family: (family, 1) for family in TARGETS} | {"bloom-T3": ("bloom", 3)}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if tp > 1 else c
                                  for c, (_, tp) in CASES.items()])
def test_adapter_greedy_matches_peft(tmp_path, case):
    family, tp = CASES[case]
    base = make_window_family_model(tmp_path / "base", family)
    adapter = make_adapter(base, tmp_path / "adapter", r=8, targets=TARGETS[family], seed=3)
    prompts = [list(range(5, 26)), list(range(30, 41))]
    llm = LLM(model=base, dtype="float32", block_size=4, max_num_batched_tokens=16,
              max_model_len=64, num_kv_blocks=40, enable_lora=True, max_lora_rank=8,
              tensor_parallel_size=tp)
    try:
        lora = llm.lora_request("a", adapter)
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompts * 2, params, use_tqdm=False,
                            lora_request=[lora, lora, None, None])
    finally:
        llm.shutdown()
    want = [peft_greedy(base, adapter, p, 6, "eager") for p in prompts] + \
        [peft_greedy(base, None, p, 6, "eager") for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == want
    assert want[:2] != want[2:]  # the adapter changes the output

