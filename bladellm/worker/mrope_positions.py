"""Per-request M-RoPE positions in the worker (Qwen2-VL, Qwen2.5-VL).

Shape rule: for a model with M-RoPE the language model's positions are always [3, T] int64
(temporal, height, width), built here from the flat [T] positions ``InputBatch`` makes; for
every other model they stay [T] and this class does not exist, so the text path pays nothing.

When a request is admitted (also again after a preemption, as a new request) its prompt's
positions [3, P] and its delta are computed once from the prompt length and its image items
(``multimodal/mrope.py``) and kept until it finishes or is preempted. A step's tokens read the
table for prompt positions and ``p + delta`` beyond it, so a chunk that starts inside an image,
a prompt-cache hit that skips the first blocks, and every decode token get the positions
transformers gives them, whatever was computed in earlier steps. A request without images keeps
no entry: its three rows are the flat positions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch

from bladellm.core.interface import NewRequestData
from bladellm.multimodal.inputs import MultiModalItem
from bladellm.worker.input_batch import StepInputs

ComputePositions = Callable[[int, list[MultiModalItem]], tuple[np.ndarray, int]]


class MRopePositions:
    def __init__(self, compute: ComputePositions) -> None:
        self._compute = compute
        self._tables: dict[str, np.ndarray] = {}  # req_id -> its prompt's positions [3, P]
        self._deltas: dict[str, int] = {}

    def add_request(self, new: NewRequestData) -> None:
        self.remove_request(new.req_id)
        if new.mm_items:
            table, delta = self._compute(new.num_prompt_tokens, list(new.mm_items))
            self._tables[new.req_id], self._deltas[new.req_id] = table, delta

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.remove_request(req_id)

    def remove_request(self, req_id: str) -> None:
        self._tables.pop(req_id, None)
        self._deltas.pop(req_id, None)

    def delta(self, req_id: str) -> int:
        return self._deltas.get(req_id, 0)

    def positions(self, inputs: StepInputs) -> torch.Tensor:
        """The step's positions [3, T] from its flat ones [T]."""
        flat = inputs.positions.cpu().numpy()
        out = np.repeat(flat[None, :], 3, axis=0)
        qsl = inputs.attn_metadata.query_start_loc_cpu
        for i, req_id in enumerate(inputs.req_ids):
            table = self._tables.get(req_id)
            if table is None:
                continue
            lo, hi = int(qsl[i]), int(qsl[i + 1])
            start = int(flat[lo])
            in_prompt = max(0, min(hi - lo, table.shape[1] - start))
            out[:, lo:lo + in_prompt] = table[:, start:start + in_prompt]
            out[:, lo + in_prompt:hi] += self._deltas[req_id]
        return torch.from_numpy(out).to(inputs.positions.device)
