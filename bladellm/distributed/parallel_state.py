"""Tensor- and pipeline-parallel groups of this process, on ``torch.distributed``.

Rank layout: ``rank = pp_rank * tp_size + tp_rank`` (a pipeline stage is ``tp_size`` consecutive
ranks). Every rank is its own process (the multi-process executor starts them), so the groups are
per-process state set once by ``init_model_parallel`` and read by the layers at construction time;
a process that never called it (world size 1: the engine core, tests, the offline ``LLM``) gets
``WORLD_1`` and every collective is the identity. ``reset_model_parallel`` exists for the worker's
shutdown, not for tests: tests that need ranks spawn processes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class GroupCoordinator:
    """One process group as seen from this rank: its position, its size, and the collectives the
    layers need. ``group`` is None at size 1 (no process group exists then)."""

    rank_in_group: int
    world_size: int
    ranks: tuple[int, ...]
    group: dist.ProcessGroup | None = None
    # Where this group's messages live: "cpu" under gloo, this rank's GPU under NCCL (which
    # moves device tensors only). Headers and scratch buffers are made here.
    device: str = "cpu"

    @property
    def is_first(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group (in place when the group has several ranks)."""
        if self.world_size == 1:
            return x
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1,
                   sizes: list[int] | None = None) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim``. ``sizes`` (each rank's extent along
        ``dim``) allows uneven shards: they are padded to the largest for the collective, which
        needs equal shapes, and trimmed after."""
        if self.world_size == 1:
            return x
        dim = dim % x.dim()
        if sizes is None:
            sizes = [x.size(dim)] * self.world_size
        if len(sizes) != self.world_size or x.size(dim) != sizes[self.rank_in_group]:
            raise ValueError(f"all_gather: sizes {sizes} do not match this rank's extent "
                             f"{x.size(dim)} in a group of {self.world_size}")
        largest = max(sizes)
        if x.size(dim) < largest:
            pad_shape = list(x.shape)
            pad_shape[dim] = largest - x.size(dim)
            x = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim=dim)

    def all_to_all(self, x: torch.Tensor, send_sizes: list[int],
                   recv_sizes: list[int]) -> torch.Tensor:
        """Rows ``x[sum(send_sizes[:j]) : ...]`` go to group rank j; returns the rows every
        rank sent here, in rank order (``sum(recv_sizes)`` of them). Uneven sizes, zeros
        included (gloo and NCCL both take them). Expert parallelism's token exchange."""
        if self.world_size == 1:
            return x
        out = x.new_empty((sum(recv_sizes), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_sizes, send_sizes, group=self.group)
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``x`` of group rank ``src`` on every rank (in place)."""
        if self.world_size > 1:
            dist.broadcast(x, src=self.ranks[src], group=self.group)
        return x

    def send(self, x: torch.Tensor, dst: int) -> None:
        """Point-to-point to group rank ``dst`` (pipeline stages)."""
        dist.send(x.contiguous(), dst=self.ranks[dst], group=self.group)

    def recv(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Fill ``x`` (its shape and dtype must be known) from group rank ``src``."""
        dist.recv(x, src=self.ranks[src], group=self.group)
        return x

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)


WORLD_1 = GroupCoordinator(rank_in_group=0, world_size=1, ranks=(0,))


@dataclass(frozen=True)
class ParallelGroups:
    tp: GroupCoordinator
    pp: GroupCoordinator
    # --enable_expert_parallel: mixture-of-experts layers split their experts over the TP group
    # (whole experts per rank) instead of each expert's intermediate size (get_ep_group).
    expert_parallel: bool = False

    @property
    def rank(self) -> int:
        return self.pp.rank_in_group * self.tp.world_size + self.tp.rank_in_group

    @property
    def world_size(self) -> int:
        return self.tp.world_size * self.pp.world_size


_GROUPS = ParallelGroups(tp=WORLD_1, pp=WORLD_1)


