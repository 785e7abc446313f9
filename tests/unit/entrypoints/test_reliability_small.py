"""Smaller findings of issue 37: a lowercase ``bearer`` scheme, --disable_docs, deeply nested
tool-call arguments (400, not 500)."""

from __future__ import annotations

import pytest
from fake_engine import FakeAsyncLLM


@pytest.mark.parametrize("header,status", [
    ("Bearer k", 200), ("bearer k", 200), ("BEARER k", 200), ("bearer  k ", 200),
    ("Basic k", 401), ("bearer x", 401), ("k", 401)])
async def test_bearer_scheme_is_case_insensitive(make_client, header, status):
    async with make_client(FakeAsyncLLM(), api_key="k") as c:
        r = await c.get("/v1/models", headers={"Authorization": header})
    assert r.status_code == status, r.text


@pytest.mark.parametrize("disabled", [False, True])
async def test_disable_docs(make_client, disabled):
    async with make_client(FakeAsyncLLM(), api_key="k", disable_docs=disabled) as c:
        for path in ("/docs", "/redoc", "/openapi.json"):
            r = await c.get(path)  # no key: documentation, not the model
            assert r.status_code == (404 if disabled else 200), (path, r.text[:200])


async def test_deeply_nested_tool_call_arguments_are_400(make_client):
    deep = "[" * 5000 + "]" * 5000
    body = {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "x"}]}
    async with make_client(FakeAsyncLLM()) as c:
        r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert "nested too deeply" in r.json()["error"]["message"]


async def test_openapi_declares_every_request_body(make_client):
    async with make_client(FakeAsyncLLM()) as c:
        schema = (await c.get("/openapi.json")).json()
    components = schema["components"]["schemas"]
    posts = {path: ops["post"] for path, ops in schema["paths"].items() if "post" in ops}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize",
            "/detokenize", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= set(posts)
    # OpenAI's cancel takes no body: the id is in the path.
    bodiless = {"/v1/responses/{response_id}/cancel"}
    assert bodiless <= set(posts)
    for path, op in posts.items():
        if path in bodiless:
            assert "requestBody" not in op, path
            continue
        body = op.get("requestBody")
        assert body is not None and body["required"], path
        schema_ = body["content"]["application/json"]["schema"]
        # A component reference, or the schema inlined (Anthropic's routes inline theirs).
        model = components[schema_["$ref"].rsplit("/", 1)[1]] if "$ref" in schema_ else schema_
        assert model["type"] == "object" and model["properties"], path
    assert "messages" in components["ChatCompletionRequest"]["required"]
    assert components["CompletionRequest"]["properties"]["top_k"]["anyOf"][0]["maximum"] == \
        2**31 - 1
    text = str(schema)
    for ref in (part.split("'")[0] for part in text.split("#/components/schemas/")[1:]):
        assert ref in components, ref  # every reference resolves
