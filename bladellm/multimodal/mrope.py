"""M-RoPE positions (Qwen2-VL, Qwen2.5-VL): three rows (temporal, height, width) per token.

Text tokens get the same position in all three rows, counting on from the previous token; an
image's tokens get ``start + (t, h, w)`` of their cell in the merged grid (``t`` is 0 for an
image), and the text after the image continues from ``start + max(h, w)``. So every position
from the end of the prompt on is ``p + delta`` in all three rows, ``delta`` (the "rope position
delta", often negative) fixed per request. This is transformers' ``Qwen2VLModel.get_rope_index``
for images, in numpy (``tests/unit/multimodal/test_mrope.py`` checks it against transformers);
it reads only what the request's ``MultiModalItem``s carry (span and ``image_grid_thw``).
Torch-free on purpose: the worker calls it once per admitted request.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from bladellm.multimodal.inputs import MultiModalItem


def image_grid(item: MultiModalItem, spatial_merge_size: int) -> tuple[int, int, int]:
    """(t, h, w) of an image's tokens in the language model: its patch grid, merged."""
    t, h, w = (int(x) for x in item.tensors["image_grid_thw"].numpy().reshape(-1)[:3])
    return t, h // spatial_merge_size, w // spatial_merge_size


def mrope_positions(num_prompt_tokens: int, items: Sequence[MultiModalItem],
                    spatial_merge_size: int) -> tuple[np.ndarray, int]:
    """(positions [3, num_prompt_tokens] int64, delta): the prompt's M-RoPE positions, and the
    shift of every later position ``p`` (``p + delta`` in each row)."""
    positions = np.empty((3, num_prompt_tokens), np.int64)
    current = 0  # the next text token's position
    last = 0  # the prompt index after the previous image
    for item in sorted(items, key=lambda it: it.offset):
        t, h, w = image_grid(item, spatial_merge_size)
        if t * h * w != item.length or item.offset < last or item.end > num_prompt_tokens:
            raise ValueError(f"image at prompt offset {item.offset}: {item.length} tokens do "
                             f"not match its grid {t}x{h}x{w} or overlap another image")
        n = item.offset - last
        positions[:, last:item.offset] = np.arange(current, current + n)
        current += n
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij"))
        positions[:, item.offset:item.end] = grid.reshape(3, -1) + current
        current += max(h, w)
        last = item.end
    positions[:, last:] = np.arange(current, current + num_prompt_tokens - last)
    delta = int(positions.max()) + 1 - num_prompt_tokens if num_prompt_tokens else 0
    return positions, delta
