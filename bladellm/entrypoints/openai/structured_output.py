"""Request fields → one ``GuidedDecodingParams``: vLLM's ``guided_*`` extras, OpenAI's
``response_format`` (``json_object`` / ``json_schema``) and vLLM's newer ``structured_outputs``
object. At most one constraint per request; two get a 400 naming both fields."""

from __future__ import annotations

from typing import Any

from bladellm.http.errors import APIError, bad_request, unsupported
from bladellm.entrypoints.openai.protocol import SamplingRequest
from bladellm.sampling_params import GuidedDecodingParams

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
        return {"json": schema}
    raise bad_request(f"response_format.type: must be 'text', 'json_object' or 'json_schema', "
                      f"got {fmt.type!r}", "response_format")


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
