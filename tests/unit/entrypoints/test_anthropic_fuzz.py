"""Random /v1/messages and /v1/messages/count_tokens bodies never get a 5xx, and every error is
in Anthropic's shape (streamed or not)."""

from __future__ import annotations

import asyncio
import json

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
_TEXT = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)},
                              optional={"cache_control": st.one_of(
                                  st.just({"type": "ephemeral"}), _JSON)})
_NAME = st.sampled_from(["f", "g", ""])
_GOOD_BLOCK = st.one_of(
    _TEXT,
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": st.text(max_size=4),
                           "name": _NAME, "input": st.dictionaries(st.text(max_size=3),
                                                                   _SCALARS, max_size=2)}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": st.text(max_size=4)},
                          optional={"is_error": st.booleans(),
                                    "content": st.one_of(st.text(max_size=8),
                                                         st.lists(_TEXT, max_size=2))}),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": st.text(max_size=8)},
                          optional={"signature": st.text(max_size=4)}))
_BLOCK = st.one_of(
    _GOOD_BLOCK,
    st.fixed_dictionaries({"type": st.sampled_from(["image", "document", "bogus"])},
                          optional={"source": _JSON}),
    # Anything at all, in the places a block goes.
    st.fixed_dictionaries({"type": st.sampled_from(["text", "tool_use", "tool_result",
                                                    "thinking", "redacted_thinking"])},
                          optional={"text": _JSON, "id": _SCALARS, "name": _SCALARS,
                                    "input": _JSON, "tool_use_id": _SCALARS,
                                    "content": _JSON, "thinking": _SCALARS, "data": _SCALARS}))
_GOOD_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant"]),
     "content": st.one_of(st.text(max_size=8),
                          st.lists(_GOOD_BLOCK, min_size=1, max_size=3))})
_MESSAGE = st.one_of(
    _GOOD_MESSAGE,
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                           "content": st.lists(_BLOCK, min_size=1, max_size=3)}),
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"])},
                          optional={"content": _JSON}))
_TOOL = st.one_of(
    st.fixed_dictionaries({"name": st.sampled_from(["f", "g", "bad name", ""]),
                           "input_schema": st.one_of(st.just({"type": "object"}), _JSON)},
                          optional={
                              "strict": _SCALARS, "type": st.sampled_from(["custom", "x"]),
                              "description": _SCALARS}),
    st.fixed_dictionaries({"type": st.sampled_from(["web_search_20250305", "bash_20250124"]),
                           "name": st.text(max_size=5)}))
# Mostly well-formed at the top (a model, max_tokens, messages) so that most bodies get past
# the schema into the conversion, the template and the engine.
_BODY = st.fixed_dictionaries(
    {"model": st.just("fake-model"), "max_tokens": st.integers(-2, 60),
     "messages": st.one_of(st.lists(_MESSAGE, min_size=1, max_size=4),
                           st.lists(_MESSAGE, min_size=1, max_size=4), _JSON)},
    optional={
        "system": st.one_of(st.text(max_size=8), st.lists(_TEXT, max_size=2), _JSON),
        "tools": st.one_of(st.lists(_TOOL, max_size=2), _JSON),
        "tool_choice": st.one_of(_JSON, st.fixed_dictionaries(
            {"type": st.sampled_from(["auto", "any", "tool", "none", "x"])},
            optional={"name": st.sampled_from(["f", "g", "h"]),
                      "disable_parallel_tool_use": _SCALARS})),
        "thinking": st.one_of(_JSON, st.fixed_dictionaries(
            {"type": st.sampled_from(["enabled", "disabled", "adaptive"])},
            optional={"budget_tokens": st.one_of(st.integers(0, 3000), _SCALARS),
                      "display": _SCALARS})),
        "stop_sequences": st.one_of(st.lists(st.text(max_size=3), max_size=2), _JSON),
        "temperature": st.one_of(st.floats(0, 1), _SCALARS),
        "top_p": st.one_of(st.floats(0, 1), _SCALARS), "top_k": _SCALARS,
        "metadata": _JSON, "stream": st.booleans(),
        "service_tier": st.one_of(st.sampled_from(["auto", "standard_only"]), _SCALARS),
        "output_config": _JSON, "cache_control": _JSON,
    })
_GOOD_TOOL = st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "g"]),
     "input_schema": st.sampled_from([{"type": "object"}, {
         "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}])},
    optional={"description": st.text(max_size=5), "strict": st.booleans()})
# Plausible requests: valid types everywhere, values that combine in every way.
_GOOD_BODY = st.fixed_dictionaries(
    {"model": st.just("fake-model"), "max_tokens": st.integers(1, 40),
     "messages": st.lists(_GOOD_MESSAGE, min_size=1, max_size=4)},
    optional={
        "system": st.one_of(st.text(max_size=8), st.lists(_TEXT, max_size=2)),
        "tools": st.lists(_GOOD_TOOL, max_size=2),
        "tool_choice": st.fixed_dictionaries(
            {"type": st.sampled_from(["auto", "any", "tool", "none"])},
            optional={"name": st.sampled_from(["f", "g", "h"]),
                      "disable_parallel_tool_use": st.booleans()}),
        "thinking": st.fixed_dictionaries(
            {"type": st.sampled_from(["enabled", "disabled", "adaptive"])},
            optional={"budget_tokens": st.integers(1000, 1100),
                      "display": st.sampled_from(["summarized", "omitted"])}),
        "stop_sequences": st.lists(st.text(max_size=3), max_size=2),
        "temperature": st.floats(0, 1), "top_p": st.floats(0.01, 1),
        "top_k": st.integers(1, 50), "stream": st.booleans(),
        "output_config": st.fixed_dictionaries({"format": st.fixed_dictionaries(
            {"type": st.just("json_schema"), "schema": st.just({"type": "object"})})}),
    })
_ANY_BODY = _BODY
_BODY = st.one_of(_GOOD_BODY, _GOOD_BODY, _GOOD_BODY, _ANY_BODY)
# Fields only /v1/messages takes (count_tokens refuses them).
_SAMPLING = ("max_tokens", "stop_sequences", "temperature", "top_p", "top_k", "metadata",
             "stream", "service_tier")

_ENGINE = FakeAsyncLLM()
_ENGINE.eos_after_tokens = 3
_ENGINE.model_info.max_model_len = 4096  # room for thinking budgets
_APP = build_app(_ENGINE, ServerConfig())  # one app: a new event loop per example is enough


def _check_error(body: dict) -> None:
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["message"] and body["error"]["type"].endswith("_error")


async def _post(path: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=_APP),
                                 base_url="http://t") as http:
        return await http.post(path, json=body)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(_BODY, st.sampled_from(["/v1/messages", "/v1/messages/count_tokens"]))
def test_no_body_gets_a_server_error(body, path):
    if path.endswith("count_tokens"):
        body = {k: v for k, v in body.items() if k not in _SAMPLING}
    resp = asyncio.run(_post(path, body))
    assert resp.status_code < 500, (body, resp.text)
    if resp.status_code != 200:
        _check_error(resp.json())
    elif resp.headers["content-type"].startswith("text/event-stream"):
        for block in resp.text.strip().split("\n\n"):
            name, data = block.split("\n")
            if name == "event: error":
                _check_error(json.loads(data[len("data: "):]))
