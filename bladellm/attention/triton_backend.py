"""``--attn_cls triton``: the paged-attention backend with the Triton kernels
(``kernels/triton``): the KV store and one attention kernel for every query length, reading the
KV blocks in place. For CUDA devices; on a CPU only under ``TRITON_INTERPRET=1`` (Triton's
interpreter), which is how the tests run the engine on it without a GPU.
"""

from __future__ import annotations

import os

import torch

from bladellm.attention.paged_backend import PagedAttentionBackend


class TritonAttentionKernels:
    """The two kernels ``PagedAttentionBackend`` calls, from ``kernels/triton``."""

    def reshape_and_cache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        from bladellm.kernels.triton.elementwise import reshape_and_cache

        reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)

    def paged_attention(self, out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, block_tables: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        scale: float) -> None:
        from bladellm.kernels.triton.attention import paged_attention

        paged_attention(out, query, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                        scale)


def make_triton_backend(device: str | torch.device) -> PagedAttentionBackend:
    """Refuses a device Triton cannot run on (a CPU without the interpreter) or a missing
    triton, naming ``--attn_cls``."""
    try:
        import triton  # noqa: F401
    except ImportError:
        raise ValueError("--attn_cls triton: the triton package is not installed "
                         "(pip install 'bladellm[gpu]')") from None
    if torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"--attn_cls triton: Triton kernels need a CUDA device (this engine "
                         f"runs on {torch.device(device).type}); on a CPU they run only under "
                         f"TRITON_INTERPRET=1 (slow, for tests)")
    return PagedAttentionBackend(TritonAttentionKernels(), "triton")
