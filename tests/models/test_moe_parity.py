"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers in fp32:
logits through a paged KV cache with dense and sparse layers mixed as the config says,
checkpoints in transformers 5's stacked-expert layout, a missing expert reported, and the
compiled decoder stack declining MoE layers. Greedy tokens under the stress configuration and
with parallelism: tests/e2e/test_moe_serving.py."""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import save_file

from bladellm.model.decoder_stack import attach_compiled_stack
from bladellm.model.layers.fused_moe import FusedMoE, SparseMoeBlock
from bladellm.kernels import resolve_kernels
from test_parity import check_prefill_then_decode, load_both

VARIANTS = {
    "mixtral": ("mixtral", {}),
    "qwen2_moe": ("qwen2_moe", {}),
    # Dense layers between sparse ones, a dense-only layer, renormalised top-k, no qkv bias.
    "qwen2_moe-sparse_step2-mlp_only": ("qwen2_moe", dict(
        num_hidden_layers=3, decoder_sparse_step=2, mlp_only_layers=(2,), norm_topk_prob=True,
        qkv_bias=False)),
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe-no-renorm-tied": ("qwen3_moe", dict(norm_topk_prob=False,
                                                   tie_word_embeddings=True)),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(tiny_model_factory, variant):
    arch, overrides = VARIANTS[variant]
    ours, ref = load_both(tiny_model_factory(arch, **overrides))
    check_prefill_then_decode(ours, ref)


def test_layer_kinds_follow_the_config(tiny_model_factory):
    ours, _ = load_both(tiny_model_factory("qwen2_moe", **VARIANTS[
        "qwen2_moe-sparse_step2-mlp_only"][1]))
    kinds = [type(layer.mlp).__name__ for layer in ours.model.layers]
    assert kinds == ["LlamaMLP", "SparseMoeBlock", "LlamaMLP"]
    block = ours.model.layers[1].mlp
    assert isinstance(block, SparseMoeBlock) and block.shared_expert is not None
    assert tuple(block.experts.gate_up_proj.shape) == (6, 2 * 48, 64)
    assert tuple(block.experts.down_proj.shape) == (6, 64, 48)


def test_stacked_expert_checkpoint_loads(tiny_model_factory, tmp_path):
    """transformers 5 keeps experts stacked ([E, 2I, H] / [E, H, I]): a checkpoint written
    from its state dict loads as well as the per-expert one."""
    src = tiny_model_factory("qwen3_moe")
    ref = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        (tmp_path / name).write_text((__import__("pathlib").Path(src) / name).read_text())
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ours, ref = load_both(str(tmp_path))
    check_prefill_then_decode(ours, ref)


def test_missing_expert_is_reported(tiny_model_factory, tmp_path):
    src = tiny_model_factory("mixtral")
    from safetensors.torch import load_file

    state = load_file(f"{src}/model.safetensors")
    del state["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((__import__("pathlib").Path(src) / name).read_text())
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.gate_up_proj"):
        load_both(str(tmp_path))


def test_compiled_decoder_stack_declines_moe(tiny_model_factory):
    from bladellm.model.decoder_stack import CompiledDecoderStack

    ours, _ = load_both(tiny_model_factory("qwen3_moe"))
    kernels = resolve_kernels("auto", "cpu")
    if kernels.name == "compiled":
        assert "mixture-of-experts" in CompiledDecoderStack._unsupported(ours.model, kernels)
    assert not attach_compiled_stack(ours, kernels)
    assert ours.model.compiled_stack is None
    assert any(isinstance(m, FusedMoE) for m in ours.modules())


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_rank_shapes_under_tensor_and_expert_parallelism(tiny_model_factory, expert_parallel):
    """TP 3: each rank holds every expert, cut to its share of the intermediate size (40 =
    14 + 13 + 13); EP 3: whole experts, an uneven share of them (8 = 3 + 3 + 2)."""
    from bladellm.attention import get_attn_backend
    from bladellm.checkpoint.hf_config import load_hf_config
    from bladellm.distributed.parallel_state import tp_shape_for_split
    from bladellm.kernels import Kernels
    from bladellm.kernels.scope import building_with
    from bladellm.model.registry import get_model_class

    cfg = load_hf_config(tiny_model_factory("qwen3_moe"), trust_remote_code=False)
    shapes = []
    for rank in range(3):
        with tp_shape_for_split(rank, 3, expert_parallel=expert_parallel), \
                building_with(Kernels()):
            model = get_model_class(cfg)(cfg, torch.float32, get_attn_backend("torch", Kernels()))
        experts = model.model.layers[0].mlp.experts
        shapes.append((tuple(experts.gate_up_proj.shape), tuple(experts.down_proj.shape),
                       experts.expert_start))
    if expert_parallel:
        assert shapes == [((3, 80, 64), (3, 64, 40), 0), ((3, 80, 64), (3, 64, 40), 3),
                          ((2, 80, 64), (2, 64, 40), 6)]
    else:
        assert shapes == [((8, 28, 64), (8, 64, 14), 0), ((8, 26, 64), (8, 64, 13), 0),
                          ((8, 26, 64), (8, 64, 13), 0)]
