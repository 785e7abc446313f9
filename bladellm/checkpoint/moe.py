"""Which layers of a mixture-of-experts config route tokens to experts (torch-free: the API
process checks LoRA adapters with it, the engine checks parallel degrees, the models build
their layers by it)."""

from __future__ import annotations

from typing import Any


def num_experts(hf_config: Any) -> int:
    """Routed experts per sparse layer (0: a dense model)."""
    return int(getattr(hf_config, "num_local_experts", None)  # Mixtral
               or getattr(hf_config, "num_experts", None) or 0)  # Qwen2-MoE, Qwen3-MoE


def is_sparse_layer(hf_config: Any, layer: int) -> bool:
    """transformers' rule: every layer of Mixtral; for Qwen2-MoE and Qwen3-MoE every
    ``decoder_sparse_step``-th layer that is not in ``mlp_only_layers``."""
    if num_experts(hf_config) == 0:
        return False
    return (layer not in (getattr(hf_config, "mlp_only_layers", None) or [])
            and (layer + 1) % (getattr(hf_config, "decoder_sparse_step", None) or 1) == 0)


def sparse_layers(hf_config: Any) -> frozenset[int]:
    return frozenset(i for i in range(hf_config.num_hidden_layers)
                     if is_sparse_layer(hf_config, i))


__all__ = ["is_sparse_layer", "num_experts", "sparse_layers"]
