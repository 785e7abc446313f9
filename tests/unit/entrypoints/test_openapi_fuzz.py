"""schemathesis over the server's own /openapi.json: every declared operation (OpenAI, Responses
with its store routes, Anthropic Messages, tokenizer, LoRA, health) gets bodies generated from
the request schemas the routes declare, and must never answer a 5xx; where a response schema
is declared, the answer must conform to it.

In-process against the fake engine (``fake_engine.py``): the real app, parsing and validation,
with no model. A short run is in the default suite; a few thousand cases run with ``-m slow``.
tests/e2e/test_openapi_fuzz_live.py runs a smaller pass against a live server on a tiny model.
"""

from __future__ import annotations

import pytest
import schemathesis
from fake_engine import FakeAsyncLLM
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error, response_schema_conformance

from bladellm.entrypoints.api_server import build_app
from bladellm.entrypoints.openai.config import ServerConfig

CHECKS = [not_a_server_error, response_schema_conformance]
_SETTINGS = dict(deadline=None, derandomize=True, database=None,
                 suppress_health_check=list(HealthCheck))


def _schema() -> schemathesis.Schema:
    # LoRA enabled so that the adapter routes run their real code, not "LoRA is disabled".
    app = build_app(FakeAsyncLLM(), ServerConfig())
    return schemathesis.openapi.from_asgi("/openapi.json", app)


schema = _schema()

# Operations the fuzz must reach: a route that stops being declared would silently leave the run.
EXPECTED = {
    ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/v1/embeddings"),
    ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/v1/responses"),
    ("GET", "/v1/responses/{response_id}"), ("DELETE", "/v1/responses/{response_id}"),
    ("POST", "/v1/responses/{response_id}/cancel"),
    ("GET", "/v1/responses/{response_id}/input_items"), ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"), ("POST", "/v1/load_lora_adapter"),
    ("POST", "/v1/unload_lora_adapter"), ("GET", "/v1/models"),
    ("GET", "/v1/models/{model_id}")}


def test_every_endpoint_is_declared_with_its_body() -> None:
    raw = schema.raw_schema["paths"]
    declared = {(method.upper(), path) for path, ops in raw.items() for method in ops}
    assert EXPECTED <= declared, EXPECTED - declared
    for method, path in EXPECTED:
        if method == "POST" and "{" not in path:
            assert "requestBody" in raw[path]["post"], path


@schema.parametrize()
@settings(max_examples=25, **_SETTINGS)
def test_fuzz_short(case: schemathesis.Case) -> None:
    case.call_and_validate(checks=CHECKS)


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=300, **_SETTINGS)
def test_fuzz_long(case: schemathesis.Case) -> None:
    case.call_and_validate(checks=CHECKS)
