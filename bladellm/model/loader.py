"""A located model -> its dtype, quantization config and a model with its weights loaded.

``resolve_model`` takes what ``bladellm.checkpoint.locate_model`` found (path, config, context
length) and adds what building the model needs (the quantization config checked, ``--dtype``
resolved); ``load_resolved_model`` builds it and loads its weights.

Checkpoint tensors are streamed one at a time (``safe_open``) into each parameter's
``weight_loader``, so a model never sits in memory twice. Every failure is a ``ValueError`` that
names the file, tensor or flag at fault.

A directory written by ``blade_llm_split`` (it holds ``bladellm_split.json``) is loaded
differently: TP rank ``r`` reads only ``rank_{r}/``, whose tensors already are that rank's
parameters (engine names and shard shapes), assigned by name with shape checks.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
from typing import Any, Iterator

import torch
from torch import nn

from bladellm.attention.backend import AttentionBackend
from bladellm.checkpoint.locate import ResolvedModel, locate_model
from bladellm.config import ModelConfig
from bladellm.model.registry import get_model_class
from bladellm.model.layers.norm import UnitOffsetRMSNorm
from bladellm.model.layers.rotary import RotaryEmbedding
from bladellm.platforms.cpu import CpuInfo, detect_cpu
from bladellm.platforms.cpu_defaults import choose_cpu_dtype
from bladellm.platforms.select import DEVICES, platform_of, resolve_platform
from bladellm.quantization import QuantConfig, get_quant_config, process_quantized_layers

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SAFE_INDEX = "model.safetensors.index.json"
SPLIT_MANIFEST = "bladellm_split.json"  # written by blade_llm_split
SPLIT_FORMAT = "bladellm_split"
SPLIT_FORMAT_VERSION = 1
BIN_INDEX = "pytorch_model.bin.index.json"


def resolve_dtype(hf_config: Any, dtype: str, device: str | torch.device = "cpu",
                  cpu: CpuInfo | None = None) -> torch.dtype:
    """``--dtype`` -> torch dtype. ``auto`` takes the checkpoint's dtype (float32 if unknown);
    on CPU a 16-bit checkpoint becomes bfloat16 only where the CPU has native bf16, else float32
    (``choose_cpu_dtype``; ``cpu`` defaults to this machine's)."""
    if dtype != "auto" and dtype not in _DTYPES:
        raise ValueError(f"--dtype: must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
    cfg = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(cfg, str):
        cfg = getattr(torch, cfg, None)
    checkpoint = str(cfg).removeprefix("torch.") if isinstance(cfg, torch.dtype) else None
    platform = (resolve_platform(device) if isinstance(device, str) and device in DEVICES
                else platform_of(device))
    if platform.name != "cpu":
        if dtype != "auto":
            return _DTYPES[dtype]
        chosen, reason = platform.auto_dtype(checkpoint)
        logger.info("dtype auto: %s (%s)", chosen, reason)
        return _DTYPES[chosen]
    choice = choose_cpu_dtype(dtype, checkpoint, cpu or detect_cpu())
    if choice.warning:
        logger.warning(choice.warning)
    if dtype == "auto":
        logger.info("dtype auto: %s (%s)", choice.dtype, choice.reason)
    return _DTYPES[choice.dtype]


def resolve_model(model_config: ModelConfig, snapshot_config: bool = False,
                  device: str = "cpu") -> ResolvedModel:
    """``locate_model``, then the quantization config checked and ``--dtype`` resolved for
    ``--device device`` (auto, cpu, cuda): what building the model needs."""
    located = locate_model(model_config, snapshot_config)
    # Validates quantization_config / --quantization before any weight is read.
    get_quant_config(located.hf_config, model_config.quantization)
    dtype = resolve_dtype(located.hf_config, model_config.dtype, device)
    return dataclasses.replace(located, dtype=dtype)


def load_resolved_model(resolved: ResolvedModel, device: torch.device,
                        attn_backend: AttentionBackend | None) -> nn.Module:
    """The model ``resolve_model`` described, on ``device`` with its weights: from its directory
    (a GGUF file's dense copy included), from the GGUF file itself, or dummy weights."""
    if resolved.dtype is None:
        raise RuntimeError("load_model: the model was only located; resolve_model it")
    model_config = resolved.model_config
    if resolved.gguf is None:
        if model_config.load_format == "gguf":  # the GGUF file's dense copy
            model_config = dataclasses.replace(model_config, load_format="auto")
        return load_model(model_config, resolved.hf_config, resolved.dtype, device,
                          attn_backend, model_dir=resolved.path)
    model = build_model(resolved.hf_config, resolved.dtype, device, attn_backend,
                        resolved.max_model_len)
    if model_config.load_format == "dummy":
        init_dummy_weights(model, model_config.seed or 0)
    else:
        check_all_loaded(model, model.load_weights(resolved.gguf.iter_hf_weights(resolved.dtype)))
    return model.eval()


def load_model(model_config: ModelConfig, hf_config: Any, dtype: torch.dtype,
               device: str | torch.device, attn_backend: AttentionBackend,
               model_dir: str | None = None) -> nn.Module:
    """Build the model for ``hf_config`` on ``device`` and fill its weights from ``model_dir``
    (default: ``model_config.model`` with ``~`` expanded)."""
    model_dir = model_dir or os.path.expanduser(model_config.model)
    manifest = None
    if model_config.load_format != "dummy":
        manifest = read_split_manifest(model_dir)
        if manifest is not None:
            from bladellm.distributed.parallel_state import get_groups

            groups = get_groups()
            check_split_parallel(manifest, groups.tp.world_size, groups.pp.world_size,
                                 model_dir, groups.expert_parallel)
    quant_config = get_quant_config(hf_config, model_config.quantization)
    if quant_config is not None and model_config.load_format == "dummy":
        raise ValueError(f"--load_format dummy: {model_dir} is a quantized checkpoint "
                         f"({quant_config.describe()}); random weights cannot stand in for "
                         f"its packed tensors, load it with --load_format auto")
    model = build_model(hf_config, dtype, device, attn_backend, model_config.max_model_len,
                        quant_config)
    if model_config.load_format == "dummy":
        init_dummy_weights(model, model_config.seed or 0)  # --seed None: still repeatable
    elif manifest is not None:
        load_split_shard(model, model_dir)
    else:
        load_checkpoint_files(model, find_weight_files(model_dir, model_config.load_format))
    if quant_config is not None:
        num = process_quantized_layers(model)
        logger.info("quantized checkpoint: %s (%d linear layers)", quant_config.describe(), num)
    return model.eval()


def load_checkpoint_files(model: nn.Module, files: list[str]) -> None:
    """Fill ``model`` from full checkpoint ``files`` through its parameters' weight loaders
    (each keeps this TP rank's slice); every parameter must be loaded."""
    source = _CheckpointReader(files)
    try:
        loaded = model.load_weights(source)
    except ValueError as e:
        raise ValueError(f"{source.current_file}: {e}") from e
    check_all_loaded(model, loaded)


def build_model(hf_config: Any, dtype: torch.dtype, device: str | torch.device,
                attn_backend: AttentionBackend, max_model_len: int | None = None,
                quant_config: QuantConfig | None = None) -> nn.Module:
    """The model with uninitialized weights (callers fill them via ``model.load_weights``;
    a quantized model then needs ``process_quantized_layers``). Call it inside
    ``kernels.scope.building_with(kernels)``: the layers take the kernel set from there."""
    model_cls = get_model_class(hf_config)
    text_config = getattr(hf_config, "text_config", None) or hf_config  # a VLM's language model
    if quant_config is not None:  # the quantized layers' checkpoint names, as this model fuses
        quant_config = quant_config.for_model(model_cls.packed_modules_mapping)
    with torch.device(device):
        model = model_cls(hf_config, dtype, attn_backend, quant_config=quant_config)
    limit = max_model_len or getattr(text_config, "max_position_embeddings", None)
    if limit:  # Bloom (ALiBi) states no position limit
        _check_positions(model, limit)
    return model


def _check_positions(model: nn.Module, max_model_len: int) -> None:
    for module in model.modules():
        if isinstance(module, RotaryEmbedding) and max_model_len > module.max_position:
            raise ValueError(f"--max_model_len {max_model_len} exceeds the model's "
                             f"{module.max_position} rotary positions")


def find_weight_files(model_dir: str, load_format: str = "auto") -> list[str]:
    """Checkpoint files in load order: sharded index, else every file of the format."""
    if load_format == "gguf":
        raise ValueError("--load_format gguf is not supported by this loader")
    if load_format in ("auto", "safetensors"):
        files = _files_of(model_dir, SAFE_INDEX, "*.safetensors")
        if files or load_format == "safetensors":
            return _require(files, model_dir, "*.safetensors")
    files = _files_of(model_dir, BIN_INDEX, "pytorch_model*.bin")
    expected = "*.safetensors or pytorch_model*.bin" if load_format == "auto" else \
        "pytorch_model*.bin"
    return _require(files, model_dir, expected)


def _files_of(model_dir: str, index_name: str, pattern: str) -> list[str]:
    index = os.path.join(model_dir, index_name)
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_dir, n) for n in names]
        for path in files:
            if not os.path.isfile(path):
                raise ValueError(f"{index} lists {os.path.basename(path)!r}, which is missing "
                                 f"from {model_dir}")
        return files
    return sorted(glob.glob(os.path.join(model_dir, pattern)))


