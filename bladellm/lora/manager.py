"""The worker's adapter tiers: disk → host memory (``--max_cpu_loras``) → device slots
(``--max_loras``), least recently used evicted at each tier.

- ``sync(wanted)`` runs once per step before scheduling: it collects finished disk loads, starts
  loads (on a background thread: the step loop never reads a file) for wanted adapters not in
  host memory, and answers which wanted adapters are ready (in host memory) and which failed.
  "Wanted" = some unfinished request uses it; a wanted adapter is never evicted from host memory,
  so when host memory is full of wanted adapters, further loads wait.
- ``prepare_step`` gives every adapter of the step a device slot (a hit, a free slot, or the
  least recently used slot that no request in the persistent batch uses: those are pinned) and
  builds the step's token → slot mapping. The scheduler keeps the distinct adapters of running
  requests within ``--max_loras``, so a slot is always found.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from bladellm.lora.adapter import BaseShapes, LoRAWeights, load_adapter
from bladellm.lora.layers import LoRALinear, wrap_model
from bladellm.lora.ops import LoRAMapping
from bladellm.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, config: Any, model: torch.nn.Module, hf_config: Any,
                 model_dtype: torch.dtype) -> None:
        self.max_rank = config.max_lora_rank
        self.num_slots = config.max_loras
        self.max_cpu = config.max_cpu_loras
        self.dtype = model_dtype if config.lora_dtype == "auto" else getattr(torch,
                                                                             config.lora_dtype)
        self.base = BaseShapes.from_hf_config(hf_config)
        self.layers: dict[tuple[int, str], LoRALinear] = wrap_model(
            model, self.base.layout, self.num_slots, self.max_rank, self.dtype)
        # role -> the name of our module holding it (a role is one output slice of it)
        self.module_of = {role: path.rsplit(".", 1)[-1]
                          for path, roles in self.base.layout.ours.items() for role in roles}
        self.host: OrderedDict[int, LoRAWeights] = OrderedDict()  # LRU: oldest first
        self.loading: dict[int, Future] = {}
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # device LRU: oldest first
        self.free_slots = list(range(self.num_slots - 1, -1, -1))
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lora-load")
        self.load_seconds: dict[int, float] = {}  # last disk load time per adapter (stats)

    # ---- host tier ------------------------------------------------------------------------------
    def sync(self, wanted: list[LoRARequest]) -> tuple[list[int], dict[int, str]]:
        """Returns (ready adapter ids, {failed id: reason}) for ``wanted``."""
        failed: dict[int, str] = {}
        for lora_id, fut in list(self.loading.items()):
            if fut.done():
                del self.loading[lora_id]
                try:
                    weights, seconds = fut.result()
                except Exception as exc:  # noqa: BLE001 - a bad adapter fails its requests
                    failed[lora_id] = f"cannot load LoRA adapter: {exc}"
                else:
                    self.host[lora_id] = weights
                    self.load_seconds[lora_id] = seconds
        wanted_ids = {r.lora_int_id for r in wanted}
        for req in wanted:
            lora_id = req.lora_int_id
            if lora_id in self.host:
                self.host.move_to_end(lora_id)
            elif lora_id not in self.loading and lora_id not in failed:
                if self._make_host_room(wanted_ids):
                    self.loading[lora_id] = self._pool.submit(self._load, req)
        ready = [i for i in wanted_ids if i in self.host]
        return ready, failed

    def _make_host_room(self, wanted_ids: set[int]) -> bool:
        while len(self.host) + len(self.loading) >= self.max_cpu:
            victim = next((i for i in self.host if i not in wanted_ids), None)
            if victim is None:
                return False  # every copy is wanted: the load waits for one to be released
            del self.host[victim]
        return True

    def _load(self, req: LoRARequest) -> tuple[LoRAWeights, float]:
        start = time.perf_counter()
        weights = load_adapter(req.lora_path, self.max_rank, self.base, self.dtype)
        seconds = time.perf_counter() - start
        logger.info("loaded LoRA adapter %r (r=%d, %.1f MiB) from disk in %.3f s",
                    req.lora_name, weights.rank, weights.num_bytes / (1 << 20), seconds)
        return weights, seconds

    @property
    def has_pending_loads(self) -> bool:
        return bool(self.loading)

    def remove(self, lora_id: int, pinned: set[int]) -> None:
        """Forget an unloaded adapter (its device slot stays until no running request uses it)."""
        self.host.pop(lora_id, None)
        if lora_id in self.slot_of and lora_id not in pinned:
            self.free_slots.append(self.slot_of.pop(lora_id))

    # ---- device tier ----------------------------------------------------------------------------
    def prepare_step(self, token_lora_ids: np.ndarray, pinned: set[int]) -> LoRAMapping | None:
        """Slots for this step's adapters and the token → slot mapping (None: base model only).
        ``pinned``: adapters of every request in the persistent batch."""
        if not token_lora_ids.any():
            return None
        ids, inverse = np.unique(token_lora_ids, return_inverse=True)
        slot_lut = np.full(len(ids), -1, np.int64)
        step_ids = {int(i) for i in ids if i}
        for k, lora_id in enumerate(ids.tolist()):
            if lora_id:
                slot_lut[k] = self._activate(lora_id, pinned | step_ids)
        return LoRAMapping.build(slot_lut[inverse], self.num_slots)

    def _activate(self, lora_id: int, pinned: set[int]) -> int:
        slot = self.slot_of.get(lora_id)
        if slot is not None:
            self.slot_of.move_to_end(lora_id)
            return slot
        weights = self.host.get(lora_id)
        if weights is None:
            raise RuntimeError(f"LoRA adapter {lora_id} is scheduled but not in host memory")
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            victim = next((i for i in self.slot_of if i not in pinned), None)
            if victim is None:
                raise RuntimeError("no free LoRA device slot: more adapters running than "
                                   "--max_loras")
            slot = self.slot_of.pop(victim)
        by_layer: dict[tuple[int, str], dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, role), pair in weights.modules.items():
            by_layer.setdefault((layer, self.module_of[role]), {})[role] = pair
        for key, lora_layer in self.layers.items():
            lora_layer.set_slot(slot, by_layer.get(key, {}))
        self.slot_of[lora_id] = slot
        self.host.move_to_end(lora_id)
        return slot

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
