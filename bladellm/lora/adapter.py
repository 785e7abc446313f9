"""The PEFT LoRA directory format: ``adapter_config.json`` + ``adapter_model.safetensors`` (or
``adapter_model.bin``).

What is served: plain LoRA (``peft_type: LORA``) on the attention and MLP projections of the
decoder layers, with ``r``, ``lora_alpha``, ``use_rslora``, under each family's own module names
(``LoRALayout``: Llama's q/k/v/o/gate/up/down, OPT's out_proj/fc1/fc2, Phi-3's fused qkv_proj /
gate_up_proj, GLM's gate_up_proj, ChatGLM's query_key_value / dense / dense_h_to_4h /
dense_4h_to_h, Bloom's query_key_value / dense / dense_h_to_4h / dense_4h_to_h). A PEFT module
that fuses several projections is one A and one B whose rows are the parts': each part gets the
shared A and its rows of B, which is the same product (Bloom's ``query_key_value`` orders its
rows per head, [head][q | k | v][head_dim]: each part takes its rows of every head). Everything
else is refused with a ``LoRAError`` naming the reason (DoRA, ``modules_to_save``, embedding /
LM-head adapters, LoRA biases, per-module rank or alpha patterns, rank above
``--max_lora_rank``), as are weights whose shapes do not fit the base model. ``fan_in_fan_out``
only describes how a Conv1D *base* layer stores its weight; PEFT's ``lora_A``/``lora_B`` are
always ``nn.Linear`` (``[r, in]`` and ``[out, r]``), and PEFT itself turns the flag off for
``nn.Linear`` targets, so it is accepted and changes nothing here.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bladellm.checkpoint.moe import sparse_layers

if TYPE_CHECKING:  # the API process validates adapters without torch; only loading needs it
    import torch

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# Projection roles (named as Llama's PEFT modules) -> (Llama's fused layer, slice index).
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0)}
_REFUSED_TARGETS = ("embed_tokens", "lm_head", "wte", "embed_out", "word_embeddings",
                    "output_layer")
# A mixture-of-experts block's modules (experts, router, shared expert) in a tensor name.
_MOE_MODULE = re.compile(r"\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\."
                         r"((?:experts|gate|shared_expert|shared_expert_gate)\b[\w.]*?)\.lora_[AB]")


@dataclass(frozen=True)
class LoRALayout:
    """How one family's checkpoint and PEFT name the adaptable projections.

    ``modules``: PEFT module path inside a decoder layer -> the roles (``TARGETS`` keys) its
    output rows hold, in order. ``ours``: our module path inside a decoder layer -> the roles of
    its output slices, in order (what ``lora/layers.py`` wraps)."""

    layers_prefix: str
    modules: dict[str, tuple[str, ...]]
    ours: dict[str, tuple[str, ...]]
    # PEFT modules whose output rows are grouped per head ([head][roles][head_dim]).
    per_head: tuple[str, ...] = ()
    key: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        paths = "|".join(re.escape(p) for p in sorted(self.modules, key=len, reverse=True))
        object.__setattr__(self, "key", re.compile(
            rf"^(?:base_model\.model\.)?{re.escape(self.layers_prefix)}\.(\d+)\.({paths})"
            rf"\.lora_([AB])(?:\.default)?\.weight$"))

    @property
    def leaf_names(self) -> tuple[str, ...]:
        return tuple(p.rsplit(".", 1)[-1] for p in self.modules)


_QKV, _GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
_LLAMA_OURS = {"self_attn.qkv_proj": _QKV, "self_attn.o_proj": ("o_proj",),
               "mlp.gate_up_proj": _GATE_UP, "mlp.down_proj": ("down_proj",)}
_LLAMA_ATTN = {f"self_attn.{n}": (n,) for n in (*_QKV, "o_proj")}
LLAMA = LoRALayout("model.layers", {**_LLAMA_ATTN, **{f"mlp.{n}": (n,) for n in
                                                      (*_GATE_UP, "down_proj")}}, _LLAMA_OURS)
# Phi-3 / Phi-4-mini: q/k/v and gate/up are single modules in transformers (and so in PEFT).
PHI3 = LoRALayout("model.layers", {"self_attn.qkv_proj": _QKV, "self_attn.o_proj": ("o_proj",),
                                   "mlp.gate_up_proj": _GATE_UP,
                                   "mlp.down_proj": ("down_proj",)}, _LLAMA_OURS)
GLM = LoRALayout("model.layers", {**_LLAMA_ATTN, "mlp.gate_up_proj": _GATE_UP,
                                  "mlp.down_proj": ("down_proj",)}, _LLAMA_OURS)
CHATGLM = LoRALayout("transformer.encoder.layers", {
    "self_attention.query_key_value": _QKV, "self_attention.dense": ("o_proj",),
    "mlp.dense_h_to_4h": _GATE_UP, "mlp.dense_4h_to_h": ("down_proj",)}, _LLAMA_OURS)
OPT = LoRALayout("model.decoder.layers", {
    "self_attn.q_proj": ("q_proj",), "self_attn.k_proj": ("k_proj",),
    "self_attn.v_proj": ("v_proj",), "self_attn.out_proj": ("o_proj",),
    "fc1": ("up_proj",), "fc2": ("down_proj",)},
    {"self_attn.qkv_proj": _QKV, "self_attn.out_proj": ("o_proj",), "fc1": ("up_proj",),
     "fc2": ("down_proj",)})
BLOOM = LoRALayout("transformer.h", {
    "self_attention.query_key_value": _QKV, "self_attention.dense": ("o_proj",),
    "mlp.dense_h_to_4h": ("up_proj",), "mlp.dense_4h_to_h": ("down_proj",)},
    {"self_attention.qkv_proj": _QKV, "self_attention.dense": ("o_proj",),
     "dense_h_to_4h": ("up_proj",), "dense_4h_to_h": ("down_proj",)},
    per_head=("self_attention.query_key_value",))
# config.json architecture -> layout; any other architecture is read as Llama-named.
LAYOUTS: dict[str, LoRALayout] = {
    "OPTForCausalLM": OPT, "Phi3ForCausalLM": PHI3, "GlmForCausalLM": GLM,
    "Glm4ForCausalLM": GLM, "ChatGLMModel": CHATGLM, "ChatGLMForConditionalGeneration": CHATGLM,
    "BloomForCausalLM": BLOOM}


class LoRAError(ValueError):
    """The adapter cannot be served (HTTP 400); the message says why."""


@dataclass(frozen=True)
class BaseShapes:
    """(in, out) features of every projection role of the base model (unsharded), and how
    its family names them."""

    num_layers: int
    sizes: dict[str, tuple[int, int]]
    layout: LoRALayout = LLAMA
    # Mixture-of-experts layers: their MLP is experts, which adapters may not target.
    sparse_layers: frozenset[int] = frozenset()
    num_heads: int = 0  # query heads (to split a per-head fused module, ``LoRALayout.per_head``)

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "BaseShapes":
        def get(*names: str) -> Any:
            return next((v for n in names if (v := getattr(cfg, n, None)) is not None), None)

        archs = list(getattr(cfg, "architectures", None) or [])
        layout = LAYOUTS.get(archs[0], LLAMA) if archs else LLAMA
        inter = get("intermediate_size", "ffn_dim", "ffn_hidden_size")
        if inter is None and layout is BLOOM:
            inter = 4 * cfg.hidden_size  # Bloom's MLP width is fixed
        if inter is None:  # no layout of ours
            raise LoRAError(f"--enable_lora: LoRA is not supported for "
                            f"{'/'.join(archs or ['this model'])}")
        hidden, heads = cfg.hidden_size, cfg.num_attention_heads
        head_dim = get("head_dim", "kv_channels") or hidden // heads
        q, kv = heads * head_dim, (get("num_key_value_heads") or heads) * head_dim
        return cls(cfg.num_hidden_layers, {
            "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}, layout, sparse_layers(cfg), heads)

    def module_shape(self, path: str) -> tuple[int, int]:
        """(in, out) of a PEFT module: a fused one's out is the sum of its parts'."""
        roles = self.layout.modules[path]
        return self.sizes[roles[0]][0], sum(self.sizes[r][1] for r in roles)


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    scaling: float
    target_modules: tuple[str, ...]  # the layout's leaf names (informational; weights decide)


@dataclass
class LoRAWeights:
    """A loaded adapter: ``modules[(layer, role)] = (A [r, in], B [out, r] * scaling)``, a
    fused PEFT module split into its roles (which share its A)."""

    rank: int
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def num_bytes(self) -> int:
        tensors = {id(t): t for pair in self.modules.values() for t in pair}  # A is shared
        return sum(t.numel() * t.element_size() for t in tensors.values())


def read_config(path: str, max_rank: int, layout: LoRALayout = LLAMA) -> AdapterConfig:
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
    return AdapterConfig(rank, float(scaling), _targets(cfg.get("target_modules"), layout))


def _targets(value: Any, layout: LoRALayout) -> tuple[str, ...]:
    supported = layout.leaf_names
    if value is None:
        raise LoRAError("target_modules is missing")
    if isinstance(value, str):
        if value == "all-linear":  # PEFT: every linear layer except the output head
            return supported
        names = [p.rsplit(".", 1)[-1] for p in layout.modules
                 if re.fullmatch(value, f"{layout.layers_prefix}.0.{p}")]
        if any(re.search(value, n) for n in _REFUSED_TARGETS):
            raise LoRAError("embedding / LM-head adapters are not supported")
        return tuple(names)
    names = [str(v).rsplit(".", 1)[-1] for v in value]
    refused = [n for n in names if n in _REFUSED_TARGETS]
    if refused:
        raise LoRAError(f"embedding / LM-head adapters are not supported (target_modules "
                        f"{refused})")
    unknown = [n for n in names if n not in supported]
    if unknown:
        raise LoRAError(f"target_modules {unknown} are not supported; supported: "
                        f"{', '.join(supported)}")
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
        m = base.layout.key.match(key)
        if m is not None and int(m.group(1)) in base.sparse_layers and any(
                r in ("gate_proj", "up_proj", "down_proj") for r in base.layout.modules[m.group(2)]):
            raise LoRAError(f"{key}: layer {m.group(1)}'s MLP is a mixture of experts; LoRA on "
                            f"its experts ({m.group(2).rsplit('.', 1)[-1]}) is not supported; "
                            f"adapt the attention projections (q_proj, k_proj, v_proj, o_proj)")
        if m is None:
            if "lora_magnitude_vector" in key:
                raise LoRAError("DoRA adapters are not supported")
            if any(t in key for t in _REFUSED_TARGETS):
                raise LoRAError(f"embedding / LM-head adapters are not supported ({key})")
            raise LoRAError(f"unexpected tensor {key!r} in the adapter")
        layer, name, which = int(m.group(1)), m.group(2), m.group(3)
        if layer >= base.num_layers:
            raise LoRAError(f"{key}: the base model has {base.num_layers} layers")
        fan_in, fan_out = base.module_shape(name)
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
    config = read_config(path, max_rank, base.layout)
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
    config = read_config(path, max_rank, base.layout)
    tensors = _read_tensors(weight_file(path))
    check_shapes({k: list(t.shape) for k, t in tensors.items()}, config, base)
    check_finite(tensors)
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = base.layout.key.match(key)
        assert m is not None  # check_shapes refused anything else
        layer, path = int(m.group(1)), m.group(2)
        if m.group(3) == "A":
            a = tensor.to(dtype).contiguous()
            b = tensors[key.replace("lora_A", "lora_B")].float() * config.scaling
            roles = base.layout.modules[path]
            if path in base.layout.per_head:
                per_head = b.reshape(base.num_heads, len(roles), -1, b.shape[-1])
                parts = [per_head[:, i].reshape(-1, b.shape[-1]) for i in range(len(roles))]
            else:
                parts = b.split([base.sizes[r][1] for r in roles])
            for role, part in zip(roles, parts):
                modules[(layer, role)] = (a, part.to(dtype).contiguous())
    return LoRAWeights(config.rank, modules)
