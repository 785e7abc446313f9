"""The router forwards the Responses and Messages APIs, checked with the vendors' own SDKs
against two real server apps (the fake engine, no model) behind it: a stored response is found
on the instance that created it (retrieve, input items, previous_response_id, cancel, delete),
a 404 only when no instance has it and a 503 when the one that may have it is down; Anthropic's
headers pass through and the router's own errors on the Messages paths are Anthropic's shape."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "entrypoints"))
sys.path.insert(0, os.path.dirname(__file__))

from fake_engine import FakeAsyncLLM  # noqa: E402
from test_proxy import ThreadServer, start_router  # noqa: E402

from bladellm.entrypoints.api_server import build_app  # noqa: E402
from bladellm.entrypoints.openai.config import ServerConfig  # noqa: E402
from bladellm.router.proxy import INSTANCE_HEADER, _sse_error  # noqa: E402

KEY = "k"


def _engine() -> FakeAsyncLLM:
    engine = FakeAsyncLLM()
    engine.eos_after_tokens = 4  # answers end with "stop", not the token limit
    return engine


@pytest.fixture(scope="module")
def servers() -> Iterator[list[ThreadServer]]:
    insts = [ThreadServer(build_app(_engine(), ServerConfig(api_key=KEY))) for _ in range(2)]
    yield insts
    for s in insts:
        s.stop()


@pytest.fixture(scope="module")
def router(servers) -> Iterator[ThreadServer]:
    r = start_router([s.url for s in servers], api_key=KEY)
    yield r
    r.stop()


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def test_stored_responses_are_found_on_the_instance_that_created_them(servers, router):
    with httpx.Client(base_url=router.url, headers=_auth(), timeout=30) as c:
        made = []
        for i in range(4):  # spread over both instances (least loaded, ties broken by order)
            r = c.post("/v1/responses", json={"model": "fake-model", "input": f"{i} hi" * 8,
                                              "max_output_tokens": 4})
            assert r.status_code == 200, r.text
            made.append((r.json()["id"], r.headers[INSTANCE_HEADER]))
        assert {where for _, where in made} == {s.url for s in servers}
        for rid, where in made:
            for _ in range(3):
                r = c.get(f"/v1/responses/{rid}")
                assert r.status_code == 200 and r.json()["id"] == rid
                assert r.headers[INSTANCE_HEADER] == where
            r = c.get(f"/v1/responses/{rid}/input_items", params={"limit": 1, "order": "asc"})
            assert r.status_code == 200 and len(r.json()["data"]) == 1, r.text
            assert r.headers[INSTANCE_HEADER] == where
            r = c.post("/v1/responses", json={"model": "fake-model", "input": "and then?",
                                              "previous_response_id": rid,
                                              "max_output_tokens": 4})
            assert r.status_code == 200, r.text
            assert r.headers[INSTANCE_HEADER] == where  # the chain continues where it is stored
            assert c.post(f"/v1/responses/{rid}/cancel").status_code in (200, 400)
            r = c.delete(f"/v1/responses/{rid}")
            assert r.status_code == 200 and r.json()["deleted"] is True, r.text
            r = c.get(f"/v1/responses/{rid}")
            assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
        # a previous_response_id nobody stores: the instance's own 404
        r = c.post("/v1/responses", json={"model": "fake-model", "input": "x",
                                          "previous_response_id": "resp_nowhere"})
        assert r.status_code == 404, r.text
        # the lookup is behind --api_key like the rest
        assert httpx.get(router.url + f"/v1/responses/{made[0][0]}").status_code == 401


def test_responses_through_the_router_with_the_openai_sdk(router):
    client = openai.OpenAI(api_key=KEY, base_url=router.url + "/v1")
    resp = client.responses.create(model="fake-model", input="hello", max_output_tokens=50)
    assert resp.status == "completed" and resp.output_text
    with client.responses.stream(model="fake-model", input="hello",
                                 max_output_tokens=50) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed",
                                                           "response.incomplete")
    assert final.output_text == resp.output_text
    assert client.responses.retrieve(final.id).id == final.id


def test_a_response_on_a_down_instance_is_a_503_never_a_wrong_404():
    down = ThreadServer(build_app(FakeAsyncLLM(), ServerConfig()))
    up = ThreadServer(build_app(FakeAsyncLLM(), ServerConfig()))
    router = start_router([down.url, up.url], health_check_interval=60)
    try:
        with httpx.Client(base_url=router.url, timeout=30) as c:
            r = c.post("/v1/responses", json={"model": "fake-model", "input": "x",
                                              "max_output_tokens": 2})
            rid = r.json()["id"]
            assert r.headers[INSTANCE_HEADER] == down.url
            down.stop()
            for path in (f"/v1/responses/{rid}", f"/v1/responses/{rid}/input_items"):
                r = c.get(path)
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "instance_unavailable"
                assert down.url in r.json()["error"]["message"]
            assert c.delete(f"/v1/responses/{rid}").status_code == 503
            r = c.post("/v1/responses", json={"model": "fake-model", "input": "x",
                                              "previous_response_id": rid})
            assert r.status_code == 503 and "instance_unavailable" in r.text
    finally:
        router.stop()
        up.stop()


def test_messages_through_the_router_with_the_anthropic_sdk(servers, router):
    client = anthropic.Anthropic(api_key=KEY, base_url=router.url)  # sends x-api-key
    msg = client.messages.create(model="fake-model", max_tokens=5,
                                 messages=[{"role": "user", "content": "hi"}])
    assert msg.type == "message" and msg.content[0].text
    with client.messages.stream(model="fake-model", max_tokens=5,
                                messages=[{"role": "user", "content": "hi"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == msg.content[0].text and final.stop_reason == msg.stop_reason
    count = client.messages.count_tokens(model="fake-model",
                                         messages=[{"role": "user", "content": "hi"}])
    assert count.input_tokens > 0
    # an instance's error passes through in Anthropic's shape, typed by the SDK
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="fake-model", max_tokens=-1,
                               messages=[{"role": "user", "content": "hi"}])


def test_the_routers_own_errors_on_messages_paths_are_anthropics(router):
    bad = anthropic.Anthropic(api_key="wrong", base_url=router.url, max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        bad.messages.create(model="fake-model", max_tokens=5,
                            messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["type"] == "error"
    assert err.value.body["error"]["type"] == "authentication_error"
    nowhere = start_router(["http://127.0.0.1:9"], health_check_interval=60)
    try:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            r = httpx.post(nowhere.url + path, timeout=30, json={
                "model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]})
            assert r.status_code == 503, r.text
            assert r.json()["type"] == "error" and r.json()["error"]["type"] == "api_error"
        # ... while the OpenAI paths keep OpenAI's shape
        r = httpx.post(nowhere.url + "/v1/chat/completions", timeout=30, json={})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_instance"
    finally:
        nowhere.stop()


def test_anthropic_headers_are_forwarded():
    seen: list[dict[str, str]] = []

    async def app(scope, receive, send):  # records the headers an instance receives
        if scope["type"] != "http":
            return
        seen.append({k.decode(): v.decode() for k, v in scope["headers"]})
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"{}"})

    inst = ThreadServer(app)
    router = start_router([inst.url], health_check_interval=60)
    try:
        r = httpx.post(router.url + "/v1/messages", json={"model": "m"}, headers={
            "x-api-key": "secret", "anthropic-version": "2023-06-01",
            "anthropic-beta": "tools-2024-04-04"})
        assert r.status_code == 200
        got = [h for h in seen if "anthropic-version" in h][-1]
        assert (got["x-api-key"], got["anthropic-version"], got["anthropic-beta"]) == (
            "secret", "2023-06-01", "tools-2024-04-04")
    finally:
        router.stop()
        inst.stop()


def _events(raw: bytes) -> list[tuple[str | None, str]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if block:
            fields = dict(line.split(": ", 1) for line in block.split("\n"))
            out.append((fields.get("event"), fields["data"]))
    return out


def test_a_broken_stream_ends_in_its_own_protocols_error_event():
    (name, data), = _events(_sse_error("/v1/messages", "gone"))
    assert name == "error" and json.loads(data) == {
        "type": "error", "error": {"type": "api_error", "message": "gone"}}
    (name, data), = _events(_sse_error("/v1/messages", "slow", "timeout", "upstream_timeout",
                                       504))
    assert json.loads(data)["error"]["type"] == "timeout_error"
    (name, data), = _events(_sse_error("/v1/responses", "gone"))
    assert name == "error" and json.loads(data) == {
        "type": "error", "code": "upstream_error", "message": "gone", "param": None}
    (_, data), (_, done) = _events(_sse_error("/v1/chat/completions", "gone"))
    assert json.loads(data)["error"]["message"] == "gone" and done == "[DONE]"
