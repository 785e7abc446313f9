"""``--kernels`` is chosen once per worker, with its device, and handed down: two engines in one
process, one on the reference kernels and one on the compiled ones, each run every layer on
their own set (no process-wide choice) and give the same greedy tokens."""

from __future__ import annotations

import shutil

import pytest

from bladellm import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], [5, 6, 7, 8, 30, 31, 32, 33, 34, 35], [40, 41, 42]]


def _kernel_holders(llm: LLM) -> dict[str, object]:
    """Every place the worker's set was handed to, by name."""
    worker = llm.engine.core.executor.worker
    runner = worker.model_runner
    layer = runner.model.model.layers[0]
    return {"attention": runner.attn_backend.kernels, "norm": layer.input_layernorm.kernels,
            "rotary": layer.self_attn.rotary_emb.kernels, "act": layer.mlp.act_fn.kernels,
            "qkv": layer.self_attn.qkv_proj.quant_method.kernels,
            "lm_head": runner.model.lm_head.kernels, "sampler": runner.sampler.kernels}


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler: no compiled kernels")
def test_two_engines_with_their_own_kernel_sets(tiny_llama):
    args = dict(model=tiny_llama, dtype="float32", block_size=4, max_num_batched_tokens=8,
                max_model_len=64, num_kv_blocks=40)
    ref = LLM(kernels="ref", **args)
    compiled = LLM(kernels="compiled", **args)  # built while the first engine is alive
    try:
        for llm, name in ((ref, "ref"), (compiled, "compiled")):
            kernels = llm.engine.core.executor.worker.kernels
            assert kernels.name == name
            for where, held in _kernel_holders(llm).items():
                assert held is kernels, (name, where)
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        tokens = [[list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params,
                                                                       use_tqdm=False)]
                  for llm in (ref, compiled)]
        assert tokens[0] == tokens[1]
        # The compiled engine's decode steps ran its compiled stack; the reference one has none.
        assert compiled.engine.core.executor.worker.model_runner.model.model.compiled_stack
        assert ref.engine.core.executor.worker.model_runner.model.model.compiled_stack is None
    finally:
        ref.shutdown()
        compiled.shutdown()


def test_layers_built_outside_a_kernel_scope_are_refused():
    """A layer gets its kernel set handed down by whoever builds the model; none is assumed."""
    from bladellm.model.layers import RMSNorm

    with pytest.raises(RuntimeError, match="building_with"):
        RMSNorm(8)
