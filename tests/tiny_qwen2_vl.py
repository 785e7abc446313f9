"""Tiny random Qwen2-VL and Qwen2.5-VL made in the test: a small vision tower (patch 4, merge 2,
so one image token per 8x8 pixels), a 2-layer Qwen2 language model with M-RoPE sections
[2, 3, 3] of its 8 rotary frequencies, a trained tokenizer with the vision tokens and a
``Qwen2VLImageProcessor`` that resizes images to between 8x8 and 64x64 pixels of 8x8 blocks
(``make_tiny_qwen2_vl``). The 2.5 tower has 4 blocks, two of them windowed (a window is 2x2
merged tokens, so images above 16x16 pixels span several windows)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from tiny_models import train_tokenizer

PATCH_SIZE = 4
MERGE_SIZE = 2
MIN_PIXELS = 8 * 8
MAX_PIXELS = 64 * 64
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"  # one image's placeholder in a prompt


def tiny_qwen2_vl_tokenizer():
    tok = train_tokenizer()
    tok.add_tokens(VISION_TOKENS, special_tokens=True)
    return tok


def _configs(arch: str, tokenizer):
    import transformers

    ids = {name: tokenizer.convert_tokens_to_ids(t) for name, t in (
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"))}
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=2,
                pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                 "mrope_section": [2, 3, 3]})
    common = dict(patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE, temporal_patch_size=2,
                  in_channels=3, num_heads=4)
    if arch == "Qwen2VLForConditionalGeneration":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, hidden_act="quick_gelu",
                      **common)
        cls = transformers.Qwen2VLConfig
    else:
        vision = dict(depth=4, hidden_size=32, out_hidden_size=64, intermediate_size=48,
                      hidden_act="silu", window_size=16, fullatt_block_indexes=[1, 3],
                      **common)
        cls = transformers.Qwen2_5_VLConfig
    return cls(text_config=text, vision_config=vision, tie_word_embeddings=False,
               architectures=[arch], **ids)


def make_tiny_qwen2_vl(path: str | os.PathLike, arch: str = "Qwen2VLForConditionalGeneration",
                       seed: int = 0) -> str:
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_qwen2_vl_tokenizer()
    config = _configs(arch, tokenizer)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).to(torch.float32).eval()
    with torch.no_grad():  # a larger init than HF's default: peaked logits for greedy checks
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    image_processor().save_pretrained(path)
    gen = {"bos_token_id": 0, "eos_token_id": [2], "pad_token_id": 0}
    (path / "generation_config.json").write_text(json.dumps(gen))
    return str(path)


def image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)

    return Qwen2VLImageProcessorPil(
        patch_size=PATCH_SIZE, merge_size=MERGE_SIZE, temporal_patch_size=2,
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})
