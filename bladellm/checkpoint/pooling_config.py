"""How a model pools its hidden states into one embedding, as its directory says.

Sentence-transformers checkpoints (gte-Qwen2, e5-mistral, ...) carry ``modules.json`` and a
``*_Pooling/config.json`` with ``pooling_mode_lasttoken`` / ``pooling_mode_mean_tokens``; a plain
decoder without one pools the last token (what decoder embedding models are trained for, and
vLLM's default for them). Matryoshka models list ``matryoshka_dimensions`` (or set
``is_matryoshka``) in config.json: only they accept the ``dimensions`` request field.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass

POOLING_TYPES = ("last", "mean")


@dataclass(frozen=True)
class PoolingConfig:
    pooling: str = "last"
    normalize: bool = True
    matryoshka: bool = False


def pooling_config(model_dir: str, hf_config: object = None) -> PoolingConfig:
    pooling = "last"
    if os.path.isdir(model_dir):
        for path in sorted(glob.glob(os.path.join(model_dir, "*Pooling", "config.json"))):
            try:
                with open(path, encoding="utf-8") as f:
                    cfg = json.load(f)
            except (OSError, ValueError):
                continue
            if cfg.get("pooling_mode_mean_tokens"):
                pooling = "mean"
            elif cfg.get("pooling_mode_lasttoken"):
                pooling = "last"
            break
    matryoshka = bool(getattr(hf_config, "matryoshka_dimensions", None)
                      or getattr(hf_config, "is_matryoshka", False))
    return PoolingConfig(pooling=pooling, matryoshka=matryoshka)
