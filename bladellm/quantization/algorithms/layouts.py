"""The module names of each family's Hugging Face decoder layer, as the quantizer walks it.

A ``LayerLayout`` lists the linears (in the groups GPTQ quantizes one after the other), the norms,
and the ``SmoothGroup``s that scales may move through: an operation ``prev`` (a norm or a linear)
whose output feeds only ``linears``, so that dividing ``prev``'s output channel ``j`` by ``s_j``
and multiplying the linears' input channel ``j`` by it leaves the float layer unchanged.
``inspect`` names the submodule whose output measures a candidate's error. A group is left out
(None) where no such scaling exists: OPT-350m's norms come after their blocks, Phi-3's v and up
are rows of fused modules, a GELU between OPT's fc1 and fc2 does not commute with scaling (ReLU
does). Gemma's norms scale by ``1 + w`` (``unit_offset``: the stored weight moves so that
``1 + w`` is divided). Torch-free: the command line checks a checkpoint's tensors against it before loading.

Mixture-of-experts layers (Mixtral, Qwen2-MoE, Qwen3-MoE) have Llama's attention; their MLP is
one linear per expert projection once algorithms/moe.py has unfused the stacked experts
(``moe_layout``). The norm before their MLP also feeds the float router (and Qwen2-MoE's
``shared_expert_gate``): those stay float but are listed in the group's ``float_linears``, so
their weight columns take the same scales and they compute what they did (the fold is exact).
The group's input is the whole block's (``inp``), and each expert's up -> down is its own group
(``expert_out``), seeing only the tokens routed to that expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SmoothGroup:
    prev: str
    linears: tuple[str, ...]
    inspect: str
    unit_offset: bool = False  # ``prev`` is a norm that scales by 1 + weight (Gemma)
    # the module whose input is the group's (default: the first linear); a MoE block's input
    # group reads the block's, as an expert's linears see only the tokens routed to it
    inp: str = ""
    # modules that also read ``prev``'s output but stay float (routers): their weight columns
    # take the scales too, so they compute exactly what they did
    float_linears: tuple[str, ...] = ()


@dataclass(frozen=True)
class LayerLayout:
    name: str
    sequential: tuple[tuple[str, ...], ...]  # linears, group after group (true_sequential)
    norms: tuple[str, ...]
    attn_in: SmoothGroup | None
    attn_out: SmoothGroup | None
    mlp_in: SmoothGroup | None
    mlp_out: SmoothGroup | None
    clip_skip: tuple[str, ...]  # AWQ's clipping search skips q/k (the softmax hides their error)
    expert_out: tuple[SmoothGroup, ...] = ()  # MoE: each expert's up -> down

    @property
    def linear_names(self) -> tuple[str, ...]:
        return tuple(n for group in self.sequential for n in group)

    @property
    def attention_linear_names(self) -> tuple[str, ...]:
        """The attention's linears (the first two groups in every family)."""
        return self.sequential[0] + self.sequential[1]


_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_NORMS = ("input_layernorm", "post_attention_layernorm")
_ATTN_IN = SmoothGroup("input_layernorm", _QKV, "self_attn")
_ATTN_OUT = SmoothGroup("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj")