def _require(files: list[str], model_dir: str, expected: str) -> list[str]:
    if not files:
        raise ValueError(f"no weight files ({expected}) in {model_dir}; use --load_format dummy "
                         f"for random weights")
    return files


class _CheckpointReader:
    """Iterates (name, tensor) over files, remembering which file is open for error messages."""

    def __init__(self, files: list[str]) -> None:
        self.files = files
        self.current_file = files[0]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for path in self.files:
            self.current_file = path
            if path.endswith(".safetensors"):
                from safetensors import safe_open

                with safe_open(path, framework="pt", device="cpu") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)
            else:
                try:  # mmap keeps a large .bin out of RAM; legacy (non-zip) files cannot be
                    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError:
                    state = torch.load(path, map_location="cpu", weights_only=True)
                yield from state.items()
                del state


# ---- checkpoints split per TP rank (blade_llm_split) ---------------------------------------------

def read_split_manifest(model_dir: str) -> dict[str, Any] | None:
    """The ``blade_llm_split`` manifest of ``model_dir``, or None for an ordinary checkpoint."""
    path = os.path.join(model_dir, SPLIT_MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != SPLIT_FORMAT:
        raise ValueError(f"{path} is not a blade_llm_split manifest")
    version = manifest.get("format_version")
    if version != SPLIT_FORMAT_VERSION:
        raise ValueError(f"{path}: split format version {version!r} is not supported by this "
                         f"bladellm (it reads version {SPLIT_FORMAT_VERSION}); split the "
                         f"original checkpoint again with this version's blade_llm_split")
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):
        size = manifest.setdefault(key, 1)
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{path}: bad {key} {size!r}")
    return manifest


