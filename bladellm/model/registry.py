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
    "LlavaForConditionalGeneration": ("bladellm.model.models.llava",
                                      "LlavaForConditionalGeneration"),
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
