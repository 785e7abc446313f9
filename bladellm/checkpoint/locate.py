"""Locate ``--model`` (a directory, a hub id, a .gguf file, or 'demo'): its path, config and
context length.

Both processes locate the model. The API process stops here (paths, config, limits for
``model_info``; no torch, no ``bladellm.model``); the engine core goes on in
``bladellm.model.loader``: ``resolve_model`` adds the quantization config and ``--dtype``,
``load_resolved_model`` builds the model and loads its weights. Nothing here is read from the
environment: all comes from ``ModelConfig``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bladellm.checkpoint.model_len import resolve_max_model_len
from bladellm.config import ModelConfig

if TYPE_CHECKING:  # the API process locates the model without importing torch
    import torch


@dataclass
class ResolvedModel:
    model_config: ModelConfig
    path: str  # model directory or .gguf file
    hf_config: Any
    # None when only located (``locate_model``: the API process, which never builds the model);
    # set by ``bladellm.model.loader.resolve_model``
    dtype: torch.dtype | None
    max_model_len: int
    gguf: Any = None  # GGUFCheckpoint when serving a .gguf file (not from its cached copy)
    source: str = ""  # what --model named (the .gguf file when ``path`` is its cached copy)

    @property
    def architecture(self) -> str:
        return (getattr(self.hf_config, "architectures", None) or ["?"])[0]


def default_served_name(model: str, path: str) -> str:
    if model == "demo":
        return "SmolLM2-135M-Instruct"
    from bladellm.checkpoint.hub import is_model_id

    if is_model_id(model):  # served under its id, as vLLM does
        return model
    base = os.path.basename(os.path.normpath(path))
    return base[:-5] if base.endswith(".gguf") else base


def locate_model(model_config: ModelConfig, snapshot_config: bool = False) -> ResolvedModel:
    """Find the checkpoint and read its config (cheap, torch-free): what the API process needs
    (paths, config, context length). Its ``dtype`` is None and the quantization config is not
    checked: ``bladellm.model.loader.resolve_model`` does both, in the process that builds
    the model.
    ``snapshot_config``: the caller only reads the config's attributes, so a snapshot from an
    earlier start will do (``load_hf_config``)."""
    from bladellm.checkpoint.demo import resolve_model_path
    from bladellm.checkpoint.hf_config import load_hf_config
    from bladellm.checkpoint.hub import download_model, is_model_id

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


def _open_gguf(path: str) -> tuple[str, Any]:
    """``(model_dir, None)`` when a dense copy of the GGUF file is cached (or can be made now),
    else ``(path, GGUFCheckpoint)`` to read the file itself (``checkpoint/gguf_cache.py``)."""
    from bladellm.checkpoint import gguf_cache

    if os.path.isfile(path) and (cached := gguf_cache.lookup(path)) is not None:
        return cached, None
    from bladellm.checkpoint.gguf import GGUFCheckpoint  # imports gguf-py: only to read the file

    gguf = GGUFCheckpoint(path)
    cached = gguf_cache.convert(gguf)
    return (cached, None) if cached is not None else (path, gguf)
