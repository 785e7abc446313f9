"""Step inputs to the device: the one host-to-device hand-over of a step.

The persistent batch builds a step's inputs in host buffers (numpy views, ``input_batch.py``);
``DeviceStager.stage`` returns the same ``StepInputs`` with every host tensor in it (ids,
positions, attention metadata, sampling metadata, and whatever fields later steps add, found by
walking the dataclasses) on the runner's device. Where the platform pins memory, each tensor is
first packed into one page-locked arena and copied from there with ``non_blocking=True``, so
the copies queue behind the previous step's work instead of stalling the host. Numpy arrays stay
on the host (the host-side plans read them).

The arena is reused every step. That is safe because a step ends by reading its sampled ids on
the host (the step's only host sync), which orders every copy of that step before the next
step overwrites the arena. An overlapped scheduler that reads sampled ids a step late needs two
arenas, alternated.

On a CPU device nothing moves: ``stage`` returns its argument.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

_HOST = torch.device("cpu")
_ALIGN = 64  # bytes: each tensor's slot in the arena starts on a cache line


class DeviceStager:
    def __init__(self, device: torch.device, pin_memory: bool) -> None:
        self.device = device
        self.pin_memory = pin_memory
        self._arena = torch.empty(0, dtype=torch.uint8)
        self._used = 0

    def stage(self, step: Any) -> Any:
        """``step`` (a dataclass of tensors, numpy arrays and nested dataclasses) with its host
        tensors on the device."""
        if self.device == _HOST:
            return step
        if self.pin_memory:
            self._reserve(_host_bytes(step))
        self._used = 0
        return self._move(step)

    def _reserve(self, nbytes: int) -> None:
        if self._arena.numel() < nbytes:
            # Grown only here, between steps: nothing reads the old arena any more.
            self._arena = torch.empty(max(nbytes, 2 * self._arena.numel()), dtype=torch.uint8,
                                      pin_memory=True)

    def _move(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            changes = {f.name: self._move(getattr(value, f.name))
                       for f in dataclasses.fields(value) if f.init}
            return dataclasses.replace(value, **changes)
        if isinstance(value, (list, tuple)) and any(
                isinstance(v, (torch.Tensor, list, tuple)) for v in value):
            return type(value)(self._move(v) for v in value)
        if isinstance(value, dict) and any(isinstance(v, torch.Tensor) for v in value.values()):
            return {k: self._move(v) for k, v in value.items()}
        return value

    def _tensor(self, t: torch.Tensor) -> torch.Tensor:
        if t.device != _HOST:
            return t
        if not self.pin_memory:
            return t.to(self.device, non_blocking=True)
        t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        start = self._used
        self._used = start + -(-nbytes // _ALIGN) * _ALIGN
        slot = self._arena[start:start + nbytes].view(t.dtype).view(t.shape)
        slot.copy_(t)
        return slot.to(self.device, non_blocking=True)


def _host_bytes(value: Any) -> int:
    """Arena bytes ``DeviceStager._move`` will use for ``value``'s host tensors."""
    if isinstance(value, torch.Tensor):
        if value.device != _HOST:
            return 0
        return -(-value.numel() * value.element_size() // _ALIGN) * _ALIGN
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(_host_bytes(getattr(value, f.name)) for f in dataclasses.fields(value)
                   if f.init)
    if isinstance(value, (list, tuple)):
        return sum(_host_bytes(v) for v in value if isinstance(v, torch.Tensor))
    if isinstance(value, dict):
        return sum(_host_bytes(v) for v in value.values() if isinstance(v, torch.Tensor))
    return 0
