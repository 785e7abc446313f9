"""Request fields → one ``GuidedDecodingParams``: vLLM's ``guided_*`` extras, OpenAI's
``response_format`` (``json_object`` / ``json_schema``) and vLLM's newer ``structured_outputs``
object. At most one constraint per request; two get a 400 naming both fields."""

from __future__ import annotations

import functools
import logging
from typing import Any

import msgspec

from bladellm.http.errors import APIError, bad_request, unsupported
from bladellm.entrypoints.openai.protocol import SamplingRequest
from bladellm.entrypoints.openai.reasoning import ReasoningParser
from bladellm.sampling_params import GuidedDecodingParams

logger = logging.getLogger(__name__)

_STRUCTURED_KEYS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar",
                    "json_object": "json_object", "whitespace_pattern": "whitespace_pattern"}


def _response_format(req: SamplingRequest) -> dict[str, Any] | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"json_object": True}
    if fmt.type == "json_schema":
        spec = getattr(fmt, "json_schema", None)
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_request("response_format.json_schema: must be an object with a 'schema' "
                              "(and a 'name')", "response_format")
        schema = spec["schema"]
        if not isinstance(schema, (dict, str)):
            raise bad_request("response_format.json_schema.schema: must be a JSON schema "
                              "object", "response_format")
        strict = spec.get("strict")
        if strict not in (None, True, False):
            raise bad_request("response_format.json_schema.strict: must be a boolean",
                              "response_format")
        if strict:
            _check_strict(schema)
        return {"json": schema, "strict": bool(strict)}
    raise bad_request(f"response_format.type: must be 'text', 'json_object' or 'json_schema', "
                      f"got {fmt.type!r}", "response_format")


@functools.lru_cache(maxsize=256)
def _unenforced(schema_text: str) -> tuple[str, ...] | str:
    """The keywords of a schema generation cannot enforce, or the schema's error."""
    from bladellm.guided.backend import unenforced_keywords

    try:
        return tuple(unenforced_keywords(schema_text))
    except ValueError as e:
        return str(e)


def _check_strict(schema: Any) -> None:
    """``strict: true`` promises the output matches the whole schema: a keyword the grammar
    engine would ignore is a 400 naming it (OpenAI refuses what strict mode does not support),
    instead of an output that may break it."""
    from bladellm.guided.backend import strict_error

    try:
        text = GuidedDecodingParams(json=schema).json
    except ValueError as e:
        raise bad_request(f"response_format.json_schema.schema: {e}", "response_format") from None
    found = _unenforced(text)  # type: ignore[arg-type]
    if isinstance(found, str):  # invalid anyway: the usual validation reports it
        return
    if found:
        raise APIError(400, strict_error("response_format.json_schema.schema", list(found)),
                       param="response_format", code="invalid_json_schema")


def _structured_outputs(req: SamplingRequest) -> dict[str, Any] | None:
    spec = getattr(req, "structured_outputs", None)
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise bad_request("structured_outputs: must be an object", "structured_outputs")
    unknown = sorted(set(spec) - set(_STRUCTURED_KEYS))
    if unknown:
        raise bad_request(f"structured_outputs: unknown or unsupported keys {unknown}; "
                          f"supported: {sorted(_STRUCTURED_KEYS)}", "structured_outputs")
    values = {k: v for k, v in spec.items() if v is not None and v is not False}
    return values or None


def guided_decoding_from_request(req: SamplingRequest,
                                 forced: tuple[str, dict[str, Any]] | None = None,
                                 ) -> GuidedDecodingParams | None:
    """The request's constraint, or None. ``forced`` is (field name, constraint) added by the
    server itself (a forced tool call)."""
    if req.guided_decoding_backend not in (None, "llguidance"):
        raise unsupported("guided_decoding_backend",
                          f"guided_decoding_backend {req.guided_decoding_backend!r} "
                          f"(this server uses llguidance)")
    sources: list[tuple[str, dict[str, Any]]] = []
    for field, key in (("guided_json", "json"), ("guided_regex", "regex"),
                       ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(req, field)
        if value is not None:
            sources.append((field, {key: value}))
    for field, get in (("response_format", _response_format),
                       ("structured_outputs", _structured_outputs)):
        value = get(req)
        if value is not None:
            sources.append((field, value))
    if forced is not None:
        sources.append(forced)
    whitespace = req.guided_whitespace_pattern
    if not sources:
        if whitespace is not None:
            raise bad_request("guided_whitespace_pattern: needs a JSON constraint "
                              "(guided_json or response_format)", "guided_whitespace_pattern")
        return None
    if len(sources) > 1:
        names = " and ".join(name for name, _ in sources)
        raise bad_request(f"only one output constraint per request; got {names}",
                          sources[1][0])
    field, values = sources[0]
    if whitespace is not None:
        values = {**values, "whitespace_pattern": whitespace}
    try:
        return GuidedDecodingParams(**values)
    except (ValueError, TypeError) as e:
        msg = str(e)
        param = field if not msg.startswith("guided_") else msg.split(":", 1)[0]
        raise APIError(400, msg if ":" in msg else f"{field}: {msg}", param=param) from None


def _single_token(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def after_reasoning(guided: GuidedDecodingParams | None, parser: ReasoningParser | None,
                    tokenizer: Any) -> GuidedDecodingParams | None:
    """``guided`` applied to the answer only: the engine's grammar waits for the end-of-thinking
    tag's token ids (``guided/reasoning_gate.py``). ``parser`` is the request's, already adapted
    to its prompt (``ReasoningParser.for_prompt``): a prompt that closed the thinking leaves the
    grammar on from the first token; Qwen3's optional thinking lets the first token be
    ``<think>`` (one token in its vocabulary) or the answer's first."""
    if guided is None or parser is None or parser.closed_by_prompt:
        return guided
    end_ids = _single_token(tokenizer, parser.end_tag)
    start_id = None
    if not parser.opened_by_prompt:
        start_ids = _single_token(tokenizer, parser.start_tag)
        if len(start_ids) != 1:
            # No single token can open the thinking: the grammar constrains the output from
            # its first token (the model answers without thinking).
            logger.debug("%s is not one token: structured output without thinking",
                         parser.start_tag)
            return guided
        start_id = start_ids[0]
    return msgspec.structs.replace(guided, reasoning_end=end_ids, reasoning_start=start_id)
