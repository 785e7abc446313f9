"""The kernel set of the model being built, handed to its layers at construction.

Whoever builds a model (the worker, with the set it resolved once from ``--kernels`` and the
device) builds it inside ``building_with(kernels)``; each layer that runs kernels takes the set
in its constructor (``kernels_for``) and keeps it. The scope is a context variable, like
``torch.device(...)`` around construction: never a process-wide choice, so two engines in one
process each build with their own set. A layer built outside any scope is an error, not a silent
default.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

from bladellm.kernels.interface import Kernels

_BUILDING: ContextVar[Kernels | None] = ContextVar("bladellm_building_kernels", default=None)


@contextlib.contextmanager
def building_with(kernels: Kernels) -> Iterator[Kernels]:
    """Layers constructed inside take ``kernels``."""
    token = _BUILDING.set(kernels)
    try:
        yield kernels
    finally:
        _BUILDING.reset(token)


def kernels_for(owner: str) -> Kernels:
    """The kernel set of the model being built; ``owner`` names the layer for the error."""
    kernels = _BUILDING.get()
    if kernels is None:
        raise RuntimeError(f"{owner}: built outside `building_with(kernels)`; the kernel set is "
                           f"chosen once (--kernels) by whoever builds the model and handed to "
                           f"its layers")
    return kernels
