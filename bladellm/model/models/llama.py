"""Llama (and Mistral, which has the same layout) for causal LM."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from bladellm.attention.backend import AttentionBackend, AttentionFeatures
from bladellm.model.forward_context import ForwardContext
from bladellm.distributed.parallel_state import get_pp_group
from bladellm.distributed.partition import pipeline_stages
from bladellm.distributed.pipeline import StageChannel
from bladellm.model.layers import (Attention, MergedColumnParallelLinear, ParallelLMHead,
                                   PPMissingLayer, QKVParallelLinear, RMSNorm, RotaryEmbedding,
                                   RowParallelLinear, VocabParallelEmbedding, get_act_fn, get_rope)
from bladellm.model.layers.attention import layer_index, layer_sliding_window
from bladellm.model.utils import KVCacheSpec, load_weights_with_mapping


def get_head_dim(hf_config: Any) -> int:
    """Explicit ``head_dim`` wins: it may differ from hidden_size / num_attention_heads."""
    return getattr(hf_config, "head_dim", None) or \
        hf_config.hidden_size // hf_config.num_attention_heads


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool,
                 dtype: torch.dtype, quant_config: Any, prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=bias, params_dtype=dtype,
            quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        # down_proj takes exactly the intermediate columns this rank's gate/up produce.
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=bias, params_dtype=dtype,
            quant_config=quant_config, prefix=f"{prefix}.down_proj",
            input_partition=self.gate_up_proj.output_shards[0])
        self.act_fn = get_act_fn(hidden_act, gated=True)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x, ctx)), ctx)


class LlamaAttention(nn.Module):
    def __init__(self, hf_config: Any, layer_idx: int, rotary_emb: RotaryEmbedding,
                 attn_backend: AttentionBackend, dtype: torch.dtype, quant_config: Any,
                 prefix: str, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        self.head_dim = get_head_dim(hf_config)
        self.qkv_proj = QKVParallelLinear(
            hf_config.hidden_size, self.head_dim, hf_config.num_attention_heads,
            hf_config.num_key_value_heads, bias=qkv_bias, params_dtype=dtype,
            quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # o_proj takes this rank's query heads (the attention output), which TP may split
        # unevenly (bladellm.distributed.partition.attention_partition).
        self.o_proj = RowParallelLinear(
            hf_config.num_attention_heads * self.head_dim, hf_config.hidden_size, bias=o_bias,
            params_dtype=dtype, quant_config=quant_config, prefix=f"{prefix}.o_proj",
            input_partition=self.qkv_proj.output_shards[0])
        self.rotary_emb = rotary_emb
        # Mistral / Qwen2 with a real sliding_window: this layer's window, as transformers reads
        # the config (layer_types, use_sliding_window, max_window_layers).
        window = layer_sliding_window(hf_config, layer_index(prefix))
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5,
                              self.num_kv_heads, layer_idx, attn_backend,
                              AttentionFeatures(sliding_window=window))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden, ctx).split([self.q_size, self.kv_size, self.kv_size],
                                                   dim=-1)
        q, k = self.rotary_emb(positions, q, k, inplace=True)
        return self.o_proj(self.attn(q, k, v, ctx), ctx)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, self_attn: nn.Module, hf_config: Any, dtype: torch.dtype,
                 quant_config: Any, prefix: str, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = self_attn
        # ``mlp``: a model's own MLP for this layer (mixture of experts), else the dense one.
        self.mlp = mlp if mlp is not None else LlamaMLP(
            hf_config.hidden_size, hf_config.intermediate_size, hf_config.hidden_act,
            getattr(hf_config, "mlp_bias", False), dtype, quant_config, f"{prefix}.mlp")
        eps = hf_config.rms_norm_eps
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps, params_dtype=dtype)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps, params_dtype=dtype)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, ctx)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden, ctx), residual


class LlamaModel(nn.Module):
    """Embedding, decoder stack and final norm; ``make_attn(layer_idx, prefix)`` builds each
    layer's self-attention so Qwen variants can swap only that part, and ``make_mlp(layer,
    prefix)`` (``layer``: the index in the full model) its MLP, or None for the dense one
    (mixture-of-experts models).

    Under pipeline parallelism this process holds only its stage: decoder layers
    ``[start_layer, end_layer)`` (``pipeline_stages``), the embedding on the first stage and the
    final norm on the last; the rest are ``PPMissingLayer`` so names and indices match the full
    model. ``layer_idx`` given to attention is the layer's index within the stage (its KV cache's
    index). A stage other than the first receives (hidden, residual) from the previous one; a
    stage other than the last sends them on and returns None.
    """

    def __init__(self, hf_config: Any, dtype: torch.dtype, quant_config: Any, prefix: str,
                 make_attn: Any, layer_cls: type[nn.Module] = LlamaDecoderLayer,
                 make_mlp: Any = None) -> None:
        super().__init__()
        pp = get_pp_group()
        self.is_first_stage, self.is_last_stage = pp.is_first, pp.is_last
        self.start_layer, self.end_layer = pipeline_stages(
            hf_config.num_hidden_layers, pp.world_size)[pp.rank_in_group]
        self.channel = (StageChannel(pp, hf_config.hidden_size, dtype)
                        if pp.world_size > 1 else None)
        self.hidden_size, self.dtype = hf_config.hidden_size, dtype
        self.embed_tokens = VocabParallelEmbedding(
            hf_config.vocab_size, hf_config.hidden_size, params_dtype=dtype) \
            if self.is_first_stage else PPMissingLayer()
        self.layers = nn.ModuleList(
            layer_cls(make_attn(i - self.start_layer, f"{prefix}.layers.{i}.self_attn"),
                      hf_config, dtype, quant_config, f"{prefix}.layers.{i}",
                      make_mlp(i, f"{prefix}.layers.{i}.mlp") if make_mlp else None)
            if self.start_layer <= i < self.end_layer else PPMissingLayer()
            for i in range(hf_config.num_hidden_layers))
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, params_dtype=dtype) \
            if self.is_last_stage else PPMissingLayer()
        # Set by the model runner after loading where it applies (model/decoder_stack.py):
        # decode-sized steps then run every layer and the final norm in one compiled call.
        self.compiled_stack: Any = None

    def holds(self, param_name: str) -> bool:
        """Whether the (model-relative, e.g. ``layers.3.mlp...``) parameter is on this stage."""
        if param_name.startswith("layers."):
            return self.start_layer <= int(param_name.split(".", 2)[1]) < self.end_layer
        if param_name.startswith("embed_tokens."):
            return self.is_first_stage
        if param_name.startswith("norm."):
            return self.is_last_stage
        return True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | None:
        """``inputs_embeds``: the input embeddings when the caller made them (a vision-language
        model puts image features at the image tokens' rows); else from ``input_ids``."""
        if self.is_first_stage:
            hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            residual = None
            if self.compiled_stack is not None:
                out = self.compiled_stack(hidden, positions, ctx)
                if out is not None:
                    return out
        else:
            assert self.channel is not None
            hidden, residual = self.channel.recv(input_ids.shape[0], input_ids.device)
        for layer in self.layers[self.start_layer:self.end_layer]:
            hidden, residual = layer(positions, hidden, residual, ctx)
        if not self.is_last_stage:
            assert self.channel is not None
            self.channel.send(hidden, residual)
            return None
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    # The engine's fused layers and the checkpoint modules each fuses, in shard order: read by
    # ``load_weights`` and handed to the quantization config (``QuantConfig.for_model``).
    packed_modules_mapping: dict[str, list[str]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    decoder_layer_cls: type[nn.Module] = LlamaDecoderLayer  # Glm4 adds sandwich norms
    rope_interleaved = False  # GLM pairs rotary dims (2i, 2i + 1)

    def __init__(self, hf_config: Any, dtype: torch.dtype, attn_backend: AttentionBackend,
                 quant_config: Any = None, prefix: str = "") -> None:
        super().__init__()
        self.hf_config, self.dtype, self.quant_config = hf_config, dtype, quant_config
        self.attn_backend = attn_backend
        self.head_dim = get_head_dim(hf_config)
        self.rotary_emb = get_rope(hf_config, self.head_dim, dtype,
                                   interleaved=self.rope_interleaved)
        model_prefix = f"{prefix}.model" if prefix else "model"
        self.model = LlamaModel(hf_config, dtype, quant_config, model_prefix, self.make_attention,
                                self.decoder_layer_cls, self.make_mlp)
        # Per process: the KV cache holds this pipeline stage's layers and this TP rank's heads.
        self.num_layers = self.model.end_layer - self.model.start_layer
        self.num_kv_heads = self.model.layers[self.model.start_layer].self_attn.num_kv_heads
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.model.is_last_stage:
            self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size,
                                          params_dtype=dtype)
            if self.tie_word_embeddings and self.model.is_first_stage:
                self.lm_head.tie_to(self.model.embed_tokens)
        else:
            self.lm_head = PPMissingLayer()

    def attention_biases(self, hf_config: Any) -> tuple[bool, bool]:
        """(bias on q/k/v, bias on o_proj); Qwen2 overrides it."""
        bias = bool(getattr(hf_config, "attention_bias", False))
        return bias, bias

    def make_attention(self, layer_idx: int, prefix: str) -> nn.Module:
        qkv_bias, o_bias = self.attention_biases(self.hf_config)
        return LlamaAttention(self.hf_config, layer_idx, self.rotary_emb, self.attn_backend,
                              self.dtype, self.quant_config, prefix, qkv_bias, o_bias)

    def make_mlp(self, layer: int, prefix: str) -> nn.Module | None:
        """Layer ``layer``'s MLP; None: the dense ``LlamaMLP`` (mixture-of-experts models
        override it)."""
        return None

    def get_kv_cache_spec(self) -> KVCacheSpec:
        """Per TP rank: ``num_kv_heads`` is this rank's (it may differ between ranks when the
        tensor-parallel size does not divide the KV heads)."""
        return KVCacheSpec(self.num_layers, self.num_kv_heads, self.head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | None:
        """Final hidden states; None on a pipeline stage other than the last."""
        return self.model(input_ids, positions, ctx, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        stage = self.model
        # A last pipeline stage without the embedding reads the tied LM head from it.
        head_from_embedding = (self.tie_word_embeddings and stage.is_last_stage
                               and not stage.is_first_stage)

        def renamed(items: Iterable[tuple[str, torch.Tensor]]):
            for name, tensor in items:
                if self.tie_word_embeddings and name.startswith("lm_head."):
                    continue  # tied checkpoints sometimes store it too: it is the embedding
                if head_from_embedding and name == "model.embed_tokens.weight":
                    name = "lm_head.weight"
                yield name, tensor

        def other_stage(name: str) -> bool:
            if name.startswith("lm_head."):
                return not stage.is_last_stage
            return name.startswith("model.") and not stage.holds(name[len("model."):])

        return load_weights_with_mapping(self, renamed(weights), self.packed_modules_mapping,
                                         skip=other_stage)


class MistralForCausalLM(LlamaForCausalLM):
    """Same weights and math as Llama; a ``sliding_window`` applies to every layer."""


__all__ = ["LlamaForCausalLM", "MistralForCausalLM"]
