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
