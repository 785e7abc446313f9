"""Gemma 2, Gemma 3 (text) and Bloom against transformers in fp32: logits through the paged
cache (prefill past the window, then decodes), with chunked prefill and a cached prefix in one
batch, and without a cache (the profiling run)."""

from __future__ import annotations

import pytest
import torch

import transformers

from bladellm.model.forward_context import ForwardContext
from test_parity import ATOL, check_prefill_then_decode, prompt
from test_parity import load_both as load_ours
from tiny_paged_kv import PagedKV, Seq
from window_family_models import make_window_family_model

VARIANTS = {
    "gemma2": ("gemma2", {}),
    "gemma2-mqa-nocap": ("gemma2", dict(num_key_value_heads=1, attn_logit_softcapping=None,
                                        final_logit_softcapping=None)),
    "gemma3": ("gemma3", {}),
    "bloom": ("bloom", {}),
    "bloom-h6-post-ln": ("bloom", dict(n_head=6, hidden_size=96,
                                       apply_residual_connection_post_layernorm=True)),
}


def load_both(model_dir: str):
    """Ours, and transformers' eager attention: its SDPA path skips Gemma 2's logit
    soft-capping (eager is what transformers documents for Gemma 2)."""
    ours, _ = load_ours(model_dir)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    return ours, ref


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cache: dict = {}

    def get(variant: str) -> str:
        if variant not in cache:
            family, overrides = VARIANTS[variant]
            cache[variant] = make_window_family_model(tmp_path_factory.mktemp(variant), family,
                                                      **overrides)
        return cache[variant]

    return get


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_then_decode(model_dir, variant):
    ours, ref = load_both(model_dir(variant))
    check_prefill_then_decode(ours, ref, block_size=4, prompt_len=21)


@pytest.mark.parametrize("variant", ["gemma2", "gemma3", "bloom"])
@torch.no_grad()
def test_chunked_prefill_after_cached_prefix_and_no_cache(model_dir, variant):
    ours, ref = load_both(model_dir(variant))
    ids = prompt(ref.config.vocab_size, 23, seed=4)
    want = ref(ids[None]).logits[0]
    kv = PagedKV(ours.get_kv_cache_spec(), num_blocks=32, block_size=4)
    seq = Seq()
    for lo, hi in ((0, 9), (9, 20), (20, 23)):
        ctx, pos = kv.step([seq], [hi - lo])
        got = ours.compute_logits(ours(ids[lo:hi], pos, ctx))
        torch.testing.assert_close(got, want[lo:hi], atol=ATOL, rtol=0)
    got = ours.compute_logits(ours(ids, torch.arange(23), ForwardContext.no_cache()))
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def _rewrite(src: str, dst, edit_config=None, edit_tensors=None) -> str:
    import json
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    dst = Path(dst)
    shutil.copytree(src, dst)
    if edit_config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if edit_tensors is not None:
        state = load_file(str(dst / "model.safetensors"))
        edit_tensors(state)
        save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def _drop_qkv_rows(state):
    state["transformer.h.0.self_attention.query_key_value.weight"] = \
        state["transformer.h.0.self_attention.query_key_value.weight"][:-16].contiguous()


def _drop_tensor(state):
    del state["model.layers.1.post_feedforward_layernorm.weight"]


BAD = {
    "bloom-qkv-rows": ("bloom", None, _drop_qkv_rows, "query_key_value"),
    "gemma2-activation": ("gemma2", lambda c: c.update(hidden_activation="swishy"), None,
                          "swishy"),
    "gemma3-layer-type": ("gemma3", lambda c: c.update(layer_types=["chunked_attention"] * 3),
                          None, "layer_types"),
    "gemma2-missing": ("gemma2", None, _drop_tensor, "post_feedforward_layernorm"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoint_is_one_line_error(model_dir, tmp_path, case):
    variant, edit_config, edit_tensors, needle = BAD[case]
    path = _rewrite(model_dir(variant), tmp_path / case, edit_config, edit_tensors)
    with pytest.raises(ValueError) as err:
        load_ours(path)
    assert needle in str(err.value) and "\n" not in str(err.value)
