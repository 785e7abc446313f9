"""The kernel set the layers call: one object whose methods are either compiled or reference.

``Kernels`` itself is the reference set (every method is the plain-PyTorch twin in ``ref.py``);
``CompiledKernels`` overrides the methods and hands any call it cannot take (a dtype, shape or
device it does not support) back to these.
"""

from __future__ import annotations

import torch

from bladellm.kernels import ref


class Kernels:
    """Reference kernels. ``name`` is ``"ref"`` or ``"compiled"``; ``isa`` the ISA the
    compiled code targets (``"none"`` for the reference)."""

    name: str = "ref"
    isa: str = "none"
    # Rows of x up to which ``linear_int4`` beats dequantize + GEMM (0: never; the reference
    # is that GEMM).
    int4_max_rows: int = 0

    def paged_attention(self, out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, block_tables: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        scale: float, *, sliding_window: int | None = None,
                        alibi_slopes: torch.Tensor | None = None,
                        soft_cap: float | None = None, max_query_len: int | None = None,
                        max_seq_len: int | None = None) -> None:
        """``ref.paged_attention``, per-layer features included (every set takes them).

        ``max_query_len`` / ``max_seq_len``: the longest query and context of the batch as host
        ints (``AttentionMetadata`` has them), for a set whose launch grid depends on them
        (Triton: without them it reads ``query_start_loc`` back, a host sync in every layer).
        They must be at least the true maxima; a host-side set needs neither and ignores them."""
        ref.paged_attention(out, query, k_cache, v_cache, block_tables, query_start_loc,
                            seq_lens, scale, sliding_window=sliding_window,
                            alibi_slopes=alibi_slopes, soft_cap=soft_cap)

    def reshape_and_cache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        ref.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return ref.rms_norm(x, weight, eps)

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return ref.fused_add_rms_norm(x, residual, weight, eps)

    def rms_norm_unit_offset(self, x: torch.Tensor, weight: torch.Tensor,
                             eps: float) -> torch.Tensor:
        """RMSNorm scaling by ``1 + weight`` in fp32 (``ref.rms_norm_unit_offset``)."""
        return ref.rms_norm_unit_offset(x, weight, eps)

    def fused_add_rms_norm_unit_offset(self, x: torch.Tensor, residual: torch.Tensor,
                                       weight: torch.Tensor, eps: float
                                       ) -> tuple[torch.Tensor, torch.Tensor]:
        return ref.fused_add_rms_norm_unit_offset(x, residual, weight, eps)

    def layer_norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   eps: float) -> torch.Tensor:
        return ref.layer_norm(x, weight, bias, eps)

    def fused_add_layer_norm(self, x: torch.Tensor, residual: torch.Tensor,
                             weight: torch.Tensor, bias: torch.Tensor | None, eps: float
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        return ref.fused_add_layer_norm(x, residual, weight, bias, eps)

    def rotary_embedding(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         cos_cache: torch.Tensor, sin_cache: torch.Tensor, head_dim: int,
                         rotary_dim: int, *, inplace: bool = True, interleaved: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        return ref.rotary_embedding(positions, q, k, cos_cache, sin_cache, head_dim, rotary_dim,
                                    inplace=inplace, interleaved=interleaved)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return ref.silu_and_mul(x)

    def act_and_mul(self, x: torch.Tensor, act: str) -> torch.Tensor:
        """[..., 2d] (gate | up) -> act(gate) * up; ``act`` one of ``ref.ACTIVATIONS``."""
        return ref.act_and_mul(x, act)

    def activation(self, x: torch.Tensor, act: str) -> torch.Tensor:
        """``act`` (one of ``ref.ACTIVATIONS``) elementwise."""
        return ref.activation(x, act)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               packed: object | None = None) -> torch.Tensor:
        """F.linear. ``packed``: what ``pack_linear_weight(weight)`` returned for this weight
        (made once at load time); the reference ignores it."""
        return ref.linear(x, weight, bias)

    def linear_int4(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                    zeros: torch.Tensor, bias: torch.Tensor | None, group: int) -> torch.Tensor:
        """Weight-only 4-bit linear (``ref.linear_int4``: codes uint8 ``[N, K / 2]``, two
        columns of a group per byte; fp32 scales and zeros ``[N, K / group]``)."""
        return ref.linear_int4(x, codes, scales, zeros, bias, group)

    def lora_sgmv(self, out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  order: torch.Tensor, seg_start: torch.Tensor, seg_slot: torch.Tensor,
                  rank: int, slice_offsets: tuple[int, ...]) -> None:
        """Every token's LoRA delta added to ``out`` in place (see ``ref.lora_sgmv``)."""
        ref.lora_sgmv(out, x, a, b, order, seg_start, seg_slot, rank, slice_offsets)

    def pack_linear_weight(self, weight: torch.Tensor) -> object | None:
        """A load-time form of ``weight`` that makes ``linear`` faster, or None (none needed)."""
        return None

    def packed_bytes(self, packed: object | None) -> int:
        """Memory held by what ``pack_linear_weight`` returned."""
        return 0

    def packed_bytes_bound(self, weight: torch.Tensor) -> int:
        """The most memory ``pack_linear_weight(weight)`` can add, known before packing (the
        runner decides from it whether the copies fit)."""
        return 0

    def moe_route(self, router_logits: torch.Tensor, top_k: int,
                  renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Mixture-of-experts routing: (weights [T, top_k] fp32, expert ids [T, top_k])
        (``ref.moe_route``)."""
        return ref.moe_route(router_logits, top_k, renormalize)

    def fused_moe(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  packed: object | None = None) -> torch.Tensor:
        """The experts of a mixture-of-experts MLP over only the selected experts
        (``ref.fused_moe``). ``packed``: what ``pack_moe_weights(w13, w2)`` returned (made once
        at load time); the reference ignores it."""
        return ref.fused_moe(x, w13, w2, topk_weights, topk_ids)

    def pack_moe_weights(self, w13: torch.Tensor, w2: torch.Tensor) -> object | None:
        """A load-time form of stacked expert weights that makes ``fused_moe`` faster, or None."""
        return None

    def apply_token_bitmask(self, logits: torch.Tensor, rows: torch.Tensor,
                            bitmask: torch.Tensor) -> None:
        """Ban, in place, the tokens a packed grammar bitmask bans (structured output)."""
        ref.apply_token_bitmask(logits, rows, bitmask)

    def describe(self) -> str:
        return "reference (plain PyTorch)"

    # A process-wide, stateless service held by layers: copying a model must not copy it
    # (the compiled set holds a ctypes library, which cannot be copied or pickled).
    def __copy__(self) -> "Kernels":
        return self

    def __deepcopy__(self, memo: dict) -> "Kernels":
        return self

    def __reduce__(self) -> tuple:
        return (Kernels, ())
