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


def test_layer_types_read_as_transformers_reads_them():
    """Configs without ``layer_types`` (older transformers) get the same per-layer windows
    transformers computes; a window no shorter than the context is full attention."""
    from types import SimpleNamespace

    import transformers

    from bladellm.checkpoint.attention_layout import kv_free_window, layer_sliding_window, \
        layer_types

    for cfg in (transformers.Qwen2Config(use_sliding_window=True, sliding_window=8,
                                         max_window_layers=2, num_hidden_layers=5),
                transformers.Qwen2Config(use_sliding_window=False, sliding_window=8,
                                         num_hidden_layers=3),
                transformers.Gemma2Config(num_hidden_layers=4),
                transformers.Gemma3TextConfig(num_hidden_layers=7)):
        old = SimpleNamespace(**{k: v for k, v in cfg.to_dict().items() if k != "layer_types"})
        old.num_hidden_layers = cfg.num_hidden_layers
        if isinstance(cfg, transformers.Qwen2Config):
            old.sliding_window = 8  # the raw config.json value (transformers clears it)
        else:
            old.sliding_window_pattern = 2 if isinstance(cfg, transformers.Gemma2Config) else 6
        assert layer_types(old) == list(cfg.layer_types), type(cfg).__name__
    mistral = transformers.MistralConfig(sliding_window=8, num_hidden_layers=2,
                                         max_position_embeddings=64)
    assert [layer_sliding_window(mistral, i) for i in range(2)] == [8, 8]
    assert kv_free_window(mistral) == 8
    mistral.sliding_window = 64  # as long as the context: plain attention, nothing freed
    assert layer_sliding_window(mistral, 0) is None and kv_free_window(mistral) is None
    assert kv_free_window(transformers.Gemma2Config(num_hidden_layers=2)) is None
