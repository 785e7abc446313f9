"""The model's own transformers image processor, and the prompt's image placeholders.

Runs in the API process (``InputProcessor``, inside its CPU offload thread): each image goes
through the checkpoint's image processor (``AutoImageProcessor``), and each image placeholder
token of the prompt is expanded to as many tokens as the vision encoder will produce rows for
that image; the request then carries one ``MultiModalItem`` per image. One spec per
architecture says what the placeholder is and how many tokens an image takes (``LlavaSpec``;
``Qwen2VLSpec``, whose count depends on the image's size).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from bladellm.config import MultiModalConfig
from bladellm.multimodal.image import ImageError, check_image
from bladellm.multimodal.inputs import MultiModalItem, TensorData, content_hash


@dataclass(frozen=True)
class LlavaSpec:
    """LLaVA: ``<image>`` (``image_token_index``) stands for one image; the projector emits one
    row per patch, plus the CLS row when ``vision_feature_select_strategy`` is ``full``."""

    image_token_id: int
    patch_size: int
    keeps_cls: bool

    @classmethod
    def of(cls, hf_config: Any) -> "LlavaSpec":
        strategy = hf_config.vision_feature_select_strategy
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported "
                             f"(default or full)")
        return cls(int(hf_config.image_token_index), int(hf_config.vision_config.patch_size),
                   strategy == "full")

    def num_tokens(self, tensors: dict[str, np.ndarray]) -> int:
        height, width = tensors["pixel_values"].shape[-2:]
        return (height // self.patch_size) * (width // self.patch_size) + int(self.keeps_cls)


    def placeholder_text(self, tokenizer: Any) -> str:
        return tokenizer.convert_ids_to_tokens(self.image_token_id)

    def check_processor(self, image_processor: Any) -> None:
        """Nothing to check: the token count follows from the processed pixels."""


@dataclass(frozen=True)
class Qwen2VLSpec:
    """Qwen2-VL / Qwen2.5-VL: ``<|image_pad|>`` (``image_token_id``) stands for one image and
    is expanded to one token per merged cell of its patch grid (dynamic resolution: the
    processor resizes each image to a multiple of ``patch_size * spatial_merge_size`` within
    its min/max pixels, so the count depends on the image). A chat image part becomes
    ``<|vision_start|><|image_pad|><|vision_end|>``, as the models' chat template writes it."""

    image_token_id: int
    video_token_id: int | None  # refused in prompts: videos are not supported yet
    vision_start_token_id: int
    vision_end_token_id: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    video_text: str = "<|video_pad|>"

    @classmethod
    def of(cls, hf_config: Any) -> "Qwen2VLSpec":
        vision = hf_config.vision_config
        video = getattr(hf_config, "video_token_id", None)
        return cls(int(hf_config.image_token_id), None if video is None else int(video),
                   int(hf_config.vision_start_token_id), int(hf_config.vision_end_token_id),
                   int(vision.patch_size), int(vision.temporal_patch_size),
                   int(vision.spatial_merge_size))

    def num_tokens(self, tensors: dict[str, np.ndarray]) -> int:
        return int(np.prod(tensors["image_grid_thw"][0])) // self.merge_size ** 2

    def placeholder_text(self, tokenizer: Any) -> str:
        return "".join(tokenizer.convert_ids_to_tokens(
            [self.vision_start_token_id, self.image_token_id, self.vision_end_token_id]))

    def check_processor(self, image_processor: Any) -> None:
        """The processor's patching must be the vision tower's, or the token count (and the
        pixel rows the tower reads) would not match."""
        for name, ours in (("patch_size", self.patch_size),
                           ("temporal_patch_size", self.temporal_patch_size),
                           ("merge_size", self.merge_size)):
            theirs = getattr(image_processor, name, None)
            if theirs is not None and int(theirs) != ours:
                raise ValueError(f"preprocessor_config.json: {name} {theirs} differs from the "
                                 f"vision tower's {ours} (config.json vision_config)")


_SPECS = {"LlavaForConditionalGeneration": LlavaSpec,
          "Qwen2VLForConditionalGeneration": Qwen2VLSpec,
          "Qwen2_5_VLForConditionalGeneration": Qwen2VLSpec}


def is_multimodal(hf_config: Any) -> bool:
    return any(arch in _SPECS for arch in getattr(hf_config, "architectures", None) or ())


class ImageInputProcessor:
    """Images + prompt token ids -> expanded token ids + one ``MultiModalItem`` per image."""

    def __init__(self, model_dir: str, hf_config: Any, tokenizer: Any,
                 config: MultiModalConfig, trust_remote_code: bool = False) -> None:
        arch = next(a for a in hf_config.architectures if a in _SPECS)
        self.spec = _SPECS[arch].of(hf_config)
        self.config = config
        # What a chat message's image part becomes in the prompt text.
        self.placeholder_text = self.spec.placeholder_text(tokenizer)
        from transformers import AutoImageProcessor

        try:
            self.image_processor = AutoImageProcessor.from_pretrained(
                model_dir, trust_remote_code=trust_remote_code)
        except Exception as e:
            raise ValueError(f"could not load the image processor of {model_dir!r} "
                             f"(preprocessor_config.json): {e}") from e
        self.spec.check_processor(self.image_processor)

    def process(self, prompt_ids: list[int], images: list[Any], param: str = "prompt"
                ) -> tuple[list[int], list[MultiModalItem]]:
        """``images`` in prompt order: the i-th placeholder token is the i-th image. Raises
        ``ValueError`` naming ``param`` when the counts differ or exceed the limit."""
        limit = self.config.image_limit
        if len(images) > limit:
            raise ValueError(f"{param}: {len(images)} images, above the server's limit of "
                             f"{limit} per request (--limit_mm_per_prompt image={limit})")
        image_id = self.spec.image_token_id
        video_id = getattr(self.spec, "video_token_id", None)
        if video_id is not None and video_id in prompt_ids:
            raise ValueError(f"{param}: the prompt has a video placeholder "
                             f"({self.spec.video_text}); videos are not supported yet")
        slots = [i for i, t in enumerate(prompt_ids) if t == image_id]
        if len(slots) != len(images):
            raise ValueError(f"{param}: the prompt has {len(slots)} image placeholder(s) "
                             f"({self.placeholder_text!r}) but {len(images)} image(s) were "
                             f"given; put one placeholder where each image goes")
        ids: list[int] = []
        items: list[MultiModalItem] = []
        last = 0
        for slot, image in zip(slots, images):
            tensors = self._preprocess(image)
            n = self.spec.num_tokens(tensors)
            ids.extend(prompt_ids[last:slot])
            items.append(MultiModalItem(
                modality="image", hash=content_hash(tensors), offset=len(ids), length=n,
                tensors={k: TensorData.of(v) for k, v in tensors.items()}))
            ids.extend([image_id] * n)
            last = slot + 1
        ids.extend(prompt_ids[last:])
        return ids, items

    def _preprocess(self, image: Any) -> dict[str, np.ndarray]:
        image = check_image(image, self.config)
        try:
            out = self.image_processor(images=[image], return_tensors="np")
        except Exception as e:
            raise ImageError(f"the image processor failed: {type(e).__name__}: {e}") from None
        return {k: np.asarray(v) for k, v in out.items()
                if k in ("pixel_values", "image_grid_thw")}
