"""One image of a request, as it travels API process -> engine core -> worker.

The API process runs the model's image processor; the result (pixel tensors), the image's
content hash and the prompt positions its tokens occupy cross the process boundaries as a
msgspec struct. The scheduler and the prompt-cache hashing read only ``hash``, ``offset`` and
``length``; the worker's encoder turns ``tensors`` into the features that replace the input
embeddings at ``[offset, offset + length)``. Torch-free on purpose (``core/`` imports it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec
import numpy as np


class TensorData(msgspec.Struct, array_like=True):
    """A numpy array as bytes (msgpack has no array type)."""

    dtype: str
    shape: list[int]
    data: bytes

    @classmethod
    def of(cls, array: np.ndarray) -> "TensorData":
        array = np.ascontiguousarray(array)
        return cls(array.dtype.str, list(array.shape), array.tobytes())

    def numpy(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype)).reshape(self.shape)


class MultiModalItem(msgspec.Struct, kw_only=True, array_like=True, frozen=True):
    """One image: processor outputs by name (``pixel_values``; Qwen2-VL adds
    ``image_grid_thw``), the hash of those outputs (equal hashes: equal encoder input, so the
    encoder cache and the prompt cache may share), and its placeholder tokens' span."""

    modality: str
    hash: str
    offset: int  # prompt position of the first of its placeholder tokens
    length: int  # how many placeholder tokens (= encoder output rows)
    tensors: dict[str, TensorData]

    @property
    def end(self) -> int:
        return self.offset + self.length


def content_hash(tensors: dict[str, np.ndarray]) -> str:
    """Hash of the processed image (dtype, shape and bytes of each tensor, by name)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        h.update(f"{name}|{array.dtype.str}|{array.shape}|".encode())
        h.update(array.tobytes())
    return h.hexdigest()[:32]


def overlapping(items: Sequence[MultiModalItem], start: int, end: int) -> list[MultiModalItem]:
    """The items whose placeholder tokens overlap positions ``[start, end)``."""
    return [item for item in items if item.offset < end and start < item.end]
