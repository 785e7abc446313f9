"""Front-end half of the embeddings path (``AsyncLLM.embed``, ``LLM.embed``): prompt checks
before the engine, and after it the Matryoshka cut (``dimensions``) and L2 normalization."""

from __future__ import annotations

import math
from dataclasses import dataclass

from bladellm.checkpoint.pooling_config import PoolingConfig


@dataclass
class EmbeddingOutput:
    embedding: list[float]
    prompt_token_ids: list[int]


def truncate_prompt(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: ``None`` keeps the prompt as it is, ``k`` keeps its last
    ``k`` tokens, ``-1`` its last ``max_model_len`` tokens (what vLLM's benchmark client sends)."""
    if keep is None:
        return ids
    if keep == 0 or keep < -1:
        raise ValueError("truncate_prompt_tokens: must be -1 or a positive number of tokens")
    if keep > max_model_len:
        raise ValueError(f"truncate_prompt_tokens: {keep} exceeds the model's maximum context "
                         f"length of {max_model_len} tokens")
    keep = max_model_len if keep == -1 else keep
    return ids[-keep:] if len(ids) > keep else ids


def check_prompt(ids: list[int], max_model_len: int, vocab_size: int, index: int) -> None:
    if not ids:
        raise ValueError(f"input[{index}]: must not be empty")
    if len(ids) > max_model_len:
        raise ValueError(f"input[{index}]: {len(ids)} tokens exceed the model's maximum "
                         f"context length of {max_model_len} tokens")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"input[{index}]: token id {bad[0]} is out of the vocabulary "
                         f"[0, {vocab_size})")


def check_dimensions(dimensions: int | None, config: PoolingConfig) -> None:
    if dimensions is None:
        return
    if not config.matryoshka:
        raise ValueError("dimensions: this model does not support Matryoshka embeddings "
                         "(no matryoshka_dimensions in its config.json)")
    if dimensions < 1:
        raise ValueError(f"dimensions: must be >= 1, got {dimensions}")


def finish(vector: list[float], config: PoolingConfig, dimensions: int | None) -> list[float]:
    if dimensions is not None:
        if dimensions > len(vector):
            raise ValueError(f"dimensions: must be <= the model's {len(vector)}, got "
                             f"{dimensions}")
        vector = vector[:dimensions]
    if config.normalize:
        norm = math.sqrt(sum(x * x for x in vector)) or 1.0
        vector = [x / norm for x in vector]
    return vector
