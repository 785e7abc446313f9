"""The PEFT LoRA directory format: ``adapter_config.json`` + ``adapter_model.safetensors`` (or
``adapter_model.bin``).

What is served: plain LoRA (``peft_type: LORA``) on the q/k/v/o/gate/up/down projections of the
decoder layers, with ``r``, ``lora_alpha``, ``use_rslora``. Everything else is refused with a
``LoRAError`` naming the reason (DoRA, ``modules_to_save``, embedding / LM-head adapters, LoRA
biases, per-module rank or alpha patterns, rank above ``--max_lora_rank``), as are weights whose
shapes do not fit the base model. ``fan_in_fan_out`` only describes how a Conv1D *base* layer
stores its weight; PEFT's ``lora_A``/``lora_B`` are always ``nn.Linear`` (``[r, in]`` and
``[out, r]``), and PEFT itself turns the flag off for ``nn.Linear`` targets, so it is accepted
and changes nothing here.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bladellm.checkpoint.moe import sparse_layers

if TYPE_CHECKING:  # the API process validates adapters without torch; only loading needs it
    import torch

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# PEFT module name -> (our fused layer, slice index within its output).
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0)}
_REFUSED_TARGETS = ("embed_tokens", "lm_head", "wte", "embed_out", "word_embeddings")
# A mixture-of-experts block's modules (experts, router, shared expert) in a tensor name.
_MOE_MODULE = re.compile(r"\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\."
                         r"((?:experts|gate|shared_expert|shared_expert_gate)\b[\w.]*?)\.lora_[AB]")
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\."
                  r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])"
                  r"(?:\.default)?\.weight$")


class LoRAError(ValueError):
    """The adapter cannot be served (HTTP 400); the message says why."""


@dataclass(frozen=True)
class BaseShapes:
    """(in, out) features of every targetable projection of the base model (unsharded)."""

    num_layers: int
    sizes: dict[str, tuple[int, int]]
    # Mixture-of-experts layers: their MLP is experts, which adapters may not target.
    sparse_layers: frozenset[int] = frozenset()

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "BaseShapes":
        inter = getattr(cfg, "intermediate_size", None)
        if inter is None:  # not the q/k/v/o/gate/up/down layout (e.g. Bloom's fused qkv)
            raise LoRAError(f"--enable_lora: LoRA is not supported for "
                            f"{'/'.join(getattr(cfg, 'architectures', None) or ['this model'])}")
        hidden = cfg.hidden_size
        head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
        q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
        return cls(cfg.num_hidden_layers, {
            "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}, sparse_layers(cfg))


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    scaling: float
    target_modules: tuple[str, ...]  # subset of TARGETS (informational; weights decide)


@dataclass
class LoRAWeights:
    """A loaded adapter: ``modules[(layer, peft_name)] = (A [r, in], B [out, r] * scaling)``."""

    rank: int
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for a, b in self.modules.values())


def read_config(path: str, max_rank: int) -> AdapterConfig:
    """Parse and check ``adapter_config.json``; raises ``LoRAError`` / ``FileNotFoundError``."""
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{CONFIG_FILE} not found: not a PEFT adapter directory")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as exc:
        raise LoRAError(f"{CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"{CONFIG_FILE} must hold a JSON object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAError(f"peft_type {cfg.get('peft_type')!r} is not supported; only LORA")
    if cfg.get("use_dora"):
        raise LoRAError("DoRA adapters (use_dora) are not supported")
    if cfg.get("modules_to_save"):
        raise LoRAError(f"modules_to_save {cfg['modules_to_save']} is not supported: only "
                        "LoRA deltas on the attention/MLP projections are served")
    if cfg.get("bias", "none") not in ("none", None):
        raise LoRAError(f"LoRA bias {cfg['bias']!r} is not supported; only bias='none'")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise LoRAError(f"{key} (per-module rank/alpha) is not supported")
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAError(f"rank {rank} exceeds --max_lora_rank {max_rank}")
    alpha = cfg.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)):
        raise LoRAError(f"lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return AdapterConfig(rank, float(scaling), _targets(cfg.get("target_modules")))


def _targets(value: Any) -> tuple[str, ...]:
    if value is None:
        raise LoRAError("target_modules is missing")
    if isinstance(value, str):
        if value == "all-linear":  # PEFT: every linear layer except the output head
            return tuple(TARGETS)
        names = [n for n in TARGETS if re.fullmatch(value, f"model.layers.0.self_attn.{n}")
                 or re.fullmatch(value, f"model.layers.0.mlp.{n}")]
        if any(re.search(value, n) for n in _REFUSED_TARGETS):
            raise LoRAError("embedding / LM-head adapters are not supported")
        return tuple(names)
    names = [str(v).rsplit(".", 1)[-1] for v in value]
    refused = [n for n in names if n in _REFUSED_TARGETS]
    if refused:
        raise LoRAError(f"embedding / LM-head adapters are not supported (target_modules "
                        f"{refused})")
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        raise LoRAError(f"target_modules {unknown} are not supported; supported: "
                        f"{', '.join(TARGETS)}")
    return tuple(names)


def weight_file(path: str) -> str:
    for name in WEIGHT_FILES:
        file = os.path.join(path, name)
        if os.path.isfile(file):
            return file
    raise LoRAError(f"no adapter weights: expected one of {', '.join(WEIGHT_FILES)}")


def check_shapes(shapes: dict[str, list[int]], config: AdapterConfig, base: BaseShapes) -> None:
    """Check tensor names and shapes (from the safetensors header or the loaded tensors)."""
    seen: set[tuple[int, str, str]] = set()
    for key, shape in shapes.items():
        moe = _MOE_MODULE.search(key)
        if moe is not None:
            raise LoRAError(f"{key}: LoRA on the mixture-of-experts module {moe.group(2)!r} "
                            f"(layer {moe.group(1)}) is not supported; adapt the attention "
                            f"projections (q_proj, k_proj, v_proj, o_proj)")
        m = _KEY.match(key)
        if m is not None and m.group(2) in ("gate_proj", "up_proj", "down_proj") and \
                int(m.group(1)) in base.sparse_layers:
            raise LoRAError(f"{key}: layer {m.group(1)}'s MLP is a mixture of experts; LoRA on "
                            f"its experts ({m.group(2)}) is not supported; adapt the attention "
                            f"projections (q_proj, k_proj, v_proj, o_proj)")
        if m is None:
            if "lora_magnitude_vector" in key:
                raise LoRAError("DoRA adapters are not supported")
            if any(t in key for t in _REFUSED_TARGETS):
                raise LoRAError(f"embedding / LM-head adapters are not supported ({key})")
            raise LoRAError(f"unexpected tensor {key!r} in the adapter")
        layer, name, which = int(m.group(1)), m.group(2), m.group(3)
        if layer >= base.num_layers:
            raise LoRAError(f"{key}: the base model has {base.num_layers} layers")
        fan_in, fan_out = base.sizes[name]
        want = [config.rank, fan_in] if which == "A" else [fan_out, config.rank]
        if list(shape) != want:
            raise LoRAError(f"{key}: shape {list(shape)} does not fit the base model (expected "
                            f"{want}, with r={config.rank})")
        seen.add((layer, name, which))
    for layer, name, which in seen:
        if (layer, name, "B" if which == "A" else "A") not in seen:
            raise LoRAError(f"layer {layer} {name}: lora_{which} without its pair")
    if not seen:
        raise LoRAError("the adapter holds no LoRA weights")


def header_shapes(file: str) -> dict[str, list[int]] | None:
    """Tensor shapes from a safetensors header without reading the weights (None for .bin)."""
    if not file.endswith(".safetensors"):
        return None
    from safetensors import safe_open

    try:
        with safe_open(file, "pt") as f:
            return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as exc:  # noqa: BLE001 - a corrupt file is a bad adapter, not a crash
        raise LoRAError(f"cannot read {os.path.basename(file)}: {exc}") from None


def validate_dir(path: str, max_rank: int, base: BaseShapes) -> AdapterConfig:
    """Up-front check for the API process: config, tensor names and shapes, and finite values
    (the weights are read once for that, then dropped; the engine reads them again)."""
    config = read_config(path, max_rank)
    file = weight_file(path)
    shapes = header_shapes(file)
    if shapes is not None:
        check_shapes(shapes, config, base)  # before reading any weight
    tensors = _read_tensors(file)
    if shapes is None:
        check_shapes({k: list(t.shape) for k, t in tensors.items()}, config, base)
    check_finite(tensors)
    return config


def check_finite(tensors: dict[str, torch.Tensor]) -> None:
    """NaN / Inf in A or B (a broken fine-tune, garbage bytes) would turn every adapted
    request's logits into NaN: refused by name instead."""
    import torch

    for key, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise LoRAError(f"{key}: the adapter's weights hold NaN or Inf values")


def _read_tensors(file: str) -> dict[str, torch.Tensor]:
    import torch

    try:
        if file.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(file)
        tensors = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001
        raise LoRAError(f"cannot read {os.path.basename(file)}: {exc}") from None
    if not isinstance(tensors, dict):
        raise LoRAError(f"{os.path.basename(file)} does not hold a dict of tensors")
    return tensors


def load_adapter(path: str, max_rank: int, base: BaseShapes, dtype: torch.dtype) -> LoRAWeights:
    """Read and check an adapter from disk (the host tier's loader thread calls this)."""
    config = read_config(path, max_rank)
    tensors = _read_tensors(weight_file(path))
    check_shapes({k: list(t.shape) for k, t in tensors.items()}, config, base)
    check_finite(tensors)
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        assert m is not None  # check_shapes refused anything else
        layer, name = int(m.group(1)), m.group(2)
        if m.group(3) == "A":
            b = tensors[key.replace("lora_A", "lora_B")].float() * config.scaling
            modules[(layer, name)] = (tensor.to(dtype).contiguous(), b.to(dtype).contiguous())
    return LoRAWeights(config.rank, modules)
