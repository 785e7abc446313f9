"""Gemma 2 (``Gemma2ForCausalLM``): embeddings scaled by sqrt(hidden), (1 + w) RMSNorms before
and after both the attention and the MLP, a GeGLU MLP (``hidden_activation``), alternating local
(sliding-window) and global layers (``layer_types``), attention logits soft-capped
(``attn_logit_softcapping``) and scaled by ``query_pre_attn_scalar ** -0.5``, final logits
soft-capped (``final_logit_softcapping``). Tensor parallelism of any degree; pipeline stages
(``models/stage.py``): the embedding and its scale on the first, the final norm, the LM head and
its soft-cap on the last.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from bladellm.attention.backend import AttentionBackend, AttentionFeatures
from bladellm.model.forward_context import ForwardContext
from bladellm.model.layers import (Attention, MergedColumnParallelLinear, ParallelLMHead,
                                   QKVParallelLinear, RotaryEmbedding, RowParallelLinear,
                                   UnitOffsetRMSNorm, VocabParallelEmbedding, get_act_fn,
                                   get_rope)
from bladellm.model.layers.attention import layer_sliding_window
from bladellm.model.models.stage import DecoderStage, stage_weights
from bladellm.model.utils import KVCacheSpec, load_weights_with_mapping


def hidden_activation(cfg: Any) -> str:
    """Gemma's MLP activation: ``hidden_activation`` (``hidden_act`` in old configs)."""
    return getattr(cfg, "hidden_activation", None) or cfg.hidden_act


class GemmaMLP(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, quant_config: Any, prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, bias=False, params_dtype=dtype,
            quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(
            cfg.intermediate_size, cfg.hidden_size, bias=False, params_dtype=dtype,
            quant_config=quant_config, prefix=f"{prefix}.down_proj",
            input_partition=self.gate_up_proj.output_shards[0])
        field = "hidden_activation" if getattr(cfg, "hidden_activation", None) else "hidden_act"
        self.act_fn = get_act_fn(hidden_activation(cfg), gated=True, field=field)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x, ctx)), ctx)


class Gemma2Attention(nn.Module):
    """``layer``: the index in the model (its window); ``kv_index``: in this pipeline stage (its
    KV cache)."""

    def __init__(self, cfg: Any, layer: int, kv_index: int, rotary_emb: RotaryEmbedding,
                 attn_backend: AttentionBackend, dtype: torch.dtype, quant_config: Any,
                 prefix: str) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        bias = bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, self.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
            bias=bias, params_dtype=dtype, quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * self.head_dim, cfg.hidden_size, bias=bias,
            params_dtype=dtype, quant_config=quant_config, prefix=f"{prefix}.o_proj",
            input_partition=self.qkv_proj.output_shards[0])
        self.rotary_emb = rotary_emb
        features = AttentionFeatures(
            sliding_window=layer_sliding_window(cfg, layer),
            soft_cap=getattr(cfg, "attn_logit_softcapping", None))
        self.attn = Attention(self.num_heads, self.head_dim, cfg.query_pre_attn_scalar ** -0.5,
                              self.num_kv_heads, kv_index, attn_backend, features)

    def qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q/k before rotary (Gemma 3 norms them here)."""
        return q, k

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden, ctx).split([self.q_size, self.kv_size, self.kv_size],
                                                   dim=-1)
        q, k = self.qk(q, k)
        q, k = self.rotary_emb(positions, q, k, inplace=True)
        return self.o_proj(self.attn(q, k, v, ctx), ctx)


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, cfg: Any, self_attn: nn.Module, dtype: torch.dtype, quant_config: Any,
                 prefix: str) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = GemmaMLP(cfg, dtype, quant_config, f"{prefix}.mlp")
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = UnitOffsetRMSNorm(h, eps, params_dtype=dtype)
        self.post_attention_layernorm = UnitOffsetRMSNorm(h, eps, params_dtype=dtype)
        self.pre_feedforward_layernorm = UnitOffsetRMSNorm(h, eps, params_dtype=dtype)
        self.post_feedforward_layernorm = UnitOffsetRMSNorm(h, eps, params_dtype=dtype)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(block output, residual stream): each residual add is fused into the next norm."""
        if residual is None:
            residual, h = hidden, self.input_layernorm(hidden)
        else:
            h, residual = self.input_layernorm(hidden, residual)
        h = self.post_attention_layernorm(self.self_attn(positions, h, ctx))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h, ctx)), residual


