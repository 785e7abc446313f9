"""Quantized mixture-of-experts checkpoints through the whole engine, fp32: greedy tokens equal
transformers running the dequantized weights, under the stress configuration (prompt cache,
chunked prefill, preemption)."""

from __future__ import annotations

import json

import pytest

from bladellm import LLM, SamplingParams
from quant_checkpoints import MOE_SHAPES as SHAPES, dequantized_checkpoint, quantize_checkpoint
from test_offline_llm import _hf_greedy, _prompts
from test_tensor_parallel import STRESS


def test_greedy_tokens_through_the_engine(tiny_model_factory, tmp_path):
    src = tiny_model_factory("qwen2_moe", **SHAPES["qwen2_moe"])
    fake = quantize_checkpoint(src, tmp_path / "q", fmt="gptq", bits=4, group_size=32)
    ref_dir = dequantized_checkpoint(src, fake, tmp_path / "ref")
    prompts = _prompts(384)[:6]
    llm = LLM(model=str(tmp_path / "q"), **STRESS)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12),
                            use_tqdm=False)
    finally:
        llm.shutdown()
    want = _hf_greedy(ref_dir, prompts, 12)
    assert [list(o.outputs[0].token_ids) for o in outs] == [list(w) for w in want]
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "gptq"


def _generate(model_dir: str, prompts: list[list[int]], **kwargs):
    llm = LLM(model=model_dir, **{**STRESS, **kwargs})
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12),
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


# Expert intermediate 64 over 2 ranks: 32 + 32, on the groups of 32; EP: 4 + 4 experts.
@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2),
                                      dict(tensor_parallel_size=2, enable_expert_parallel=True)],
                         ids=["TP2", "EP2"])
def test_parallel_greedy_identical_to_one_rank(tiny_model_factory, tmp_path, parallel):
    src = tiny_model_factory("qwen3_moe", **SHAPES["qwen3_moe"])
    quantize_checkpoint(src, tmp_path, fmt="awq", group_size=32)
    prompts = _prompts(384)[:6]
    assert _generate(str(tmp_path), prompts, **parallel) == _generate(str(tmp_path), prompts)


def test_tensor_parallel_off_group_boundaries_is_refused(tiny_model_factory, tmp_path):
    # Expert intermediate 64 = 22 + 21 + 21: the ranks' slices cut groups of 16 (attention's
    # head slices fall on them).
    src = tiny_model_factory("qwen3_moe", **SHAPES["qwen3_moe"])
    quantize_checkpoint(src, tmp_path, fmt="gptq", bits=4, group_size=16, sym=True)
    with pytest.raises(RuntimeError,
                       match=r"--tensor_parallel_size: .*experts\.\d+\.gate_up_proj"):
        LLM(model=str(tmp_path), dtype="float32", tensor_parallel_size=3)


@pytest.mark.parametrize("ep", [False, True], ids=["TP2", "EP2"])
def test_split_serves_the_unsplit_tokens(tiny_model_factory, tmp_path, ep):
    """``blade_llm_split`` of a quantized MoE checkpoint: each rank holds its experts' packed
    shards (EP: whole experts, half of them), and serving the split gives one rank's tokens."""
    from safetensors import safe_open

    from bladellm.entrypoints.cli.split import split_checkpoint

    src = tiny_model_factory("qwen3_moe", **SHAPES["qwen3_moe"])
    quantize_checkpoint(src, tmp_path / "q", fmt="gptq", bits=4, group_size=32)
    out = str(tmp_path / "split")
    split_checkpoint(str(tmp_path / "q"), out, 2, enable_expert_parallel=ep)
    with safe_open(f"{out}/rank_1/model.safetensors", "pt") as f:
        names = set(f.keys())
    experts = {n.split(".quant_experts.")[1].split(".")[0] for n in names
               if ".mlp.experts.quant_experts." in n and n.endswith("down_proj.qweight")}
    assert experts == ({"0", "1", "2", "3"} if ep else {str(e) for e in range(8)})
    assert not any(n.endswith("gate_up_proj") for n in names)  # no stacked float experts
    prompts = _prompts(384)[:4]
    parallel = dict(tensor_parallel_size=2, enable_expert_parallel=ep)
    assert _generate(out, prompts, **parallel) == _generate(str(tmp_path / "q"), prompts)
