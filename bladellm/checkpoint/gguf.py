"""GGUF checkpoints (llama.cpp's single-file format) as Hugging Face config, weights and tokenizer.

A GGUF file carries the model config as metadata under llama.cpp's key names, the tokenizer
(vocabulary, merges, chat template) and the weights, most of them block-quantized. We serve
dense weights: every tensor is dequantized with ``gguf.quants.dequantize`` to the serving dtype
and renamed to the Hugging Face parameter name, so the model code and its ``load_weights`` see
exactly what a safetensors checkpoint would give them.

llama.cpp's converter reorders the rows of the llama q/k projections (``LlamaModel.permute``:
GPT-NeoX rotary halves -> interleaved pairs). ``iter_hf_weights`` undoes it; transformers'
``LlamaTensorProcessor._reverse_permute_weights`` is the reference and the tests compare with it.

Reading the config, tokenizer and tensor list needs no torch (the API process locates a .gguf
model through this module): torch is imported only where tensors are made, in
``iter_hf_weights`` (and so ``hf_state_dict``) and ``write_hf_dir``.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class _Arch:
    config_class: str       # transformers config class
    hf_architecture: str    # config.architectures[0], what the model registry keys on
    permute_qk: bool        # llama.cpp permuted the q/k rows when converting


_ARCHS = {
    "llama": _Arch("LlamaConfig", "LlamaForCausalLM", permute_qk=True),
    "qwen2": _Arch("Qwen2Config", "Qwen2ForCausalLM", permute_qk=False),
    "qwen3": _Arch("Qwen3Config", "Qwen3ForCausalLM", permute_qk=False),
}
SUPPORTED_ARCHITECTURES = tuple(_ARCHS)

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors that describe the config rather than a parameter (llama 3.1 rope factors).
_CONFIG_TENSORS = {"rope_freqs.weight"}

# The serving dtypes ``iter_hf_weights`` takes by name.
_DTYPE_NAMES = ("float32", "bfloat16", "float16")


def supported_quant_types() -> tuple[str, ...]:
    """Names of the ggml tensor types this module can dequantize."""
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits

    types = [GGMLQuantizationType.F32, GGMLQuantizationType.F16, *_type_traits]
    return tuple(t.name for t in types)


def is_gguf_file(path: str | os.PathLike) -> bool:
    """True for an existing file that starts with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter name of a GGUF tensor; None for a config-only tensor.

    ``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``.
    """
    if gguf_name in _CONFIG_TENSORS:
        return None
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 1 and parts[0] in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[parts[0]]}.{suffix}"
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart")


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's ``LlamaModel.permute`` on a q/k weight or bias (rows = heads * head_dim).

    llama.cpp: ``w.reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1, 2)``; this inverts it.
    """
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


