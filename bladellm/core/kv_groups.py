"""Hybrid KV cache groups: which decoder layers share a block table, and which KV tensor
("slot") each layer writes.

A model whose layers all attend alike (all global, or all with one window) has ONE group
holding every layer, one slot per layer: exactly the single-table path (and, with a window,
the all-window freeing) of the KV manager. A model that mixes kinds (Gemma 2/3: local and
global layers; Qwen2 with ``max_window_layers``) gets one group per kind and per run of
``group_size`` layers of that kind, vLLM's hybrid KV cache manager layout:

- Every group has its own block table per request. A global group keeps all of a request's
  blocks; a window group frees those that fell out of its window (null in its table), so a
  request of 4x the window holds window-sized KV on its local layers.
- One shared ``BlockPool`` hands out block ids to every group (per-group accounting comes from
  the tables themselves). A block id is ONE page of memory: ``group_size`` layer-blocks, in the
  ``group_size`` slot tensors ``[2, num_blocks, block_size, kv_heads, head_dim]``; layer ``i``
  of any group reads and writes slot ``i``. A block id is held by one group at a time, so the
  groups share the slot tensors without overlap. Why one pool rather than a fixed split per
  group: the share each group needs depends on the traffic (short prompts need as many window
  blocks as global ones, long ones far fewer), and a shared pool lets LRU eviction and
  preemption act on all of it; with a split, one group could run dry while the other idles.
- ``group_size`` is the smallest layer count among the kinds, so every group fills its slots,
  except the last group of a kind whose count it does not divide (its spare slots idle while
  it holds a block; Gemma 3 1B: 4 global + 22 local layers -> groups of 4, the last local
  group of 2).

Groups are off with ``--disable_hybrid_kv_cache`` (one group; the widest window when every
layer has one), and with an sps draft model, which shares the block table and may attend over
the whole context (one group, every block kept).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroup:
    window: int | None  # None: global attention, every block kept
    layers: tuple[int, ...]  # global decoder-layer indices; layers[i] uses slot i


@dataclass(frozen=True)
class KVCacheGroups:
    groups: tuple[KVCacheGroup, ...]

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def windows(self) -> list[int | None]:
        return [g.window for g in self.groups]

    @property
    def num_slots(self) -> int:
        """KV tensors of the whole model (one page of a block id spans them all)."""
        return max(len(g.layers) for g in self.groups)

    def placement(self) -> dict[int, tuple[int, int]]:
        """Global layer index -> (group, slot)."""
        return {layer: (g, slot) for g, group in enumerate(self.groups)
                for slot, layer in enumerate(group.layers)}


def kv_cache_groups(layer_windows: Sequence[int | None], hybrid: bool = True) -> KVCacheGroups:
    """The groups of a model whose layer ``i`` has window ``layer_windows[i]`` (None: global).
    ``hybrid=False``, or layers all of one kind: one group of every layer, with the widest
    window when every layer has one (the all-window path) and none otherwise."""
    if not layer_windows:
        raise ValueError("a model needs at least one attention layer")
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(window, []).append(layer)
    if not hybrid or len(kinds) == 1:
        window = None if None in kinds else max(w for w in kinds if w is not None)
        return KVCacheGroups((KVCacheGroup(window, tuple(range(len(layer_windows)))),))
    size = min(len(layers) for layers in kinds.values())
    # Global first: group 0's table is the one a single-table reader (an sps draft, the
    # runner's ``block_ids``) could use for every position.
    order = sorted(kinds, key=lambda w: -1 if w is None else w)
    return KVCacheGroups(tuple(
        KVCacheGroup(window, tuple(kinds[window][i:i + size]))
        for window in order for i in range(0, len(kinds[window]), size)))


def engine_kv_cache_groups(layer_windows: Sequence[int | None], disable_hybrid: bool,
                           decode_algo: str) -> KVCacheGroups:
    """The groups the engine, the runner and ``blade_llm_check`` use. Under sps every block is
    kept (one group, no window): the draft shares the single block table and may attend wider
    than the target (a global draft of a windowed target), so no block may be freed under it.
    Otherwise one group per kind unless ``--disable_hybrid_kv_cache``."""
    if decode_algo == "sps":
        return KVCacheGroups((KVCacheGroup(None, tuple(range(len(layer_windows)))),))
    return kv_cache_groups(layer_windows, not disable_hybrid)
