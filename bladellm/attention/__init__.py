"""Attention backends: the interface (``backend.py``) and the selector used once at startup."""

from __future__ import annotations

import torch

from bladellm.attention.backend import AttentionBackend, AttentionContext, AttentionMetadata

# --attn_cls value -> backend; "auto" / None picks per device.
_BACKENDS = ("torch",)


def get_attn_backend(name: str | None, device: str | torch.device) -> AttentionBackend:
    """Backend for ``--attn_cls`` (None or "auto": the best available for ``device``).

    Only the torch reference exists so far; a Triton backend will become the GPU default here.
    """
    name = (name or "auto").lower()
    if name == "auto":
        name = "torch"
    if name == "torch":
        from bladellm.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    raise ValueError(f"--attn_cls: unknown attention backend {name!r}; supported: "
                     f"auto, {', '.join(_BACKENDS)}")


__all__ = ["AttentionBackend", "AttentionContext", "AttentionMetadata", "get_attn_backend"]
