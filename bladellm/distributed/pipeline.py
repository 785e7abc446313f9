"""Activations between consecutive pipeline stages (point-to-point on the PP group).

A stage sends ``[2, num_tokens, hidden]`` (the hidden states and the residual stream: the next
layer's fused add-norm needs both) to the same TP rank of the next stage. Sends are
asynchronous (``isend``): a stage hands its step's activations over and goes on with the next
micro-batch while the next stage works on this one; the send is completed before the next one
starts, so at most one message per stage is in flight and the buffer stays alive until then.
Receives block: a stage cannot start a step before the previous stage has finished it. Every
rank runs the steps in the order the executor published them, so sends and receives always
pair up in order. Each message starts with a header (ok, num_tokens); a stage that fails a call
settles the stream (``StageChannel.call``) so that every stage fails the same forward and the
next call starts in step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from bladellm.distributed.parallel_state import GroupCoordinator


class StageFailedError(RuntimeError):
    """An earlier pipeline stage failed this step (its error is in that rank's log)."""


class StageChannel:
    def __init__(self, group: GroupCoordinator, hidden_size: int, dtype: torch.dtype) -> None:
        self.group = group
        self.hidden_size, self.dtype = hidden_size, dtype
        self._in_flight: list[tuple[Any, torch.Tensor]] = []  # the last sends' (work, buffer)
        self._received = self._sent = 0  # messages of the current call (see ``call``)

    @contextlib.contextmanager
    def call(self, num_forwards: int) -> Iterator[None]:
        """Around one published call that runs ``num_forwards`` forwards on every stage (1 for
        a step, one per prompt for embeddings / prompt logprobs, 0 for an empty step). If it
        fails here, the stream is settled before the error goes on: the messages this stage
        has not read yet are drained from the previous stage, and the ones it has not sent go
        to the next as failure headers, so every stage fails the same forward and the next
        call starts in step (without it the next stage would wait forever, or take the next
        micro-batch's activations for this one's)."""
        self._received = self._sent = 0
        try:
            yield
        except BaseException:
            self._settle(num_forwards)
            raise

    def _settle(self, num_forwards: int) -> None:
        if not self.group.is_first:
            while self._received < num_forwards:
                try:
                    self._recv_header()
                except StageFailedError:
                    continue
                payload = torch.empty(2, self._last_tokens, self.hidden_size, dtype=self.dtype,
                                      device=self.group.device)
                self._recv_payload(payload)
        if not self.group.is_last:
            while self._sent < num_forwards:
                self._send_header(ok=False, num_tokens=0)

    def _send_header(self, ok: bool, num_tokens: int) -> None:
        self.wait()
        header = torch.tensor([1 if ok else 0, num_tokens], dtype=torch.int64,
                              device=self.group.device)
        dst = self.group.ranks[self.group.rank_in_group + 1]
        self._in_flight.append((dist.isend(header, dst=dst, group=self.group.group), header))
        self._sent += 1

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """Hand ``hidden`` and ``residual`` ([num_tokens, hidden]) to the next stage: a header
        (ok, num_tokens), then the activations."""
        self._send_header(ok=True, num_tokens=hidden.shape[0])
        buf = torch.stack([hidden, residual])
        dst = self.group.ranks[self.group.rank_in_group + 1]
        self._in_flight.append((dist.isend(buf, dst=dst, group=self.group.group), buf))

    def _recv_header(self) -> int:
        header = torch.empty(2, dtype=torch.int64, device=self.group.device)
        dist.recv(header, src=self.group.ranks[self.group.rank_in_group - 1],
                  group=self.group.group)
        self._received += 1
        if not int(header[0]):
            raise StageFailedError(f"pipeline stage {self.group.rank_in_group - 1} failed this "
                                   f"forward")
        self._last_tokens = int(header[1])
        return self._last_tokens

    def _recv_payload(self, buf: torch.Tensor) -> None:
        dist.recv(buf, src=self.group.ranks[self.group.rank_in_group - 1],
                  group=self.group.group)

    def recv(self, num_tokens: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) of this forward from the previous stage; ``StageFailedError`` if
        that stage failed it."""
        got = self._recv_header()
        buf = torch.empty(2, got, self.hidden_size, dtype=self.dtype, device=device)
        self._recv_payload(buf)  # read whatever came, so the stream stays in step
        if got != num_tokens:
            raise RuntimeError(f"pipeline stages out of step: {got} tokens received, this "
                               f"forward has {num_tokens}")
        return buf[0], buf[1]

    def wait(self) -> None:
        """Complete the last sends (before the next ones, and before the worker leaves)."""
        for work, _ in self._in_flight:
            work.wait()
        self._in_flight = []
