"""Pipeline parallelism for the families with a layout of their own (Gemma 2, Gemma 3, Bloom,
OPT; models/stage.py): greedy tokens identical to transformers' ``generate`` in fp32 under the
stress configuration (prompt cache, chunked prefill, preemption, block accounting checked every
step), with 3 layers over 2 stages (2 + 1): the first stage's embedding side (Gemma's scale,
Bloom's embedding LayerNorm, OPT's learned positions and ``project_in``), the last stage's
final norm, tied LM head read from the checkpoint's embedding, final soft-cap and
``project_out``; a local (sliding) layer whose index in the model differs from its KV cache's
index on the second stage; Bloom with 2 x 2 ranks (each its heads' ALiBi slopes)."""

from __future__ import annotations

import pytest
import transformers

from bladellm import LLM, SamplingParams
from family_models import make_family_model
from test_window_family_engine import MAX_TOKENS, STRESS, _hf_greedy, _prompts
from window_family_models import make_window_family_model

# case -> (family, config overrides, tensor_parallel_size)
CASES = {
    # layers: local, global, local
    "gemma2": ("gemma2", dict(num_hidden_layers=3), 1),
    # layers 0, 1 local (first stage), 2 global (second stage)
    "gemma3": ("gemma3", {}, 1),
    "bloom": ("bloom", dict(n_layer=3), 1),
    "bloom-post-ln-residual": ("bloom", dict(n_layer=3,
                                             apply_residual_connection_post_layernorm=True), 1),
    "bloom-T2": ("bloom", dict(n_layer=3), 2),
    "opt": ("opt", dict(num_hidden_layers=3), 1),
    "opt-post-ln-proj": ("opt", dict(num_hidden_layers=3, do_layer_norm_before=False,
                                     word_embed_proj_dim=32), 1),
}


# Local and global layers mixed: a KV cache group per kind and run (core/kv_groups.py), so a
# request of max_model_len needs more block ids than STRESS's pool; still small enough to preempt.
POOL = {"gemma2": dict(num_kv_blocks=60), "gemma3": dict(num_kv_blocks=60)}


def _make(tmp_path, family: str, overrides: dict) -> str:
    if family == "opt":
        return make_family_model(tmp_path, family, **overrides)
    return make_window_family_model(tmp_path, family, **overrides)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_two_stages_greedy_identical_to_transformers(tmp_path, case):
    family, overrides, tp = CASES[case]
    path = _make(tmp_path, family, overrides)
    prompts = _prompts(transformers.AutoConfig.from_pretrained(path).vocab_size)[:8]
    llm = LLM(model=path, pipeline_parallel_size=2, tensor_parallel_size=tp,
              **{**STRESS, **POOL.get(family, {})})
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                            use_tqdm=False)
        stats = llm.engine.core.scheduler.get_stats()
    finally:
        llm.shutdown()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.num_used_blocks == 0
    for i, (out, exp) in enumerate(zip(outs, _hf_greedy(path, prompts))):
        assert out.outputs[0].token_ids == exp, f"{case}: prompt {i} (len {len(prompts[i])})"


@pytest.mark.slow
@pytest.mark.parametrize("family, overrides", [("gemma2", dict(num_hidden_layers=3)),
                                               ("bloom", dict(n_layer=3))])
def test_split_two_stages_serves_the_transformers_tokens(tmp_path, family, overrides):
    """``blade_llm_split -pp 2``: each stage's shard holds only its layers and parts (the tied
    LM head, from the embedding, on the last) and serves transformers' tokens."""
    from safetensors import safe_open

    from bladellm.entrypoints.cli.split import main as split_main

    src = _make(tmp_path / "src", family, overrides)
    out = str(tmp_path / "split")
    assert split_main(["-tp", "1", "-pp", "2", "--model", src, "--output_dir", out]) == 0
    names = []
    for r in range(2):
        with safe_open(f"{out}/rank_{r}/model.safetensors", "pt") as f:
            names.append(set(f.keys()))
    assert "lm_head.weight" in names[1] and "lm_head.weight" not in names[0]
    layer2 = "model.layers.2." if family == "gemma2" else "transformer.h.2."
    assert not any(n.startswith(layer2) for n in names[0])
    assert any(n.startswith(layer2) for n in names[1])
    prompts = _prompts(transformers.AutoConfig.from_pretrained(src).vocab_size)[:8]
    llm = LLM(model=out, pipeline_parallel_size=2, **{**STRESS, **POOL.get(family, {})})
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                            use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == _hf_greedy(src, prompts)
