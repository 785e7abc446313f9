"""Tiny random Hugging Face models made in the test: config + weights + a trained tokenizer.

``make_tiny_model(path, arch)`` writes a directory that transformers and bladellm both load:
config.json, model.safetensors, generation_config.json, a byte-level BPE tokenizer trained here
with ``tokenizers`` and a ChatML chat template. Weights use a larger init range than HF's default
so logits are peaked enough for greedy comparisons to be meaningful.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "Large language models generate text one token at a time.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "Continuous batching admits new requests while others are decoding.",
    "def add(a, b):\n    return a + b\n",
    "Once upon a time there was a small engine that served many requests.",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "hello world! how are you today? I am fine, thank you.",
    "JSON: {\"name\": \"blade\", \"fast\": true, \"tokens\": [1, 2, 3]}",
] * 20

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def train_tokenizer(vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
        unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML_TEMPLATE
    return fast


def _hf_config(arch: str, vocab_size: int, **overrides):
    import transformers

    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.2, tie_word_embeddings=False, rms_norm_eps=1e-6,
        bos_token_id=0, eos_token_id=2, pad_token_id=0,
    )
    common.update(overrides)
    cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mixtral": transformers.MixtralConfig,
        "qwen2_moe": transformers.Qwen2MoeConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
    }[arch]
    if isinstance(common.get("mlp_only_layers"), tuple):  # hashable in the fixture's cache key
        common["mlp_only_layers"] = list(common["mlp_only_layers"])
    return cls(**{**MOE_DEFAULTS.get(arch, {}), **common})


# Mixture-of-experts shapes (overridable like the rest): several experts per token, and for
# Qwen2-MoE a shared expert; intermediate sizes differ from the dense one to catch mix-ups.
MOE_DEFAULTS: dict[str, dict] = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48,
                      shared_expert_intermediate_size=80, norm_topk_prob=False),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=40,
                      norm_topk_prob=True),
}


def make_tiny_model(path: str | os.PathLike, arch: str = "llama", seed: int = 0,
                    **config_overrides) -> str:
    """Write a tiny random model of ``arch`` (llama, mistral, qwen2, qwen3, mixtral, qwen2_moe,
    qwen3_moe) to ``path``."""
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    config = _hf_config(arch, len(tokenizer), **config_overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    gen = {"bos_token_id": 0, "eos_token_id": [2], "pad_token_id": 0}
    (path / "generation_config.json").write_text(json.dumps(gen))
    return str(path)
