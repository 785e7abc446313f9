"""Qwen2-VL and Qwen2.5-VL: a dynamic-resolution vision tower and a Qwen2 language model with
M-RoPE positions. One implementation; the two differ only in the tower.

Vision tower (``qwen2_vl_vision.py``): 3D-conv patch embedding, 2D rotary, the 2x2 patch
merger; Qwen2.5-VL's with RMSNorm + SwiGLU blocks and window attention outside
``fullatt_block_indexes``. As for LLaVA it runs once per image in the worker (the encoder
cache keeps its rows across prefill chunks and requests), replicated on each tensor-parallel
rank, with the image's ``image_grid_thw``.

Language model: ``Qwen2ForCausalLM``'s layers (TP-sharded as usual) whose rotary embedding is
``MRotaryEmbedding``: positions are [3, T] (``worker/mrope_positions.py`` builds them per step
from the table ``mrope_positions`` gives per request). Weight names are read in both layouts
transformers uses: ``visual.*`` / ``model.*`` / ``lm_head.*`` (the checkpoints on the hub) and
``model.visual.*`` / ``model.language_model.*`` / ``lm_head.*``.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import torch
from torch import nn

from bladellm.attention.backend import AttentionBackend
from bladellm.distributed.parallel_state import get_pp_group
from bladellm.model.forward_context import ForwardContext
from bladellm.model.layers.mrope import get_mrope
from bladellm.model.models.qwen2 import Qwen2ForCausalLM
from bladellm.model.models.qwen2_vl_vision import Qwen25VisionTower, Qwen2VisionTower
from bladellm.model.utils import KVCacheSpec
from bladellm.multimodal.inputs import MultiModalItem
from bladellm.multimodal.mrope import mrope_positions


class Qwen2VLTextForCausalLM(Qwen2ForCausalLM):
    """Qwen2 with M-RoPE: every layer shares one ``MRotaryEmbedding`` (positions [3, T])."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, attn_backend: AttentionBackend,
                 quant_config: Any = None, prefix: str = "") -> None:
        super().__init__(hf_config, dtype, attn_backend, quant_config, prefix)
        self.rotary_emb = get_mrope(hf_config, self.head_dim, dtype)
        for layer in self.model.layers[self.model.start_layer:self.model.end_layer]:
            layer.self_attn.rotary_emb = self.rotary_emb

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | None:
        """A step without image tokens has three equal rows: its row 0 is the plain rotary
        position of every token (the same rotation), which lets such steps (every decode step)
        skip the per-section gather and run in the compiled decoder stack, which reads [T]."""
        if positions.dim() == 2 and bool(torch.equal(positions[1:], positions[:1].expand(2, -1))):
            positions = positions[0]
        return self.model(input_ids, positions, ctx, inputs_embeds)


class Qwen2VLForConditionalGeneration(nn.Module):
    packed_modules_mapping: dict[str, list[str]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    vision_tower_cls: type[nn.Module] = Qwen2VisionTower

    def __init__(self, hf_config: Any, dtype: torch.dtype, attn_backend: AttentionBackend,
                 quant_config: Any = None, prefix: str = "") -> None:
        super().__init__()
        if get_pp_group().world_size > 1:
            raise ValueError("--pipeline_parallel_size: vision-language models run on one "
                             "pipeline stage only (the image features enter at the first)")
        if quant_config is not None:
            raise ValueError(f"quantized {type(self).__name__} checkpoints are not supported "
                             f"yet")
        self.hf_config, self.dtype = hf_config, dtype
        self.language_model = Qwen2VLTextForCausalLM(hf_config.text_config, dtype, attn_backend)
        self.visual = self.vision_tower_cls(hf_config.vision_config).to(dtype).eval()
        self.spatial_merge_size = int(hf_config.vision_config.spatial_merge_size)
        self.tie_word_embeddings = self.language_model.tie_word_embeddings

    # ---- the language model's interface ---------------------------------------------------------
    def get_kv_cache_spec(self) -> KVCacheSpec:
        return self.language_model.get_kv_cache_spec()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | None:
        """``positions``: [3, T] M-RoPE positions (or [T] for a text-only dummy forward)."""
        return self.language_model(input_ids, positions, ctx, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def mrope_positions(self, num_prompt_tokens: int, items: list[MultiModalItem]
                        ) -> tuple[np.ndarray, int]:
        """The prompt's positions [3, P] and the delta of the positions after it."""
        return mrope_positions(num_prompt_tokens, items, self.spatial_merge_size)

    # ---- images ---------------------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.model.embed_tokens(input_ids)

    def encode_image(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's processor outputs (``pixel_values`` [patches, C * tps * ps * ps],
        ``image_grid_thw`` [1, 3]) -> its rows of input embeddings [t * h * w / merge^2,
        hidden]."""
        t, h, w = (int(x) for x in tensors["image_grid_thw"].reshape(-1)[:3])
        return self.visual(tensors["pixel_values"].to(self.dtype), (t, h, w))

    # ---- weights --------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        own = dict(self.visual.named_parameters())
        loaded: set[str] = set()

        def language(items):
            for name, tensor in items:
                if name.startswith("model.visual."):
                    name = name[len("model."):]
                if name.startswith("visual."):
                    self._load_visual(name[len("visual."):], tensor, own)
                    loaded.add(name)
                elif name.startswith("model.language_model."):
                    yield "model." + name[len("model.language_model."):], tensor
                else:  # model.* (the hub's layout) and lm_head.*
                    yield name, tensor

        loaded |= {f"language_model.{n}" for n in self.language_model.load_weights(
            language(weights))}
        return loaded

    def _load_visual(self, name: str, tensor: torch.Tensor,
                     own: dict[str, nn.Parameter]) -> None:
        param = own.get(name)
        if param is None:
            raise ValueError(f"checkpoint tensor visual.{name} matches no parameter of the "
                             f"vision tower")
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"visual.{name}: shape mismatch: checkpoint tensor has shape "
                             f"{tuple(tensor.shape)}, parameter expects {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor)


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: the same language model and positions; the windowed RMSNorm/SwiGLU tower."""

    vision_tower_cls = Qwen25VisionTower


__all__ = ["Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"]