def check_split_parallel(manifest: dict[str, Any], tp_size: int, pp_size: int,
                         model_dir: str, expert_parallel: bool = False) -> None:
    """A split checkpoint serves exactly the degrees (and expert layout) it was split for."""
    split_ep = bool(manifest.get("enable_expert_parallel", False))
    if split_ep != expert_parallel:
        flag = "with" if split_ep else "without"
        raise ValueError(f"--enable_expert_parallel: {model_dir} was split by blade_llm_split "
                         f"{flag} --enable_expert_parallel; serve it {flag} it, or split the "
                         f"original checkpoint ({manifest.get('source', '?')}) again")
    for key, size in (("tensor_parallel_size", tp_size), ("pipeline_parallel_size", pp_size)):
        split = manifest[key]
        if size != split:
            raise ValueError(
                f"--{key} {size}: {model_dir} was split by blade_llm_split for --{key} {split}; "
                f"serve it with --{key} {split}, or split the original checkpoint "
                f"({manifest.get('source', '?')}) again for {size}")


def split_rank_dir(model_dir: str, rank: int) -> str:
    return os.path.join(model_dir, f"rank_{rank}")


def split_rank_files(model_dir: str, rank: int) -> list[str]:
    rank_dir = split_rank_dir(model_dir, rank)
    files = sorted(glob.glob(os.path.join(rank_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"split checkpoint {model_dir}: no *.safetensors in {rank_dir}")
    return files


def split_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """What ``blade_llm_split`` saves for a rank: every parameter once (a tied LM head is the
    embedding, saved under the embedding's name) and the persistent buffers; non-persistent
    buffers (rotary caches) are rebuilt at construction."""
    params = dict(model.named_parameters())
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - set(params)
    out = {}
    for name, tensor in model.state_dict().items():
        if name in aliases:
            continue
        out[name] = tensor.detach().contiguous()
    return out


@torch.no_grad()
def load_split_shard(model: nn.Module, model_dir: str) -> int:
    """Fill ``model`` (built as this process's rank) from ``model_dir/rank_{r}`` only:
    tensors are assigned to parameters and persistent buffers by name, shapes must match
    exactly. Returns the bytes of the files read."""
    from safetensors import safe_open

    from bladellm.distributed.parallel_state import get_groups

    rank = get_groups().rank  # pp_rank * T + tp_rank: one directory per process
    files = split_rank_files(model_dir, rank)
    targets = dict(model.named_parameters())
    for name, buf in model.named_buffers():
        targets.setdefault(name, buf)
    loaded: set[str] = set()
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                target = targets.get(name)
                if target is None:
                    raise ValueError(f"{path}: tensor {name!r} matches no parameter of "
                                     f"{type(model).__name__}; was it split from another model "
                                     f"or bladellm version?")
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                     f"rank {rank} expects {tuple(target.shape)}")
                target.data.copy_(tensor)
                loaded.add(name)
    try:
        check_all_loaded(model, loaded)
    except ValueError as e:
        raise ValueError(f"{split_rank_dir(model_dir, rank)}: {e}") from e
    return sum(os.path.getsize(p) for p in files)


def check_all_loaded(model: nn.Module, loaded: set[str]) -> None:
    # named_parameters() lists a tied lm_head.weight once, under the embedding's name.
    missing = [name for name, _ in model.named_parameters() if name not in loaded]
    # A fused parameter is named by the checkpoint tensors it lacks (or is made of).
    fused = getattr(model, "packed_modules_mapping", {})
    parts = getattr(loaded, "missing_parts", {})
    for i, name in enumerate(missing):
        frag = next((f for f in fused if f".{f}." in name), None)
        if name in parts:
            missing[i] = f"{name} (checkpoint: no {', '.join(parts[name])})"
        elif frag is not None:
            missing[i] = f"{name} (checkpoint: {', '.join(fused[frag])})"
    if missing:
        shown = ", ".join(missing[:10]) + (f" (+{len(missing) - 10} more)"
                                            if len(missing) > 10 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} parameter(s): {shown}")


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights for benchmarks: normal(0, 0.02); norms the identity scale (weights 1, or
    0 where the weight is an offset from 1), biases 0."""
    # One generator per device the parameters live on: drawn where they live (a GPU draws an
    # 8B model's weights in a second; the host would take a minute and copy them over).
    gens: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("bias"):  # LayerNorm's too
            param.zero_()
        elif "norm" in name.split(".")[-2]:
            param.fill_(1.0)
        else:
            gen = gens.get(param.device)
            if gen is None:
                gen = gens[param.device] = torch.Generator(param.device).manual_seed(seed)
            sample = torch.empty(param.shape, dtype=torch.float32,
                                 device=param.device).normal_(0.0, 0.02, generator=gen)
            param.copy_(sample)
    for module in model.modules():  # its weight is the offset from 1: identity is 0
        if isinstance(module, UnitOffsetRMSNorm):
            module.weight.zero_()
