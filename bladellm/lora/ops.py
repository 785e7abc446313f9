"""The batched LoRA delta: every token adds ``x @ A[slot] @ B[slot]`` of its own adapter slot.

Punica's kernels take a per-token adapter index: BGMV gathers one adapter per token (decode),
SGMV multiplies contiguous segments of tokens that share an adapter (prefill). Once per step,
``LoRAMapping.build`` groups the tokens by slot with numpy (a stable argsort); every layer then
reuses that grouping. ``LoRALinear`` calls ``lora_delta``, which runs one of:

- the compiled CPU kernel (``Kernels.lora_sgmv``, ``bladellm/kernels/cpu/lora.cpp``; its
  plain-PyTorch twin ``kernels/ref.py:lora_sgmv`` is the oracle): one call per layer fuses
  shrink and expand over the unpadded segments, reads only each fused slice's diagonal block of
  B, and adds into the base output in place; no gather, scatter or padding, which makes it
  several times cheaper than the path below, most on a step mixing decodes with a prefill
  chunk (docs/kernels.md).
- ``sgmv_shrink_expand`` (where no kernel was compiled): segmented and padded, ``k`` active
  slots each a padded row of ``max_seg`` tokens; one ``index_select`` gathers the tokens into
  ``[k, max_seg, in]``, one ``bmm`` with the active slots' A (shrink), one with their
  block-diagonal B (expand), one ``index_add_`` puts the deltas back on their tokens.

No Python loop over adapters or requests either way; base-model tokens (slot -1) are not
touched, and a step without adapter tokens has no mapping at all. ``bgmv_reference`` is the
per-token definition, the tests' oracle; a GPU kernel (Triton) would take ``lora_delta``'s seam.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from bladellm.kernels import Kernels

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class LoRAMapping:
    """Per-step token → slot layout, shared by every LoRA layer of the forward pass."""

    slots: torch.Tensor  # [k] active slot ids (sorted)
    # The active slots are consecutive (always true for one): a view of the stacks, no gather.
    slot_range: tuple[int, int] | None
    gather: torch.Tensor  # [k * max_seg] token index per padded position (pads read token 0)
    valid: torch.Tensor  # [n] padded positions that hold a real token
    dest: torch.Tensor  # [n] the token each valid position belongs to
    max_seg: int
    padded: bool  # some segment is shorter than max_seg (valid selects the real rows)
    identity: bool  # one adapter for every token of the step: no gather or scatter needed
    # The same grouping unpadded, for the compiled kernel: segment g is the tokens
    # dest[seg_start[g]:seg_start[g + 1]], all of slot slots[g].
    seg_start: torch.Tensor  # [k + 1]

    @classmethod
    def build(cls, token_slots: np.ndarray, num_slots: int) -> "LoRAMapping | None":
        """``token_slots[t]``: slot of token t, -1 for the base model. None if no token has one."""
        tokens = np.flatnonzero(token_slots >= 0)
        if not len(tokens):
            return None
        slots_of = token_slots[tokens]
        active, group = np.unique(slots_of, return_inverse=True)
        order = np.argsort(group, kind="stable")
        counts = np.bincount(group, minlength=len(active))
        starts = np.zeros(len(active), np.int64)
        np.cumsum(counts[:-1], out=starts[1:])
        max_seg = int(counts.max())
        g_sorted = group[order]
        within = np.arange(len(order)) - starts[g_sorted]
        valid = g_sorted * max_seg + within
        gather = np.zeros(len(active) * max_seg, np.int64)
        dest = tokens[order]
        gather[valid] = dest
        return cls(
            slots=torch.from_numpy(active.astype(np.int64)),
            slot_range=((int(active[0]), len(active))
                        if int(active[-1]) - int(active[0]) + 1 == len(active) else None),
            gather=torch.from_numpy(gather), valid=torch.from_numpy(valid.astype(np.int64)),
            dest=torch.from_numpy(dest.astype(np.int64)), max_seg=max_seg,
            padded=len(active) * max_seg != len(tokens),
            identity=len(active) == 1 and len(tokens) == len(token_slots),
            seg_start=torch.from_numpy(np.append(starts, len(tokens)).astype(np.int64)))


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
               mapping: LoRAMapping, kernels: Kernels, rank: int,
               slice_offsets: torch.Tensor) -> None:
    """``out[t] += x[t] @ a[s] @ b[s]`` for every token t with slot s: the compiled kernel (one
    call per layer, block-diagonal zeros skipped, no gather/scatter/padding) when there is one,
    else ``sgmv_shrink_expand``. ``slice_offsets``: int64 column offsets of the n output slices
    and their end (b's slice j lives in rows ``j*rank:(j+1)*rank``, columns o_j:o_{j+1})."""
    # The kernel takes activations and stacks of one dtype (fp32 or bf16); anything else (e.g.
    # --lora_dtype float32 on a bf16 model) would reach its per-segment reference twin, so the
    # batched PyTorch path runs it instead.
    if kernels.name == "compiled" and x.dtype == a.dtype and x.dtype in _KERNEL_DTYPES:
        kernels.lora_sgmv(out, x, a, b, mapping.dest, mapping.seg_start, mapping.slots, rank,
                          slice_offsets)
    else:
        sgmv_shrink_expand(x, a, b, out, mapping)


def sgmv_shrink_expand(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                       mapping: LoRAMapping) -> None:
    """``out[t] += x[t] @ a[s] @ b[s]`` for every token t with slot s. ``a``: ``[num_slots, in,
    n*rank]``; ``b``: ``[num_slots, n*rank, out]``, block-diagonal over a fused layer's n output
    slices (one expand matmul instead of n); the stacks' dtype is the LoRA dtype, ``out`` keeps
    its own. Four tensor ops per layer: few small ops matter more than flops on a busy CPU."""
    k = mapping.slots.numel()
    xs = x if mapping.identity else x.index_select(0, mapping.gather)
    xs = xs.view(k, mapping.max_seg, x.shape[1]).to(a.dtype)
    if mapping.slot_range is not None:
        first, count = mapping.slot_range
        a, b = a.narrow(0, first, count), b.narrow(0, first, count)
    else:
        a, b = a.index_select(0, mapping.slots), b.index_select(0, mapping.slots)
    d = torch.bmm(torch.bmm(xs, a), b).view(-1, b.shape[2])  # [k * max_seg, out]
    if mapping.padded:
        d = d.index_select(0, mapping.valid)
    if mapping.identity:
        out.add_(d.to(out.dtype))
    else:
        out.index_add_(0, mapping.dest, d.to(out.dtype))


def bgmv_reference(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   token_slots: torch.Tensor) -> torch.Tensor:
    """The per-token definition (gather each token's adapter), for tests: the delta ``[T, out]``."""
    keep = (token_slots >= 0).to(torch.float64)[:, None]
    idx = token_slots.clamp(min=0)
    h = torch.einsum("ti,tir->tr", x.double(), a.double()[idx])
    return torch.einsum("tr,tro->to", h, b.double()[idx]) * keep
