"""Each token's raw bytes, for the chat API's ``logprobs.content[].bytes``.

OpenAI documents ``bytes`` as the token's UTF-8 bytes so that clients can concatenate consecutive
tokens' bytes to rebuild characters split across tokens (an emoji is often 2-4 tokens of one
byte each). Decoding such a token alone gives U+FFFD, so the bytes have to come from the
vocabulary itself:

- byte-level BPE (GPT-2, Llama 3, SmolLM, Qwen: the decoder is ``ByteLevel``, or a slow tokenizer
  with ``byte_decoder``): the token string is written in GPT-2's bytes-to-unicode alphabet; map
  each character back to its byte;
- SentencePiece-style (``Metaspace`` / ``Replace("▁", " ")`` / ``ByteFallback`` decoders, or a
  slow tokenizer with ``sp_model``): ``<0xNN>`` is the byte NN, otherwise ``▁`` is a space and
  the rest is UTF-8;
- added and special tokens: the UTF-8 of their content;
- anything else (or a token these rules cannot map): the UTF-8 of the token decoded alone.

The table is a list indexed by token id, one per tokenizer, filled one id at a time on first use
(no up-front pass over a 150k vocabulary on the event loop).
"""

from __future__ import annotations

import json
import re
import weakref
from typing import Any

from transformers.convert_slow_tokenizer import bytes_to_unicode

BYTE_LEVEL = "byte_level"
SENTENCEPIECE = "sentencepiece"
TEXT = "text"

_SP_SPACE = "\u2581"  # ▁
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


# GPT-2's byte -> printable character table, inverted.
_UNICODE_TO_BYTE = {c: b for b, c in bytes_to_unicode().items()}


def _decoder_types(spec: Any, into: list[tuple[str, dict]]) -> None:
    if isinstance(spec, dict):
        if "type" in spec:
            into.append((spec["type"], spec))
        for child in spec.get("decoders") or ():
            _decoder_types(child, into)


def detect_scheme(tokenizer: Any) -> str:
    """``byte_level``, ``sentencepiece`` or ``text`` (fall back to decoding the token)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None) if backend is not None else None
    if decoder is not None:
        try:
            spec = json.loads(decoder.__getstate__())
        except Exception:  # noqa: BLE001 - an unknown decoder: decode tokens instead
            return TEXT
        found: list[tuple[str, dict]] = []
        _decoder_types(spec, found)
        kinds = {kind for kind, _ in found}
        if "ByteLevel" in kinds:
            return BYTE_LEVEL
        if kinds & {"ByteFallback", "Metaspace"} or any(
                kind == "Replace" and _SP_SPACE in json.dumps(d.get("pattern"), ensure_ascii=False)
                for kind, d in found):
            return SENTENCEPIECE
        return TEXT
    if backend is None:
        if getattr(tokenizer, "byte_decoder", None):
            return BYTE_LEVEL
        if getattr(tokenizer, "sp_model", None) is not None:
            return SENTENCEPIECE
    return TEXT


class TokenBytes:
    """``token_bytes(token_id)`` -> the token's raw bytes; see the module docstring."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.scheme = detect_scheme(tokenizer)
        try:
            size = len(tokenizer)
        except TypeError:
            size = 0
        self._table: list[bytes | None] = [None] * size
        # Added and special tokens: their content, whatever the vocabulary's alphabet.
        for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
            content = getattr(added, "content", added)
            if 0 <= token_id < size and isinstance(content, str):
                self._table[token_id] = content.encode("utf-8")
        for token_id in getattr(tokenizer, "all_special_ids", None) or ():
            if 0 <= token_id < size and self._table[token_id] is None:
                self._table[token_id] = self._decoded(token_id).encode("utf-8")

    def __call__(self, token_id: int, decoded: str | None = None) -> bytes:
        """``decoded``: the token decoded alone, when the caller has it (the fallback)."""
        table = self._table
        if 0 <= token_id < len(table):
            value = table[token_id]
            if value is None:
                value = table[token_id] = self._compute(token_id, decoded)
            return value
        return (decoded if decoded is not None else self._decoded(token_id)).encode("utf-8")

    def _decoded(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def _compute(self, token_id: int, decoded: str | None) -> bytes:
        if self.scheme != TEXT:
            try:
                piece = self._tokenizer.convert_ids_to_tokens(token_id)
            except Exception:  # noqa: BLE001 - an id outside the vocabulary
                piece = None
            if isinstance(piece, str) and piece:
                if self.scheme == BYTE_LEVEL:
                    try:
                        return bytes(_UNICODE_TO_BYTE[ch] for ch in piece)
                    except KeyError:
                        pass  # not in the byte alphabet: fall back to the decoded text
                else:
                    match = _BYTE_FALLBACK.fullmatch(piece)
                    if match:
                        return bytes([int(match.group(1), 16)])
                    return piece.replace(_SP_SPACE, " ").encode("utf-8")
        return (decoded if decoded is not None else self._decoded(token_id)).encode("utf-8")


_BY_TOKENIZER: "weakref.WeakKeyDictionary[Any, TokenBytes]" = weakref.WeakKeyDictionary()


def token_bytes_for(tokenizer: Any) -> TokenBytes:
    """The one ``TokenBytes`` of ``tokenizer`` (kept as long as the tokenizer lives)."""
    try:
        found = _BY_TOKENIZER.get(tokenizer)
    except TypeError:  # not weak-referenceable or not hashable
        return TokenBytes(tokenizer)
    if found is None:
        found = _BY_TOKENIZER[tokenizer] = TokenBytes(tokenizer)
    return found
