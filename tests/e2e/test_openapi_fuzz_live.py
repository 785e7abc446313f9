"""schemathesis over a live ``blade_llm_server`` (tiny llama, the real engine) and through
``blade_llm_router`` in front of it: every operation of the server's /openapi.json, a few
hundred cases per target, no 5xx; declared response schemas conformed to. The in-process run
with thousands of cases is tests/unit/entrypoints/test_openapi_fuzz.py; this one catches what
only the engine (sampling, stop strings, tokenizer, stored responses) or the router adds."""

from __future__ import annotations

import signal
import subprocess

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from openapi_steer import steer
from schemathesis.checks import not_a_server_error, response_schema_conformance
# tests/e2e is on sys.path (pytest's prepend mode)
from test_router import RouterProcess
from test_server import ServerProcess

pytestmark = pytest.mark.slow

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "tiny"
CHECKS = [not_a_server_error, response_schema_conformance]


@pytest.fixture(scope="module")
def live(tiny_model_factory):
    srv = ServerProcess([
        "--model", tiny_model_factory("llama"), "--served_model_name", MODEL, "--host",
        "127.0.0.1", "--port", "0", "--dtype", "float32", "--max_model_len", "128",
        "--num_kv_blocks", "256", "--block_size", "16", "--api_key", KEY,
        "--disable_access_log", "--shutdown_timeout", "2", "--num_threads", "1"])
    srv.wait_ready(timeout=240)
    router = RouterProcess([srv.url], "least_tokens", "--api_key", KEY)
    yield srv.url, router.url
    router.stop()
    srv.proc.send_signal(signal.SIGTERM)
    try:
        srv.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        srv.proc.kill()
    assert "Traceback" not in srv.log(), srv.log()[-4000:]


@pytest.fixture(scope="module")
def live_schema(live):
    raw = httpx.get(live[0] + "/openapi.json", timeout=30).json()
    return schemathesis.openapi.from_dict(raw)


schema = schemathesis.pytest.from_fixture("live_schema")
_SETTINGS = dict(max_examples=12, deadline=None, derandomize=True, database=None,
                 suppress_health_check=list(HealthCheck))


def _run(case: schemathesis.Case, base_url: str) -> None:
    def stored() -> str:
        r = httpx.post(base_url + "/v1/responses", headers=AUTH, timeout=60, json={
            "model": MODEL, "input": "hi", "max_output_tokens": 4})
        assert r.status_code == 200, r.text
        return r.json()["id"]

    steer(case, MODEL, stored)
    case.call_and_validate(base_url=base_url, headers=AUTH, checks=CHECKS, timeout=120)


@schema.parametrize()
@settings(**_SETTINGS)
def test_live_server(case: schemathesis.Case, live) -> None:
    _run(case, live[0])


@schema.parametrize()
@settings(**_SETTINGS)
def test_through_the_router(case: schemathesis.Case, live) -> None:
    _run(case, live[1])
