"""Mistral and Qwen2 with a real ``sliding_window`` (prompts longer than the window) against
transformers in fp32: logits through the paged cache (the engine under stress:
tests/e2e/test_sliding_window.py)."""

from __future__ import annotations

import pytest

from test_parity import check_prefill_then_decode, load_both

WINDOWED = {
    # every layer slides
    "mistral-w8": ("mistral", dict(sliding_window=8)),
    # Qwen2: layers from max_window_layers on slide (layer 0 global, layer 1 local)
    "qwen2-w8-mixed": ("qwen2", dict(use_sliding_window=True, sliding_window=8,
                                     max_window_layers=1)),
    "qwen2-w8-all": ("qwen2", dict(use_sliding_window=True, sliding_window=8,
                                   max_window_layers=0)),
}


@pytest.mark.parametrize("variant", list(WINDOWED))
def test_logits_match_transformers_past_the_window(tiny_model_factory, variant):
    arch, overrides = WINDOWED[variant]
    ours, ref = load_both(tiny_model_factory(arch, **overrides))
    check_prefill_then_decode(ours, ref, block_size=4, prompt_len=21)
