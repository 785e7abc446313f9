"""schemathesis over the server's own /openapi.json: every declared operation (OpenAI, Responses
with its store routes, Anthropic Messages, tokenizer, LoRA, models, health) gets bodies and
parameters generated from the schemas the routes declare, and must never answer a 5xx; where a
response schema is declared, the answer must conform to it.

In-process against the fake engine (``fake_engine.py``): the real app, parsing and validation,
with no model; LoRA on, with one adapter under its root. Random ``model`` names and response
ids would stop almost every case at a 404, so three cases in four are steered to the served
model or the adapter, a stored response's id, a real adapter path (tests/openapi_steer.py).
A short run is in the default suite; several thousand cases run with ``-m slow``.
tests/e2e/test_openapi_fuzz_live.py runs a smaller pass against a live server on a tiny model,
directly and through ``blade_llm_router``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from types import SimpleNamespace

import pytest
import schemathesis
from fake_engine import FakeAsyncLLM
from hypothesis import HealthCheck, settings
from openapi_steer import steer
from schemathesis.checks import not_a_server_error, response_schema_conformance
from starlette.testclient import TestClient

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "lora"))

from test_lora_adapter import write  # noqa: E402

from bladellm.config import LoRAConfig  # noqa: E402
from bladellm.entrypoints.api_server import build_app  # noqa: E402
from bladellm.entrypoints.openai.config import ServerConfig  # noqa: E402
from bladellm.lora.registry import LoRARegistry  # noqa: E402

CHECKS = [not_a_server_error, response_schema_conformance]
_SETTINGS = dict(deadline=None, derandomize=True, database=None,
                 suppress_health_check=list(HealthCheck))
MODEL = "fake-model"
_HF = SimpleNamespace(hidden_size=8, intermediate_size=16, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=4, num_hidden_layers=2)
# Built at import: schemathesis reads the schema when the tests are collected.
_ROOT = tempfile.TemporaryDirectory(prefix="bladellm-fuzz-lora-")
ADAPTER = write(os.path.join(_ROOT.name, "a1"), {})


def _app():
    engine = FakeAsyncLLM()
    engine.eos_after_tokens = 4
    # Many entries: random names registered by the fuzz would fill a small registry, whose
    # answer (503, retry later) is right but would stop the cases that follow.
    engine.lora_registry = LoRARegistry(
        LoRAConfig(enable_lora=True, lora_root=[_ROOT.name], max_lora_entries=100_000), _HF)
    return build_app(engine, ServerConfig())


app = _app()
schema = schemathesis.openapi.from_asgi("/openapi.json", app)
_client = TestClient(app)


def _stored_response() -> str:
    r = _client.post("/v1/responses", json={"model": MODEL, "input": "hi",
                                            "max_output_tokens": 8})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def _run(case: schemathesis.Case) -> None:
    steer(case, MODEL, _stored_response, "a1", ADAPTER)
    case.call_and_validate(checks=CHECKS)


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
    _run(case)


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=300, **_SETTINGS)
def test_fuzz_long(case: schemathesis.Case) -> None:
    _run(case)
