"""OPT (``OPTForCausalLM``): learned positions (offset by 2), LayerNorm before (most sizes) or
after (350m: ``do_layer_norm_before`` false) each block, a plain ReLU MLP, biases
(``enable_bias``), and ``project_in`` / ``project_out`` where ``word_embed_proj_dim`` differs
from ``hidden_size``. Pipeline stages (``models/stage.py``): the embeddings and ``project_in`` on
the first, the final norm, ``project_out`` and the LM head on the last."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from bladellm.attention.backend import AttentionBackend
from bladellm.model.forward_context import ForwardContext
from bladellm.model.layers import (Attention, ColumnParallelLinear, LayerNorm, ParallelLMHead,
                                   QKVParallelLinear, ReplicatedLinear, RowParallelLinear,
                                   VocabParallelEmbedding, get_act_fn)
from bladellm.model.models.stage import DecoderStage, stage_weights
from bladellm.model.utils import KVCacheSpec, load_weights_with_mapping

# OPT's learned position table starts at row 2 (fairseq kept rows for padding).
POSITION_OFFSET = 2


class OPTAttention(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, attn_backend: AttentionBackend,
                 dtype: torch.dtype, quant_config: Any, prefix: str) -> None:
        super().__init__()
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        bias = cfg.enable_bias
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, self.head_dim, cfg.num_attention_heads, cfg.num_attention_heads,
            bias=bias, params_dtype=dtype, quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.out_proj = RowParallelLinear(
            cfg.hidden_size, cfg.hidden_size, bias=bias, params_dtype=dtype,
            quant_config=quant_config, prefix=f"{prefix}.out_proj",
            input_partition=self.qkv_proj.output_shards[0])
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5,
                              self.num_kv_heads, layer_idx, attn_backend)

    def forward(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden, ctx).split([self.q_size, self.kv_size, self.kv_size],
                                                   dim=-1)
        return self.out_proj(self.attn(q, k, v, ctx), ctx)


class OPTDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, attn_backend: AttentionBackend,
                 dtype: torch.dtype, quant_config: Any, prefix: str) -> None:
        super().__init__()
        self.pre_norm = cfg.do_layer_norm_before
        self.self_attn = OPTAttention(cfg, layer_idx, attn_backend, dtype, quant_config,
                                      f"{prefix}.self_attn")
        self.self_attn_layer_norm = LayerNorm(cfg.hidden_size, params_dtype=dtype)
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, cfg.ffn_dim, bias=cfg.enable_bias,
                                        params_dtype=dtype, quant_config=quant_config,
                                        prefix=f"{prefix}.fc1")
        self.fc2 = RowParallelLinear(cfg.ffn_dim, cfg.hidden_size, bias=cfg.enable_bias,
                                     params_dtype=dtype, quant_config=quant_config,
                                     prefix=f"{prefix}.fc2",
                                     input_partition=self.fc1.output_shards[0])
        self.act_fn = get_act_fn(cfg.activation_function, gated=False,
                                 field="activation_function")
        self.final_layer_norm = LayerNorm(cfg.hidden_size, params_dtype=dtype)

    def mlp(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.fc2(self.act_fn(self.fc1(hidden, ctx)), ctx)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Pre-norm: (block output, residual stream), the add fused into the next norm, as in
        Llama. Post-norm: the normed sum, which is the next residual itself (None)."""
        if not self.pre_norm:
            h = self.self_attn_layer_norm(self.self_attn(hidden, ctx), hidden)[0]
            return self.final_layer_norm(self.mlp(h, ctx), h)[0], None
        if residual is None:
            residual, h = hidden, self.self_attn_layer_norm(hidden)
        else:
            h, residual = self.self_attn_layer_norm(hidden, residual)
        h, residual = self.final_layer_norm(self.self_attn(h, ctx), residual)
        return self.mlp(h, ctx), residual


