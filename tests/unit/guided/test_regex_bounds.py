"""Client regexes leave no process-wide state behind (each schema's regexes are checked once
per schema, the memo dropped with it) and have a length limit, a 400 naming the field."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from bladellm.guided import grammar
from bladellm.guided.backend import GrammarError, validate
from bladellm.sampling_params import MAX_REGEX_CHARS
from bladellm.sampling_params import GuidedDecodingParams as G

LOOKAHEAD = "^(?!x)[a-z]+$"  # llguidance cannot compile look-around: a lenient schema drops it


def _schema(patterns: list[str]) -> dict:
    return {"type": "object", "properties": {
        f"f{i}": {"type": "string", "pattern": p} for i, p in enumerate(patterns)}}


def test_each_regex_checked_once_per_schema_and_not_remembered(monkeypatch):
    checked: list[str] = []
    real = grammar.regex_supported

    def counting(regex: str) -> bool:
        checked.append(regex)
        return real(regex)

    monkeypatch.setattr(grammar, "regex_supported", counting)
    schema = _schema([LOOKAHEAD] * 50 + ["[a-z]+"] * 50)
    _, dropped = grammar.grammar_and_dropped(G(json=schema))
    assert dropped == ["pattern"] * 50
    assert sorted(checked) == sorted([grammar.ascii_regex(LOOKAHEAD), "[a-z]+"])
    grammar.grammar_and_dropped(G(json=schema))  # another request: checked anew, no global cache
    assert len(checked) == 4
    assert not hasattr(real, "cache_info")


@pytest.mark.parametrize("field", ["regex", "whitespace_pattern"])
def test_regex_length_limit(field):
    value = "a" * (MAX_REGEX_CHARS + 1)
    extra = {"json": {"type": "object"}} if field == "whitespace_pattern" else {}
    with pytest.raises(ValueError, match=f"guided_{field}: at most {MAX_REGEX_CHARS} characters"):
        G(**{field: value}, **extra)
    G(**{field: "a" * MAX_REGEX_CHARS}, **extra)  # at the limit: fine


@pytest.mark.parametrize("strict", [False, True])
def test_schema_pattern_length_limit(strict):
    long = "a" * (MAX_REGEX_CHARS + 1)
    for schema in (_schema([long]), {"type": "object", "patternProperties": {long: {}}}):
        with pytest.raises(GrammarError, match=f"guided_json: .*at most {MAX_REGEX_CHARS}"):
            validate(G(json=schema, strict=strict))


async def test_long_regex_is_a_400_naming_the_field():
    sys.path.insert(0, str(Path(__file__).parents[1] / "entrypoints"))
    from fake_engine import FakeAsyncLLM

    from bladellm.entrypoints.api_server import build_app
    from bladellm.entrypoints.openai.config import ServerConfig

    app = build_app(FakeAsyncLLM(), ServerConfig())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as http:
        r = await http.post("/v1/chat/completions", json={
            "model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
            "guided_regex": "a" * (MAX_REGEX_CHARS + 1)})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "guided_regex", r.text
