"""HF ``architectures`` name -> model class, imported lazily."""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("bladellm.model.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("bladellm.model.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("bladellm.model.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("bladellm.model.models.qwen3", "Qwen3ForCausalLM"),
    "OPTForCausalLM": ("bladellm.model.models.opt", "OPTForCausalLM"),
    "Phi3ForCausalLM": ("bladellm.model.models.phi3", "Phi3ForCausalLM"),
    "GlmForCausalLM": ("bladellm.model.models.glm", "GlmForCausalLM"),
    "Glm4ForCausalLM": ("bladellm.model.models.glm", "Glm4ForCausalLM"),
    "ChatGLMModel": ("bladellm.model.models.chatglm", "ChatGLMForCausalLM"),
    "ChatGLMForConditionalGeneration": ("bladellm.model.models.chatglm", "ChatGLMForCausalLM"),
    "Gemma2ForCausalLM": ("bladellm.model.models.gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("bladellm.model.models.gemma3", "Gemma3ForCausalLM"),
    "BloomForCausalLM": ("bladellm.model.models.bloom", "BloomForCausalLM"),
    "MixtralForCausalLM": ("bladellm.model.models.mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("bladellm.model.models.qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("bladellm.model.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "LlavaForConditionalGeneration": ("bladellm.model.models.llava",
                                      "LlavaForConditionalGeneration"),
    "Qwen2VLForConditionalGeneration": ("bladellm.model.models.qwen2_vl",
                                        "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("bladellm.model.models.qwen2_vl",
                                           "Qwen2_5_VLForConditionalGeneration"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(hf_config: Any) -> type[nn.Module]:
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in _MODELS:
            module, cls = _MODELS[arch]
            return getattr(importlib.import_module(module), cls)
    raise ValueError(f"model architecture {archs or '(none in config.json)'} is not supported; "
                     f"supported architectures: {', '.join(supported_architectures())}")
