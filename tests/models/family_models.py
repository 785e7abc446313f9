"""Tiny random models of the OPT, Phi-3, GLM, GLM-4 and ChatGLM families, made with
transformers (as tests/tiny_models.py makes Llama's), with every norm weight and bias random
too, so norms and biases are really exercised.

A ChatGLM directory is a GLM model written in the ``ChatGLMModel`` layout and config
(``write_chatglm``): transformers' GlmForCausalLM on the GLM directory is its oracle.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tiny_models import train_tokenizer

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=512, bos_token_id=0, eos_token_id=2, pad_token_id=0,
              tie_word_embeddings=False)


def family_config(family: str, vocab_size: int, **overrides):
    import transformers

    g = torch.Generator().manual_seed(1)
    if family == "opt":
        cfg = dict(COMMON, ffn_dim=128, word_embed_proj_dim=64, init_std=0.2,
                   activation_function="relu", do_layer_norm_before=True,
                   tie_word_embeddings=True)
        cls = transformers.OPTConfig
    elif family == "phi3":
        partial = overrides.get("partial_rotary_factor", 1.0)
        half = int(16 * partial) // 2
        cfg = dict(COMMON, intermediate_size=128, num_key_value_heads=2, initializer_range=0.2,
                   rms_norm_eps=1e-6, sliding_window=None, original_max_position_embeddings=256,
                   rope_scaling={"type": "longrope",
                                 "short_factor": (1 + torch.rand(half, generator=g)).tolist(),
                                 "long_factor": (2 + torch.rand(half, generator=g)).tolist()})
        cls = transformers.Phi3Config
    elif family in ("glm", "glm4"):
        cfg = dict(COMMON, intermediate_size=128, num_key_value_heads=2, head_dim=16,
                   initializer_range=0.2, rms_norm_eps=1e-6, attention_bias=True,
                   partial_rotary_factor=0.5)
        cls = transformers.GlmConfig if family == "glm" else transformers.Glm4Config
    else:
        raise ValueError(family)
    cfg.update(vocab_size=vocab_size, **overrides)
    return cls(**cfg)


@torch.no_grad()
def make_family_model(path: str | Path, family: str, seed: int = 0, **overrides) -> str:
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    config = family_config(family, len(tokenizer), **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed + 1)
    for name, param in model.named_parameters():
        if "norm" in name and name.endswith("weight"):
            # Gemma-style offsets are small; plain norms scale around 1.
            param.copy_(1 + 0.2 * torch.randn(param.shape, generator=g))
        elif name.endswith("bias"):
            param.copy_(0.2 * torch.randn(param.shape, generator=g))
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    gen = {"bos_token_id": 0, "eos_token_id": [2], "pad_token_id": 0}
    (path / "generation_config.json").write_text(json.dumps(gen))
    return str(path)


# transformers GLM name -> ChatGLM name (the inverse of what the engine maps).
def _chatglm_name(name: str) -> str:
    name = name.replace("model.embed_tokens.", "transformer.embedding.word_embeddings.")
    name = name.replace("model.norm.", "transformer.encoder.final_layernorm.")
    name = name.replace("lm_head.", "transformer.output_layer.")
    name = name.replace("model.layers.", "transformer.encoder.layers.")
    name = name.replace(".self_attn.o_proj.", ".self_attention.dense.")
    name = name.replace(".mlp.gate_up_proj.", ".mlp.dense_h_to_4h.")
    return name.replace(".mlp.down_proj.", ".mlp.dense_4h_to_h.")


def write_chatglm(glm_dir: str, path: str | Path) -> str:
    """The GLM model of ``glm_dir`` as a ChatGLM2/3 checkpoint: fused ``query_key_value``
    (q | k | v rows, weight and bias), ChatGLM names, and its config.json (with the
    ``auto_map`` its custom code would need, which must not be run)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    glm = json.loads((Path(glm_dir) / "config.json").read_text())
    state = load_file(str(Path(glm_dir) / "model.safetensors"))
    out = {}
    for name, tensor in state.items():
        if ".self_attn.q_proj." in name:
            parts = [state[name.replace(".q_proj.", f".{p}.")] for p in ("q_proj", "k_proj",
                                                                         "v_proj")]
            fused = name.replace(".self_attn.q_proj.", ".self_attention.query_key_value.")
            out[_chatglm_name(fused)] = torch.cat(parts).contiguous()
        elif ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            continue
        else:
            out[_chatglm_name(name)] = tensor.contiguous()
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    rope = glm.get("rope_parameters") or {}
    config = {
        "architectures": ["ChatGLMModel"], "model_type": "chatglm",
        "auto_map": {"AutoConfig": "configuration_chatglm.ChatGLMConfig",
                     "AutoModel": "modeling_chatglm.ChatGLMForConditionalGeneration"},
        "num_layers": glm["num_hidden_layers"], "padded_vocab_size": glm["vocab_size"],
        "hidden_size": glm["hidden_size"], "ffn_hidden_size": glm["intermediate_size"],
        "kv_channels": glm["head_dim"], "num_attention_heads": glm["num_attention_heads"],
        "multi_query_attention": True, "multi_query_group_num": glm["num_key_value_heads"],
        "layernorm_epsilon": glm["rms_norm_eps"], "seq_length": glm["max_position_embeddings"],
        "add_qkv_bias": True, "add_bias_linear": False, "rmsnorm": True,
        "post_layer_norm": True, "apply_residual_connection_post_layernorm": False,
        "original_rope": True, "rope_ratio": rope.get("rope_theta", 10000.0) / 10000.0,
        "torch_dtype": "float32", "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0,
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "generation_config.json"):
        src = Path(glm_dir) / name
        if src.exists():
            (path / name).write_bytes(src.read_bytes())
    return str(path)


