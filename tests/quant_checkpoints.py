"""Test-side quantizer and packers: a tiny float checkpoint -> the same model as a GPTQ, AWQ or
compressed-tensors checkpoint, written exactly as AutoGPTQ / AutoAWQ / llm-compressor lay out
their tensors. Written independently of bladellm.quantization (bit-by-bit loops, its own
dequantization formula), so the loader is checked against the formats, not against itself.

``quantize_checkpoint(src, dst, fmt, ...)`` returns the fake-quantized float weights (what the
quantized model computes, by name, e.g. ``model.layers.0.self_attn.q_proj.weight``) so tests can
put them into a transformers model as the reference.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# Mixture-of-experts checkpoints name their experts' projections the same (Qwen-MoE:
# ``mlp.experts.{e}.gate_proj``, its shared expert's too) or w1 / w3 / w2 (Mixtral); the routers
# (``mlp.gate``, ``block_sparse_moe.gate``, ``shared_expert_gate``) stay float, as AutoGPTQ /
# AutoAWQ leave them.
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "w1", "w2", "w3")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


@dataclass
class Quantized:
    q: torch.Tensor  # int64 [N, K]
    scales: torch.Tensor  # [N, G] in the stored dtype
    zeros: torch.Tensor  # int64 [N, G]
    g_idx: torch.Tensor  # int64 [K]

    def dequantized(self) -> torch.Tensor:
        s = self.scales.float()[:, self.g_idx]
        return (self.q - self.zeros[:, self.g_idx]).float() * s


def minmax_quantize(w: torch.Tensor, bits: int, group_size: int, sym: bool, signed: bool,
                    scale_dtype: torch.dtype = torch.float16,
                    g_idx: torch.Tensor | None = None) -> Quantized:
    """Plain min-max quantization of ``w`` [N, K] per (row, group); codes unsigned
    ``[0, 2**bits)`` (GPTQ, AWQ) or signed ``[-2**(bits-1), 2**(bits-1))`` (compressed-tensors).
    Scales are rounded to ``scale_dtype`` before the codes are computed, as stored."""
    n, k = w.shape
    gs = k if group_size == -1 else group_size
    if g_idx is None:
        g_idx = torch.arange(k) // gs
    groups = int(g_idx.max()) + 1
    qmin, qmax = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    scales = torch.empty(n, groups)
    zeros = torch.empty(n, groups, dtype=torch.int64)
    for g in range(groups):
        cols = w[:, g_idx == g].double()
        if sym:
            s = cols.abs().amax(1) / ((qmax - qmin) / 2)
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            s = (hi - lo) / (qmax - qmin)
        scales[:, g] = s.float()
    scales = scales.to(scale_dtype)
    s32 = scales.float().double().clamp_min(1e-8)
    for g in range(groups):
        cols = w[:, g_idx == g].double()
        if sym:
            zeros[:, g] = (qmin + qmax + 1) // 2
        else:
            zeros[:, g] = (qmin - torch.round(cols.amin(1).clamp(max=0) / s32[:, g])).long()
    zeros = zeros.clamp(qmin, qmax)
    q = torch.round(w.double() / s32[:, g_idx]).long() + zeros[:, g_idx]
    return Quantized(q.clamp(qmin, qmax), scales, zeros, g_idx)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 bit patterns held in int64 -> int32 (two's complement)."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def pack_along(values: torch.Tensor, bits: int, dim: int, order: list[int] | None = None
               ) -> torch.Tensor:
    """Pack unsigned ``values`` into int32 along ``dim``: value ``order[j]`` of each run of
    ``32 // bits`` at bits ``[bits*j, bits*(j+1))``."""
    per = 32 // bits
    order = order or list(range(per))
    v = values.movedim(dim, 0).long()
    assert int(v.min()) >= 0 and int(v.max()) < (1 << bits)
    words = torch.zeros((v.shape[0] // per, *v.shape[1:]), dtype=torch.int64)
    for j in range(per):
        words |= v[order[j]::per] << (bits * j)
    return _to_int32(words).movedim(0, dim).contiguous()


def pack_gptq(qz: Quantized, bits: int) -> dict[str, torch.Tensor]:
    # AutoGPTQ v1 stores zero - 1 (a zero of 0 would not survive; min-max never makes one here)
    assert int(qz.zeros.min()) >= 1, "GPTQ v1 cannot store a zero point of 0"
    return {"qweight": pack_along(qz.q.t(), bits, 0),
            "qzeros": pack_along((qz.zeros - 1).t(), bits, 1),
            "scales": qz.scales.t().contiguous(),
            "g_idx": qz.g_idx.to(torch.int32)}


def pack_awq(qz: Quantized) -> dict[str, torch.Tensor]:
    return {"qweight": pack_along(qz.q.t(), 4, 1, AWQ_ORDER),
            "qzeros": pack_along(qz.zeros.t(), 4, 1, AWQ_ORDER),
            "scales": qz.scales.t().contiguous()}


def pack_ct(qz: Quantized, bits: int, sym: bool) -> dict[str, torch.Tensor]:
    offset = 1 << (bits - 1)
    out = {"weight_packed": pack_along(qz.q + offset, bits, 1),
           "weight_scale": qz.scales.contiguous(),
           "weight_shape": torch.tensor(list(qz.q.shape))}
    if not sym:
        out["weight_zero_point"] = pack_along(qz.zeros + offset, bits, 0)
    return out


def pack_ct_int8(qz: Quantized) -> dict[str, torch.Tensor]:
    return {"weight": qz.q.to(torch.int8), "weight_scale": qz.scales.contiguous()}


def gptq_config(bits: int, group_size: int, sym: bool, desc_act: bool) -> dict:
    return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "sym": sym,
            "desc_act": desc_act, "damp_percent": 0.01, "true_sequential": True,
            "static_groups": False, "checkpoint_format": "gptq", "lm_head": False}


def awq_config(group_size: int) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
            "version": "gemm", "modules_to_not_convert": None}


