"""JSON schemas with keywords llguidance cannot enforce: a lenient (non-strict) schema is
compiled without them and reports their names; a strict one is refused naming them. Checked
on one schema per keyword and on real-world pydantic ``model_json_schema()`` outputs."""

from __future__ import annotations

import logging

import pytest

from bladellm.guided.backend import (
    GrammarError, GrammarValidator, ignored_keywords, unenforced_keywords, validate)
from bladellm.guided.grammar import to_grammar
from bladellm.sampling_params import GuidedDecodingParams as G
from guided_cases import PYDANTIC_IGNORED, PYDANTIC_SCHEMAS, SCHEMAS, UNENFORCEABLE


@pytest.mark.parametrize("case", list(UNENFORCEABLE))
def test_lenient_ignores_and_names_strict_refuses(case):
    schema, keywords = UNENFORCEABLE[case]
    assert validate(G(json=schema)) == keywords
    assert unenforced_keywords(schema) == keywords
    with pytest.raises(GrammarError, match=f"'{keywords[0]}'.* not supported in a strict "):
        validate(G(json=schema, strict=True))


@pytest.mark.parametrize("name", list(PYDANTIC_SCHEMAS))
def test_real_world_pydantic_schemas(name):
    schema = PYDANTIC_SCHEMAS[name]
    assert validate(G(json=schema)) == PYDANTIC_IGNORED[name]
    if PYDANTIC_IGNORED[name]:
        with pytest.raises(GrammarError, match=PYDANTIC_IGNORED[name][0]):
            validate(G(json=schema, strict=True))
    else:
        assert validate(G(json=schema, strict=True)) == []


def test_fully_enforceable_schemas_report_nothing():
    for name, schema in SCHEMAS.items():
        assert validate(G(json=schema)) == [], name


def test_what_can_be_enforced_still_is():
    """uniqueItems is dropped, but items and maxItems still hold (over a byte tokenizer)."""
    import llguidance

    from bladellm.guided.backend import _byte_tokenizer

    def accepts(schema, text):
        m = llguidance.LLMatcher(_byte_tokenizer(), to_grammar(G(json=schema)), log_level=0)
        ok = m.try_consume_tokens(list(text.encode())) == len(text.encode())
        return ok and m.is_accepting()  # the value is complete

    schema = UNENFORCEABLE["uniqueItems"][0]
    assert accepts(schema, "[1, 1]")  # duplicates: not enforceable
    assert not accepts(schema, '["a"]') and not accepts(schema, "[1, 2, 3, 4]")
    pattern = UNENFORCEABLE["pattern"][0]
    # The whole regex is dropped (it cannot be compiled), the type still holds.
    assert accepts(pattern, '"xtoolong"') and not accepts(pattern, "12")


def test_warning_names_are_parsed():
    assert ignored_keywords(['Unimplemented keys: ["uniqueItems"] (2 times)',
                             'Unimplemented keys: ["if", "then"]', "Unknown format: foo",
                             "something else"]) == ["uniqueItems", "if", "then", "format: foo"]


def test_validator_logs_the_ignored_keywords_for_every_request(caplog):
    validator = GrammarValidator()
    params = G(json=UNENFORCEABLE["contains"][0])
    with caplog.at_level(logging.INFO, logger="bladellm.guided.backend"):
        validator.validate(params)
        validator.validate(params)  # cached: validated once, logged again for this request
        validator.validate(G(json=SCHEMAS["string"]))
    assert validator.num_validations == 2
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2 and all("contains" in m and "ignored" in m for m in logged)
