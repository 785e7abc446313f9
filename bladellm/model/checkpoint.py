"""Resolve ``--model`` (a directory, a .gguf file, or 'demo') into config, dtype and loaders.

Both processes resolve the model: the API process only locates it (``locate_model``: paths,
config, limits for ``model_info``; no torch), the engine core resolves it (``resolve_model``:
also the quantization config and ``--dtype``) and loads the weights (``load_model``). Nothing
here is read from the environment: all comes from ``ModelConfig``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bladellm.config import ModelConfig
from bladellm.model.model_len import resolve_max_model_len

if TYPE_CHECKING:  # the API process locates the model without importing torch
    import torch
    from torch import nn


@dataclass
class ResolvedModel:
    model_config: ModelConfig
    path: str  # model directory or .gguf file
    hf_config: Any
    # None when only located (``locate_model``: the API process, which never builds the model)
    dtype: torch.dtype | None
    max_model_len: int
    gguf: Any = None  # GGUFCheckpoint when serving a .gguf file (not from its cached copy)
    source: str = ""  # what --model named (the .gguf file when ``path`` is its cached copy)

    @property
    def architecture(self) -> str:
        return (getattr(self.hf_config, "architectures", None) or ["?"])[0]

    def load_model(self, device: torch.device, attn_backend: Any) -> nn.Module:
        from bladellm.model.loader import build_model, check_all_loaded, load_model

        if self.dtype is None:
            raise RuntimeError("load_model: the model was only located; resolve_model it")
        if self.gguf is None:
            model_config = self.model_config
            if model_config.load_format == "gguf":  # the GGUF file's dense copy
                model_config = dataclasses.replace(model_config, load_format="auto")
            return load_model(model_config, self.hf_config, self.dtype, device,
                              attn_backend, model_dir=self.path)
        model = build_model(self.hf_config, self.dtype, device, attn_backend, self.max_model_len)
        if self.model_config.load_format == "dummy":
            from bladellm.model.loader import init_dummy_weights

            init_dummy_weights(model, self.model_config.seed or 0)
        else:
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


def locate_model(model_config: ModelConfig, snapshot_config: bool = False) -> ResolvedModel:
    """Find the checkpoint and read its config (cheap, torch-free): what the API process needs
    (paths, config, context length). Its ``dtype`` is None and the quantization config is not
    checked: ``resolve_model`` does both, in the process that builds the model.
    ``snapshot_config``: the caller only reads the config's attributes, so a snapshot from an
    earlier start will do (``load_hf_config``)."""
    from bladellm.model.demo import resolve_model_path
    from bladellm.model.hf_config import load_hf_config
    from bladellm.model.hub import download_model, is_model_id

    if model_config.model != "demo" and is_model_id(model_config.model):
        source = path = download_model(model_config.model, model_config.revision,
                                       model_config.download_dir, model_config.model_hub)
    else:
        check_hub_flags(model_config)
        source = path = resolve_model_path(model_config.model)
    is_gguf = model_config.load_format == "gguf" or path.endswith(".gguf")
    if is_gguf and model_config.load_format in ("safetensors", "pt"):
        raise ValueError(f"--load_format {model_config.load_format}: {path} is a GGUF file; "
                         f"serve it with --load_format auto, gguf or dummy")
    gguf = None
    if is_gguf:
        path, gguf = _open_gguf(path)
    hf_config = gguf.hf_config() if gguf is not None else load_hf_config(
        path, model_config.trust_remote_code, snapshot=snapshot_config)
    max_len = resolve_max_model_len(hf_config, model_config.max_model_len)
    return ResolvedModel(model_config, path, hf_config, None, max_len, gguf, source)


# The flags that only say where a hub model id comes from, with their defaults.
HUB_FLAGS = {"revision": None, "download_dir": None, "model_hub": "huggingface"}


def check_hub_flags(model_config: ModelConfig) -> None:
    """``--model`` is a local path or 'demo': a hub flag set to anything but its default would
    be ignored, so it is an error naming the flag."""
    for name, default in HUB_FLAGS.items():
        value = getattr(model_config, name)
        if value != default:
            what = ("the built-in demo model" if model_config.model == "demo"
                    else "a local path")
            raise ValueError(f"--{name} {value}: only applies when --model is a hub model id "
                             f"(org/name); --model {model_config.model} is {what}")


def resolve_model(model_config: ModelConfig, snapshot_config: bool = False) -> ResolvedModel:
    """``locate_model``, then the quantization config checked and ``--dtype`` resolved: what
    building the model needs."""
    from bladellm.model.loader import resolve_dtype
    from bladellm.quantization import get_quant_config

    located = locate_model(model_config, snapshot_config)
    # Validates quantization_config / --quantization before any weight is read.
    get_quant_config(located.hf_config, model_config.quantization)
    dtype = resolve_dtype(located.hf_config, model_config.dtype)
    return dataclasses.replace(located, dtype=dtype)


def _open_gguf(path: str) -> tuple[str, Any]:
    """``(model_dir, None)`` when a dense copy of the GGUF file is cached (or can be made now),
    else ``(path, GGUFCheckpoint)`` to read the file itself (``model/gguf_cache.py``)."""
    from bladellm.model import gguf_cache

    if os.path.isfile(path) and (cached := gguf_cache.lookup(path)) is not None:
        return cached, None
    from bladellm.model.gguf import GGUFCheckpoint  # imports torch: only to read the file

    gguf = GGUFCheckpoint(path)
    cached = gguf_cache.convert(gguf)
    return (cached, None) if cached is not None else (path, gguf)
