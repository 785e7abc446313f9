"""Whether a model splits into the tensor- and pipeline-parallel degrees asked for.

The rules are the loader's and the layers' (``distributed/partition.py`` shards heads,
intermediate columns, vocabulary rows and layers; a ``blade_llm_split`` checkpoint fixes its
degrees). They are pure functions over the config, so that the engine core (``MultiprocExecutor``),
``blade_llm_worker``, ``blade_llm_split`` and ``blade_llm_check`` refuse a bad degree at start-up,
with one error naming the flag, before any worker process starts or any weight is read.
"""

from __future__ import annotations

import os
from typing import Any

from bladellm.checkpoint.moe import num_experts
from bladellm.distributed.partition import attention_partitions, even_shard, pipeline_stages


def check_tensor_parallel(hf_config: Any, tp_size: int, model_dir: str | None = None,
                          pp_size: int = 1, expert_parallel: bool = False) -> None:
    """Refuse a degree the model cannot be split into (a rank would hold no query head, no
    intermediate column or no vocabulary row), or that differs from the degrees a
    ``blade_llm_split`` checkpoint at ``model_dir`` was split for, before any worker process
    starts."""
    if model_dir is not None and os.path.isdir(model_dir):
        # The loader (torch) only when there is a directory to look at.
        from bladellm.model.loader import check_split_parallel, read_split_manifest

        manifest = read_split_manifest(model_dir)
        if manifest is not None:
            check_split_parallel(manifest, tp_size, pp_size, model_dir, expert_parallel)

    hf_config = getattr(hf_config, "text_config", None) or hf_config  # a VLM: its LM is split
    heads = hf_config.num_attention_heads
    try:
        attention_partitions(heads, getattr(hf_config, "num_key_value_heads", None) or heads,
                             tp_size)
        for what in ("intermediate_size", "vocab_size", "shared_expert_intermediate_size") + \
                (() if expert_parallel else ("moe_intermediate_size",)):
            if getattr(hf_config, what, None):
                even_shard(getattr(hf_config, what), tp_size, 0, what)
    except ValueError as exc:
        raise ValueError(f"--tensor_parallel_size {tp_size}: {exc}") from None
    if expert_parallel:
        experts = num_experts(hf_config)
        archs = getattr(hf_config, "architectures", None) or ["this model"]
        if experts == 0:
            raise ValueError(f"--enable_expert_parallel: {archs[0]} has no experts (not a "
                             f"mixture-of-experts model)")
        if experts < tp_size:
            raise ValueError(f"--enable_expert_parallel: {experts} experts cannot be split over "
                             f"--tensor_parallel_size {tp_size} ranks")


# Architectures whose model file has no pipeline stages (a vision-language model's image
# features enter at the first stage, models/llava.py, models/qwen2_vl.py).
SINGLE_STAGE_ARCHITECTURES = ("LlavaForConditionalGeneration",
                              "Qwen2VLForConditionalGeneration",
                              "Qwen2_5_VLForConditionalGeneration")


def check_pipeline_parallel(hf_config: Any, pp_size: int) -> None:
    """Refuse more stages than the model has layers, or stages for an architecture that has
    none, before any worker process starts."""
    single = [a for a in getattr(hf_config, "architectures", None) or []
              if a in SINGLE_STAGE_ARCHITECTURES]
    if pp_size > 1 and single:
        raise ValueError(f"--pipeline_parallel_size {pp_size}: {single[0]} runs on one pipeline "
                         f"stage only (use --tensor_parallel_size to spread it)")
    hf_config = getattr(hf_config, "text_config", None) or hf_config  # a VLM: its LM
    try:
        pipeline_stages(hf_config.num_hidden_layers, pp_size)
    except ValueError as exc:
        raise ValueError(f"--pipeline_parallel_size {pp_size}: {exc}") from None
