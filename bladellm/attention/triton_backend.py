"""``--attn_cls triton``: the paged-attention backend with the Triton kernels
(``kernels/triton``): the KV store and one attention kernel for every query length, reading the
KV blocks in place. For CUDA devices; on a CPU only under ``TRITON_INTERPRET=1`` (Triton's
interpreter), which is how the tests run the engine on it without a GPU.
"""

from __future__ import annotations

import os

import torch

from bladellm.attention.paged_backend import PagedAttentionBackend


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
    from bladellm.kernels.triton_set import TritonKernels

    # Only its attention and KV store are used here (the layers keep the start-up kernel set).
    return PagedAttentionBackend(TritonKernels(), "triton")
