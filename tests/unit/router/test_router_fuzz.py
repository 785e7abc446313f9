"""schemathesis through ``blade_llm_router``: the server's /openapi.json cases sent to the router
in front of two real server apps (the fake engine, no model) get no 5xx from the router or the
instances, and declared response schemas hold through it. The router reads every body it forwards (prompt text, cost, previous_response_id) and
answers some errors itself; a body the server refuses with a 400 must not fail the router
first. A short run; tests/e2e/test_openapi_fuzz_live.py does the same with a real engine."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from openapi_steer import steer
from schemathesis.checks import not_a_server_error, response_schema_conformance

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "entrypoints"))
sys.path.insert(0, os.path.dirname(__file__))

from fake_engine import FakeAsyncLLM  # noqa: E402
from test_proxy import ThreadServer, start_router  # noqa: E402

from bladellm.entrypoints.api_server import build_app  # noqa: E402
from bladellm.entrypoints.openai.config import ServerConfig  # noqa: E402

MODEL = "fake-model"


def _app():
    engine = FakeAsyncLLM()
    engine.eos_after_tokens = 4
    return build_app(engine, ServerConfig())


schema = schemathesis.openapi.from_dict(_app().openapi())


@pytest.fixture(scope="module")
def router_url() -> Iterator[str]:
    insts = [ThreadServer(_app()) for _ in range(2)]
    router = start_router([s.url for s in insts], health_check_interval=60)
    yield router.url
    router.stop()
    for s in insts:
        s.stop()


@schema.parametrize()
@settings(max_examples=8, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_fuzz_through_the_router(case: schemathesis.Case, router_url: str) -> None:
    def stored() -> str:
        r = httpx.post(router_url + "/v1/responses", timeout=30, json={
            "model": MODEL, "input": "hi", "max_output_tokens": 4})
        assert r.status_code == 200, r.text
        return r.json()["id"]

    steer(case, MODEL, stored)
    case.call_and_validate(base_url=router_url, timeout=30,
                           checks=[not_a_server_error, response_schema_conformance])
