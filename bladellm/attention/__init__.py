"""Attention backends: the interface (``backend.py``) and the selector used once at startup."""

from __future__ import annotations

import torch

from bladellm.attention.backend import AttentionBackend, AttentionMetadata

_BACKENDS = ("auto", "paged", "torch", "triton")


def get_attn_backend(name: str | None, device: str | torch.device) -> AttentionBackend:
    """Backend for ``--attn_cls``: ``auto`` / ``paged`` run the compiled kernels chosen for this
    CPU (the reference if they cannot be built), ``torch`` the plain-PyTorch reference twins,
    ``triton`` the Triton kernels (CUDA; on a CPU only under ``TRITON_INTERPRET=1``)."""
    from bladellm.attention.paged_backend import PagedAttentionBackend

    name = (name or "auto").lower()
    if name in ("auto", "paged"):
        from bladellm.kernels import get_kernels

        return PagedAttentionBackend(get_kernels(), "paged")
    if name == "torch":
        from bladellm.kernels import Kernels

        return PagedAttentionBackend(Kernels(), "torch")  # the reference set
    if name == "triton":
        from bladellm.attention.triton_backend import make_triton_backend

        return make_triton_backend(device)
    raise ValueError(f"--attn_cls: unknown attention backend {name!r}; supported: "
                     f"{', '.join(_BACKENDS)}")


__all__ = ["AttentionBackend", "AttentionMetadata", "get_attn_backend"]
