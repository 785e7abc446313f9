"""What the API process needs to know about the served model: tokenizer, EOS ids, length limit,
sampling defaults from ``generation_config.json``.

Loaded once at startup (``load_model_info``); the server, ``InputProcessor`` and
``OutputProcessor`` read it and never touch the model directory again.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from bladellm.checkpoint.locate import ResolvedModel, default_served_name
from bladellm.checkpoint.model_len import get_text_attr, resolve_max_model_len
from bladellm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# generation_config.json keys that map 1:1 onto SamplingParams fields.
_SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

@dataclass
class ModelInfo:
    model_dir: str
    tokenizer: Any  # a transformers tokenizer (fast when the model ships tokenizer.json)
    eos_token_ids: list[int]
    max_model_len: int
    served_model_name: str
    vocab_size: int  # the model's embedding rows; valid token ids are [0, vocab_size)
    has_chat_template: bool
    # Values from generation_config.json for the fields a request may omit. Only keys the model
    # actually sets appear here; the server applies them before its own defaults.
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)
    hf_config: Any = None


def load_model_info(model_dir: str, tokenizer_dir: str | None = None,
                    trust_remote_code: bool = False, max_model_len: int | None = None,
                    hf_config: Any = None, served_model_name: str | None = None,
                    tokenizer: Any = None) -> ModelInfo:
    """Load the tokenizer and the serving-relevant facts of ``model_dir``.

    ``hf_config`` and ``tokenizer`` may be passed when the caller already loaded them (a GGUF
    file carries its own tokenizer). A ``max_model_len`` above the model's own context length
    raises ``ValueError`` (naming ``--max_model_len``).
    """
    if tokenizer is None:
        tokenizer = _load_tokenizer(tokenizer_dir or model_dir, trust_remote_code)
    if hf_config is None:
        hf_config = _load_hf_config(model_dir, trust_remote_code)
    gen_config = _read_generation_config(model_dir)
    vocab_size = get_text_attr(hf_config, ("vocab_size",)) or len(tokenizer)
    chat_template = getattr(tokenizer, "chat_template", None)
    return ModelInfo(
        model_dir=str(model_dir),
        tokenizer=tokenizer,
        eos_token_ids=_eos_token_ids(gen_config, tokenizer),
        max_model_len=resolve_max_model_len(hf_config, max_model_len),
        served_model_name=served_model_name or _default_served_name(model_dir),
        vocab_size=int(vocab_size),
        has_chat_template=bool(chat_template),
        sampling_defaults=_sampling_defaults(gen_config),
        hf_config=hf_config,
    )


def _load_tokenizer(tokenizer_dir: str, trust_remote_code: bool):
    """``AutoTokenizer``'s tokenizer; on later starts through the class it picked, where that
    was proven to give the same tokenizer (``checkpoint/resolution_cache.py``: importing
    ``AutoTokenizer`` costs seconds)."""
    from bladellm.checkpoint.resolution_cache import remembered_tokenizer

    def auto():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=trust_remote_code)

    try:
        return remembered_tokenizer(tokenizer_dir, trust_remote_code, auto)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError, ... here
        raise ValueError(f"could not load a tokenizer from {tokenizer_dir!r}: {e}") from e


def _load_hf_config(model_dir: str, trust_remote_code: bool):
    from transformers import AutoConfig

    from bladellm.checkpoint.chatglm import chatglm_config, is_chatglm

    try:
        path = os.path.join(str(model_dir), "config.json")
        if not trust_remote_code and os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
            if isinstance(raw, dict) and is_chatglm(raw):  # read without its custom code
                return chatglm_config(raw, path)
        return AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise ValueError(f"could not load config.json from {model_dir!r}: {e}") from e


def _read_generation_config(model_dir: str) -> dict:
    """The raw JSON, so that only keys the model sets count (GenerationConfig fills in defaults)."""
    path = os.path.join(str(model_dir), "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        logger.warning("ignoring unreadable %s: %s", path, e)
        return {}
    return data if isinstance(data, dict) else {}


def _eos_token_ids(gen_config: dict, tokenizer) -> list[int]:
    ids: set[int] = set()
    gen_eos = gen_config.get("eos_token_id")
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif isinstance(gen_eos, list):
        ids.update(i for i in gen_eos if isinstance(i, int))
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(tok_eos, int):
        ids.add(tok_eos)
    return sorted(ids)


def _sampling_defaults(gen_config: dict) -> dict[str, float | int]:
    """Keep each value SamplingParams accepts; a bad one is logged and dropped, not fatal."""
    defaults: dict[str, float | int] = {}
    for key in _SAMPLING_DEFAULT_KEYS:
        value = gen_config.get(key)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        try:
            SamplingParams(**{key: value})
        except (ValueError, TypeError) as e:
            logger.warning("ignoring generation_config.json %s=%r: %s", key, value, e)
            continue
        defaults[key] = value
    return defaults


def _default_served_name(model_dir: str) -> str:
    return os.path.basename(os.path.normpath(str(model_dir))) or str(model_dir)


def model_info_for(resolved: ResolvedModel) -> ModelInfo:
    """The API process's view of a resolved model: the tokenizer is ``--tokenizer`` when given,
    else the model's own (the GGUF file's when served from one)."""
    cfg = resolved.model_config
    name = cfg.served_model_name or default_served_name(cfg.model, resolved.source or resolved.path)
    tokenizer = None
    if cfg.tokenizer is None and resolved.gguf is not None:
        tokenizer = resolved.gguf.load_tokenizer()
    return load_model_info(resolved.path, cfg.tokenizer, cfg.trust_remote_code,
                           resolved.max_model_len, resolved.hf_config, name, tokenizer=tokenizer)
