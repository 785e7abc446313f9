"""The new families on the engine's other paths: the whole model through the Triton kernel set
(``--kernels triton``, under ``TRITON_INTERPRET=1`` without a GPU), ``blade_llm_split``
checkpoints, and the compiled decoder stack taken where it fits and declined where not."""

from __future__ import annotations

import pytest
import torch

from bladellm import LLM, SamplingParams
from bladellm.entrypoints.cli.split import split_checkpoint
from bladellm.model.decoder_stack import attach_compiled_stack
from family_models import family_dirs
from test_family_parity import load_ours

OPTS = dict(dtype="float32", block_size=4, max_num_batched_tokens=16, max_model_len=64,
            num_kv_blocks=40)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 9, 10, 11, 12, 40, 41, 42, 43, 44, 45,
                                             46, 47, 48, 49, 50], [60, 61, 62, 63, 64]]


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    return family_dirs(tmp_path_factory)


def _greedy(model: str, **kwargs) -> tuple[list[list[int]], str]:
    llm = LLM(model=model, **{**OPTS, **kwargs})
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6,
                                                    ignore_eos=True), use_tqdm=False)
        kernels = llm.engine.core.executor.worker.kernels.name if kwargs.get(
            "tensor_parallel_size", 1) == 1 else "?"
        return [list(o.outputs[0].token_ids) for o in outs], kernels
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["opt-no-bias-untied-gelu", "opt-post-ln-proj", "glm4",
                                     "phi3-partial-rotary"])
def test_whole_model_through_the_triton_kernel_set(family_dir, variant):
    """LayerNorm (+ residual), plain GELU / ReLU, interleaved partial rotary, LongRoPE tables
    through the Triton kernels: the greedy tokens of the compiled CPU kernels."""
    want, _ = _greedy(family_dir(variant))
    got, kernels = _greedy(family_dir(variant), kernels="triton")
    assert kernels == "triton"
    assert got == want


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["opt-uneven", "chatglm"])
def test_split_checkpoint_serves_the_same_tokens(family_dir, variant, tmp_path):
    src = family_dir(variant)
    want, _ = _greedy(src)
    out = str(tmp_path / "split")
    split_checkpoint(src, out, 2)
    got, _ = _greedy(out, tensor_parallel_size=2)
    assert got == want


@pytest.mark.parametrize("variant, attached", [("phi3-longrope", True), ("glm", False),
                                               ("glm4", False), ("opt", False)])
def test_compiled_decoder_stack_only_where_it_fits(family_dir, layer_kernels, variant,
                                                   attached):
    """Phi-3 is the Llama layout (its LongRoPE is just a cos/sin table): the stack takes it;
    GLM's interleaved rotary, GLM-4's sandwich norms and OPT's layout decline it."""
    if layer_kernels.name != "compiled":
        pytest.skip("no compiled kernels here")
    assert attach_compiled_stack(load_ours(family_dir(variant)), layer_kernels) is attached


@pytest.mark.parametrize("variant", ["opt-post-ln-proj", "phi3-longrope", "glm4", "chatglm"])
@torch.no_grad()
def test_dummy_weights_run(family_dir, layer_kernels, variant):
    """``--load_format dummy`` (benchmarks): every family builds and runs on random weights."""
    from bladellm.attention import get_attn_backend
    from bladellm.checkpoint.hf_config import load_hf_config
    from bladellm.config import ModelConfig
    from bladellm.model.forward_context import ForwardContext
    from bladellm.model.loader import load_model

    model_dir = family_dir(variant)
    model = load_model(ModelConfig(model=model_dir, load_format="dummy"),
                       load_hf_config(model_dir, False), torch.float32, "cpu",
                       get_attn_backend(None, layer_kernels))
    logits = model.compute_logits(model(torch.arange(3, 12), torch.arange(9),
                                        ForwardContext.no_cache()))
    assert logits.shape[0] == 9 and bool(logits.isfinite().all())