def ct_config(fmt: str, bits: int, group_size: int, sym: bool, w8a8: bool) -> dict:
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "dynamic": False,
               "strategy": "channel" if group_size == -1 else "group",
               "group_size": None if group_size == -1 else group_size,
               "actorder": None, "observer": "minmax", "block_structure": None}
    acts = ({"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True,
             "strategy": "token", "group_size": None, "observer": None} if w8a8 else None)
    return {"quant_method": "compressed-tensors", "format": fmt,
            "quantization_status": "compressed", "global_compression_ratio": None,
            "ignore": ["lm_head"], "kv_cache_scheme": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": acts,
                                          "output_activations": None}}}


def quantize_checkpoint(src: str, dst: str | Path, fmt: str, bits: int = 4,
                        group_size: int = 32, sym: bool = False, desc_act: bool = False,
                        seed: int = 0, skip: str | None = None) -> dict[str, torch.Tensor]:
    """Write ``src`` quantized as ``fmt`` (gptq, awq, ct-pack, ct-w8a8) to ``dst``; returns the
    fake-quantized float weight of every quantized linear, by checkpoint name. ``skip``: a regex
    (``re.match`` on the module name) of linears left float."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, dst / f.name)
    state = load_file(str(Path(src) / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    fake: dict[str, torch.Tensor] = {}
    perms: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        module = name[:-len(".weight")]
        if not (name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEARS) or \
                (skip is not None and re.match(skip, module)):
            out[name] = tensor
            continue
        g_idx = None
        if desc_act:  # act-order: each group is a random set of group_size columns, the same
            k = tensor.shape[1]  # for modules reading the same input (as GPTQ's Hessian is)
            key = module.rsplit(".", 1)[0] + {"k_proj": "q_proj", "v_proj": "q_proj",
                                              "up_proj": "gate_proj", "w3": "w1"}.get(
                module.rsplit(".", 1)[1], module.rsplit(".", 1)[1])
            perm = perms.setdefault(key, torch.randperm(k, generator=gen))
            g_idx = torch.empty(k, dtype=torch.int64)
            g_idx[perm] = torch.arange(k) // group_size
        if fmt == "gptq":
            qz = minmax_quantize(tensor, bits, group_size, sym, signed=False, g_idx=g_idx)
            packed = pack_gptq(qz, bits)
        elif fmt == "awq":
            qz = minmax_quantize(tensor, 4, group_size, sym=False, signed=False)
            packed = pack_awq(qz)
        elif fmt == "ct-pack":
            qz = minmax_quantize(tensor, bits, group_size, sym, signed=True,
                                 scale_dtype=torch.bfloat16)
            packed = pack_ct(qz, bits, sym)
        elif fmt == "ct-w8a8":
            qz = minmax_quantize(tensor, 8, -1, sym=True, signed=True,
                                 scale_dtype=torch.float32)
            packed = pack_ct_int8(qz)
        else:
            raise ValueError(fmt)
        out.update({f"{module}.{k}": v for k, v in packed.items()})
        fake[name] = qz.dequantized()
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((Path(src) / "config.json").read_text())
    config["quantization_config"] = {
        "gptq": lambda: gptq_config(bits, group_size, sym, desc_act),
        "awq": lambda: awq_config(group_size),
        "ct-pack": lambda: ct_config("pack-quantized", bits, group_size, sym, False),
        "ct-w8a8": lambda: ct_config("int-quantized", 8, -1, True, True),
    }[fmt]()
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return fake


def set_config_field(model_dir: str | Path, **fields) -> None:
    """Edit the checkpoint's quantization_config (bad-config tests)."""
    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"].update(fields)
    path.write_text(json.dumps(config, indent=2))


# Tiny MoE shapes whose intermediate sizes groups of 32 divide (tiny_models' defaults, 48 and
# 40, are not).
MOE_SHAPES = {
    "mixtral": {},
    "qwen2_moe": dict(moe_intermediate_size=64, shared_expert_intermediate_size=96),
    "qwen3_moe": dict(moe_intermediate_size=64),
}


def dequantized_checkpoint(float_dir: str, fake: dict[str, torch.Tensor], dst: Path) -> str:
    """``float_dir`` with every quantized weight replaced by its dequantized value: what
    transformers runs as the reference (it stacks the per-expert tensors itself)."""
    shutil.copytree(float_dir, dst)
    state = load_file(str(dst / "model.safetensors"))
    assert set(fake) <= set(state)
    save_file({**state, **fake}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)
