"""Image features in the worker: computed once per image, sliced into each prefill chunk.

``EncoderCache`` maps an image's content hash to its encoder output (the rows that replace the
input embeddings at the image's placeholder tokens). An entry is held by the running requests
whose prefill has not yet gone past the image: a chunked prefill that cuts through an image
slices the cached rows instead of re-running the encoder, and requests with the same image in
flight share one entry. A request lets go of an image once its prefill has passed the image's
last token (or a prompt-cache hit skipped it), and of all of them when it finishes, is aborted
or is preempted (a preempted request comes back as a new one, with its items, and recomputes
what its KV lost); an entry is freed with its last holder.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch

from bladellm.multimodal.inputs import MultiModalItem, overlapping

Encode = Callable[[dict[str, torch.Tensor]], torch.Tensor]


class EncoderCache:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._features: dict[str, torch.Tensor] = {}
        self._holders: dict[str, set[str]] = {}
        self._items: dict[str, list[MultiModalItem]] = {}  # req_id -> its images
        self.num_encoded = 0  # images run through the encoder, cumulative (tests, metrics)

    def __len__(self) -> int:
        return len(self._features)

    def add_request(self, req_id: str, items: list[MultiModalItem]) -> None:
        self.remove_request(req_id)  # resumed without a preemption notice: start over
        if not items:
            return
        self._items[req_id] = list(items)
        for item in items:
            self._holders.setdefault(item.hash, set()).add(req_id)

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.remove_request(req_id)

    def remove_request(self, req_id: str) -> None:
        for item in self._items.pop(req_id, ()):
            self._release(req_id, item)

    def _release(self, req_id: str, item: MultiModalItem) -> None:
        holders = self._holders.get(item.hash)
        if holders is None:
            return
        holders.discard(req_id)
        if not holders:
            del self._holders[item.hash]
            self._features.pop(item.hash, None)

    def _consumed(self, req_id: str, upto: int) -> None:
        """The request's prefill has computed every position before ``upto``: it needs no
        image that ends there or earlier."""
        items = self._items[req_id]
        done = [item for item in items if item.end <= upto]
        if done:
            self._items[req_id] = [item for item in items if item.end > upto]
            for item in done:
                self._release(req_id, item)

    def features(self, item: MultiModalItem, encode: Encode) -> torch.Tensor:
        cached = self._features.get(item.hash)
        if cached is None:
            tensors = {name: torch.from_numpy(t.numpy().copy()).to(self.device)
                       for name, t in item.tensors.items()}
            cached = encode(tensors)
            if cached.shape[0] != item.length:
                raise RuntimeError(f"the encoder produced {cached.shape[0]} rows for an image "
                                   f"with {item.length} placeholder tokens")
            self._features[item.hash] = cached
            self.num_encoded += 1
        return cached

    def input_embeds(self, model: torch.nn.Module, input_ids: torch.Tensor,
                     req_ids: list[str], query_start_loc: np.ndarray,
                     first_positions: np.ndarray) -> torch.Tensor | None:
        """The step's input embeddings with image features at the image tokens' rows, or None
        when no request's chunk covers an image token (the model embeds the ids itself).
        ``first_positions[i]``: the prompt position of request ``i``'s first token this step."""
        writes: list[tuple[int, torch.Tensor]] = []
        for i, req_id in enumerate(req_ids):
            items = self._items.get(req_id)
            if not items:
                continue
            start = int(first_positions[i])
            end = start + int(query_start_loc[i + 1] - query_start_loc[i])
            for item in overlapping(items, start, end):
                feats = self.features(item, model.encode_image)
                lo, hi = max(start, item.offset), min(end, item.end)
                writes.append((int(query_start_loc[i]) + lo - start,
                               feats[lo - item.offset:hi - item.offset]))
            self._consumed(req_id, end)  # the slices above keep their rows alive
        if not writes:
            return None
        embeds = model.embed_input_ids(input_ids)
        for row, rows in writes:
            embeds[row:row + rows.shape[0]] = rows.to(embeds.dtype)
        return embeds
