"""``TritonKernels``: the kernel set of the GPU path. The Triton kernels (``kernels/triton``) where
they exist: paged attention, the KV store, the norms (+ residual), rotary, the activations; the
reference methods elsewhere (``linear`` is ``F.linear``, i.e. cuBLAS on a GPU; LoRA and the
grammar bitmask run as torch ops on the tensors' device).

Selected by ``--kernels triton`` (or ``auto`` on CUDA, or ``auto`` with ``--attn_cls triton``):
on a CUDA device, or on a CPU under ``TRITON_INTERPRET=1`` (tests: the whole model through the
Triton kernels without a GPU).
"""

from __future__ import annotations

import torch

from bladellm.kernels.interface import Kernels


class TritonKernels(Kernels):
    name = "triton"

    def paged_attention(self, out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, block_tables: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        scale: float, *, sliding_window: int | None = None,
                        alibi_slopes: torch.Tensor | None = None,
                        soft_cap: float | None = None, max_query_len: int | None = None,
                        max_seq_len: int | None = None) -> None:
        from bladellm.kernels.triton.attention import paged_attention

        # The host maxima size the launch grid without reading the device tensors back.
        paged_attention(out, query, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                        scale, sliding_window=sliding_window, alibi_slopes=alibi_slopes,
                        soft_cap=soft_cap, max_query_len=max_query_len,
                        max_seq_len=max_seq_len)

    def reshape_and_cache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        from bladellm.kernels.triton.elementwise import reshape_and_cache

        reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        from bladellm.kernels.triton.elementwise import rms_norm

        return rms_norm(x, weight, eps)

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        from bladellm.kernels.triton.elementwise import fused_add_rms_norm

        return fused_add_rms_norm(x, residual, weight, eps)

    def rms_norm_unit_offset(self, x: torch.Tensor, weight: torch.Tensor,
                             eps: float) -> torch.Tensor:
        from bladellm.kernels.triton.elementwise import rms_norm_unit_offset

        return rms_norm_unit_offset(x, weight, eps)

    def fused_add_rms_norm_unit_offset(self, x: torch.Tensor, residual: torch.Tensor,
                                       weight: torch.Tensor, eps: float
                                       ) -> tuple[torch.Tensor, torch.Tensor]:
        from bladellm.kernels.triton.elementwise import fused_add_rms_norm_unit_offset

        return fused_add_rms_norm_unit_offset(x, residual, weight, eps)

    def layer_norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   eps: float) -> torch.Tensor:
        from bladellm.kernels.triton.elementwise import layer_norm

        return layer_norm(x, weight, bias, eps)

    def fused_add_layer_norm(self, x: torch.Tensor, residual: torch.Tensor,
                             weight: torch.Tensor, bias: torch.Tensor | None, eps: float
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        from bladellm.kernels.triton.elementwise import fused_add_layer_norm

        return fused_add_layer_norm(x, residual, weight, bias, eps)

    def rotary_embedding(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         cos_cache: torch.Tensor, sin_cache: torch.Tensor, head_dim: int,
                         rotary_dim: int, *, inplace: bool = True, interleaved: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        from bladellm.kernels.triton.elementwise import rotary_embedding

        return rotary_embedding(positions, q, k, cos_cache, sin_cache, head_dim, rotary_dim,
                                inplace=inplace, interleaved=interleaved)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        from bladellm.kernels.triton.elementwise import silu_and_mul

        return silu_and_mul(x)

    def act_and_mul(self, x: torch.Tensor, act: str) -> torch.Tensor:
        from bladellm.kernels.triton.elementwise import act_and_mul

        return act_and_mul(x, act)

    def activation(self, x: torch.Tensor, act: str) -> torch.Tensor:
        from bladellm.kernels.triton.elementwise import activation

        return activation(x, act)

    def fused_moe(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  packed: object | None = None) -> torch.Tensor:
        from bladellm.kernels.triton.moe import fused_moe

        return fused_moe(x, w13, w2, topk_weights, topk_ids)

    def describe(self) -> str:
        return "triton"

    def __reduce__(self) -> tuple:
        return (TritonKernels, ())
