"""Activations between consecutive pipeline stages (point-to-point on the PP group).

A stage sends ``[2, num_tokens, hidden]`` (the hidden states and the residual stream: the next
layer's fused add-norm needs both) to the same TP rank of the next stage. Sends are
asynchronous (``isend``): a stage hands its step's activations over and goes on with the next
micro-batch while the next stage works on this one; the send is completed before the next one
starts, so at most one message per stage is in flight and the buffer stays alive until then.
Receives block: a stage cannot start a step before the previous stage has finished it. Every
rank runs the steps in the order the executor published them, so sends and receives always
pair up in order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from bladellm.distributed.parallel_state import GroupCoordinator


class StageChannel:
    def __init__(self, group: GroupCoordinator) -> None:
        self.group = group
        self._in_flight: tuple[Any, torch.Tensor] | None = None  # (work, buffer) of the last send

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """Hand ``hidden`` and ``residual`` ([num_tokens, hidden]) to the next stage."""
        self.wait()
        buf = torch.stack([hidden, residual])
        dst = self.group.ranks[self.group.rank_in_group + 1]
        self._in_flight = (dist.isend(buf, dst=dst, group=self.group.group), buf)

    def recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) of this step from the previous stage."""
        buf = torch.empty(2, num_tokens, hidden_size, dtype=dtype, device=device)
        dist.recv(buf, src=self.group.ranks[self.group.rank_in_group - 1], group=self.group.group)
        return buf[0], buf[1]

    def wait(self) -> None:
        """Complete the last send (before the next one, and before the worker leaves)."""
        if self._in_flight is not None:
            self._in_flight[0].wait()
            self._in_flight = None
