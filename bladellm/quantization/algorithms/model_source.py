"""The float model being quantized, whole in memory or one decoder layer at a time.

Without ``cpu_offload`` the model is ``AutoModelForCausalLM.from_pretrained`` (float32). With it,
the model is built on the meta device and only the embedding (plus the rotary embedding, which
is computed, not stored) is materialized; ``load_layer(i)`` reads layer ``i``'s tensors from the
safetensors files and ``release_layer(i)`` sends it back to meta, so memory peaks at about one
layer plus the embedding and the calibration activations. Both paths compute in float32 from the
same tensors, so they quantize to the same bits.

A ChatGLM2/3 checkpoint (``ChatGLMModel`` layout, whose modeling code transformers does not
have) becomes the equivalent transformers ``GlmForCausalLM`` in memory (``checkpoint/chatglm.py``
maps config and names, the mapping the engine loads it with; ``query_key_value`` is split into
q / k / v rows): that model is calibrated and quantized, and written as a GLM checkpoint.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from bladellm.checkpoint.chatglm import glm_fields, glm_tensor_name, is_chatglm
from bladellm.quantization.algorithms.layouts import LAYER_PREFIXES

LAYER_PREFIX = "model.layers."  # the Llama family's (OPT's: model.decoder.layers.)


def weight_files(model_dir: str) -> dict[str, str]:
    """Tensor name -> safetensors file of ``model_dir``."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {k: os.path.join(model_dir, v) for k, v in json.load(f)["weight_map"].items()}
    single = os.path.join(model_dir, "model.safetensors")
    if not os.path.isfile(single):
        raise ValueError(f"--model: {model_dir} has no model.safetensors or "
                         f"model.safetensors.index.json (only safetensors checkpoints are read)")
    with safe_open(single, "pt") as f:
        return {k: single for k in f.keys()}


def read_tensors(files: dict[str, str], names: list[str]) -> dict[str, torch.Tensor]:
    by_file: dict[str, list[str]] = {}
    for n in names:
        by_file.setdefault(files[n], []).append(n)
    out = {}
    for path, ns in by_file.items():
        with safe_open(path, "pt") as f:
            for n in ns:
                out[n] = f.get_tensor(n)
    return out


