"""What the router reads from a body (prompt text, cost) is read from any JSON a client sends:
the router must not fail where the instance answers a 400. schemathesis found
``{"messages": [{"role": "tool", "content": [{"text": null}]}]}`` answered 500 by the router
(TypeError in the prompt text), where the server answers 400."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from bladellm.router.prompt import prompt_text, request_info

_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                     st.floats(allow_nan=False), st.text(max_size=6))
_JSON = st.recursive(_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=12)
_KEYS = ["messages", "prompt", "input", "system", "instructions", "content", "text", "role",
         "n", "max_tokens", "max_output_tokens", "max_completion_tokens", "stream"]
# Bodies shaped like the APIs' (their keys at every level), with any value anywhere.
_BODY = st.recursive(_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3),
    st.dictionaries(st.sampled_from(_KEYS), inner, max_size=4)), max_leaves=16)


@settings(max_examples=400, deadline=None)
@given(st.one_of(_BODY, _JSON))
def test_any_body_gives_routing_facts_without_an_exception(body):
    info = request_info(body, 4, 8)
    assert info.prompt_tokens >= 0 and info.max_tokens >= 0


def test_null_and_non_text_parts_are_skipped():
    body = {"messages": [{"role": "tool", "content": [{"text": None}, {"text": {}},
                                                      {"type": "text", "text": "ok"}]}],
            "system": [{"type": "text", "text": {}}]}
    assert prompt_text(body) == "tool\nok\n"
    assert prompt_text({"system": "be brief", "messages": [{"role": "user", "content": "hi"}]}) \
        == "system\nbe brief\nuser\nhi\n"
    assert prompt_text({"instructions": "be brief", "input": "hi"}) == \
        "system\nbe brief\nuser\nhi\n"
    assert prompt_text({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "a"}]}, {"type": "function_call_output"}]}).startswith(
        "user\na\n")
