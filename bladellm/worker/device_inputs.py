"""Step inputs to the device: the one host-to-device hand-over of a step.

The persistent batch builds a step's inputs in host buffers (numpy views, ``input_batch.py``);
``DeviceStager.stage`` returns the same ``StepInputs`` with every host tensor in it (ids,
positions, attention metadata, sampling metadata, and whatever fields later steps add, found by
walking the dataclasses) on the runner's device. Where the platform pins memory, each tensor is
first packed into one page-locked arena and copied from there with ``non_blocking=True``, so
the copies queue behind the previous step's work instead of stalling the host. Numpy arrays stay
on the host (the host-side plans read them).

The arena is reused every step. A step does not always end by reading its sampled ids on the
host: a non-driver tensor-parallel rank, a pipeline stage before the last and a step in which
nothing samples return without any host sync, so the host could start the next step (and
overwrite the arena) while the device still reads the last one's copies. ``stage`` therefore
records a fence (the platform's ``CopyFence``: a CUDA event; a no-op on a CPU) after its last
copy and waits on it before it writes the arena again. The wait costs nothing where the step
ended by reading sampled ids (the copies are long done). Under ``--async_scheduling`` step n + 1
is staged while step n runs: the wait covers step n's copies only (queued behind step n - 1,
whose ids were read), not its forward, so one arena serves (reasoned; not yet timed on a GPU).

The arena's size and its contents come from one walk of the step (``_host_tensors``): the same
list of host tensors is summed, reserved and then copied, so nested containers (the hybrid KV
groups' ``(tables, slots)`` pairs, M-RoPE's ``[3, T]`` positions) cannot be counted differently
from how they are copied.

On a CPU device nothing moves: ``stage`` returns its argument.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from bladellm.platforms.interface import CopyFence

_HOST = torch.device("cpu")
_ALIGN = 64  # bytes: each tensor's slot in the arena starts on a cache line


def _slot_bytes(t: torch.Tensor) -> int:
    return -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN


class DeviceStager:
    def __init__(self, device: torch.device, pin_memory: bool,
                 fence: CopyFence | None = None) -> None:
        self.device = device
        self.pin_memory = pin_memory
        self.fence = fence if fence is not None else CopyFence()
        self._arena = torch.empty(0, dtype=torch.uint8)

    def stage(self, step: Any) -> Any:
        """``step`` (a dataclass of tensors, numpy arrays and nested dataclasses, lists, tuples
        and dicts) with its host tensors on the device."""
        if self.device == _HOST:
            return step
        host = _host_tensors(step)
        if not self.pin_memory:
            moved = [t.to(self.device, non_blocking=True) for t in host]
        else:
            self.fence.wait()  # the previous step's copies have read the arena
            self._reserve(sum(_slot_bytes(t) for t in host))
            moved, used = [], 0
            for t in host:
                nbytes = t.numel() * t.element_size()
                slot = self._arena[used:used + nbytes].view(t.dtype).view(t.shape)
                slot.copy_(t)
                moved.append(slot.to(self.device, non_blocking=True))
                used += _slot_bytes(t)
            self.fence.record()
        by_id = {id(t): m for t, m in zip(host, moved)}
        return _replace_tensors(step, by_id)

    def _reserve(self, nbytes: int) -> None:
        if self._arena.numel() < nbytes:
            # Grown only here, after the fence: nothing reads the old arena any more.
            self._arena = _pinned_bytes(max(nbytes, 2 * self._arena.numel()))


def _pinned_bytes(nbytes: int) -> torch.Tensor:
    """A page-locked host buffer (tests swap in plain memory to run the arena path on a CPU)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


_MAY_HOLD = (torch.Tensor, list, tuple, dict)


def _containers(value: Any) -> list | None:
    """The values inside ``value`` that may hold tensors, or None for a leaf. Lists are
    homogeneous in step inputs, so one whose first item is not a tensor or a container (req_ids,
    a row's token ids: long) is a leaf without a scan; tuples are short records (a tree entry's
    ints and mask), scanned whole."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [getattr(value, f.name) for f in dataclasses.fields(value) if f.init]
    if isinstance(value, tuple):
        return list(value) if any(isinstance(v, _MAY_HOLD) or dataclasses.is_dataclass(v)
                                  for v in value) else None
    if isinstance(value, list):
        if value and (isinstance(value[0], _MAY_HOLD) or dataclasses.is_dataclass(value[0])):
            return value
        return None
    if isinstance(value, dict):
        return list(value.values())
    return None


def _host_tensors(value: Any) -> list[torch.Tensor]:
    """Every distinct host tensor in ``value``, in walk order."""
    out: dict[int, torch.Tensor] = {}
    _collect(value, out)
    return list(out.values())


def _collect(value: Any, out: dict[int, torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        if value.device == _HOST:
            out.setdefault(id(value), value)
        return
    for v in _containers(value) or ():
        _collect(v, out)


def _replace_tensors(value: Any, by_id: dict[int, torch.Tensor]) -> Any:
    """``value`` rebuilt with each tensor in ``by_id`` replaced (containers without one are
    returned as they are, so host-only parts such as the generators stay shared)."""
    if isinstance(value, torch.Tensor):
        return by_id.get(id(value), value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {}
        for f in dataclasses.fields(value):
            if f.init:
                old = getattr(value, f.name)
                new = _replace_tensors(old, by_id)
                if new is not old:
                    changes[f.name] = new
        return dataclasses.replace(value, **changes) if changes else value
    items = _containers(value)
    if items is None:
        return value
    new_items = [_replace_tensors(v, by_id) for v in items]
    if all(a is b for a, b in zip(new_items, items)):
        return value
    if isinstance(value, dict):
        return dict(zip(value.keys(), new_items))
    return type(value)(new_items)
