"""Random /v1/responses bodies never get a 5xx, and every error is OpenAI's error shape."""

from __future__ import annotations

import asyncio

import httpx
from fake_engine import FakeAsyncLLM
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bladellm.entrypoints.openai.config import ServerConfig
from bladellm.entrypoints.api_server import build_app

_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                     st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8))
_JSON = st.recursive(_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8)
_PART = st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "refusal",
                                                       "input_image", "x"])},
                              optional={"text": st.one_of(st.text(max_size=8), _JSON)})
_ITEM = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool"])},
                          optional={"type": st.just("message"),
                                    "content": st.one_of(st.text(max_size=8),
                                                         st.lists(_PART, max_size=2), _JSON)}),
    st.fixed_dictionaries({"type": st.sampled_from(["function_call", "function_call_output",
                                                    "reasoning", "item_reference", "bogus"])},
                          optional={"call_id": _SCALARS, "name": _SCALARS,
                                    "arguments": st.one_of(st.just("{}"), _SCALARS),
                                    "output": _SCALARS, "id": _SCALARS,
                                    "content": st.lists(_PART, max_size=2),
                                    "summary": _JSON}))
_TOOL = st.one_of(
    st.fixed_dictionaries({"type": st.just("function"), "name": st.text(max_size=5)},
                          optional={"parameters": _JSON, "strict": _SCALARS}),
    st.fixed_dictionaries({"type": st.sampled_from(["web_search", "file_search", "mcp"])}))
_BODY = st.fixed_dictionaries(
    {"input": st.one_of(st.text(max_size=12), st.lists(_ITEM, max_size=4), _JSON)},
    optional={
        "instructions": st.one_of(st.text(max_size=8), _SCALARS),
        "tools": st.one_of(st.lists(_TOOL, max_size=2), _JSON),
        "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required"]), _JSON,
                                 st.fixed_dictionaries({"type": st.sampled_from(
                                     ["function", "allowed_tools", "web_search"])},
                                     optional={"name": _SCALARS, "mode": _SCALARS,
                                               "tools": _JSON})),
        "text": st.one_of(_JSON, st.fixed_dictionaries({"format": st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "json_object", "json_schema"])},
            optional={"schema": _JSON, "name": _SCALARS, "strict": _SCALARS})})),
        "max_output_tokens": st.one_of(st.integers(-5, 300), _SCALARS),
        "temperature": _SCALARS, "top_p": _SCALARS, "priority": _SCALARS,
        "previous_response_id": _SCALARS, "store": _SCALARS, "stream": st.booleans(),
        "metadata": _JSON, "reasoning": _JSON, "include": _JSON, "truncation": _SCALARS,
        "background": _SCALARS, "parallel_tool_calls": _SCALARS,
    })


_ENGINE = FakeAsyncLLM()
_ENGINE.eos_after_tokens = 3
_APP = build_app(_ENGINE, ServerConfig())  # one app: a new event loop per example is enough


async def _post(body: dict) -> httpx.Response:
    app = _APP
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as http:
        return await http.post("/v1/responses", json=body)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(_BODY)
def test_no_body_gets_a_server_error(body):
    resp = asyncio.run(_post(body))
    assert resp.status_code < 500, (body, resp.text)
    if resp.status_code != 200:
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
