"""Writing quantized checkpoints in the formats other engines load.

* GPTQ (``quant_method: gptq``, ``checkpoint_format: gptq``, i.e. AutoGPTQ's v1 layout, what
  AutoGPTQ and GPTQModel write and vLLM / SGLang / transformers load). Per quantized linear
  ``<name>``: ``qweight`` int32 ``[in / (32/bits), out]`` (``32/bits`` consecutive input rows
  packed low bits first), ``qzeros`` int32 ``[groups, out / (32/bits)]`` (consecutive output
  columns packed, each stored as ``zero - 1``), ``scales`` float16 ``[groups, out]``, ``g_idx``
  int32 ``[in]``; ``w[o, i] = scales[g_idx[i], o] * (q[i, o] - (stored_zero[g_idx[i], o] + 1))``.
* compressed-tensors ``int-quantized`` (llm-compressor's W8A8): ``weight`` int8 ``[out, in]``,
  ``weight_scale`` ``[out, 1]`` in the model's dtype, no zero point (symmetric);
  ``w = weight * weight_scale``.

A ChatGLM checkpoint's output is a GLM one (``GlmForCausalLM``, transformers' ``GlmConfig``
fields): the tensors were quantized under GLM's names (``model_source.py``), and the custom
modeling / configuration code its config.json's ``auto_map`` names is not copied (the tokenizer's
is).

The checkpoint is written as sharded safetensors (one shard per decoder layer plus one for the
rest) with a ``model.safetensors.index.json``, so a layer can be written and forgotten.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch
from safetensors.torch import save_file

from bladellm.checkpoint.chatglm import is_chatglm
from bladellm.quantization.algorithms.model_source import glm_config_of_chatglm
from bladellm.quantization.algorithms.quantizer import Int8ChannelWeight, QuantizedWeight

INDEX_FILE = "model.safetensors.index.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".ckpt")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 holding unsigned 32-bit words -> the same bits as int32."""
    x = x & 0xFFFFFFFF
    return torch.where(x >= 2 ** 31, x - 2 ** 32, x).to(torch.int32)


def pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """``q`` ``[n, m]`` of ``bits``-bit values -> int32 ``[n / (32/bits), m]``: row
    ``r * (32/bits) + j`` goes to bits ``[bits*j, bits*(j+1))`` of packed row ``r``."""
    per = 32 // bits
    if q.shape[0] % per:
        raise ValueError(f"cannot pack {q.shape[0]} rows into int32 words of {per} at {bits} bits")
    q = q.to(torch.int64).reshape(q.shape[0] // per, per, q.shape[1])
    shifts = (torch.arange(per, dtype=torch.int64) * bits).view(1, per, 1)
    return _to_int32((q << shifts).sum(dim=1))


def pack_gptq(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    bits = qw.spec.bits
    stored_zeros = (qw.zeros.to(torch.int64) - 1) & qw.spec.maxq  # v1: zero - 1
    return {
        "qweight": pack_rows(qw.qweight.t().contiguous(), bits),
        "qzeros": pack_rows(stored_zeros.t().contiguous(), bits).t().contiguous(),
        "scales": qw.scales.to(torch.float16).contiguous(),
        "g_idx": qw.g_idx.to(torch.int32).contiguous(),
    }


def pack_int8(w: Int8ChannelWeight, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {"weight": w.qweight.contiguous(), "weight_scale": w.scale.to(dtype).contiguous()}


def gptq_quantization_config(bits: int, group_size: int, sym: bool, desc_act: bool,
                             damp_percent: float, meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act,
        "sym": sym, "checkpoint_format": "gptq", "damp_percent": damp_percent,
        "static_groups": False, "true_sequential": True, "lm_head": False,
        "pack_dtype": "int32", "meta": meta,
    }


def _int_args(dynamic: bool, strategy: str, observer: str | None) -> dict[str, Any]:
    return {"actorder": None, "block_structure": None, "dynamic": dynamic, "group_size": None,
            "num_bits": 8, "observer": observer, "observer_kwargs": {}, "strategy": strategy,
            "symmetric": True, "type": "int"}


def w8a8_quantization_config(meta: dict[str, Any]) -> dict[str, Any]:
    """llm-compressor's config for ``W8A8`` int (SmoothQuant + per-channel weights + dynamic
    per-token activations), ``format: int-quantized``."""
    return {
        "config_groups": {"group_0": {
            "input_activations": _int_args(True, "token", None),
            "output_activations": None,
            "targets": ["Linear"],
            "weights": _int_args(False, "channel", "minmax"),
        }},
        "format": "int-quantized",
        "global_compression_ratio": None,
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "bladellm": meta,
    }


class ShardedWriter:
    """Shards ``model-XXXXX-of-YYYYY.safetensors`` written one at a time; the index (and so a
    loadable checkpoint) appears only in ``finish``."""

    def __init__(self, output_dir: str, num_shards: int) -> None:
        self.output_dir, self.num_shards = output_dir, num_shards
        self.weight_map: dict[str, str] = {}
        self.total_bytes = 0
        self._next = 1

    def write_shard(self, tensors: dict[str, torch.Tensor]) -> str:
        assert self._next <= self.num_shards
        name = f"model-{self._next:05d}-of-{self.num_shards:05d}.safetensors"
        self._next += 1
        save_file({k: v.contiguous() for k, v in tensors.items()},
                  os.path.join(self.output_dir, name), metadata={"format": "pt"})
        for k, v in tensors.items():
            self.weight_map[k] = name
            self.total_bytes += v.numel() * v.element_size()
        return name

    def finish(self) -> None:
        assert self._next == self.num_shards + 1, "not every shard was written"
        index = {"metadata": {"total_size": self.total_bytes},
                 "weight_map": dict(sorted(self.weight_map.items()))}
        with open(os.path.join(self.output_dir, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2)


def _source_config(src: str) -> dict[str, Any]:
    with open(os.path.join(src, "config.json")) as f:
        return json.load(f)


def _model_code_files(config: dict[str, Any]) -> set[str]:
    """A ChatGLM directory's modeling / configuration code (``auto_map``'s non-tokenizer
    entries): the GLM checkpoint written from it does not use them."""
    if not is_chatglm(config):
        return set()
    refs = [v for k, v in (config.get("auto_map") or {}).items() if "Tokenizer" not in k]
    return {f"{ref.split('--')[-1].rsplit('.', 1)[0]}.py" for ref in refs if isinstance(ref, str)}


def copy_side_files(src: str, dst: str) -> list[str]:
    """Tokenizer, generation config, chat template, ...: every top-level file of ``src`` that
    is neither weights nor config.json (written by the caller with the quantization config),
    nor a ChatGLM directory's model code."""
    copied = []
    skip = _model_code_files(_source_config(src))
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if (not os.path.isfile(path) or name in _WEIGHT_INDEXES or name == "config.json"
                or name.endswith(_WEIGHT_SUFFIXES) or name in skip):
            continue
        shutil.copy2(path, os.path.join(dst, name))
        copied.append(name)
    return copied


def write_config(src: str, dst: str, quantization_config: dict[str, Any],
                 torch_dtype: str) -> None:
    config = _source_config(src)
    if is_chatglm(config):  # quantized as transformers' GlmForCausalLM: written as one
        config = glm_config_of_chatglm(config).to_diff_dict()
        config["dtype"] = torch_dtype
    config["quantization_config"] = quantization_config
    config["torch_dtype"] = torch_dtype
    if "dtype" in config:
        config["dtype"] = torch_dtype
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if quantization_config["quant_method"] == "gptq":
        # AutoGPTQ also reads (and writes) the bare config next to the weights
        with open(os.path.join(dst, "quantize_config.json"), "w") as f:
            json.dump(quantization_config, f, indent=2)
