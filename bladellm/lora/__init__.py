"""Multi-LoRA serving: PEFT adapters loaded from disk, many in one batch (docs/lora.md).

- ``request.py``  ``LoRARequest``: the adapter a request runs with (name, unique id, path).
- ``adapter.py``  the PEFT directory format: config checks, weight loading, shape validation.
- ``registry.py`` API side: names and paths → ``LoRARequest`` (``--lora_modules``, ``--lora_root``).
- ``ops.py``      the batched delta (segmented gather-matmul by per-token adapter slot).
- ``layers.py``   ``LoRALinear``: wraps a base linear, adds the delta of each token's adapter.
- ``manager.py``  worker side: host-memory LRU tier (loads off the step loop) and device slots.
"""

from bladellm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
