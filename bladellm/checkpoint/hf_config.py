"""Reading a checkpoint's ``config.json``, torch-free: the API process resolves the model
with it (``locate.locate_model``) and never imports torch."""

from __future__ import annotations

import json
import os
from typing import Any

from bladellm.checkpoint.chatglm import chatglm_config, is_chatglm


def load_hf_config(model_dir: str, trust_remote_code: bool, snapshot: bool = False) -> Any:
    """Read ``config.json`` as a transformers ``PretrainedConfig``; with ``snapshot``, callers
    that only read attributes may get a ``ConfigSnapshot`` of what transformers built for these
    bytes at an earlier start instead (``checkpoint/resolution_cache.py``: the import of
    transformers' config classes is most of a start-up)."""
    if snapshot:
        from bladellm.checkpoint.resolution_cache import remembered_config

        if not os.path.isdir(model_dir):
            raise ValueError(f"--model: model directory {model_dir!r} does not exist")
        return remembered_config(model_dir, trust_remote_code,
                                 lambda: load_hf_config(model_dir, trust_remote_code))
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not os.path.isdir(model_dir):
        raise ValueError(f"--model: model directory {model_dir!r} does not exist")
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"--model: {model_dir!r} has no config.json; expected a Hugging Face "
                         f"/ ModelScope model directory")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if is_chatglm(raw) and not trust_remote_code:  # read natively: no custom code needed
        return chatglm_config(raw, path)
    needs_code = "auto_map" in raw and raw.get("model_type") not in CONFIG_MAPPING
    if needs_code and not trust_remote_code:
        raise ValueError(f"{path} needs custom code from the model directory (auto_map, "
                         f"model_type {raw.get('model_type')!r}); pass --trust_remote_code to "
                         f"allow it")
    try:
        from huggingface_hub.errors import StrictDataclassClassValidationError as invalid
    except ImportError:  # huggingface_hub < 1.0: transformers raised ValueError itself
        invalid = ValueError
    try:
        return AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except (ValueError, OSError, KeyError, invalid) as e:
        if "trust_remote_code" in str(e) and not trust_remote_code:
            raise ValueError(f"{path}: loading this config needs --trust_remote_code") from e
        # one line: transformers' config validation errors run over several
        one_line = " ".join(part.strip() for part in str(e).splitlines() if part.strip())
        raise ValueError(f"cannot load {path}: {one_line}") from e
