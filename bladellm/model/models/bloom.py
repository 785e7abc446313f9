"""Bloom (``BloomForCausalLM``): ALiBi instead of positions (slopes per head; a tensor-parallel
rank takes its own heads' slopes), LayerNorm with bias (also right after the embedding),
``query_key_value`` fused per head in the checkpoint (rows [head][q | k | v][head_dim]), a
plain GELU MLP (tanh form), biases everywhere, the LM head tied to the embedding. Tensor
parallelism of any degree (uneven head splits included) and pipeline stages (``models/stage.py``:
the embedding and its LayerNorm on the first stage, ``ln_f`` and the LM head on the last)."""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
from torch import nn

from bladellm.attention.backend import AttentionBackend, AttentionFeatures
from bladellm.model.forward_context import ForwardContext
from bladellm.model.layers import (Attention, ColumnParallelLinear, LayerNorm, ParallelLMHead,
                                   QKVParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                   get_act_fn)
from bladellm.model.layers.attention import alibi_slopes
from bladellm.model.models.stage import DecoderStage, stage_weights
from bladellm.model.utils import KVCacheSpec, load_weights_with_mapping


class BloomAttention(nn.Module):
    def __init__(self, cfg: Any, layer: int, attn_backend: AttentionBackend, dtype: torch.dtype,
                 quant_config: Any, prefix: str) -> None:
        super().__init__()
        heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // heads
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, self.head_dim, heads, heads, bias=True, params_dtype=dtype,
            quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.num_heads = self.num_kv_heads = self.qkv_proj.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.dense = RowParallelLinear(
            cfg.hidden_size, cfg.hidden_size, bias=True, params_dtype=dtype,
            quant_config=quant_config, prefix=f"{prefix}.dense",
            input_partition=self.qkv_proj.output_shards[0])
        start = self.qkv_proj.q_head_start
        slopes = alibi_slopes(heads)[start:start + self.num_heads]
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5,
                              self.num_kv_heads, layer, attn_backend,
                              AttentionFeatures(alibi_slopes=slopes))

    def forward(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden, ctx).split([self.q_size] * 3, dim=-1)
        return self.dense(self.attn(q, k, v, ctx), ctx)


