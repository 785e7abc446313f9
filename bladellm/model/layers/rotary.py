"""Rotary position embedding with transformers' scaling types.

The inverse frequencies follow ``transformers.modeling_rope_utils`` exactly (default, linear,
dynamic, llama3, yarn, longrope); cos/sin are computed once for every position up to
``max_position`` and indexed by ``positions``, so there is no per-step work besides a gather.
Rotary may cover only the first ``partial_rotary_factor`` of each head, in the neox
(rotate-half) layout or the interleaved one (GPT-J / GLM pairs).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from bladellm.kernels.scope import kernels_for

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
# Older spellings transformers still reads: Phi-3's "su" is LongRoPE.
ROPE_TYPE_ALIASES = {"su": "longrope"}


def rope_parameters_from_config(hf_config: Any) -> dict[str, Any]:
    """One flat dict with ``rope_type`` and ``rope_theta`` from either config form.

    transformers >= 5 keeps everything in ``config.rope_parameters``; older configs have
    ``rope_theta`` next to an optional ``rope_scaling`` dict whose type key is ``type`` or
    ``rope_type``.
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None)
    if not params and isinstance(scaling, dict):
        params = dict(scaling)
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type rope_parameters are not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    params["rope_type"] = ROPE_TYPE_ALIASES.get(rope_type, rope_type)
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(hf_config, "rope_theta", None) or 10000.0
    if params.get("partial_rotary_factor") is None:
        factor = getattr(hf_config, "partial_rotary_factor", None)
        if factor is not None:
            params["partial_rotary_factor"] = factor
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        # Same default as transformers' standardize_rope_params.
        params.setdefault("original_max_position_embeddings",
                          getattr(hf_config, "original_max_position_embeddings", None)
                          or hf_config.max_position_embeddings)
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {params['rope_type']!r} (rope_scaling / "
                         f"rope_parameters in config.json); supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if params["rope_type"] == "longrope":
        for key in ("short_factor", "long_factor"):
            if not params.get(key):
                raise ValueError(f"rope type 'longrope' needs {key} (rope_scaling in "
                                 f"config.json)")
    return params


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(p: dict[str, Any], dim: int) -> torch.Tensor:
    inv_freq = _base_inv_freq(p["rope_theta"], dim)
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(p: dict[str, Any], dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    base = p["rope_theta"]
    orig = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_position / orig

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale)
                                     / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation_factor = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + \
        (1.0 / pos_freqs) * extrapolation_factor
    return inv_freq, attention_factor


def _longrope_freqs(p: dict[str, Any], dim: int, max_position: int
                    ) -> tuple[torch.Tensor, float]:
    """Per-position angles and the attention factor of LongRoPE (Phi-3).

    transformers uses ``short_factor`` while the sequence is at most
    ``original_max_position_embeddings`` long and ``long_factor`` beyond (for every position of
    the sequence it recomputes). Position ``p`` here gets the short factors below that length
    and the long ones from it on: exactly transformers' token-by-token decode, and its prefill
    of any prompt that fits the original length. A prompt longer than that differs in its first
    ``original_max_position_embeddings`` positions (transformers rotates them with the long
    factors in that prefill only, and with the short ones when decoded token by token).
    """
    orig = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_position / orig
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else \
            math.sqrt(1 + math.log(factor) / math.log(orig))
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    for key in ("short_factor", "long_factor"):
        if len(p[key]) != dim // 2:
            raise ValueError(f"rope_scaling.{key} has {len(p[key])} entries; the rotary "
                             f"dimension {dim} needs {dim // 2}")
    short = 1.0 / (torch.tensor(p["short_factor"], dtype=torch.float32)
                   * p["rope_theta"] ** exponent)
    long = 1.0 / (torch.tensor(p["long_factor"], dtype=torch.float32)
                  * p["rope_theta"] ** exponent)
    pos = torch.arange(max_position, dtype=torch.float32)
    inv_freq = torch.where(pos[:, None] < orig, short[None, :], long[None, :])
    return pos[:, None] * inv_freq, attention_factor


def _dynamic_freqs(p: dict[str, Any], dim: int, max_position: int,
                   num_positions: int) -> torch.Tensor:
    """Per-position angles for dynamic NTK.

    transformers recomputes the base for ``seq_len = max(position) + 1`` once a sequence outgrows
    ``max_position_embeddings`` (and uses the plain base below it). Giving position ``p`` the
    frequencies for ``seq_len = max(p + 1, max_position)`` reproduces that exactly up to
    ``max_position_embeddings`` and matches its token-by-token decode beyond it, while staying a
    fixed per-position table.
    """
    factor = p["factor"]
    pos = torch.arange(num_positions, dtype=torch.float32)
    seq_len = torch.clamp(pos + 1, min=max_position)
    base = p["rope_theta"] * ((factor * seq_len / max_position) - (factor - 1)) ** (dim / (dim - 2))
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (base[:, None] ** exponent[None, :])  # [P, dim/2]
    return pos[:, None] * inv_freq


class RotaryEmbedding(nn.Module):
    """Applies rotary embedding to q [T, nh*hd] and k [T, nkv*hd] at ``positions`` [T]."""

    def __init__(self, head_dim: int, rope_parameters: dict[str, Any], max_position: int,
                 dtype: torch.dtype, *, interleaved: bool = False) -> None:
        super().__init__()
        p = rope_parameters
        self.head_dim = head_dim
        self.rotary_dim = int(head_dim * p.get("partial_rotary_factor", 1.0))
        # Dims (2i, 2i + 1) form pair i (GPT-J / GLM) instead of (i, i + rotary_dim / 2).
        self.interleaved = interleaved
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= head_dim:
            raise ValueError(f"partial_rotary_factor {p.get('partial_rotary_factor')} gives a "
                             f"rotary dimension of {self.rotary_dim} for head_dim {head_dim}; "
                             f"it must be even and in (0, head_dim]")
        dim, rope_type = self.rotary_dim, p["rope_type"]
        num_positions = max_position
        scaling = 1.0
        if rope_type == "dynamic":
            # Positions past max_position_embeddings are legal with NTK scaling.
            num_positions = int(max_position * p["factor"])
            freqs = _dynamic_freqs(p, dim, max_position, num_positions)
        elif rope_type == "longrope":
            freqs, scaling = _longrope_freqs(p, dim, max_position)
        else:
            if rope_type == "default":
                inv_freq = _base_inv_freq(p["rope_theta"], dim)
            elif rope_type == "linear":
                inv_freq = _base_inv_freq(p["rope_theta"], dim) / p["factor"]
            elif rope_type == "llama3":
                inv_freq = _llama3_inv_freq(p, dim)
            else:
                inv_freq, scaling = _yarn_inv_freq(p, dim, max_position)
            pos = torch.arange(num_positions, dtype=torch.float32)
            freqs = pos[:, None] * inv_freq[None, :]
        self.max_position = num_positions
        self.kernels = kernels_for("RotaryEmbedding")
        # Kept in the model dtype: transformers casts cos/sin to the activation dtype too.
        self.register_buffer("cos_cache", (freqs.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin_cache", (freqs.sin() * scaling).to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, *,
                inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated (q, k). ``inplace=True`` overwrites q and k (which may be views of a fused
        qkv output): the models do that, since nothing reads the unrotated values."""
        return self.kernels.rotary_embedding(positions, q, k, self.cos_cache, self.sin_cache,
                                             self.head_dim, self.rotary_dim, inplace=inplace,
                                             interleaved=self.interleaved)


def get_rope(hf_config: Any, head_dim: int, dtype: torch.dtype, *,
             interleaved: bool = False) -> RotaryEmbedding:
    """The model builds one and shares it across layers: one cos/sin table per model."""
    return RotaryEmbedding(head_dim, rope_parameters_from_config(hf_config),
                           hf_config.max_position_embeddings, dtype, interleaved=interleaved)