def init_model_parallel(rank: int, tp_size: int, pp_size: int, init_method: str,
                        backend: str = "gloo", timeout_s: float = 600.0,
                        expert_parallel: bool = False, device: str = "cpu") -> ParallelGroups:
    """Join the default group of ``tp_size * pp_size`` ranks and build the TP and PP groups.

    Every rank must call this with the same sizes (``new_group`` is collective). ``init_method``
    is a torch.distributed URL (``tcp://host:port``, ``env://`` under torchrun). ``backend``
    and ``device`` come from the platform (``Platform.dist_backend``: gloo on CPU, NCCL with
    this rank's GPU).
    """
    global _GROUPS
    world = tp_size * pp_size
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside a world of {world}")
    if world == 1:
        _GROUPS = ParallelGroups(tp=WORLD_1, pp=WORLD_1)
        return _GROUPS
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    tp_rank, pp_rank = rank % tp_size, rank // tp_size
    tp = pp = None
    # new_group must be called by every rank for every group, in the same order.
    for stage in range(pp_size):
        ranks = tuple(range(stage * tp_size, (stage + 1) * tp_size))
        group = dist.new_group(list(ranks)) if tp_size > 1 else None
        if stage == pp_rank:
            tp = GroupCoordinator(tp_rank, tp_size, ranks, group, device)
    for column in range(tp_size):
        ranks = tuple(range(column, world, tp_size))
        group = dist.new_group(list(ranks)) if pp_size > 1 else None
        if column == tp_rank:
            pp = GroupCoordinator(pp_rank, pp_size, ranks, group, device)
    assert tp is not None and pp is not None
    _GROUPS = ParallelGroups(tp=tp, pp=pp, expert_parallel=expert_parallel)
    return _GROUPS


def reset_model_parallel() -> None:
    """Leave the groups (worker shutdown)."""
    global _GROUPS
    if dist.is_initialized():
        dist.destroy_process_group()
    _GROUPS = ParallelGroups(tp=WORLD_1, pp=WORLD_1)


def get_groups() -> ParallelGroups:
    return _GROUPS


def get_tp_group() -> GroupCoordinator:
    return _GROUPS.tp


def get_pp_group() -> GroupCoordinator:
    return _GROUPS.pp


def get_ep_group() -> GroupCoordinator:
    """The group mixture-of-experts layers split their experts over: the TP group under
    --enable_expert_parallel, else a group of one (experts are then split by intermediate size
    over the TP group, like dense MLPs)."""
    return _GROUPS.tp if _GROUPS.expert_parallel else WORLD_1


@contextlib.contextmanager
def tp_shape_for_split(rank: int, size: int, pp_rank: int = 0, pp_size: int = 1,
                       expert_parallel: bool = False) -> Iterator[GroupCoordinator]:
    """Build layers as TP rank ``rank`` of ``size`` (of pipeline stage ``pp_rank`` of
    ``pp_size``) without any process group (``blade_llm_split``).

    The layers read the groups only at construction to size their shards and pick their stage's
    layers, so coordinators of those ranks and sizes with no ``group`` give exactly the
    parameters a real rank holds. Their collectives must never run: a forward under this context
    would fail (no process group). The previous groups are restored on exit.
    """
    global _GROUPS
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside tensor_parallel_size {size}")
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"stage {pp_rank} outside pipeline_parallel_size {pp_size}")
    if dist.is_initialized() or _GROUPS.world_size != 1:
        raise RuntimeError("tp_shape_for_split: this process already belongs to a process group")
    first = pp_rank * size
    fake = GroupCoordinator(rank_in_group=rank, world_size=size,
                            ranks=tuple(range(first, first + size)))
    stage = GroupCoordinator(rank_in_group=pp_rank, world_size=pp_size,
                             ranks=tuple(range(rank, size * pp_size, size)))
    saved = _GROUPS
    _GROUPS = ParallelGroups(tp=fake, pp=stage, expert_parallel=expert_parallel)
    try:
        yield fake
    finally:
        _GROUPS = saved
