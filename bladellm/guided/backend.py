"""The llguidance backend: tokenizer bridge, validation and compilation under size limits.

``validate`` checks a constraint without the model's tokenizer (a few ms, cached per constraint;
the API process runs it so that a bad schema is a 400 before the request reaches the engine),
including a dry run of the first token with a byte-level tokenizer, which catches grammars that
compile but fail at once (``start: start``). ``compile`` builds an
``LLMatcher`` for the model's tokenizer (the engine core runs it in a worker thread; llguidance
drops the GIL while it builds). Both apply the same ``LLParserLimits``, so a pathological
schema (deep nesting, a huge grammar) fails with llguidance's reason instead of running away.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
from dataclasses import dataclass
from typing import Any

from bladellm.errors import FIELD_OF_KIND, unsatisfiable_error
from bladellm.guided.grammar import grammar_and_dropped
from bladellm.sampling_params import GuidedDecodingParams

logger = logging.getLogger(__name__)

SUPPORTED_BACKENDS = ("llguidance",)


class GrammarError(ValueError):
    """The constraint cannot be compiled; the message names the request field and the reason."""


@dataclass(frozen=True)
class GrammarLimits:
    max_grammar_size: int = 500_000  # llguidance symbols
    initial_lexer_fuel: int = 1_000_000  # regex-analysis work while building
    step_lexer_fuel: int = 200_000  # work per mask

    def to_llguidance(self) -> Any:
        import llguidance

        return llguidance.LLParserLimits(max_grammar_size=self.max_grammar_size,
                                         initial_lexer_fuel=self.initial_lexer_fuel,
                                         step_lexer_fuel=self.step_lexer_fuel,
                                         verbose_errors=False)


def grammar_text(params: GuidedDecodingParams) -> str:
    """The grammar for ``params``; malformed input raises ``GrammarError``."""
    return _grammar(params)[0]


def _grammar(params: GuidedDecodingParams) -> tuple[str, list[str]]:
    try:
        return grammar_and_dropped(params)
    except ValueError as e:
        msg = str(e)
        field = FIELD_OF_KIND[params.kind]
        raise GrammarError(msg if msg.startswith("guided_") else f"{field}: {msg}") from None


def validate(params: GuidedDecodingParams, limits: GrammarLimits = GrammarLimits()) -> list[str]:
    """Raise ``GrammarError`` (a ``ValueError``) with llguidance's reason if ``params`` is bad;
    return the JSON-schema keywords the grammar ignores (``ignored_keywords``; non-strict)."""
    import llguidance

    grammar, dropped = _grammar(params)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, None, limits=limits.to_llguidance())
    if is_error:
        keywords: list[str] = []
        if params.strict and params.kind == "json":
            try:  # what a lenient compile would have left out, if that is the failure
                keywords = unenforced_keywords(params.json, limits)  # type: ignore[arg-type]
            except GrammarError:
                pass
        if keywords:
            raise GrammarError(strict_error(FIELD_OF_KIND[params.kind], keywords))
        raise GrammarError(f"{FIELD_OF_KIND[params.kind]}: invalid {params.kind} constraint: "
                           f"{messages[0].strip()}")
    reason = first_step_error(grammar, limits)
    if reason is not None:
        raise GrammarError(unsatisfiable_error(params.kind, reason))
    if params.kind != "json":
        return []
    return list(dict.fromkeys(dropped + ignored_keywords(messages)))


_UNIMPLEMENTED = "Unimplemented keys: "
_UNKNOWN_FORMAT = "Unknown format: "
_TIMES = re.compile(r" \(\d+ times\)$")


def ignored_keywords(messages: list[str]) -> list[str]:
    """The schema keywords named in llguidance's warnings (``Unimplemented keys: [...]``,
    ``Unknown format: X`` → ``format: X``), in order, without repeats."""
    found: list[str] = []
    for message in messages:
        # llguidance folds repeats: 'Unimplemented keys: ["uniqueItems"] (2 times)'.
        message = _TIMES.sub("", message.strip())
        if message.startswith(_UNIMPLEMENTED):
            try:
                names = json.loads(message[len(_UNIMPLEMENTED):])
            except ValueError:
                names = [message[len(_UNIMPLEMENTED):]]
            found.extend(str(n) for n in names)
        elif message.startswith(_UNKNOWN_FORMAT):
            found.append(f"format: {message[len(_UNKNOWN_FORMAT):]}")
    return list(dict.fromkeys(found))


def strict_error(field: str, keywords: list[str]) -> str:
    """The 400 of a ``strict`` schema using keywords the grammar cannot enforce (OpenAI also
    refuses keywords it does not support in strict mode)."""
    names = ", ".join(f"'{k}'" for k in keywords)
    return (f"{field}: keyword(s) {names} not supported in a strict schema: they cannot be "
            f"enforced while generating; remove them, or send the schema without strict: true "
            f"to have them ignored")


def unenforced_keywords(schema: dict[str, Any] | str,
                        limits: GrammarLimits = GrammarLimits()) -> list[str]:
    """The keywords of a JSON schema that generation would not enforce (a lenient compile's
    warnings); raises ``GrammarError`` if the schema is invalid anyway."""
    import llguidance

    grammar, dropped = _grammar(GuidedDecodingParams(json=schema))
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, None, limits=limits.to_llguidance())
    if is_error:
        raise GrammarError(f"guided_json: invalid json constraint: {messages[0].strip()}")
    return list(dict.fromkeys(dropped + ignored_keywords(messages)))


class _ByteTokenizer:
    """One token per byte, then EOS (token 256): ``llguidance.TokenizerWrapper``'s interface."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


