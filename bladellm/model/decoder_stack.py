"""The decoder stack of a Llama-layout model as one compiled call, for decode-sized batches.

A decode step of a small model is mostly weight streaming, and the ~10 kernel calls per layer
each pay Python around them (argument checks, ctypes structs, tensor allocations): a sizeable
share of a small model's step (docs/kernels.md), which is what kept single-stream TBT behind
llama.cpp's. ``CompiledDecoderStack`` describes every layer's weights to the kernel
library once (``kernels/cpu/decoder.cpp``), and per step fills in only the step's tensors, so the
whole stack is one call, the CPU counterpart of a captured CUDA graph.

It runs the same kernels with the same arguments in the same order as the modules, so its
output is bit-identical to theirs; where it does not apply it returns None and the modules run:

- at build: a model whose layers are not the plain Llama layout (Qwen3's q/k norms, LoRA or
  quantized linears, tensor or pipeline parallelism), or kernels that are not the compiled CPU
  set (``--attn_cls torch``, the GPU);
- per step: more tokens than ``STACK_MAX_ROWS`` or than a linear's row limit (the kernels'
  choice: above it ``linear`` goes to oneDNN or F.linear), M-RoPE positions [3, T] (a step
  with image tokens; text-only steps come as [T]), a dummy run without KV cache,
  padding tokens, tree attention (look_ahead), or a LoRA step.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from bladellm.model.forward_context import ForwardContext

logger = logging.getLogger(__name__)

_INDEX_DTYPES = (torch.int64, torch.int32)  # positions and slots: the kernels take either
# The most tokens a step may have to run as one call (its scratch holds that many rows of every
# activation: 8.6 MB on the demo model, ~54 MB at an 8B model's widths). A busy server's steps
# (a few dozen decodes and a prefill chunk) fit; a bigger step's forward dwarfs the modules'
# Python.
STACK_MAX_ROWS = 256


class CompiledDecoderStack:
    def __init__(self, kernels: Any, layer_args: Any, model: nn.Module, max_rows: int,
                 keep_alive: list[torch.Tensor]) -> None:
        from bladellm.kernels.compiled import DecoderStackArgs

        self.kernels = kernels
        self.layer_args = layer_args  # ctypes array of DecoderLayerArgs
        self.max_rows = max_rows
        self._kv_caches: list[torch.Tensor] | None = None
        first = model.layers[model.start_layer]
        attn, rope = first.self_attn, first.self_attn.rotary_emb
        self.hidden_size, self.dtype = model.hidden_size, model.dtype
        inter2 = first.mlp.gate_up_proj.weight.shape[0]
        # Scratch for the largest step it takes: a few hundred KiB, reused every step.
        self._scratch = {name: torch.empty((max_rows, width), dtype=self.dtype)
                         for name, width in (("normed", self.hidden_size),
                                             ("residual0", self.hidden_size),
                                             ("residual1", self.hidden_size),
                                             ("proj", self.hidden_size),
                                             ("qkv", attn.qkv_proj.weight.shape[0]),
                                             ("attn", attn.q_size), ("gate_up", inter2),
                                             ("act", inter2 // 2))}
        # Every tensor the args point into, held so a replaced parameter never leaves the
        # kernel a dangling pointer.
        self._keep_alive = keep_alive + [model.norm.weight, rope.cos_cache, rope.sin_cache]
        a = DecoderStackArgs()
        for name, t in self._scratch.items():
            setattr(a, name, t.data_ptr())
        a.layers = layer_args
        a.final_norm = model.norm.weight.data_ptr()
        a.cos, a.sin = rope.cos_cache.data_ptr(), rope.sin_cache.data_ptr()
        a.max_position = rope.cos_cache.shape[0]
        a.silu_chunk = kernels.silu_chunk
        a.num_layers = len(layer_args)
        a.hidden_size = self.hidden_size
        a.num_heads, a.num_kv_heads = attn.num_heads, attn.num_kv_heads
        a.head_dim, a.rotary_dim = attn.head_dim, rope.rotary_dim
        a.dtype = 0 if self.dtype == torch.float32 else 1
        a.sum_lanes = kernels.sum_lanes
        a.eps = model.norm.eps
        a.scale = attn.attn.scale
        self.args = a

    # ---- building -------------------------------------------------------------------------------
    @classmethod
    def build(cls, model: nn.Module, kernels: Any) -> "CompiledDecoderStack | None":
        """The stack for ``model`` (a ``LlamaModel``), or None where it does not apply (with a
        log line saying why). Call after the weights are loaded and prepacked."""
        why = cls._unsupported(model, kernels)
        if why is not None:
            logger.info("compiled decoder stack not used: %s", why)
            return None
        from bladellm.kernels.compiled import DecoderLayerArgs, LinearArgs

        layers = list(model.layers[model.start_layer:model.end_layer])
        array = (DecoderLayerArgs * len(layers))()
        keep: list[torch.Tensor] = []
        max_rows = None
        for dst, layer in zip(array, layers):
            attn, mlp = layer.self_attn, layer.mlp
            for field, lin in (("qkv", attn.qkv_proj), ("o", attn.o_proj),
                               ("gate_up", mlp.gate_up_proj), ("down", mlp.down_proj)):
                plan = kernels.small_rows_weight(lin.weight, lin.bias,
                                                 getattr(lin, "packed_weight", None))
                if plan is None:
                    logger.info("compiled decoder stack not used: %s has no GEMV path",
                                lin.prefix)
                    return None
                weight, kind, rows = plan
                max_rows = rows if max_rows is None else min(max_rows, rows)
                keep += [weight] + ([] if lin.bias is None else [lin.bias])
                setattr(dst, field, LinearArgs(
                    weight.data_ptr(), 0 if lin.bias is None else lin.bias.data_ptr(),
                    lin.weight.shape[0], lin.weight.shape[1], kind))
            dst.input_norm = layer.input_layernorm.weight.data_ptr()
            dst.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            keep += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        assert max_rows is not None
        stack = cls(kernels, array, model, min(max_rows, STACK_MAX_ROWS), keep)
        logger.info("compiled decoder stack: %d layers in one call for steps of up to %d "
                    "tokens", len(layers), stack.max_rows)
        return stack

    @staticmethod
    def _unsupported(model: nn.Module, kernels: Any) -> str | None:
        from bladellm.kernels.compiled import CompiledKernels
        from bladellm.model.layers.activation import SiluAndMul
        from bladellm.model.layers.fused_moe import SparseMoeBlock
        from bladellm.model.layers.linear import LinearBase, UnquantizedLinearMethod
        from bladellm.model.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP

        if not isinstance(kernels, CompiledKernels):
            return f"the {kernels.name} kernels have no compiled stack"
        if not (model.is_first_stage and model.is_last_stage):
            return "pipeline parallelism"
        if model.dtype not in (torch.float32, torch.bfloat16):
            return f"dtype {model.dtype}"
        layers = list(model.layers[model.start_layer:model.end_layer])
        if not layers:
            return "no decoder layers"
        eps = {model.norm.eps}
        shapes = set()  # the scratch buffers are sized once for every layer
        for layer in layers:
            if isinstance(layer.mlp, SparseMoeBlock):
                return "mixture-of-experts layers (the stack runs dense MLPs only)"
            if type(layer) is not LlamaDecoderLayer or type(layer.self_attn) is not \
                    LlamaAttention or type(layer.mlp) is not LlamaMLP:
                return f"{type(layer.self_attn).__name__} is not the plain Llama layout"
            attn = layer.self_attn
            if type(layer.mlp.act_fn) is not SiluAndMul:
                return f"activation {layer.mlp.act_fn.act} (the stack runs SiLU)"
            if attn.rotary_emb is not layers[0].self_attn.rotary_emb:
                return "layers with their own rotary tables"
            if not attn.attn.features.is_plain:
                return "attention features (sliding window, ALiBi, soft-capping)"
            if type(attn.attn.backend).__name__ != "PagedAttentionBackend" or \
                    attn.attn.backend.kernels is not kernels:
                return "an attention backend other than the compiled paged one"
            for lin in (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj,
                        layer.mlp.down_proj):
                if not isinstance(lin, LinearBase):
                    return f"{type(lin).__name__} layers (LoRA)"
                if type(lin.quant_method) is not UnquantizedLinearMethod:
                    return "quantized linear layers"
                if lin.kernels is not kernels:
                    return "layers built with another kernel set"
                if lin.tp_size != 1:
                    return "tensor parallelism"
                if lin.weight.dtype != model.dtype:
                    return "linear weights in another dtype"
            if attn.head_dim % 16:
                return f"head_dim {attn.head_dim} (the kernels need a multiple of 16)"
            eps.update((layer.input_layernorm.eps, layer.post_attention_layernorm.eps))
            shapes.add((attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.attn.scale,
                        tuple(layer.mlp.gate_up_proj.weight.shape)))
        if len(eps) != 1:
            return "norms with different eps"
        if len(shapes) != 1:
            return "layers of different shapes"
        rope = layers[0].self_attn.rotary_emb
        if rope.interleaved:
            return "interleaved rotary (the stack runs the neox layout)"
        if rope.cos_cache.dtype != model.dtype or rope.cos_cache.shape[-1] * 2 != \
                rope.rotary_dim:
            return "a rotary table the kernel does not take"
        return None

    # ---- one step -------------------------------------------------------------------------------
    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor,
                 ctx: ForwardContext) -> torch.Tensor | None:
        """The final norm's output for ``hidden`` (the embeddings), or None where the step is
        not one the stack takes (the caller runs the modules)."""
        md = ctx.attn_metadata
        T = hidden.shape[0]
        if (md is None or md.tree is not None or ctx.lora is not None or T == 0
                or T > self.max_rows or md.num_actual_tokens != T
                or hidden.dtype != self.dtype or not hidden.is_contiguous()
                or positions.dim() != 1  # M-RoPE's [3, T] (models/qwen2_vl.py)
                or positions.dtype not in _INDEX_DTYPES
                or md.slot_mapping.dtype not in _INDEX_DTYPES
                or not all(t.dtype == torch.int32 for t in (md.block_tables, md.seq_lens,
                                                             md.query_start_loc))
                or not all(t.is_contiguous() for t in (positions, md.slot_mapping,
                                                       md.block_tables, md.seq_lens,
                                                       md.query_start_loc))):
            return None
        if ctx.kv_caches is not self._kv_caches:
            if not self._bind_caches(ctx.kv_caches):
                return None
        out = torch.empty((T, self.hidden_size), dtype=self.dtype)
        a = self.args
        a.out, a.hidden = out.data_ptr(), hidden.data_ptr()
        a.positions, a.positions_int64 = positions.data_ptr(), positions.dtype == torch.int64
        a.slots, a.slots_int64 = md.slot_mapping.data_ptr(), md.slot_mapping.dtype == torch.int64
        a.block_tables, a.block_table_stride = md.block_tables.data_ptr(), \
            md.block_tables.stride(0)
        a.query_start_loc, a.seq_lens = md.query_start_loc.data_ptr(), md.seq_lens.data_ptr()
        a.tokens, a.num_reqs = T, md.num_reqs
        a.num_threads = torch.get_num_threads()
        self.kernels.decoder_stack(a)
        return out

    def _bind_caches(self, kv_caches: list[torch.Tensor]) -> bool:
        """Point every layer at its KV cache (once per cache allocation)."""
        from bladellm.kernels import kv_int8

        if len(kv_caches) != len(self.layer_args):
            return False
        int8 = kv_int8.is_int8(kv_caches[0][0])
        row = kv_int8.row_width(self.args.head_dim) if int8 else self.args.head_dim
        for dst, cache in zip(self.layer_args, kv_caches):
            k, v = cache[0], cache[1]
            if (k.dtype != (torch.int8 if int8 else self.dtype) or v.dtype != k.dtype
                    or k.shape[-1] != row or not (k.is_contiguous() and v.is_contiguous())
                    or not k.is_cpu):
                return False
            dst.k_cache, dst.v_cache = k.data_ptr(), v.data_ptr()
        self.args.block_size = kv_caches[0][0].shape[1]
        self.args.kv_int8 = int(int8)
        self._kv_caches = kv_caches
        return True


def attach_compiled_stack(model: nn.Module, kernels: Any) -> bool:
    """Give ``model`` (a causal LM built with the kernel set ``kernels``) its compiled decoder
    stack where it applies: decode-sized steps then run every layer in one call. Call after the
    weights are loaded (and prepacked, and wrapped for LoRA). Returns whether it did."""
    from bladellm.model.models.llama import LlamaModel

    # A vision-language model's language model takes the stack (its vision tower is not hot).
    inner = getattr(getattr(model, "language_model", model), "model", None)
    if not isinstance(inner, LlamaModel):
        return False
    inner.compiled_stack = CompiledDecoderStack.build(inner, kernels)
    return inner.compiled_stack is not None
