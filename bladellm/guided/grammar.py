"""A request's constraint → llguidance grammar text, and the cache key of that constraint.

JSON is served with compact, bounded whitespace by default (``", "`` and ``": "``, nothing else):
a weak model given unbounded whitespace can loop on spaces or newlines. ``\\d``, ``\\w``, ``\\s``
(and their negations) in user regexes and in JSON-schema ``pattern`` mean ASCII, as users expect
from Python / JavaScript; llguidance's regex engine would read them as Unicode classes.
"""

from __future__ import annotations

import json
from typing import Any

from bladellm.sampling_params import MAX_REGEX_CHARS, GuidedDecodingParams

# Compact separators, no free whitespace (llguidance's JsonCompileOptions).
COMPACT_JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_ASCII_CLASSES = {"d": "0-9", "w": "0-9A-Za-z_", "s": " \\t\\n\\r\\f\\v"}
# Keys whose value maps names (not keywords) to subschemas.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def ascii_regex(pattern: str) -> str:
    """Rewrite ``\\d \\w \\s \\D \\W \\S`` as ASCII classes, inside and outside ``[...]``."""
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            cls = _ASCII_CLASSES.get(nxt.lower())
            if cls is not None and nxt.islower():
                out.append(cls if in_class else f"[{cls}]")
            elif cls is not None and not in_class:
                out.append(f"[^{cls}]")
            else:  # a negated class inside [...] cannot be spelled as a range: leave it
                out.append(pattern[i:i + 2])
            i += 2
            continue
        if ch == "[" and not in_class:
            in_class = True
            out.append(ch)
            # A ']' right after '[' or '[^' is a literal.
            j = i + 1
            if j < len(pattern) and pattern[j] == "^":
                out.append("^")
                j += 1
            if j < len(pattern) and pattern[j] == "]":
                out.append("]")
                j += 1
            i = j
            continue
        if ch == "]" and in_class:
            in_class = False
        out.append(ch)
        i += 1
    return "".join(out)


def _ascii_schema(node: Any, dropped: list[str] | None = None) -> Any:
    """A copy of a JSON schema with every ``pattern`` / ``patternProperties`` regex ASCII.
    ``dropped`` (lenient schemas): a regex llguidance cannot compile (look-around, as in the
    pattern pydantic writes for every ``Decimal``; backreferences) is left out and named here,
    instead of failing the whole schema. A regex over ``MAX_REGEX_CHARS`` is a ValueError."""
    return _SchemaRegexes(dropped).convert(node)


class _SchemaRegexes:
    """One schema's conversion. Each distinct regex is checked once per schema (a schema may
    repeat one pattern in every field, and a check is a grammar build): the memo lives as long
    as the conversion, so no client regex outlives its request."""

    def __init__(self, dropped: list[str] | None) -> None:
        self.dropped = dropped
        self._supported: dict[str, bool] = {}

    def convert(self, node: Any) -> Any:
        if isinstance(node, list):
            return [self.convert(x) for x in node]
        if not isinstance(node, dict):
            return node
        result: dict[str, Any] = {}
        for key, value in node.items():
            if key == "pattern" and isinstance(value, str):
                regex = self._regex(value, key)
                if regex is not None:
                    result[key] = regex
            elif key == "patternProperties" and isinstance(value, dict):
                entries = {}
                for k, v in value.items():
                    regex = self._regex(k, key)
                    if regex is not None:
                        entries[regex] = self.convert(v)
                result[key] = entries
            elif key in _SCHEMA_MAPS and isinstance(value, dict):
                result[key] = {k: self.convert(v) for k, v in value.items()}
            else:
                result[key] = self.convert(value)
        return result

    def _regex(self, pattern: str, keyword: str) -> str | None:
        """``pattern`` made ASCII; None when it is dropped (lenient, unsupported)."""
        if len(pattern) > MAX_REGEX_CHARS:
            raise ValueError(f"{keyword}: a regex of {len(pattern)} characters; at most "
                             f"{MAX_REGEX_CHARS}")
        regex = ascii_regex(pattern)
        if self.dropped is None:
            return regex
        supported = self._supported.get(regex)
        if supported is None:
            supported = self._supported[regex] = regex_supported(regex)
        if not supported:
            self.dropped.append(keyword)
            return None
        return regex


def regex_supported(regex: str) -> bool:
    """Whether llguidance's regex engine accepts ``regex`` (no look-around, backreferences)."""
    import llguidance

    is_error, _ = llguidance.LLMatcher.validate_grammar_with_warnings(
        llguidance.LLMatcher.grammar_from_regex(regex), None)
    return not is_error


def json_options(params: GuidedDecodingParams) -> dict[str, Any]:
    # lenient: keywords llguidance cannot enforce are dropped (with a warning) instead of
    # failing the schema; ``strict`` requests refuse them (backend.validate names them).
    lenient = {"lenient": not params.strict}
    if params.whitespace_pattern is not None:
        return {"whitespace_flexible": True, "whitespace_pattern": params.whitespace_pattern,
                **lenient}
    return {**COMPACT_JSON_OPTIONS, **lenient}


def choice_lark(choices: list[str]) -> str:
    """A Lark grammar whose sentences are exactly ``choices``.

    The choices form one lexer-level terminal (an uppercase rule: llguidance compiles it into a
    single regex), not parser-level alternatives: llguidance's Earley parser allows at most
    ``max_items_in_row`` (2000) items in a row, so ``start: "a" | "b" | ...`` failed at the first
    token with 2000 choices or more. A terminal's size is bounded only by the grammar and lexer
    limits, and it compiles faster. The choices are JSON string literals, which Lark reads
    verbatim (quotes, backslashes, newlines and non-ASCII text included; regex metacharacters
    have no meaning inside a literal).
    """
    return "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in choices)


def to_grammar(params: GuidedDecodingParams) -> str:
    """llguidance grammar text for ``params`` (raises ``ValueError`` for malformed input)."""
    return grammar_and_dropped(params)[0]


def grammar_and_dropped(params: GuidedDecodingParams) -> tuple[str, list[str]]:
    """``to_grammar``, and the schema keywords left out before llguidance saw the schema (a
    lenient schema's unsupported regexes; llguidance reports the keywords it ignores itself)."""
    import llguidance

    kind = params.kind
    dropped: list[str] = []
    if kind in ("json", "json_object"):
        schema = (_ascii_schema(json.loads(params.json),  # type: ignore[arg-type]
                                None if params.strict else dropped)
                  if kind == "json" else {"type": "object"})
        # The schema's own "x-guidance" options may not override ours (applied last).
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults=json_options(params), overrides=json_options(params)), dropped
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(  # type: ignore[arg-type]
            ascii_regex(params.regex)), dropped  # type: ignore[arg-type]
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(  # type: ignore[arg-type]
            choice_lark(params.choice)), dropped  # type: ignore[arg-type]
    # Lark (llguidance's own dialect) or GBNF; grammar_from converts GBNF to Lark.
    try:
        return llguidance.grammar_from("grammar", params.grammar), dropped  # type: ignore
    except ValueError as e:
        raise ValueError(f"guided_grammar: {e}") from None


def cache_key(params: GuidedDecodingParams) -> str:
    """The normalised constraint: equal keys compile to the same grammar."""
    return json.dumps([params.kind, params.json, params.regex, params.choice, params.grammar,
                       params.whitespace_pattern, params.strict], separators=(",", ":"),
                      ensure_ascii=False)
