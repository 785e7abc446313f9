"""A cheap bound on prompt length in characters, checked before tokenizing.

Tokenizing costs time linear in the text (seconds for megabytes); a prompt that cannot fit in
``max_model_len`` tokens should be refused before paying it. Every token decodes to at most
``max_token_chars`` characters (the longest vocabulary entry: byte-level BPE and SentencePiece
spell each character with at least one symbol of the entry), so a text of more than
``max_model_len * max_token_chars`` characters needs more than ``max_model_len`` tokens. A
normalizer that deletes characters (accent stripping, control characters) could break that
argument, hence the safety factor: the check only refuses what is hopeless, the exact token
count still decides the rest.
"""

from __future__ import annotations

from typing import Any

SAFETY_FACTOR = 4


def max_token_chars(tokenizer: Any) -> int | None:
    """Characters of the longest vocabulary entry, or None when the tokenizer has no vocab."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    try:
        vocab = get_vocab()
    except Exception:  # noqa: BLE001 - some slow tokenizers do not implement it
        return None
    longest = max((len(tok) for tok in vocab), default=0)
    return longest or None


def prompt_char_limit(tokenizer: Any, max_model_len: int) -> int | None:
    """Most characters a prompt can have and still fit; None = no cheap bound known."""
    longest = max_token_chars(tokenizer)
    return None if longest is None else max_model_len * longest * SAFETY_FACTOR


def check_prompt_chars(text: str, limit: int | None, max_model_len: int,
                       param: str = "prompt") -> None:
    if limit is not None and len(text) > limit:
        raise ValueError(f"{param}: {len(text)} characters cannot fit in the model's maximum "
                         f"context length of {max_model_len} tokens")
