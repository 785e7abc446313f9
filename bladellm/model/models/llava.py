"""LLaVA: a CLIP or SigLIP vision tower, a two-layer projector and any causal LM we support.

The vision tower is transformers' own module (``CLIPVisionModel`` / ``SiglipVisionModel`` via
``AutoModel.from_config``): it runs once per image (its output is kept in the worker's encoder
cache and sliced across prefill chunks), so it is not the hot path and gains nothing from our
paged-attention layers. It and the projector are replicated on every tensor-parallel rank; the
language model is the registry's model for ``text_config`` (Llama, Qwen2, ...), TP-sharded as
usual. Weight names are read as transformers saves them, old and new layouts alike:
``[model.]vision_tower.[vision_model.]*``, ``[model.]multi_modal_projector.*``,
``model.language_model.*`` / ``language_model.model.*`` and ``lm_head`` /
``language_model.lm_head``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Iterable

import torch
from torch import nn

from bladellm.attention.backend import AttentionBackend
from bladellm.distributed.parallel_state import get_pp_group
from bladellm.model.forward_context import ForwardContext
from bladellm.model.registry import get_model_class
from bladellm.model.utils import KVCacheSpec


def text_model_class(text_config: Any) -> type[nn.Module]:
    """The registry's class for a text config, which often names no ``architectures`` (then
    transformers' causal-LM class for its ``model_type``)."""
    archs = getattr(text_config, "architectures", None)
    if not archs:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(text_config.model_type)
        archs = [arch] if arch else [text_config.model_type]
    return get_model_class(SimpleNamespace(architectures=archs))


def _real_config(config: Any) -> Any:
    """A transformers config object (the engine may hold a read-only snapshot of it, which
    transformers' model classes do not take)."""
    from transformers import CONFIG_MAPPING, PretrainedConfig

    if isinstance(config, PretrainedConfig):
        return config
    as_dict = config.to_dict()
    return CONFIG_MAPPING[as_dict["model_type"]].from_dict(as_dict)


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, vision_width: int, text_width: int, act: str, bias: bool) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        self.linear_1 = nn.Linear(vision_width, text_width, bias=bias)
        self.act = ACT2FN[act]
        self.linear_2 = nn.Linear(text_width, text_width, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(nn.Module):
    packed_modules_mapping: dict[str, list[str]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self, hf_config: Any, dtype: torch.dtype, attn_backend: AttentionBackend,
                 quant_config: Any = None, prefix: str = "") -> None:
        super().__init__()
        if get_pp_group().world_size > 1:
            raise ValueError("--pipeline_parallel_size: vision-language models run on one "
                             "pipeline stage only (the image features enter at the first)")
        if quant_config is not None:
            raise ValueError("quantized LLaVA checkpoints are not supported yet")
        from transformers import AutoModel

        self.hf_config, self.dtype = hf_config, dtype
        text_config = hf_config.text_config
        self.language_model = text_model_class(text_config)(text_config, dtype, attn_backend)
        self.vision_tower = AutoModel.from_config(_real_config(hf_config.vision_config)).to(
            dtype).eval()
        layer = hf_config.vision_feature_layer
        num_layers = hf_config.vision_config.num_hidden_layers
        # hidden_states[i] is layer i's output (0: the embeddings): negative indices made
        # positive, so that the layers past the deepest one read can be dropped (LLaVA-1.5
        # reads the second to last: its last layer would run for nothing on every image).
        self.feature_layers = [i if i >= 0 else num_layers + 1 + i
                               for i in ([layer] if isinstance(layer, int) else list(layer))]
        self.num_tower_layers = max(self.feature_layers)
        encoder = self.vision_tower.encoder if hasattr(self.vision_tower, "encoder") else \
            self.vision_tower.vision_model.encoder
        encoder.layers = encoder.layers[:self.num_tower_layers]
        strategy = hf_config.vision_feature_select_strategy
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported")
        self.drop_cls = strategy == "default"
        self.multi_modal_projector = LlavaMultiModalProjector(
            hf_config.vision_config.hidden_size * len(self.feature_layers),
            text_config.hidden_size, hf_config.projector_hidden_act,
            getattr(hf_config, "multimodal_projector_bias", True)).to(dtype)
        self.tie_word_embeddings = self.language_model.tie_word_embeddings

    # ---- the language model's interface ---------------------------------------------------------
    def get_kv_cache_spec(self) -> KVCacheSpec:
        return self.language_model.get_kv_cache_spec()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | None:
        return self.language_model(input_ids, positions, ctx, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    # ---- images ---------------------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.model.embed_tokens(input_ids)

    def encode_image(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's processor outputs -> its rows of input embeddings [n, hidden], n the
        number of its placeholder tokens (``multimodal.processor.LlavaSpec.num_tokens``)."""
        pixels = tensors["pixel_values"].to(self.dtype)
        out = self.vision_tower(pixels, output_hidden_states=True, return_dict=True)
        feats = [out.hidden_states[i] for i in self.feature_layers]
        if self.drop_cls:
            feats = [f[:, 1:] for f in feats]
        return self.multi_modal_projector(torch.cat(feats, dim=-1)).flatten(0, 1)

    # ---- weights --------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        own = dict(self.named_parameters())
        loaded: set[str] = set()

        def language(items):
            for name, tensor in items:
                name = name.removeprefix("model.") if name.startswith("model.") and \
                    name.split(".")[1] in ("vision_tower", "multi_modal_projector",
                                           "language_model") else name
                if name.startswith("language_model.model."):  # the old layout
                    yield "model." + name[len("language_model.model."):], tensor
                elif name.startswith("language_model.lm_head."):
                    yield name[len("language_model."):], tensor
                elif name.startswith("language_model."):  # transformers 5's layout
                    yield "model." + name[len("language_model."):], tensor
                elif name.startswith("lm_head."):
                    yield name, tensor
                else:
                    self._load_own(name, tensor, own, loaded)

        loaded |= {f"language_model.{n}" for n in self.language_model.load_weights(
            language(weights))}
        return loaded

    def _load_own(self, name: str, tensor: torch.Tensor, own: dict[str, nn.Parameter],
                  loaded: set[str]) -> None:
        if name.startswith("vision_tower.vision_model.") and name not in own:
            name = "vision_tower." + name[len("vision_tower.vision_model."):]
        param = own.get(name)
        if param is None:
            if self._dropped_tower_layer(name):
                return
            if name.startswith(("vision_tower.", "multi_modal_projector.")):
                raise ValueError(f"checkpoint tensor {name} matches no parameter of the "
                                 f"vision tower or projector")
            return
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: shape mismatch: checkpoint tensor has shape "
                             f"{tuple(tensor.shape)}, parameter expects {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor)
        loaded.add(name)

    def _dropped_tower_layer(self, name: str) -> bool:
        """A tensor of a tower layer past the deepest feature layer (not built)."""
        for prefix in ("vision_tower.encoder.layers.", "vision_tower.vision_model.encoder.layers."):
            if name.startswith(prefix):
                index = name[len(prefix):].split(".", 1)[0]
                return index.isdigit() and int(index) >= self.num_tower_layers
        return False


__all__ = ["LlavaForConditionalGeneration"]
