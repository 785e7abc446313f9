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
from family_models import VARIANTS, family_dirs
from test_parity import check_prefill_then_decode


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
    return family_dirs(tmp_path_factory)


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


@pytest.mark.parametrize("variant", ["opt", "glm4", "phi3-longrope"])
@torch.no_grad()
def test_bfloat16_close_to_transformers(family_dir, variant):
    """bf16 (LayerNorm, interleaved rotary, LongRoPE tables in bf16): close to transformers in
    bf16, each side's greedy token within the other's top 3 (near-ties may flip)."""
    from test_parity import prompt
    from tiny_paged_kv import PagedKV, Seq

    model_dir = family_dir(variant)
    ours = load_ours(model_dir, torch.bfloat16)
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    ids = prompt(ref.config.vocab_size, 13)
    kv = PagedKV(ours.get_kv_cache_spec(), num_blocks=16, block_size=4, dtype=torch.bfloat16)
    ctx, pos = kv.step([Seq()], [13])
    logits = ours.compute_logits(ours(ids, pos, ctx))
    want = ref.eval()(ids[None]).logits[0].float()
    assert (logits - want).abs().max() < 0.1 * want.abs().max()
    ours_top, want_top = logits.topk(3).indices, want.topk(3).indices
    assert (ours_top == want_top[:, :1]).any(-1).all()
    assert (want_top == ours_top[:, :1]).any(-1).all()
