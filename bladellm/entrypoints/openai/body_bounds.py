"""Request bodies parsed off the event loop, after cheap bounds on their token-id prompts.

Parsing a body of 13 M token ids into Python objects takes seconds and a gigabyte, whatever
happens to the request afterwards. So before the request model parses a body, the prompt fields
are looked at as raw JSON text (msgspec skips over them without building anything): the number
of prompts against ``--max_prompts_per_request`` and each token-id prompt's length (its commas)
against ``--max_model_len``. A body over a bound gets its 400 in tens of milliseconds; one within
them is bounded, and its full parse runs in a worker thread.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from bladellm.engine.input_processor import context_length_message
from bladellm.http.errors import bad_request

_Envelope = dict[str, msgspec.Raw]


@dataclass(frozen=True)
class BodyBounds:
    """``prompts``: request field -> the most prompts it may hold, and the flag that sets it.
    ``unbounded_by``: a field that lets a prompt be longer than the context (embeddings'
    ``truncate_prompt_tokens``); when a body sets it, lengths are left to the engine."""

    max_model_len: int
    prompts: dict[str, tuple[int, str]] = field(default_factory=dict)
    unbounded_by: str | None = None
    generates: bool = True  # False (embeddings): a prompt may fill the whole context


def check_body(body: bytes, bounds: BodyBounds) -> None:
    """400 when a prompt field cannot be served whatever its content; otherwise nothing (the
    request model's parse reports every other problem)."""
    if not bounds.prompts:
        return
    # A JSON array has at most one element more than the body has commas: when that is within
    # every bound, no prompt can be too long nor too many, and the structure need not be read.
    elements = _Bytes(body).count(_COMMA) + 1
    if elements < bounds.max_model_len and all(elements <= m for m, _ in bounds.prompts.values()):
        return
    try:
        top = msgspec.json.decode(body, type=_Envelope)
    except msgspec.ValidationError:
        return  # valid JSON but not an object: the request model says so
    except msgspec.DecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}",
                          code="invalid_json") from None
    limit = None if bounds.unbounded_by in top else _Limit(bounds.max_model_len,
                                                            bounds.generates)
    for name, (max_prompts, flag) in bounds.prompts.items():
        raw = top.get(name)
        if raw is not None:
            _check_prompt(_Bytes(raw), name, max_prompts, flag, limit)


_COMMA, _QUOTE, _BACKSLASH, _LBRACKET, _RBRACKET = (ord(c) for c in ',"\\[]')
_SPACE = np.array([ord(c) for c in " \t\r\n"], np.uint8)


class _Bytes:
    """Counts over a JSON text without copying it, in numpy loops (which release the GIL: the
    event loop keeps running while a 30 MiB body is looked at)."""

    def __init__(self, buf: Any) -> None:
        self.a = np.frombuffer(buf, np.uint8)

    def count(self, byte: int) -> int:
        return int(np.count_nonzero(self.a == byte))

    def positions(self, byte: int) -> np.ndarray:
        return np.flatnonzero(self.a == byte)

    def first_non_space(self, start: int = 0) -> int:
        """The first byte at or after ``start`` that is not JSON whitespace (-1: none)."""
        rest = self.a[start:start + 64]
        idx = np.flatnonzero(~np.isin(rest, _SPACE))
        if len(idx):
            return int(rest[idx[0]])
        if start + 64 >= len(self.a):
            return -1
        return self.first_non_space(start + 64)

    def escaped_quotes(self) -> int:
        return int(np.count_nonzero((self.a[:-1] == _BACKSLASH) & (self.a[1:] == _QUOTE)))


@dataclass(frozen=True)
class _Limit:
    max_model_len: int
    generates: bool

    def check(self, num_ids: int, label: str, param: str) -> None:
        """The engine's own words once tokenized, said before any id is parsed."""
        if self.generates and num_ids >= self.max_model_len:
            raise bad_request(context_length_message(num_ids, None, self.max_model_len, label),
                              param, code="context_length_exceeded")
        if not self.generates and num_ids > self.max_model_len:
            raise bad_request(f"{label}: {num_ids} tokens exceed the model's maximum context "
                              f"length of {self.max_model_len} tokens", param)


def _check_prompt(raw: _Bytes, name: str, max_prompts: int, flag: str,
                  limit: _Limit | None) -> None:
    """``raw``: the field's JSON text (msgspec hands it over stripped of outer whitespace)."""
    if raw.first_non_space() != _LBRACKET:
        return  # one text prompt: bounded by its length in characters after parsing
    num_quotes = raw.count(_QUOTE)
    if num_quotes:  # texts: one per pair of unescaped quotes
        num_prompts = min(raw.count(_COMMA) + 1, (num_quotes - raw.escaped_quotes()) // 2)
        _check_count(num_prompts, name, max_prompts, flag)
        return
    inner = raw.first_non_space(1)
    if inner == _LBRACKET:  # token-id prompts: count each list's commas
        _check_count(raw.count(_LBRACKET) - 1, name, max_prompts, flag)
        if limit is None:
            return
        ends = raw.positions(_RBRACKET)[:-1]  # each inner list's "]" (the last closes the outer)
        commas = raw.positions(_COMMA)
        # Commas before each inner "]", minus those before the previous one and the separator.
        before = np.searchsorted(commas, ends)
        per_list = np.diff(np.concatenate(([0], before))) - (np.arange(len(ends)) > 0)
        starts_empty = _empty_lists(raw, ends)
        ids = per_list + 1 - starts_empty
        if len(ids):
            worst = int(np.argmax(ids))
            limit.check(int(ids[worst]), f"{name}[{worst}]", name)
    elif inner not in (_RBRACKET, -1) and limit is not None:  # one token-id prompt
        limit.check(raw.count(_COMMA) + 1, name if limit.generates else f"{name}[0]", name)


def _empty_lists(raw: _Bytes, ends: np.ndarray) -> np.ndarray:
    """1 for each inner list that is empty ("[]", maybe with whitespace), else 0."""
    prev = np.zeros(len(ends), np.int64)
    for k, end in enumerate(ends.tolist()):  # at most max_prompts lists, checked above
        j = end - 1
        while j >= 0 and raw.a[j] in _SPACE:
            j -= 1
        prev[k] = int(raw.a[j] == _LBRACKET)
    return prev


def _check_count(num_prompts: int, name: str, max_prompts: int, flag: str) -> None:
    if num_prompts > max_prompts:
        raise bad_request(f"{name}: at most {max_prompts} prompts per request ({flag}), got "
                          f"{num_prompts}", name)


def _parse(model_cls: type, body: bytes, bounds: BodyBounds) -> Any:
    check_body(body, bounds)
    return model_cls.model_validate_json(body)


async def parse_request(model_cls: type, body: bytes, bounds: BodyBounds) -> Any:
    """The request model of ``body``, bounded and parsed in a worker thread."""
    return await asyncio.to_thread(_parse, model_cls, body, bounds)
