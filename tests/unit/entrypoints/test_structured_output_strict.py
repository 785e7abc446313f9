"""response_format json_schema ``strict``: a keyword the grammar cannot enforce is refused in
the API process with OpenAI's error shape; without strict the request goes through lenient."""

from guided_cases import PYDANTIC_SCHEMAS, UNENFORCEABLE

MSGS = [{"role": "user", "content": "hi"}]


def _fmt(schema, **kw):
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, **kw}}


async def test_strict_schema_with_unenforceable_keyword_is_a_400(client, engine):
    for case, (schema, keywords) in UNENFORCEABLE.items():
        r = await client.post("/v1/chat/completions", json={
            "messages": MSGS, "max_tokens": 2, "response_format": _fmt(schema, strict=True)})
        assert r.status_code == 400, (case, r.text)
        error = r.json()["error"]
        assert error["param"] == "response_format" and error["code"] == "invalid_json_schema"
        assert f"'{keywords[0]}'" in error["message"]
        assert error["type"] == "invalid_request_error"
    calls = len(engine.calls)
    assert calls == 0  # refused before the engine
    r = await client.post("/v1/completions", json={
        "prompt": "x", "max_tokens": 2,
        "response_format": _fmt(PYDANTIC_SCHEMAS["TaggedItem"], strict=True)})
    assert r.status_code == 400 and "'uniqueItems'" in r.json()["error"]["message"]


async def test_non_strict_goes_through_lenient(client, engine):
    schema = UNENFORCEABLE["uniqueItems"][0]
    for fmt in (_fmt(schema), _fmt(schema, strict=False)):
        r = await client.post("/v1/chat/completions", json={
            "messages": MSGS, "max_tokens": 2, "response_format": fmt})
        assert r.status_code == 200, r.text
        assert engine.calls[-1][1].guided_decoding.strict is False
    r = await client.post("/v1/chat/completions", json={
        "messages": MSGS, "max_tokens": 2, "response_format": _fmt({"type": "object"},
                                                                 strict=True)})
    assert r.status_code == 200 and engine.calls[-1][1].guided_decoding.strict is True
    r = await client.post("/v1/chat/completions", json={
        "messages": MSGS, "max_tokens": 2, "response_format": _fmt(schema, strict="yes")})
    assert r.status_code == 400 and "strict" in r.json()["error"]["message"]