class GGUFCheckpoint:
    """One GGUF file: its Hugging Face config, weights (dequantized) and tokenizer.

    The file is memory-mapped; weights are dequantized one tensor at a time as they are iterated,
    so peak memory is the dense model in the serving dtype plus one tensor in float32.
    """

    def __init__(self, path: str | os.PathLike):
        from gguf import GGUFReader

        self.path = str(Path(path).expanduser())
        if not os.path.isfile(self.path):
            raise ValueError(f"GGUF file {self.path!r} does not exist")
        if not is_gguf_file(self.path):
            raise ValueError(f"{self.path!r} is not a GGUF file (no GGUF magic)")
        self.reader = GGUFReader(self.path, "r")
        self.architecture = self.get("general.architecture")
        if self.architecture not in _ARCHS:
            raise ValueError(
                f"{self.path}: GGUF architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        self.tensors = {t.name: t for t in self.reader.tensors}
        supported = set(supported_quant_types())
        bad = {n: t.tensor_type.name for n, t in self.tensors.items()
               if t.tensor_type.name not in supported}
        if bad:
            name, qtype = next(iter(bad.items()))
            raise ValueError(
                f"{self.path}: {len(bad)} tensor(s) use unsupported GGUF tensor types "
                f"{sorted(set(bad.values()))} (e.g. {name}: {qtype}); "
                f"supported: {', '.join(sorted(supported))}")
        for name in self.tensors:
            hf_tensor_name(name)  # fail now on a tensor we would not know where to put

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (to a tensor-parallel worker) as its path: the reader's memory map would be
        copied, twice the file, into every worker otherwise."""
        state = dict(self.__dict__)
        for key in ("reader", "tensors"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        from gguf import GGUFReader

        self.__dict__.update(state)
        self.reader = GGUFReader(self.path, "r")
        self.tensors = {t.name: t for t in self.reader.tensors}

    # -- metadata ---------------------------------------------------------------------------

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value (numbers, strings, lists), or ``default`` when absent."""
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def _arch_key(self, key: str, default: Any = None) -> Any:
        value = self.get(f"{self.architecture}.{key}", default)
        if isinstance(value, float):
            # metadata floats are float32: 9.999999747e-06 is the checkpoint's 1e-05
            value = float(str(np.float32(value)))
        return value

    def quant_types(self) -> Counter:
        """How many tensors use each ggml type, e.g. ``Counter({'Q4_1': 210, 'F32': 61})``."""
        return Counter(t.tensor_type.name for t in self.tensors.values())

    @cached_property
    def _hf_config(self):
        import transformers

        arch = _ARCHS[self.architecture]
        num_heads = self._arch_key("attention.head_count")
        hidden_size = self._arch_key("embedding_length")
        vocab_size = self._arch_key("vocab_size")
        if vocab_size is None:
            vocab_size = int(self.tensors["token_embd.weight"].shape[1])
        kwargs = dict(
            architectures=[arch.hf_architecture],
            vocab_size=int(vocab_size),
            hidden_size=hidden_size,
            intermediate_size=self._arch_key("feed_forward_length"),
            num_hidden_layers=self._arch_key("block_count"),
            num_attention_heads=num_heads,
            num_key_value_heads=self._arch_key("attention.head_count_kv", num_heads),
            head_dim=self._arch_key("attention.key_length", hidden_size // num_heads),
            max_position_embeddings=self._arch_key("context_length"),
            rms_norm_eps=self._arch_key("attention.layer_norm_rms_epsilon"),
            rope_parameters=self._rope_parameters(),
            tie_word_embeddings="output.weight" not in self.tensors,
            bos_token_id=self.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=self.get("tokenizer.ggml.eos_token_id"),
            pad_token_id=self.get("tokenizer.ggml.padding_token_id"),
            dtype=self._dense_dtype(),
        )
        if arch.config_class != "Qwen2Config":  # qwen2 always has q/k/v biases
            kwargs["attention_bias"] = "blk.0.attn_q.bias" in self.tensors
        config = getattr(transformers, arch.config_class)(**kwargs)
        config._name_or_path = self.path
        return config

    def hf_config(self):
        """The transformers ``PretrainedConfig`` this file describes (a fresh copy each call)."""
        import copy

        return copy.deepcopy(self._hf_config)

    def _dense_dtype(self) -> str:
        """The dtype ``--dtype auto`` should serve: the file's float type, float32 for quants."""
        types = {t.tensor_type.name for t in self.tensors.values() if len(t.shape) == 2}
        if types == {"BF16"}:
            return "bfloat16"
        if types == {"F16"}:
            return "float16"
        return "float32"

    def _rope_parameters(self) -> dict:
        theta = float(self._arch_key("rope.freq_base", 10000.0))
        kind = self._arch_key("rope.scaling.type")
        if kind in (None, "none"):
            if "rope_freqs.weight" in self.tensors:
                return self._llama3_rope_parameters(theta)
            return {"rope_type": "default", "rope_theta": theta}
        factor = float(self._arch_key("rope.scaling.factor", 1.0))
        params = {"rope_type": kind, "rope_theta": theta, "factor": factor}
        original = self._arch_key("rope.scaling.original_context_length")
        if kind == "yarn":
            if original is None:
                raise ValueError(f"{self.path}: yarn rope scaling without original_context_length")
            params["original_max_position_embeddings"] = int(original)
        elif kind != "linear":
            raise ValueError(f"{self.path}: unsupported rope scaling type {kind!r} "
                             "(supported: linear, yarn, llama3 rope_freqs)")
        return params

    def _llama3_rope_parameters(self, theta: float) -> dict:
        """llama.cpp stores llama-3.1-style rope scaling as a ``rope_freqs`` tensor of per-dim
        factors, not as metadata. Every llama 3.x release uses low/high freq factors 1 and 4 over
        8192 original positions; we check that the stored factors are exactly those."""
        stored = np.array(self.tensors["rope_freqs.weight"].data, dtype=np.float32)
        factor = float(stored.max())
        params = {"rope_type": "llama3", "rope_theta": theta, "factor": factor,
                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}
        head_dim = stored.shape[0] * 2
        inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
        expected = _llama3_factors(inv_freq, params)
        if not np.allclose(stored.astype(np.float64), expected, rtol=1e-4):
            raise ValueError(f"{self.path}: rope_freqs tensor is not llama-3 rope scaling with "
                             "low/high freq factors 1/4 over 8192 positions; not supported")
        return params

    # -- weights ----------------------------------------------------------------------------

    def iter_hf_weights(self, dtype: torch.dtype | str = "float32"
                        ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, tensor)`` for every parameter, dequantized to ``dtype``.

        Names are Hugging Face's (``model.layers.0.self_attn.q_proj.weight``); q/k rows are in
        Hugging Face order. ``lm_head.weight`` is absent when the file ties it to the embedding
        (``hf_config().tie_word_embeddings``).
        """
        import torch
        from gguf.quants import dequantize

        if isinstance(dtype, str):
            dtype = {name: getattr(torch, name) for name in _DTYPE_NAMES}[dtype]
        config = self._hf_config
        permute = _ARCHS[self.architecture].permute_qk
        for gguf_name, tensor in self.tensors.items():
            name = hf_tensor_name(gguf_name)
            if name is None:
                continue
            array = dequantize(tensor.data, tensor.tensor_type)
            if not array.flags.writeable:  # F32 tensors come back as a view of the mmap
                array = array.copy()
            values = torch.from_numpy(array).to(dtype)
            if permute and ".self_attn.q_proj." in name:
                values = unpermute_qk(values, config.num_attention_heads)
            elif permute and ".self_attn.k_proj." in name:
                values = unpermute_qk(values, config.num_key_value_heads)
            yield name, values.contiguous()

    def hf_state_dict(self, dtype: torch.dtype | str = "float32") -> dict[str, torch.Tensor]:
        return dict(self.iter_hf_weights(dtype))

    # -- tokenizer --------------------------------------------------------------------------

    def load_tokenizer(self):
        """The Hugging Face tokenizer and chat template stored in the file.

        transformers builds it (``convert_gguf_tokenizer``, the conversion ``AutoTokenizer`` uses
        for ``gguf_file=``). We call the fast-tokenizer class directly: ``AutoTokenizer`` would
        first re-parse the whole file for a config only to pick the same class (many times
        slower; docs/cpu.md).
        """
        from transformers import PreTrainedTokenizerFast

        path = Path(self.path)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
        if self.get("tokenizer.ggml.add_bos_token") and tokenizer.bos_token_id is not None:
            ids = tokenizer("a").input_ids
            if not ids or ids[0] != tokenizer.bos_token_id:
                tokenizer.add_bos_token = True  # llama-3 style files: transformers drops the flag
        return tokenizer


def _llama3_factors(inv_freq: np.ndarray, params: dict) -> np.ndarray:
    """llama.cpp's stored rope factors for llama-3 scaling (convert_hf_to_gguf.py)."""
    import math

    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    out = []
    for freq in inv_freq.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float64)


def save_as_hf_dir(gguf_path: str | os.PathLike, out_dir: str | os.PathLike,
                   dtype: torch.dtype | str | None = None) -> str:
    """Write a Hugging Face model directory (config.json, model.safetensors, tokenizer files,
    generation_config.json) from a GGUF file; returns ``out_dir``.

    Weights are dequantized to ``dtype`` (default: the config's dtype, float32 for quantized
    files). Tied embeddings are written once, as transformers does. The whole state dict is held
    in memory, which is fine for the small models this is meant for.
    """
    return write_hf_dir(GGUFCheckpoint(gguf_path), out_dir, dtype)


def write_hf_dir(ckpt: GGUFCheckpoint, out_dir: str | os.PathLike,
                 dtype: torch.dtype | str | None = None) -> str:
    """``save_as_hf_dir`` for a checkpoint that is already open."""
    from safetensors.torch import save_file

    config = ckpt.hf_config()
    dtype = dtype or str(config.dtype).removeprefix("torch.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = ckpt.hf_state_dict(dtype)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.dtype = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    config.save_pretrained(out)
    ckpt.load_tokenizer().save_pretrained(out)
    gen = {k: getattr(config, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")
           if getattr(config, k, None) is not None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return str(out)
