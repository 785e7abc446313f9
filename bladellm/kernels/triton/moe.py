"""Fused mixture-of-experts MLP in Triton (the GPU path), after vLLM's ``fused_moe``: the
(token, slot) pairs sorted by expert and padded per expert to whole blocks of ``BLOCK_M`` rows
(``align_by_expert``), then one grouped GEMM launch per projection, each program computing a
``BLOCK_M x BLOCK_N`` tile of one expert's rows against that expert's weights only:

1. ``h[pair] = x[pair // top_k] @ w13[e].T``      [T * top_k, 2I]
2. ``a = silu(gate) * up``                        [T * top_k, I]  (the SiLU-and-mul kernel)
3. ``y[pair] = round(a[pair] @ w2[e].T) * weight[pair]``   [T * top_k, H]
4. ``out[t] = sum_j y[t * top_k + j]``

The twin is ``kernels/ref.py: fused_moe`` (same contract; ids outside ``[0, E)`` contribute
nothing). Products accumulate in fp32 (an IEEE dot for fp32: no TF32), each GEMM
output rounds once to the dtype as F.linear does; the final sum over the ``top_k`` slots runs in
fp32 and rounds once, where the twin rounds after each expert: 16-bit results agree to an ulp.

Tests: tests/kernels/test_triton_moe.py, under ``TRITON_INTERPRET=1`` without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bladellm.kernels.triton import INTERPRETING
from bladellm.kernels.triton.elementwise import silu_and_mul


def align_by_expert(topk_ids: torch.Tensor, num_experts: int,
                    block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs, block_experts): the flat (token, slot) pair indices grouped by expert in
    ascending order, each expert's run padded to a multiple of ``block_m`` with the sentinel
    ``topk_ids.numel()``; and the expert of each block of ``block_m`` entries. Pairs whose id
    is outside ``[0, num_experts)`` are left out. Torch ops on the ids' device, no host sync
    beyond the padded length."""
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    valid = (flat >= 0) & (flat < num_experts)
    keyed = torch.where(valid, flat, torch.full_like(flat, num_experts))
    order = torch.argsort(keyed, stable=True)
    counts = torch.bincount(keyed, minlength=num_experts + 1)[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_start = torch.cumsum(padded, 0) - padded
    start = torch.cumsum(counts, 0) - counts
    num_valid = int(counts.sum())
    total = int(padded.sum())
    sorted_pairs = torch.full((max(total, block_m),), n, dtype=torch.int32, device=flat.device)
    if num_valid:
        pairs = order[:num_valid]
        e = keyed[pairs]
        rank = torch.arange(num_valid, device=flat.device) - start[e]
        sorted_pairs[padded_start[e] + rank] = pairs.to(torch.int32)
    block_experts = torch.repeat_interleave(
        torch.arange(num_experts, device=flat.device, dtype=torch.int32), padded // block_m)
    if block_experts.numel() == 0:  # nothing routed here: one block of sentinels
        block_experts = torch.zeros(1, dtype=torch.int32, device=flat.device)
    return sorted_pairs, block_experts


@triton.jit
def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, w_ptr, pairs_ptr, experts_ptr, N, K, num_pairs,
                         stride_am, stride_be, stride_bn, stride_bk, stride_cm,
                         TOP_K: tl.constexpr, A_BY_PAIR: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                         DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    """c[pair, n] = a[row] . b[e, n, :] (times weight[pair]) for this block's pairs, all of
    expert e; row = pair (A_BY_PAIR) or the pair's token (pair // TOP_K)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + offs_m)
    valid = pairs < num_pairs
    expert = tl.load(experts_ptr + pid_m).to(tl.int64)
    rows = pairs if A_BY_PAIR else pairs // TOP_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    b_base = b_ptr + expert * stride_be
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_ptr + rows[:, None].to(tl.int64) * stride_am + offs_k[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_base + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if DOT_FP32:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    out_ty = c_ptr.dtype.element_ty
    if MUL_WEIGHT:  # the twin: F.linear's output in the dtype, times the weight in the dtype
        w = tl.load(w_ptr + pairs, mask=valid, other=0.0)
        acc = acc.to(out_ty).to(tl.float32) * w[:, None]
    tl.store(c_ptr + pairs[:, None].to(tl.int64) * stride_cm + offs_n[None, :],
             acc.to(out_ty), mask=valid[:, None] & n_ok[None, :])


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, weights: torch.Tensor,
                  sorted_pairs: torch.Tensor, block_experts: torch.Tensor, top_k: int,
                  a_by_pair: bool, mul_weight: bool, block_m: int) -> None:
    N, K = b.shape[1], b.shape[2]
    block_n = 64 if N >= 64 else 32
    grid = (block_experts.numel(), triton.cdiv(N, block_n))
    # fp32: an IEEE dot (no TF32). The interpreter's bf16 dot is wrong (kernels/triton/
    # __init__.py): an fp32 dot of the same values there, which changes only rounding.
    dot_fp32 = a.dtype == torch.float32 or (INTERPRETING and a.dtype == torch.bfloat16)
    _grouped_gemm_kernel[grid](
        a, b, c, weights, sorted_pairs, block_experts, N, K, c.shape[0],
        a.stride(0), b.stride(0), b.stride(1), b.stride(2), c.stride(0),
        TOP_K=top_k, A_BY_PAIR=a_by_pair, MUL_WEIGHT=mul_weight, DOT_FP32=dot_fp32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=32)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """``ref.fused_moe`` on the GPU (see the module docstring)."""
    T, H = x.shape
    E, k = w13.shape[0], topk_ids.shape[1]
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"fused_moe: dtype {x.dtype} is not supported")
    if T == 0:
        return torch.zeros_like(x)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    block_m = 16 if T * k <= 16 * E else 64
    sorted_pairs, block_experts = align_by_expert(topk_ids, E, block_m)
    # The twin multiplies in x's dtype: round the weights to it, multiply in fp32 (exact).
    weights = topk_weights.reshape(-1).to(x.dtype).to(torch.float32).contiguous()
    h = torch.empty(T * k, w13.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, h, weights, sorted_pairs, block_experts, k, False, False, block_m)
    act = silu_and_mul(h)
    y = torch.zeros(T * k, H, dtype=x.dtype, device=x.device)  # foreign pairs stay zero
    _grouped_gemm(act, w2, y, weights, sorted_pairs, block_experts, k, True, True, block_m)
    return y.view(T, k, H).sum(dim=1, dtype=torch.float32).to(x.dtype)