class Gemma2Model(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, quant_config: Any, prefix: str,
                 make_attn: Any) -> None:
        super().__init__()
        self.stage = stage = DecoderStage(cfg.num_hidden_layers, cfg.hidden_size, dtype)
        self.channel = stage.channel
        self.embed_tokens = stage.first(lambda: VocabParallelEmbedding(
            cfg.vocab_size, cfg.hidden_size, params_dtype=dtype))
        # transformers multiplies by sqrt(hidden) rounded to the activation dtype.
        self.normalizer = torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype).item()
        self.layers = stage.layers(lambda i, kv_index: Gemma2DecoderLayer(
            cfg, make_attn(i, kv_index, f"{prefix}.layers.{i}.self_attn"), dtype, quant_config,
            f"{prefix}.layers.{i}"))
        self.norm = stage.last(lambda: UnitOffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                         params_dtype=dtype))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor | None:
        stage = self.stage
        if stage.is_first:
            hidden, residual = self.embed_tokens(input_ids) * self.normalizer, None
        else:
            hidden, residual = stage.receive(input_ids.shape[0], input_ids.device)
        for layer in self.layers[stage.start:stage.end]:
            hidden, residual = layer(positions, hidden, residual, ctx)
        if not stage.is_last:
            stage.send(hidden, residual)
            return None
        return self.norm(hidden, residual)[0]


class Gemma2ForCausalLM(nn.Module):
    packed_modules_mapping: dict[str, list[str]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self, hf_config: Any, dtype: torch.dtype, attn_backend: AttentionBackend,
                 quant_config: Any = None, prefix: str = "") -> None:
        super().__init__()
        self.hf_config, self.dtype, self.quant_config = hf_config, dtype, quant_config
        self.attn_backend = attn_backend
        self.head_dim = hf_config.head_dim
        self.rotary = nn.ModuleDict(self.make_rotary(hf_config, dtype))
        model_prefix = f"{prefix}.model" if prefix else "model"
        self.model = Gemma2Model(hf_config, dtype, quant_config, model_prefix,
                                 self.make_attention)
        stage = self.model.stage
        self.num_kv_heads = self.model.layers[stage.start].self_attn.num_kv_heads
        self.final_soft_cap = getattr(hf_config, "final_logit_softcapping", None)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        self.lm_head = stage.last(lambda: ParallelLMHead(hf_config.vocab_size,
                                                         hf_config.hidden_size,
                                                         params_dtype=dtype))
        if self.tie_word_embeddings and stage.is_first and stage.is_last:
            self.lm_head.tie_to(self.model.embed_tokens)

    def make_rotary(self, cfg: Any, dtype: torch.dtype) -> dict[str, RotaryEmbedding]:
        """Rotary table per layer type; Gemma 2 has one for all layers."""
        rope = get_rope(cfg, self.head_dim, dtype)
        return {"full_attention": rope, "sliding_attention": rope}

    def make_attention(self, layer: int, kv_index: int, prefix: str) -> nn.Module:
        kind = "sliding_attention" if layer_sliding_window(self.hf_config, layer) else \
            "full_attention"
        return Gemma2Attention(self.hf_config, layer, kv_index, self.rotary[kind],
                               self.attn_backend, self.dtype, self.quant_config, prefix)

    def get_kv_cache_spec(self) -> KVCacheSpec:
        stage = self.model.stage
        return KVCacheSpec(stage.end - stage.start, self.num_kv_heads, self.head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor | None:
        """Final hidden states; None on a pipeline stage other than the last."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden)
        if self.final_soft_cap is not None:
            logits = torch.tanh(logits / self.final_soft_cap) * self.final_soft_cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def renamed(items: Iterable[tuple[str, torch.Tensor]]):
            for name, tensor in items:
                if self.tie_word_embeddings and name.startswith("lm_head."):
                    continue  # it is the embedding
                yield name, tensor

        return load_weights_with_mapping(
            self, stage_weights(self, renamed(weights), "model.embed_tokens.weight"),
            self.packed_modules_mapping)


__all__ = ["Gemma2ForCausalLM"]
