"""A tiny random LLaVA made in the test: CLIP vision tower + projector + Llama, a trained
tokenizer with an ``<image>`` token, and a small CLIP image processor (``make_tiny_llava``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from tiny_models import train_tokenizer

IMAGE_SIZE = 32
PATCH_SIZE = 8  # 16 patches: 16 image tokens per image (17 with strategy "full")


def tiny_llava_tokenizer():
    tok = train_tokenizer()
    tok.add_tokens(["<image>"], special_tokens=True)
    return tok


def make_tiny_llava(path: str | os.PathLike, seed: int = 0,
                    vision_feature_select_strategy: str = "default",
                    vision_feature_layer: int | list[int] = -2) -> str:
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_llava_tokenizer()
    image_token_index = tokenizer.convert_tokens_to_ids("<image>")
    vision = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=32, initializer_range=0.2)
    text = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.2, tie_word_embeddings=False, rms_norm_eps=1e-6,
        bos_token_id=0, eos_token_id=2, pad_token_id=0)
    config = transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=image_token_index,
        vision_feature_select_strategy=vision_feature_select_strategy,
        vision_feature_layer=vision_feature_layer, projector_hidden_act="gelu",
        image_seq_length=(IMAGE_SIZE // PATCH_SIZE) ** 2)
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).to(torch.float32).eval()
    with torch.no_grad():  # a larger init than HF's default: peaked logits for greedy checks
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    transformers.CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(path)
    gen = {"bos_token_id": 0, "eos_token_id": [2], "pad_token_id": 0}
    (path / "generation_config.json").write_text(json.dumps(gen))
    return str(path)
