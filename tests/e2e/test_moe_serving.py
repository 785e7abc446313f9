"""Mixture-of-experts models through the whole engine, fp32: greedy tokens identical to
transformers under the stress configuration (prompt cache, chunked prefill, preemption, block
accounting checked every step) for Mixtral, Qwen2-MoE and Qwen3-MoE; identical to one rank with
tensor parallelism (2, and 3 with uneven expert shards), expert parallelism (2 and 3 ranks,
uneven expert counts) and pipeline parallelism; sps and look_ahead never change the tokens; LoRA
on the attention projections matches PEFT, and adapters on experts are refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from bladellm import LLM, SamplingParams
from bladellm.checkpoint.hf_config import load_hf_config
from bladellm.lora.adapter import BaseShapes, LoRAError, validate_dir
from test_offline_llm import _hf_greedy, _prompts
from test_tensor_parallel import STRESS
from tiny_lora import make_adapter, peft_greedy

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def _generate(model_dir: str, prompts: list[list[int]], **kwargs):
    llm = LLM(model=model_dir, **{**STRESS, **kwargs})
    try:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        stats = llm.engine.core.scheduler.get_stats()
        return [o.outputs[0].token_ids for o in outs], stats
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_greedy_identical_to_transformers_under_stress(tiny_model_factory, arch):
    model_dir = tiny_model_factory(arch)
    prompts = _prompts(384)[:12]
    got, stats = _generate(model_dir, prompts)
    want = _hf_greedy(model_dir, prompts, MAX_TOKENS)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"{arch} prompt {i} (len {len(prompts[i])})"
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.num_used_blocks == 0


# (arch, config overrides, parallel options)
PARALLEL = {
    "qwen3_moe-TP2": ("qwen3_moe", {}, dict(tensor_parallel_size=2)),
    # Expert intermediate 50 = 17+17+16, shared expert 80 = 27+27+26, 4 heads over 3 ranks.
    "qwen2_moe-TP3-uneven": ("qwen2_moe", dict(moe_intermediate_size=50),
                             dict(tensor_parallel_size=3)),
    "qwen3_moe-EP2": ("qwen3_moe", {}, dict(tensor_parallel_size=2,
                                            enable_expert_parallel=True)),
    # 4 experts over 3 ranks: 2+1+1.
    "mixtral-EP3-uneven": ("mixtral", {}, dict(tensor_parallel_size=3,
                                               enable_expert_parallel=True)),
    "mixtral-PP2": ("mixtral", dict(num_hidden_layers=3), dict(pipeline_parallel_size=2)),
}


@pytest.mark.parametrize("case", list(PARALLEL))
def test_parallel_greedy_identical_to_one_rank(tiny_model_factory, case):
    arch, overrides, parallel = PARALLEL[case]
    model_dir = tiny_model_factory(arch, **overrides)
    prompts = _prompts(384)[:10]
    want, _ = _generate(model_dir, prompts)
    got, stats = _generate(model_dir, prompts, **parallel)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"{case} prompt {i}: {g} != one rank's {w}"
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.num_used_blocks == 0


def test_expert_parallel_refused_for_dense_models(tiny_llama):
    with pytest.raises(ValueError, match="--enable_expert_parallel: .* has no experts"):
        LLM(model=tiny_llama, tensor_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="--enable_expert_parallel: needs --tensor_parallel"):
        LLM(model=tiny_llama, enable_expert_parallel=True)


@pytest.mark.parametrize("algo", ["sps", "look_ahead"])
def test_speculative_decoding_keeps_the_tokens(tiny_model_factory, algo):
    model_dir = tiny_model_factory("qwen3_moe")
    prompts = _prompts(384)[:8]
    want, _ = _generate(model_dir, prompts)
    extra = dict(decode_algo=algo, spec_policy="always")
    if algo == "sps":  # a dense draft with the same tokenizer
        extra.update(draft_model=tiny_model_factory("qwen2", seed=7, num_hidden_layers=1),
                     gamma=3)
    got, stats = _generate(model_dir, prompts, **extra)
    assert got == want
    assert stats.num_spec_draft_tokens > 0


def test_lora_on_attention_matches_peft(tiny_model_factory, tmp_path):
    model_dir = tiny_model_factory("qwen3_moe")
    adapter = make_adapter(model_dir, tmp_path / "qv", r=4, targets=["q_proj", "v_proj"],
                           seed=0)
    prompt = _prompts(384)[3]
    llm = LLM(model=model_dir, **STRESS, enable_lora=True, max_lora_rank=8)
    try:
        out = llm.generate([prompt], GREEDY, use_tqdm=False,
                           lora_request=llm.lora_request("qv", adapter))[0]
    finally:
        llm.shutdown()
    want = peft_greedy(model_dir, adapter, prompt, MAX_TOKENS)
    assert out.outputs[0].token_ids == want
    assert want != peft_greedy(model_dir, None, prompt, MAX_TOKENS)  # the adapter matters


@pytest.mark.parametrize("module", ["experts.2.gate_proj", "down_proj"])
def test_lora_on_experts_is_refused_by_name(tiny_model_factory, tmp_path, module):
    model_dir = tiny_model_factory("qwen3_moe")
    cfg = load_hf_config(model_dir, trust_remote_code=False)
    fan_in, fan_out = (64, 40) if module != "down_proj" else (128, 64)
    prefix = f"base_model.model.model.layers.1.mlp.{module}"
    save_file({f"{prefix}.lora_A.weight": torch.zeros(4, fan_in),
               f"{prefix}.lora_B.weight": torch.zeros(fan_out, 4)},
              str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8,
         "target_modules": [module.rsplit(".", 1)[-1]]}))
    with pytest.raises(LoRAError, match=r"mixture.of.experts.*not supported") as e:
        validate_dir(str(tmp_path), 8, BaseShapes.from_hf_config(cfg))
    assert module.rsplit(".", 1)[-1] in str(e.value) and "layer 1" in str(e.value)


def test_split_for_tp_and_ep_serves_the_same_tokens(tiny_model_factory, tmp_path):
    from bladellm.entrypoints.cli.split import split_checkpoint

    model_dir = tiny_model_factory("qwen3_moe")
    prompts = _prompts(384)[:6]
    want, _ = _generate(model_dir, prompts)
    for ep in (False, True):
        out = str(tmp_path / f"split-ep{int(ep)}")
        manifest = split_checkpoint(model_dir, out, 2, enable_expert_parallel=ep)
        assert manifest["enable_expert_parallel"] is ep
        got, _ = _generate(out, prompts, tensor_parallel_size=2, enable_expert_parallel=ep)
        assert got == want, f"split with enable_expert_parallel={ep}"
        with pytest.raises(ValueError, match="--enable_expert_parallel: .* split"):
            LLM(model=out, tensor_parallel_size=2, enable_expert_parallel=not ep)


def test_quantized_moe_checkpoint_with_a_bad_group_size_names_it(tiny_model_factory, tmp_path):
    """Quantized MoE checkpoints load (tests/models/test_quantized_moe.py); one whose group size
    does not divide an expert's input features is refused with one line naming both."""
    import shutil

    src = tiny_model_factory("qwen3_moe")
    shutil.copytree(src, tmp_path / "q", dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                  "desc_act": False, "sym": True}
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"quantization_config.group_size: 32 does not divide "
                                         r"model\.layers\.0\.mlp\.experts\.0\.down_proj"):
        LLM(model=str(tmp_path / "q"), dtype="float32")
