"""User-facing sampling parameters and their validation.

A msgspec Struct so the same object crosses the API ↔ engine-core boundary without a copy type.
Invalid values raise ``ValueError`` naming the field.
"""

from __future__ import annotations

import json
import numbers
from typing import Any

import msgspec

_MAX_LOGPROBS = 20
# What the engine can represent: per-row arrays hold counts (top_k, min_tokens, max_tokens) as
# int32 and seeds as int64, and msgspec carries at most 64 bits across the process boundary.
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class SamplingParamsTypeError(TypeError, ValueError):
    """A sampling parameter of the wrong type (a ValueError too, so callers that turn invalid
    parameters into a 400 keep doing so)."""


_INT_FIELDS = ("n", "top_k", "min_tokens")
_OPTIONAL_INT_FIELDS = ("max_tokens", "seed", "logprobs", "prompt_logprobs")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty")
_BOOL_FIELDS = ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


# Longest regex a constraint may carry (``regex``, ``whitespace_pattern``, a JSON schema's
# ``pattern`` / ``patternProperties``): far above any real one, and it bounds the work of
# checking and compiling each.
MAX_REGEX_CHARS = 16_384


class GuidedDecodingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One output constraint (structured output / JSON mode); see docs/structured_output.md.

    Exactly one of ``json`` (a JSON schema, as an object or JSON text), ``regex``, ``choice``
    (the output is one of these strings), ``grammar`` (Lark, or GBNF as llama.cpp writes it) or
    ``json_object`` (any JSON object) must be set. ``whitespace_pattern`` (a regex) replaces the
    default compact JSON separators (``", "`` and ``": "``, no other whitespace).
    ``json`` is normalised to compact JSON text, which is also the compiled-grammar cache key.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    whitespace_pattern: str | None = None
    # JSON schema keywords the grammar engine cannot enforce (uniqueItems, contains, if/then,
    # unknown formats, ...): ignored and reported (False), or an error naming them (True: OpenAI's
    # ``strict: true``).
    strict: bool = False
    # Reasoning models (guided/reasoning_gate.py): the constraint applies after the output has
    # produced these token ids (the end-of-thinking tag); None: from the first token.
    reasoning_end: list[int] | None = None
    # With ``reasoning_end``: the first output token may be this one (the start-of-thinking
    # tag, which opens the thinking) instead of the answer's first token.
    reasoning_start: int | None = None

    def __post_init__(self) -> None:
        if self.json is not None:
            self.json = _normalize_schema(self.json)
        kinds = self.kinds
        if len(kinds) != 1:
            raise ValueError(f"guided_decoding: set exactly one of json, regex, choice, grammar, "
                             f"json_object; got {', '.join(kinds) or 'none'}")
        if self.choice is not None:
            if not self.choice or any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError("guided_choice: must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"guided_{name}: must be a non-empty string")
        for name in ("regex", "whitespace_pattern"):
            value = getattr(self, name)
            if isinstance(value, str) and len(value) > MAX_REGEX_CHARS:
                raise ValueError(f"guided_{name}: at most {MAX_REGEX_CHARS} characters, got "
                                 f"{len(value)}")
        if self.whitespace_pattern is not None and self.kind not in ("json", "json_object"):
            raise ValueError("guided_whitespace_pattern: only applies to JSON constraints")
        if self.reasoning_end is not None and (
                not self.reasoning_end or not all(_is_int(t) and t >= 0
                                                  for t in self.reasoning_end)):
            raise ValueError("guided_decoding.reasoning_end: must be a non-empty list of token ids")
        if self.reasoning_start is not None and (
                self.reasoning_end is None or not _is_int(self.reasoning_start)
                or self.reasoning_start < 0):
            raise ValueError("guided_decoding.reasoning_start: a token id, only with "
                             "reasoning_end")

    @property
    def kinds(self) -> list[str]:
        names = [n for n in ("json", "regex", "choice", "grammar")
                 if getattr(self, n) is not None]
        return names + (["json_object"] if self.json_object else [])

    @property
    def kind(self) -> str:
        return self.kinds[0]


def _normalize_schema(schema: Any) -> str:
    """Compact JSON text of a schema given as an object or as JSON text (key order kept: it is
    the order the model writes the properties in)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except RecursionError:
            raise ValueError("guided_json: the schema is nested too deeply") from None
        except ValueError as e:
            raise ValueError(f"guided_json: not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"guided_json: a JSON schema must be an object, "
                         f"got {type(schema).__name__}")
    try:
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    except RecursionError:
        raise ValueError("guided_json: the schema is nested too deeply") from None


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs besides the sampled token's
    # Per prompt token after the first: its logprob and rank, and this many top alternatives
    # (``RequestOutput.prompt_logprobs``), from the request's own prefill (which then takes no
    # prompt-cache hit).
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    # Structured output: the output follows this constraint (None: unconstrained).
    guided_decoding: GuidedDecodingParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._check_types()
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _check_types(self) -> None:
        """Wrong types name the parameter (a Struct does not check them on construction), and
        numbers are normalised (an integral numpy value to int; bool is not a number here)."""
        def bad(name: str, expected: str, value: Any) -> SamplingParamsTypeError:
            return SamplingParamsTypeError(f"{name}: must be {expected}, got "
                                           f"{type(value).__name__} {value!r}")

        for name in _INT_FIELDS + _OPTIONAL_INT_FIELDS:
            value = getattr(self, name)
            if value is None and name in _OPTIONAL_INT_FIELDS:
                continue
            if not _is_int(value):
                raise bad(name, "an int" + (" or None" if name in _OPTIONAL_INT_FIELDS else ""),
                          value)
            if type(value) is not int:
                setattr(self, name, int(value))
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if not _is_real(value):
                raise bad(name, "a number", value)
            if type(value) is not float:
                setattr(self, name, float(value))
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise bad(name, "a bool", value)
        if self.stop is not None:
            if not isinstance(self.stop, (list, tuple)) or not all(
                    isinstance(x, str) for x in self.stop):
                raise bad("stop", "a string or a list of strings", self.stop)
            self.stop = list(self.stop)
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                    _is_int(t) for t in self.stop_token_ids):
                raise bad("stop_token_ids", "a list of ints", self.stop_token_ids)
            self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", "a dict of token id to bias", self.logit_bias)
            for tok, bias in self.logit_bias.items():
                if not (_is_int(tok) or (isinstance(tok, str) and tok.strip().lstrip("-")
                                         .isdigit())):
                    raise bad("logit_bias", "keyed by int token ids", tok)
                if not _is_real(bias):
                    raise bad("logit_bias", f"a number for token {tok}", bias)
        if isinstance(self.guided_decoding, dict):
            # vLLM's GuidedDecodingParams(**dict)
            try:
                self.guided_decoding = GuidedDecodingParams(**self.guided_decoding)
            except TypeError as exc:
                raise SamplingParamsTypeError(
                    f"guided_decoding: {exc} (keys: json, regex, choice, grammar, json_object, "
                    f"whitespace_pattern)") from None
        elif self.guided_decoding is not None and not isinstance(self.guided_decoding,
                                                                 GuidedDecodingParams):
            raise bad("guided_decoding", "a GuidedDecodingParams or a dict of its fields",
                      self.guided_decoding)

    def _validate(self) -> None:
        def bad(name: str, msg: str) -> ValueError:
            return ValueError(f"{name}: {msg}")

        for name in ("n", "top_k", "min_tokens", "max_tokens"):
            value = getattr(self, name)
            if value is not None and value > INT32_MAX:
                raise bad(name, f"must be <= {INT32_MAX}, got {value}")
        if self.n < 1:
            raise bad("n", f"must be >= 1, got {self.n}")
        if not (self.temperature >= 0.0) or self.temperature > 1e4:
            raise bad("temperature", f"must be in [0, 1e4], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise bad("top_k", f"must be 0 or -1 (disabled) or positive, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not (self.repetition_penalty > 0.0) or self.repetition_penalty > 100:
            raise bad("repetition_penalty", f"must be in (0, 100], got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (-2.0 <= value <= 2.0):
                raise bad(name, f"must be in [-2, 2], got {value}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens}), "
                                    f"got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (0 <= value <= _MAX_LOGPROBS):
                raise bad(name, f"must be in [0, {_MAX_LOGPROBS}], got {value}")
        if self.stop is not None and any((not isinstance(s, str)) or s == "" for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if self.stop_token_ids is not None and any(not 0 <= t <= INT32_MAX
                                                   for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"must be token ids in [0, {INT32_MAX}]")
        if self.logit_bias is not None:
            for tok, bias in self.logit_bias.items():
                if not 0 <= int(tok) <= INT32_MAX:
                    raise bad("logit_bias", f"token id {tok} is out of range [0, {INT32_MAX}]")
                if not (-100.0 <= bias <= 100.0):
                    raise bad("logit_bias", f"bias for token {tok} must be in [-100, 100]")
        if self.seed is not None and not (INT64_MIN <= self.seed <= INT64_MAX):
            raise bad("seed", "must fit in 64 bits")
        if self.guided_decoding is not None and self.min_tokens > 0:
            # min_tokens bans EOS, which a finished grammar may leave as the only valid token.
            raise bad("min_tokens", "cannot be combined with guided decoding")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def clone(self, **changes) -> "SamplingParams":
        return msgspec.structs.replace(self, **changes)