@functools.cache
def _byte_tokenizer() -> Any:
    import llguidance

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()), slices=[])


def first_step_error(grammar: str, limits: GrammarLimits = GrammarLimits()) -> str | None:
    """llguidance's error if ``grammar`` fails at the first token of any output, else ``None``.

    ``validate_grammar`` checks syntax and limits but not whether a sentence can be generated:
    ``start: start`` (no sentence at all) or ``root ::= "a" root`` (an endless forced "aaa...")
    compile, then fail in the engine at the first token. Run that first step here, with a byte
    tokenizer instead of the model's (a few ms): the first mask, and the first byte if the
    grammar forces one (consuming a token makes llguidance compute the text forced after it).
    Only forced bytes are consumed: every output starts with them, so an error there is certain,
    whereas a chosen byte could lead into one failing branch of a grammar that has good ones.
    """
    import llguidance

    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0,
                                   limits=limits.to_llguidance())
    if matcher.is_error():
        # Only with this tokenizer (the grammar names the model's special tokens, e.g.
        # <|im_end|>): the engine compiles it with the model's tokenizer and judges it then.
        return None
    matcher.compute_bitmask()
    if not matcher.is_error():
        forced = matcher.compute_ff_tokens()
        if forced:
            matcher.try_consume_tokens(forced[:1])
    return matcher.get_error() if matcher.is_error() else None


class LLGuidanceBackend:
    """Compiles constraints for one model's tokenizer."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int],
                 limits: GrammarLimits = GrammarLimits()) -> None:
        import llguidance
        import llguidance.hf

        self.limits = limits
        self._ll_limits = limits.to_llguidance()
        # Costly for a large vocabulary: built once per process.
        self.tokenizer = llguidance.hf.from_tokenizer(
            hf_tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._executor: Any = None

    def compile(self, params: GuidedDecodingParams) -> Any:
        """A fresh ``LLMatcher`` (the prototype the cache keeps); raises ``GrammarError``."""
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer, grammar_text(params), log_level=0,
                                       limits=self._ll_limits)
        if matcher.is_error():
            raise GrammarError(f"{FIELD_OF_KIND[params.kind]}: grammar failed to compile: "
                               f"{matcher.get_error().strip()}")
        return matcher

    @property
    def executor(self) -> Any:
        """llguidance's thread pool for batched mask computation (built on first use)."""
        with self._lock:
            if self._executor is None:
                import llguidance

                self._executor = llguidance.LLExecutor()
            return self._executor


class GrammarValidator:
    """``validate`` with an LRU of constraints already found valid (the API process's check)."""

    def __init__(self, capacity: int = 1024, limits: GrammarLimits = GrammarLimits()) -> None:
        from collections import OrderedDict

        self.capacity = capacity
        self.limits = limits
        self._valid: OrderedDict[str, list[str]] = OrderedDict()  # key -> ignored keywords
        self._lock = threading.Lock()
        self.num_validations = 0

    def validate(self, params: GuidedDecodingParams) -> list[str]:
        """``validate``, remembered; logs the ignored keywords for every request that has any."""
        from bladellm.guided.grammar import cache_key

        key = cache_key(params)
        with self._lock:
            ignored = self._valid.get(key)
            if ignored is not None:
                self._valid.move_to_end(key)
        if ignored is None:
            with self._lock:
                self.num_validations += 1
            ignored = validate(params, self.limits)
            with self._lock:
                self._valid[key] = ignored
                while len(self._valid) > self.capacity:
                    self._valid.popitem(last=False)
        if ignored:
            logger.info("%s: the schema's keyword(s) %s cannot be enforced while generating "
                           "and are ignored (strict: true refuses them instead)",
                           FIELD_OF_KIND[params.kind], ", ".join(ignored))
        return ignored