class BloomBlock(nn.Module):
    def __init__(self, cfg: Any, layer: int, attn_backend: AttentionBackend, dtype: torch.dtype,
                 quant_config: Any, prefix: str) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.layer_norm_epsilon
        self.post_ln_residual = bool(cfg.apply_residual_connection_post_layernorm)
        self.input_layernorm = LayerNorm(h, eps, params_dtype=dtype)
        self.self_attention = BloomAttention(cfg, layer, attn_backend, dtype, quant_config,
                                             f"{prefix}.self_attention")
        self.post_attention_layernorm = LayerNorm(h, eps, params_dtype=dtype)
        self.dense_h_to_4h = ColumnParallelLinear(h, 4 * h, bias=True, params_dtype=dtype,
                                                  quant_config=quant_config,
                                                  prefix=f"{prefix}.mlp.dense_h_to_4h")
        self.dense_4h_to_h = RowParallelLinear(4 * h, h, bias=True, params_dtype=dtype,
                                               quant_config=quant_config,
                                               prefix=f"{prefix}.mlp.dense_4h_to_h",
                                               input_partition=self.dense_h_to_4h.output_shards[0])
        # Bloom's GELU is the tanh form (transformers' bloom_gelu_forward).
        self.act = get_act_fn("gelu_pytorch_tanh", gated=False)

    def mlp(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x, ctx)), ctx)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(block output, residual): the add is fused into the next LayerNorm. With the
        residual taken after the norms (``apply_residual_connection_post_layernorm``) the
        sums are made here and the residual is None."""
        if self.post_ln_residual:
            if residual is not None:
                hidden = hidden + residual
            ln = self.input_layernorm(hidden)
            attn_out = self.self_attention(ln, ctx) + ln
            ln = self.post_attention_layernorm(attn_out)
            return self.mlp(ln, ctx) + ln, None
        if residual is None:
            residual, ln = hidden, self.input_layernorm(hidden)
        else:
            ln, residual = self.input_layernorm(hidden, residual)
        ln, residual = self.post_attention_layernorm(self.self_attention(ln, ctx), residual)
        return self.mlp(ln, ctx), residual


class BloomModel(nn.Module):
    def __init__(self, cfg: Any, attn_backend: AttentionBackend, dtype: torch.dtype,
                 quant_config: Any, prefix: str) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.layer_norm_epsilon
        self.stage = stage = DecoderStage(cfg.num_hidden_layers, h, dtype)
        self.channel = stage.channel
        self.post_ln_residual = bool(cfg.apply_residual_connection_post_layernorm)
        self.word_embeddings = stage.first(
            lambda: VocabParallelEmbedding(cfg.vocab_size, h, params_dtype=dtype))
        self.word_embeddings_layernorm = stage.first(lambda: LayerNorm(h, eps,
                                                                       params_dtype=dtype))
        self.h = stage.layers(lambda i, kv_index: BloomBlock(
            cfg, kv_index, attn_backend, dtype, quant_config, f"{prefix}.h.{i}"))
        self.ln_f = stage.last(lambda: LayerNorm(h, eps, params_dtype=dtype))

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor | None:
        stage = self.stage
        if stage.is_first:
            hidden = self.word_embeddings_layernorm(self.word_embeddings(input_ids))
            residual = None
        else:
            hidden, residual = stage.receive(input_ids.shape[0], input_ids.device,
                                             with_residual=not self.post_ln_residual)
        for block in self.h[stage.start:stage.end]:
            hidden, residual = block(hidden, residual, ctx)
        if not stage.is_last:
            stage.send(hidden, residual)
            return None
        return self.ln_f(hidden, residual)[0] if residual is not None else self.ln_f(hidden)


class BloomForCausalLM(nn.Module):
    packed_modules_mapping: dict[str, list[str]] = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self, hf_config: Any, dtype: torch.dtype, attn_backend: AttentionBackend,
                 quant_config: Any = None, prefix: str = "") -> None:
        super().__init__()
        if hf_config.hidden_size % hf_config.num_attention_heads:
            raise ValueError(f"config.json: hidden_size {hf_config.hidden_size} is not a "
                             f"multiple of n_head {hf_config.num_attention_heads}")
        self.hf_config, self.dtype = hf_config, dtype
        self.transformer = BloomModel(hf_config, attn_backend, dtype, quant_config,
                                      f"{prefix}.transformer" if prefix else "transformer")
        stage = self.transformer.stage
        attn = self.transformer.h[stage.start].self_attention
        self.head_dim, self.num_kv_heads = attn.head_dim, attn.num_kv_heads
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        self.lm_head = stage.last(lambda: ParallelLMHead(hf_config.vocab_size,
                                                         hf_config.hidden_size,
                                                         params_dtype=dtype))
        if self.tie_word_embeddings and stage.is_first and stage.is_last:
            self.lm_head.tie_to(self.transformer.word_embeddings)

    @property
    def model(self) -> BloomModel:
        """The decoder stack under the name the engine looks for (its stage channel)."""
        return self.transformer

    def get_kv_cache_spec(self) -> KVCacheSpec:
        stage = self.transformer.stage
        return KVCacheSpec(stage.end - stage.start, self.num_kv_heads, self.head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor | None:
        """Final hidden states; None on a pipeline stage other than the last."""
        return self.transformer(input_ids, ctx)  # ALiBi: positions come from the cache layout

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def _unfused(self, weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint names as this module names them; ``query_key_value`` (rows per head:
        q, k, v of head_dim each) split into q_proj / k_proj / v_proj. A quantized tensor
        (GPTQ / AWQ ``qweight``, ``qzeros``, ``scales``) is split along its output dimension in
        packed units; one without an output dimension (GPTQ's ``g_idx``) goes to every part."""
        cfg = self.hf_config
        heads, hidden = cfg.num_attention_heads, cfg.hidden_size
        params = dict(self.named_parameters())
        for name, tensor in weights:
            if not name.startswith(("transformer.", "lm_head.")):
                name = f"transformer.{name}"  # saved from BloomModel
            if self.tie_word_embeddings and name.startswith("lm_head."):
                continue  # it is the embedding
            name = name.replace(".mlp.", ".")
            if ".query_key_value." not in name:
                yield name, tensor
                continue
            spec = getattr(params.get(name.replace(".query_key_value.", ".qkv_proj.")),
                           "quant_spec", None)
            dim, div = (0, 1) if spec is None else (spec.output_dim, spec.output_div)
            parts = [name.replace(".query_key_value.", f".{p}.")
                     for p in ("q_proj", "k_proj", "v_proj")]
            if dim is None:
                for part in parts:
                    yield part, tensor
                continue
            rows = 3 * hidden // div
            if tensor.dim() <= dim or tensor.shape[dim] != rows or (hidden // heads) % div:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}; "
                                 f"config.json gives {rows} in dim {dim} (3 x hidden_size "
                                 f"{hidden}{f', in units of {div}' if div > 1 else ''})")
            shape = tensor.shape
            per_head = tensor.reshape(*shape[:dim], heads, 3, rows // (3 * heads),
                                      *shape[dim + 1:])
            for i, part in enumerate(parts):
                piece = per_head.select(dim + 1, i)
                yield part, piece.reshape(*shape[:dim], rows // 3, *shape[dim + 1:])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_weights_with_mapping(
            self, stage_weights(self, self._unfused(weights), "transformer.word_embeddings.weight"),
            self.packed_modules_mapping)


__all__ = ["BloomForCausalLM"]