class ModelSource:
    def __init__(self, model_dir: str, cpu_offload: bool) -> None:
        import transformers

        self.model_dir, self.cpu_offload = model_dir, cpu_offload
        self.files = weight_files(model_dir)
        #: the GLM tensors of a ChatGLM checkpoint (its files hold other names)
        self.glm_state: dict[str, torch.Tensor] | None = None
        self._chatglm_dtype: torch.dtype | None = None
        with open(os.path.join(model_dir, "config.json")) as f:
            raw = json.load(f)
        if is_chatglm(raw):
            self._load_chatglm(raw)
            return
        self.layer_prefix = layer_prefix(self.files)
        self.config = transformers.AutoConfig.from_pretrained(model_dir)
        # transformers' SDPA path skips Gemma 2's attention soft-cap (calibrate on the real
        # model); Bloom has no SDPA path.
        attn = "eager" if getattr(self.config, "attn_logit_softcapping", None) or \
            self.config.model_type == "bloom" else "sdpa"
        if cpu_offload:
            if "Gemma3ForCausalLM" in (getattr(self.config, "architectures", None) or []):
                # its embedding's scale is a computed buffer the meta model would lose
                raise ValueError("--cpu_offload: not supported for Gemma3ForCausalLM; quantize "
                                 "without it")
            if self.layer_prefix != LAYER_PREFIX:
                raise ValueError(f"--cpu_offload: not supported for "
                                 f"{type(self.config).__name__} checkpoints (layers under "
                                 f"{self.layer_prefix!r}); quantize without it")
            with torch.device("meta"):
                model = transformers.AutoModelForCausalLM.from_config(
                    self.config, dtype=torch.float32, attn_implementation=attn)
            inner = model.model
            inner.rotary_emb = type(inner.rotary_emb)(config=self.config)  # a computed buffer
            self._materialize(inner.embed_tokens, "model.embed_tokens.")
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=torch.float32, attn_implementation=attn)
        model.eval()
        self.model = model

    def _load_chatglm(self, raw: dict) -> None:
        """transformers' GlmForCausalLM of the ChatGLM checkpoint's weights."""
        import transformers

        if self.cpu_offload:
            raise ValueError("--cpu_offload: not supported for ChatGLM checkpoints (they are "
                             "converted to GLM in memory); quantize without it")
        self.layer_prefix = LAYER_PREFIX
        self.config = glm_config_of_chatglm(raw)
        self.glm_state = glm_state_of_chatglm(
            raw, read_tensors(self.files, list(self.files)))
        with torch.device("meta"):
            model = transformers.GlmForCausalLM(self.config)
        missing, unexpected = model.load_state_dict(
            {n: t.float() for n, t in self.glm_state.items()}, strict=False, assign=True)
        if self.config.tie_word_embeddings:
            missing = [n for n in missing if n != "lm_head.weight"]
            model.tie_weights()
        if missing or unexpected:
            raise ValueError(f"--model: {self.model_dir} is not a ChatGLM checkpoint of its "
                             f"config.json: missing {missing[:3]}, unexpected "
                             f"{unexpected[:3]} (GLM names)")
        model.model.rotary_emb = type(model.model.rotary_emb)(config=self.config)
        self.model = model.eval()
        # the model holds the layers (float32); keep only what is written as it was
        self._chatglm_dtype = next(t.dtype for n, t in self.glm_state.items()
                                   if n.startswith(self.layer_prefix)
                                   and n.endswith("weight"))
        self.glm_state = {n: t for n, t in self.glm_state.items()
                          if not n.startswith(self.layer_prefix)}

    @property
    def layers(self) -> nn.ModuleList:
        from bladellm.quantization.algorithms.layer_io import decoder_layers

        return decoder_layers(self.model)

    def source_dtype(self) -> torch.dtype:
        if self._chatglm_dtype is not None:
            return self._chatglm_dtype
        name = next(n for n in self.files
                    if n.startswith(self.layer_prefix) and n.endswith("weight"))
        with safe_open(self.files[name], "pt") as f:
            return f.get_tensor(name).dtype

    def _materialize(self, module: nn.Module, prefix: str) -> None:
        module.to_empty(device="cpu")
        names = [prefix + k for k in module.state_dict()]
        missing = [n for n in names if n not in self.files]
        if missing:
            raise ValueError(f"--model: {self.model_dir} lacks tensors {missing[:4]}")
        tensors = read_tensors(self.files, names)
        module.load_state_dict({n[len(prefix):]: t.float() for n, t in tensors.items()})

    def load_layer(self, i: int) -> nn.Module:
        layer = self.layers[i]
        if self.cpu_offload:
            self._materialize(layer, f"{self.layer_prefix}{i}.")
        return layer

    def release_layer(self, i: int) -> None:
        if self.cpu_offload:
            self.layers[i].to("meta")

    def non_layer_names(self) -> list[str]:
        names = self.files if self.glm_state is None else self.glm_state
        return sorted(n for n in names if not n.startswith(self.layer_prefix))

    def non_layer_tensors(self) -> dict[str, torch.Tensor]:
        """The embedding, final norm and lm_head, as the output checkpoint names them."""
        if self.glm_state is not None:
            return {n: self.glm_state[n] for n in self.non_layer_names()}
        return read_tensors(self.files, self.non_layer_names())


def layer_prefix(files: dict[str, str]) -> str:
    """The decoder layers' tensor name prefix (OPT checkpoints saved from ``OPTModel`` drop
    the leading ``model.``)."""
    return next((p for p in LAYER_PREFIXES if any(n.startswith(p) for n in files)),
                LAYER_PREFIX)


def glm_config_of_chatglm(raw: dict) -> Any:
    """transformers' ``GlmConfig`` of a ChatGLM config.json (what the output's config.json is)."""
    import transformers

    try:
        fields = glm_fields(raw)
    except ValueError as e:
        raise ValueError(f"--model: {e}") from e
    config = transformers.GlmConfig(**fields)
    config.architectures = ["GlmForCausalLM"]
    return config


def glm_state_of_chatglm(raw: dict, tensors: dict[str, torch.Tensor]
                         ) -> dict[str, torch.Tensor]:
    """A ChatGLM checkpoint's tensors under transformers' GLM names, ``query_key_value`` (weight
    and bias: the q rows, then k's, then v's) split into ``q_proj`` / ``k_proj`` / ``v_proj``."""
    fields = glm_fields(raw)
    q = fields["num_attention_heads"] * fields["head_dim"]
    kv = fields["num_key_value_heads"] * fields["head_dim"]
    out = {}
    for name, tensor in tensors.items():
        glm = glm_tensor_name(name)
        if glm is None:
            continue
        if ".self_attn.qkv_proj." in glm:
            if tensor.shape[0] != q + 2 * kv:
                raise ValueError(f"--model: {name} has {tensor.shape[0]} rows; config.json gives "
                                 f"q {q} + k {kv} + v {kv} = {q + 2 * kv}")
            for part, t in zip(("q_proj", "k_proj", "v_proj"), tensor.split([q, kv, kv])):
                out[glm.replace(".qkv_proj.", f".{part}.")] = t.contiguous()
        else:
            out[glm] = tensor
    return out
