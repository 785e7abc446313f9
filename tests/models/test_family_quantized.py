"""GPTQ / AWQ checkpoints of OPT (its q/k/v, out_proj, fc1, fc2 quantized as AutoGPTQ /
AutoAWQ write them, by tests/quant_checkpoints.py): logits match transformers running the
fake-quantized weights. The families whose checkpoints fuse tensors (Phi-3, GLM, ChatGLM)
refuse quantized checkpoints with a one-line error."""

from __future__ import annotations

import pytest
import torch

import quant_checkpoints
from bladellm.attention import get_attn_backend
from bladellm.checkpoint.hf_config import load_hf_config
from bladellm.config import ModelConfig
from bladellm.model.loader import load_model
from family_models import family_dirs
from quant_checkpoints import quantize_checkpoint
from test_quantized_parity import _close, _reference
from tiny_paged_kv import PagedKV, Seq

OPT_LINEARS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    return family_dirs(tmp_path_factory)


def _load(model_dir: str, kernels):
    return load_model(ModelConfig(model=model_dir), load_hf_config(model_dir, False),
                      torch.float32, "cpu", get_attn_backend(None, kernels))


@pytest.mark.parametrize("case", [dict(fmt="gptq", bits=4, group_size=32, sym=False),
                                  dict(fmt="awq", group_size=32)], ids=["gptq", "awq"])
@torch.no_grad()
def test_opt_quantized_logits(family_dir, tmp_path, case, layer_kernels, monkeypatch):
    monkeypatch.setattr(quant_checkpoints, "LINEARS", OPT_LINEARS)
    src = family_dir("opt")
    fake = quantize_checkpoint(src, tmp_path, **case)
    assert any(".fc1." in name for name in fake)
    ours = _load(str(tmp_path), layer_kernels)
    ref = _reference(src, fake, w8a8=False)
    ids = torch.randint(3, ref.config.vocab_size, (13,), generator=torch.Generator().manual_seed(0))
    kv = PagedKV(ours.get_kv_cache_spec(), num_blocks=32, block_size=4)
    seq = Seq()
    ctx, pos = kv.step([seq], [len(ids)])
    _close(ours.compute_logits(ours(ids, pos, ctx)), ref(ids[None]).logits[0], False)
    tokens = ids
    for _ in range(4):
        nxt = ref(tokens[None]).logits[0, -1].argmax().view(1)
        tokens = torch.cat([tokens, nxt])
        ctx, pos = kv.step([seq], [1])
        _close(ours.compute_logits(ours(nxt, pos, ctx)), ref(tokens[None]).logits[0, -1:], False)


@pytest.mark.parametrize("variant", ["phi3-longrope", "glm4"])
def test_fused_families_refuse_quantized_checkpoints(family_dir, tmp_path, layer_kernels,
                                                     variant):
    quantize_checkpoint(family_dir(variant), tmp_path, fmt="gptq", bits=4, group_size=32)
    with pytest.raises(ValueError, match="quantized .* checkpoints .* not supported yet"):
        _load(str(tmp_path), layer_kernels)
