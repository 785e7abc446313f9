"""Prompt-cache block hashes.

A full block's hash chains its parent's hash, its token ids and extra keys (LoRA id; the content
hashes of the images whose placeholder tokens overlap the block: the placeholder ids are the same
for every image), so equal hashes mean equal prefixes, not just equal blocks. sha256 keeps the
value stable across processes and runs (the router can compute the same hashes for prefix
affinity); 128 bits make a collision, which would serve wrong KV, practically impossible.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from bladellm.multimodal.inputs import MultiModalItem, overlapping

BlockHash = int

_NO_PARENT = b"\x00" * 16


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: tuple | None = None) -> BlockHash:
    """Hash of one full block given its parent's hash (None for the first block)."""
    h = hashlib.sha256(_NO_PARENT if parent is None else parent.to_bytes(16, "little"))
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return int.from_bytes(h.digest()[:16], "little")


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        extra_keys: tuple | None = None,
                        mm_items: Sequence[MultiModalItem] = ()) -> list[BlockHash]:
    """Append to ``hashes`` the hashes of the full blocks of ``token_ids`` not hashed yet.

    Extra keys go into the first block only: the chain carries them to every later block.
    A block overlapping an image's tokens also takes that image's hash.
    """
    num_full = len(token_ids) // block_size
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i else None
        start = i * block_size
        keys = extra_keys if i == 0 else None
        images = tuple(item.hash for item in overlapping(mm_items, start,
                                                          start + block_size))
        if images:
            keys = (keys or ()) + ("image",) + images
        hashes.append(hash_block_tokens(parent, token_ids[start:start + block_size], keys))
    return hashes


def request_extra_keys(lora_id: int = 0) -> tuple | None:
    """Two LoRA adapters never share KV blocks (their K/V differ); one adapter shares its own."""
    return ("lora", lora_id) if lora_id else None