class OPTDecoder(nn.Module):
    def __init__(self, cfg: Any, attn_backend: AttentionBackend, dtype: torch.dtype,
                 quant_config: Any, prefix: str) -> None:
        super().__init__()
        if not getattr(cfg, "layer_norm_elementwise_affine", True):
            raise ValueError("layer_norm_elementwise_affine=false (config.json) is not "
                             "supported for OPTForCausalLM")
        proj_dim = cfg.word_embed_proj_dim
        self.stage = stage = DecoderStage(cfg.num_hidden_layers, cfg.hidden_size, dtype)
        self.channel = stage.channel
        self.pre_norm = cfg.do_layer_norm_before
        self.embed_tokens = stage.first(
            lambda: VocabParallelEmbedding(cfg.vocab_size, proj_dim, params_dtype=dtype))
        self.embed_positions = stage.first(lambda: VocabParallelEmbedding(
            cfg.max_position_embeddings + POSITION_OFFSET, cfg.hidden_size, params_dtype=dtype))
        self.project_in = self.project_out = None
        if proj_dim != cfg.hidden_size:
            self.project_in = stage.first(lambda: ReplicatedLinear(
                proj_dim, cfg.hidden_size, bias=False, params_dtype=dtype,
                prefix=f"{prefix}.project_in"))
            self.project_out = stage.last(lambda: ReplicatedLinear(
                cfg.hidden_size, proj_dim, bias=False, params_dtype=dtype,
                prefix=f"{prefix}.project_out"))
        self.layers = stage.layers(lambda i, kv_index: OPTDecoderLayer(
            cfg, kv_index, attn_backend, dtype, quant_config, f"{prefix}.layers.{i}"))
        self.final_layer_norm = None
        if cfg.do_layer_norm_before and not getattr(cfg, "_remove_final_layer_norm", False):
            self.final_layer_norm = stage.last(lambda: LayerNorm(cfg.hidden_size,
                                                                 params_dtype=dtype))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor | None:
        stage = self.stage
        if stage.is_first:
            hidden = self.embed_tokens(input_ids)
            if self.project_in is not None:
                hidden = self.project_in(hidden, ctx)
            hidden = hidden + self.embed_positions(positions + POSITION_OFFSET)
            residual = None
        else:
            hidden, residual = stage.receive(input_ids.shape[0], input_ids.device,
                                             with_residual=self.pre_norm)
        for layer in self.layers[stage.start:stage.end]:
            hidden, residual = layer(hidden, residual, ctx)
        if not stage.is_last:
            stage.send(hidden, residual)
            return None
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden, residual)[0] if residual is not None \
                else self.final_layer_norm(hidden)
        elif residual is not None:
            hidden = hidden + residual
        if self.project_out is not None:
            hidden = self.project_out(hidden, ctx)
        return hidden


class OPTModel(nn.Module):
    def __init__(self, *args: Any) -> None:
        super().__init__()
        self.decoder = OPTDecoder(*args)
        self.channel = self.decoder.channel  # where the engine looks for a stage's channel


class OPTForCausalLM(nn.Module):
    packed_modules_mapping: dict[str, list[str]] = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self, hf_config: Any, dtype: torch.dtype, attn_backend: AttentionBackend,
                 quant_config: Any = None, prefix: str = "") -> None:
        super().__init__()
        self.hf_config, self.dtype = hf_config, dtype
        model_prefix = f"{prefix}.model.decoder" if prefix else "model.decoder"
        self.model = OPTModel(hf_config, attn_backend, dtype, quant_config, model_prefix)
        decoder = self.model.decoder
        stage = decoder.stage
        self.head_dim = decoder.layers[stage.start].self_attn.head_dim
        self.num_kv_heads = decoder.layers[stage.start].self_attn.num_kv_heads
        # OPT ties the LM head to the token embedding unless the config says otherwise.
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        self.lm_head = stage.last(lambda: ParallelLMHead(
            hf_config.vocab_size, hf_config.word_embed_proj_dim, params_dtype=dtype))
        if self.tie_word_embeddings and stage.is_first and stage.is_last:
            self.lm_head.tie_to(decoder.embed_tokens)

    def get_kv_cache_spec(self) -> KVCacheSpec:
        stage = self.model.decoder.stage
        return KVCacheSpec(stage.end - stage.start, self.num_kv_heads, self.head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor | None:
        """Final hidden states; None on a pipeline stage other than the last."""
        return self.model.decoder(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def renamed(items: Iterable[tuple[str, torch.Tensor]]):
            for name, tensor in items:
                if name.startswith("decoder."):  # checkpoints saved from OPTModel
                    name = f"model.{name}"
                if self.tie_word_embeddings and name.startswith("lm_head."):
                    continue  # it is the embedding
                yield name, tensor

        return load_weights_with_mapping(
            self, stage_weights(self, renamed(weights), "model.decoder.embed_tokens.weight"),
            self.packed_modules_mapping)


__all__ = ["OPTForCausalLM"]
