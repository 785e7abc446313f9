"""Resolve ``--model`` (a directory, a .gguf file, or 'demo') into config, dtype and loaders.

Both processes resolve the model: the API process needs the tokenizer and limits
(``model_info``), the engine core the weights (``load_model``). Nothing here is read from the
environment: all comes from ``ModelConfig``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bladellm.config import ModelConfig
from bladellm.model.model_len import resolve_max_model_len


@dataclass
class ResolvedModel:
    model_config: ModelConfig
    path: str  # model directory or .gguf file
    hf_config: Any
    dtype: torch.dtype
    max_model_len: int
    gguf: Any = None  # GGUFCheckpoint when serving a .gguf file (not from its cached copy)
    source: str = ""  # what --model named (the .gguf file when ``path`` is its cached copy)

    @property
    def architecture(self) -> str:
        return (getattr(self.hf_config, "architectures", None) or ["?"])[0]

    def load_model(self, device: torch.device, attn_backend: Any) -> nn.Module:
        from bladellm.model.loader import build_model, check_all_loaded, load_model

        if self.gguf is None:
            return load_model(self.model_config, self.hf_config, self.dtype, device,
                              attn_backend, model_dir=self.path)
        model = build_model(self.hf_config, self.dtype, device, attn_backend, self.max_model_len)
        check_all_loaded(model, model.load_weights(self.gguf.iter_hf_weights(self.dtype)))
        return model.eval()


def default_served_name(model: str, path: str) -> str:
    if model == "demo":
        return "SmolLM2-135M-Instruct"
    from bladellm.model.hub import is_model_id

    if is_model_id(model):  # served under its id, as vLLM does
        return model
    base = os.path.basename(os.path.normpath(path))
    return base[:-5] if base.endswith(".gguf") else base


def resolve_model(model_config: ModelConfig, snapshot_config: bool = False) -> ResolvedModel:
    """Find the checkpoint and read its config (cheap); weights are read by ``load_model``.
    ``snapshot_config``: the caller only reads the config's attributes, so a snapshot from an
    earlier start will do (``load_hf_config``)."""
    from bladellm.model.demo import resolve_model_path
    from bladellm.model.hub import download_model, is_model_id
    from bladellm.model.loader import load_hf_config, resolve_dtype
    from bladellm.quantization import get_quant_config

    source = path = resolve_model_path(model_config.model)
    if model_config.model != "demo" and is_model_id(model_config.model):
        source = path = download_model(model_config.model, model_config.revision,
                                       model_config.download_dir, model_config.model_hub)
    is_gguf = model_config.load_format == "gguf" or path.endswith(".gguf")
    gguf = None
    if is_gguf:
        path, gguf = _open_gguf(path)
    hf_config = gguf.hf_config() if gguf is not None else load_hf_config(
        path, model_config.trust_remote_code, snapshot=snapshot_config)
    # Validates quantization_config / --quantization here, before any process starts.
    get_quant_config(hf_config, model_config.quantization)
    dtype = resolve_dtype(hf_config, model_config.dtype)
    max_len = resolve_max_model_len(hf_config, model_config.max_model_len)
    return ResolvedModel(model_config, path, hf_config, dtype, max_len, gguf, source)


def _open_gguf(path: str) -> tuple[str, Any]:
    """``(model_dir, None)`` when a dense copy of the GGUF file is cached (or can be made now),
    else ``(path, GGUFCheckpoint)`` to read the file itself (``model/gguf_cache.py``)."""
    from bladellm.model import gguf_cache
    from bladellm.model.gguf import GGUFCheckpoint

    if os.path.isfile(path) and (cached := gguf_cache.lookup(path)) is not None:
        return cached, None
    gguf = GGUFCheckpoint(path)
    cached = gguf_cache.convert(gguf)
    return (cached, None) if cached is not None else (path, gguf)