LLAMA = LayerLayout(
    "Llama", (_QKV, ("self_attn.o_proj",), ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",)),
    _NORMS, _ATTN_IN, _ATTN_OUT,
    SmoothGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
    SmoothGroup("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"), _QKV[:2])
# GLM / GLM-4: Llama's attention, gate and up fused in one module (so up -> down cannot scale).
GLM = LayerLayout(
    "GLM", (_QKV, ("self_attn.o_proj",), ("mlp.gate_up_proj",), ("mlp.down_proj",)), _NORMS,
    _ATTN_IN, _ATTN_OUT, SmoothGroup("post_attention_layernorm", ("mlp.gate_up_proj",), "mlp"),
    None, _QKV[:2])
# Phi-3: q/k/v fused too.
PHI3 = LayerLayout(
    "Phi-3", (("self_attn.qkv_proj",), ("self_attn.o_proj",), ("mlp.gate_up_proj",),
              ("mlp.down_proj",)), _NORMS,
    SmoothGroup("input_layernorm", ("self_attn.qkv_proj",), "self_attn"), None,
    SmoothGroup("post_attention_layernorm", ("mlp.gate_up_proj",), "mlp"), None,
    ("self_attn.qkv_proj",))


# Gemma 2 / Gemma 3: (1 + w) norms before and after attention and the MLP (the ones after feed
# the residual stream, not a linear); GeGLU: up -> down scales (gate's GELU is not in between).
_GEMMA_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm")
GEMMA = LayerLayout(
    "Gemma", (_QKV, ("self_attn.o_proj",), ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",)),
    _GEMMA_NORMS, SmoothGroup("input_layernorm", _QKV, "self_attn", unit_offset=True), _ATTN_OUT,
    SmoothGroup("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp",
                unit_offset=True),
    SmoothGroup("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"), _QKV[:2])


# Bloom: q/k/v fused per head in query_key_value (v's rows interleaved with q and k, so v -> dense
# cannot scale), a GELU between the MLP's linears; LayerNorms with bias feed query_key_value and
# dense_h_to_4h. Its attention and MLP take the residual as an argument: the linears themselves
# measure a candidate's error.
_BLOOM_QKV = "self_attention.query_key_value"
BLOOM = LayerLayout(
    "Bloom", ((_BLOOM_QKV,), ("self_attention.dense",), ("mlp.dense_h_to_4h",),
              ("mlp.dense_4h_to_h",)), ("input_layernorm", "post_attention_layernorm"),
    SmoothGroup("input_layernorm", (_BLOOM_QKV,), _BLOOM_QKV), None,
    SmoothGroup("post_attention_layernorm", ("mlp.dense_h_to_4h",), "mlp.dense_h_to_4h"), None,
    (_BLOOM_QKV,))


def opt_layout(pre_norm: bool, relu: bool) -> LayerLayout:
    """OPT: LayerNorms (with bias) before each block, or after it (350m: no norm feeds a
    linear); fc1 -> fc2 scales through ReLU only."""
    return LayerLayout(
        "OPT", (_QKV, ("self_attn.out_proj",), ("fc1",), ("fc2",)),
        ("self_attn_layer_norm", "final_layer_norm"),
        SmoothGroup("self_attn_layer_norm", _QKV, "self_attn") if pre_norm else None,
        SmoothGroup("self_attn.v_proj", ("self_attn.out_proj",), "self_attn.out_proj"),
        SmoothGroup("final_layer_norm", ("fc1",), "fc1") if pre_norm else None,
        SmoothGroup("fc1", ("fc2",), "fc2") if relu else None, _QKV[:2])


# config.json architectures (transformers' names) -> layout; Llama's for the others.
_BY_ARCHITECTURE = {"GlmForCausalLM": GLM, "Glm4ForCausalLM": GLM, "Phi3ForCausalLM": PHI3,
                    "Gemma2ForCausalLM": GEMMA, "Gemma3ForCausalLM": GEMMA,
                    "BloomForCausalLM": BLOOM}
# The decoder layers' tensor name prefixes a checkpoint may use (Bloom saved from BloomModel:
# no "transformer.").
LAYER_PREFIXES = ("model.layers.", "model.decoder.layers.", "decoder.layers.", "transformer.h.",
                  "h.")
# The token embedding next to each prefix's layers.
EMBEDDINGS = {"model.layers.": "model.embed_tokens.weight",
              "model.decoder.layers.": "model.decoder.embed_tokens.weight",
              "decoder.layers.": "decoder.embed_tokens.weight",
              "transformer.h.": "transformer.word_embeddings.weight",
              "h.": "word_embeddings.weight"}


def layout_of_config(raw: dict[str, Any]) -> LayerLayout:
    arch = (raw.get("architectures") or [""])[0]
    if arch == "OPTForCausalLM" or raw.get("model_type") == "opt":
        return opt_layout(bool(raw.get("do_layer_norm_before", True)),
                          raw.get("activation_function", "relu") == "relu")
    return _BY_ARCHITECTURE.get(arch, LLAMA)


def moe_layout(experts: tuple[tuple[str, str, str], ...], shared_expert: bool) -> LayerLayout:
    """A sparse layer: Llama's attention, then every expert's gate and up (and the shared
    expert's) in one group, every down in the next. ``experts``: each expert's (gate, up, down)
    module names in the checkpoint's spelling (Mixtral: w1, w3, w2). Smoothing: the norm before
    the block -> every gate / up, the router (and ``shared_expert_gate``) compensated in float,
    the error measured on the block's output; each expert's up -> down (AutoAWQ's grouping)."""
    gate_up = tuple(f"mlp.experts.{e}.{n}" for e, names in enumerate(experts) for n in names[:2])
    down = tuple(f"mlp.experts.{e}.{names[2]}" for e, names in enumerate(experts))
    routers: tuple[str, ...] = ("mlp.gate",)
    mlp_out = None
    if shared_expert:
        gate_up += ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj")
        down += ("mlp.shared_expert.down_proj",)
        routers += ("mlp.shared_expert_gate",)
        mlp_out = SmoothGroup("mlp.shared_expert.up_proj", ("mlp.shared_expert.down_proj",),
                              "mlp.shared_expert.down_proj")
    mlp_in = SmoothGroup("post_attention_layernorm", gate_up, "mlp", inp="mlp",
                         float_linears=routers)
    expert_out = tuple(SmoothGroup(f"mlp.experts.{e}.{names[1]}",
                                   (f"mlp.experts.{e}.{names[2]}",), f"mlp.experts.{e}.{names[2]}")
                       for e, names in enumerate(experts))
    return LayerLayout("MoE", (_QKV, ("self_attn.o_proj",), gate_up, down), _NORMS, _ATTN_IN,
                       _ATTN_OUT, mlp_in, mlp_out, _QKV[:2], expert_out)


def layout_of_layer(layer: Any) -> LayerLayout:
    """The layout of a loaded Hugging Face decoder layer, from the modules it has."""
    children = dict(layer.named_modules())
    if "mlp.experts" in children:
        experts = getattr(children["mlp.experts"], "expert_names", None)
        if experts is None:  # transformers' stacked experts: no per-expert linear to hook
            raise ValueError(f"--model: the experts of {type(layer).__name__} are stacked; "
                             f"algorithms/moe.py unfuse_experts must run first")
        return moe_layout(experts, "mlp.shared_expert" in children)
    if "fc1" in children:
        return opt_layout(bool(getattr(layer, "do_layer_norm_before", True)),
                          type(getattr(layer, "activation_fn", None)).__name__ == "ReLU")
    if "pre_feedforward_layernorm" in children:
        return GEMMA
    if _BLOOM_QKV in children:
        return BLOOM
    if "self_attn.qkv_proj" in children:
        return PHI3
    if "mlp.gate_up_proj" in children:
        return GLM
    return LLAMA
