"""OPT, Phi-3, GLM, GLM-4 and ChatGLM2/3 against transformers in float32: logits through a real
paged KV cache (prefill, then greedy decode steps), as tests/models/test_parity.py does for
Llama. ChatGLM's oracle is transformers' GlmForCausalLM on the same weights."""

from __future__ import annotations

import pytest
import torch
import transformers

from bladellm.attention import get_attn_backend
from bladellm.checkpoint.hf_config import load_hf_config
from bladellm.config import ModelConfig
from bladellm.kernels import resolve_kernels
from bladellm.kernels.scope import building_with
from bladellm.model.loader import load_model
from family_models import make_family_model, write_chatglm
from test_parity import check_prefill_then_decode

VARIANTS = {
    "opt": ("opt", {}),
    # OPT-350m's shape: norms after each block, project_in / project_out, no final norm.
    "opt-post-ln-proj": ("opt", {"do_layer_norm_before": False, "word_embed_proj_dim": 32}),
    "opt-no-bias-untied-gelu": ("opt", {"enable_bias": False, "tie_word_embeddings": False,
                                        "activation_function": "gelu"}),
    "phi3-longrope": ("phi3", {}),
    "phi3-partial-rotary": ("phi3", {"partial_rotary_factor": 0.75}),
    "glm": ("glm", {}),
    "glm4": ("glm4", {}),
}


def load_ours(model_dir: str, dtype: torch.dtype = torch.float32):
    cfg = load_hf_config(model_dir, trust_remote_code=False)
    kernels = resolve_kernels("auto", "cpu")
    with building_with(kernels):
        return load_model(ModelConfig(model=model_dir), cfg, dtype, "cpu",
                          get_attn_backend(None, kernels))


def load_ref(model_dir: str):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir,
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    cache: dict = {}

    def get(variant: str) -> str:
        if variant not in cache:
            if variant == "chatglm":
                glm = get("glm-rope-ratio")
                cache[variant] = write_chatglm(glm, tmp_path_factory.mktemp("chatglm"))
            elif variant == "glm-rope-ratio":
                cache[variant] = make_family_model(tmp_path_factory.mktemp("glm"), "glm",
                                                   rope_theta=50000.0)
            else:
                family, overrides = VARIANTS[variant]
                cache[variant] = make_family_model(tmp_path_factory.mktemp(family), family,
                                                   **overrides)
        return cache[variant]

    return get


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_family_parity(family_dir, variant):
    model_dir = family_dir(variant)
    check_prefill_then_decode(load_ours(model_dir), load_ref(model_dir))


def test_chatglm_checkpoint_parity(family_dir):
    """A ChatGLM2/3 directory (auto_map to custom code, model_type chatglm) loads without
    --trust_remote_code and matches GlmForCausalLM on the same weights."""
    ours = load_ours(family_dir("chatglm"))
    assert type(ours).__name__ == "ChatGLMForCausalLM"
    check_prefill_then_decode(ours, load_ref(family_dir("glm-rope-ratio")))