# Tiny model variants the tests build: (family, config overrides).
VARIANTS = {
    "opt": ("opt", {}),
    # OPT-350m's shape: norms after each block, project_in / project_out, no final norm.
    "opt-post-ln-proj": ("opt", {"do_layer_norm_before": False, "word_embed_proj_dim": 32}),
    "opt-no-bias-untied-gelu": ("opt", {"enable_bias": False, "tie_word_embeddings": False,
                                        "activation_function": "gelu"}),
    "phi3-longrope": ("phi3", {}),
    "phi3-partial-rotary": ("phi3", {"partial_rotary_factor": 0.75}),
    "glm": ("glm", {}),
    "glm4": ("glm4", {}),
    # Shapes no tensor-parallel degree of 3 divides: 12 heads (4 KV groups over 3 ranks),
    # intermediate 100, vocab.
    "opt-uneven": ("opt", {"num_attention_heads": 12, "hidden_size": 96,
                           "word_embed_proj_dim": 96, "ffn_dim": 100}),
    "glm4-uneven": ("glm4", {"num_attention_heads": 12, "num_key_value_heads": 4,
                             "hidden_size": 96, "intermediate_size": 100}),
}


def family_dirs(tmp_path_factory):
    """variant -> model directory, each built once (a test module's fixture wraps this).
    ``chatglm`` is ``glm-rope-ratio`` (a GLM with rope_theta 50000) in the ChatGLM layout."""
    cache: dict = {}

    def get(variant: str) -> str:
        if variant not in cache:
            if variant == "chatglm":
                cache[variant] = write_chatglm(get("glm-rope-ratio"),
                                               tmp_path_factory.mktemp("chatglm"))
            elif variant == "glm-rope-ratio":
                cache[variant] = make_family_model(tmp_path_factory.mktemp("glm"), "glm",
                                                   rope_theta=50000.0)
            else:
                family, overrides = VARIANTS[variant]
                cache[variant] = make_family_model(tmp_path_factory.mktemp(family), family,
                                                   **overrides)
        return cache[variant]

    return get
