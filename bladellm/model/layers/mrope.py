"""Multimodal rotary embedding (M-RoPE, Qwen2-VL / Qwen2.5-VL): positions are [3, T]
(temporal, height, width; ``multimodal/mrope.py``), and ``mrope_section`` splits the rotary
frequencies into three runs, the first rotated by the temporal row, the next by the height
row, the last by the width row (transformers' ``apply_multimodal_rotary_pos_emb``).

The cos/sin tables are the plain rotary ones; each token's row of them is gathered per section
and handed to the ordinary rotary kernel as a [T, rotary_dim / 2] table read at positions
``0..T-1``, so every kernel set (reference, compiled CPU, Triton) applies it unchanged. A text
token has equal rows, which gives exactly the plain rotary embedding; 1-D positions [T] (the
runner's dummy and profiling forwards) mean that.
"""

from __future__ import annotations

from typing import Any

import torch

from bladellm.model.layers.rotary import RotaryEmbedding, rope_parameters_from_config


def mrope_parameters(hf_config: Any) -> tuple[dict[str, Any], list[int]]:
    """(the rotary parameters without M-RoPE's keys, ``mrope_section``). Old configs spell
    the type ``mrope`` in ``rope_scaling``; the frequencies are the default ones."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None)
    if not params and isinstance(scaling, dict):
        params = dict(scaling)
    section = params.pop("mrope_section", None)
    params.pop("mrope_interleaved", None)
    if params.get("rope_type", params.get("type")) == "mrope":
        params.pop("type", None)
        params["rope_type"] = "default"
    if not section:
        raise ValueError("config.json: an M-RoPE model needs rope_parameters.mrope_section "
                         "(rope_scaling.mrope_section in older configs)")
    view = type("RopeConfig", (), {"rope_parameters": params, "rope_scaling": None,
                                   "rope_theta": getattr(hf_config, "rope_theta", None),
                                   "max_position_embeddings":
                                   hf_config.max_position_embeddings})
    return rope_parameters_from_config(view), [int(s) for s in section]


class MRotaryEmbedding(RotaryEmbedding):
    """Applies M-RoPE to q [T, nh*hd] and k [T, nkv*hd] at ``positions`` [3, T] (or [T])."""

    def __init__(self, head_dim: int, rope_parameters: dict[str, Any], max_position: int,
                 dtype: torch.dtype, mrope_section: list[int]) -> None:
        super().__init__(head_dim, rope_parameters, max_position, dtype)
        half = self.rotary_dim // 2
        if sum(mrope_section) != half or len(mrope_section) != 3:
            raise ValueError(f"mrope_section {mrope_section} must have 3 runs summing to "
                             f"{half} (half the rotary dimension {self.rotary_dim})")
        # Which position row rotates each frequency: 0 x section[0], 1 x section[1], 2 x ...
        rows = torch.repeat_interleave(torch.arange(3), torch.tensor(mrope_section))
        self.register_buffer("section_rows", rows, persistent=False)
        self.register_buffer("freq_index", torch.arange(half), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, *,
                inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions, q, k, inplace=inplace)
        # [T, half]: each frequency's position; contiguous, so the gathered tables are too
        # (the compiled and Triton kernels take only contiguous rows).
        per_freq = positions[self.section_rows].t().contiguous()
        cos = self.cos_cache[per_freq, self.freq_index]
        sin = self.sin_cache[per_freq, self.freq_index]
        rows = torch.arange(positions.shape[1], device=positions.device)
        return self.kernels.rotary_embedding(rows, q, k, cos, sin, self.head_dim,
                                             self.rotary_dim, inplace=inplace,
                                             interleaved=False)


def get_mrope(hf_config: Any, head_dim: int, dtype: torch.dtype) -> MRotaryEmbedding:
    params, section = mrope_parameters(hf_config)
    return MRotaryEmbedding(head_dim, params, hf_config.max_position_embeddings, dtype, section)
