"""Attention backends: the interface (``backend.py``) and the selector used once at startup."""

from __future__ import annotations

from bladellm.attention.backend import AttentionBackend, AttentionFeatures, AttentionMetadata
from bladellm.kernels.interface import Kernels

_BACKENDS = ("auto", "paged", "torch", "triton")


def get_attn_backend(name: str | None, kernels: Kernels,
                     flag: str = "--attn_cls") -> AttentionBackend:
    """Backend for ``--attn_cls`` (``flag``: ``--draft.attn_cls`` for the draft model) over the
    worker's kernel set ``kernels`` (``--kernels``, resolved once with the device):

    - ``auto``: the set's paged attention (named ``triton`` for the Triton set, else ``paged``);
    - ``paged``: the set's paged attention;
    - ``torch``: the plain-PyTorch reference twins, whatever the set (the oracle);
    - ``triton``: the Triton kernels; the set must be the Triton one (``--kernels triton``, or
      ``auto``, which resolves to it when an attention backend asks for triton).
    """
    from bladellm.attention.paged_backend import PagedAttentionBackend

    name = (name or "auto").lower()
    if name == "auto":
        return PagedAttentionBackend(kernels, "triton" if kernels.name == "triton" else "paged")
    if name == "paged":
        return PagedAttentionBackend(kernels, "paged")
    if name == "torch":
        return PagedAttentionBackend(Kernels(), "torch")  # the reference set
    if name == "triton":
        if kernels.name != "triton":
            raise ValueError(f"{flag} triton: the Triton attention kernels need the Triton "
                             f"kernel set, but --kernels resolved to {kernels.name}; pass "
                             f"--kernels triton (or auto)")
        return PagedAttentionBackend(kernels, "triton")
    raise ValueError(f"{flag}: unknown attention backend {name!r}; supported: "
                     f"{', '.join(_BACKENDS)}")


__all__ = ["AttentionBackend", "AttentionFeatures", "AttentionMetadata", "get_attn_backend"]
