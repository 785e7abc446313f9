"""Structured output end to end through the offline ``LLM`` with a tiny random model: every
constraint, at temperature 0 and 1, must produce output that ``jsonschema`` / ``re.fullmatch``
accepts; mixed batches, n > 1, preemption, the compiled-grammar cache and bad input."""

from __future__ import annotations

import json
import re
from decimal import Decimal

import jsonschema
import pytest

from bladellm import LLM, SamplingParams
from bladellm.sampling_params import GuidedDecodingParams
from guided_cases import (
    CHOICES, EMPLOYEE_PROFILE, GRAMMARS, IPV4_REGEX, PYDANTIC_IGNORED, PYDANTIC_MODELS,
    PYDANTIC_SCHEMAS, PYDANTIC_UNBOUNDED, REGEXES, SCHEMAS)

MAX_TOKENS = 400


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=tiny_llama, dtype="float32", max_model_len=512, num_kv_blocks=512,
               max_num_seqs=128, num_threads=1)


def _params(guided: GuidedDecodingParams, temperature: float, seed: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=MAX_TOKENS,
                          guided_decoding=guided, **kw)


def _check_json(text: str, schema: dict) -> None:
    value = json.loads(text, parse_float=Decimal)  # huge exponents stay exact
    jsonschema.validate(value, schema)


def _generate(llm, params: list[SamplingParams]):
    return llm.generate(["Answer in JSON:"] * len(params), params, use_tqdm=False)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_schema_gives_valid_json(llm, temperature):
    names = list(SCHEMAS)
    assert len(names) >= 40
    params = [_params(GuidedDecodingParams(json=SCHEMAS[n]), temperature, seed=i)
              for i, n in enumerate(names)]
    for name, out in zip(names, _generate(llm, params)):
        comp = out.outputs[0]
        assert comp.finish_reason == "stop", (name, comp.text)
        _check_json(comp.text, SCHEMAS[name])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_choice_and_grammar(llm, temperature):
    cases = ([(GuidedDecodingParams(regex=r), lambda t, r=r: re.fullmatch(r, t, re.ASCII))
              for r in REGEXES.values()]
             + [(GuidedDecodingParams(choice=c), lambda t, c=c: t in c) for c in CHOICES])
    outs = _generate(llm, [_params(g, temperature, seed=i) for i, (g, _) in enumerate(cases)])
    for (guided, ok), out in zip(cases, outs):
        comp = out.outputs[0]
        assert comp.finish_reason == "stop" and ok(comp.text), (guided, comp.text)
    outs = _generate(llm, [_params(GuidedDecodingParams(grammar=g), temperature, seed=1)
                           for g in GRAMMARS.values()])
    assert re.fullmatch(r"[0-9]{1,3}([-+*][0-9]{1,3})*", outs[0].outputs[0].text)
    assert re.fullmatch(r"(hello|hi) [a-z]{1,8}", outs[1].outputs[0].text)


def test_ipv4_means_ascii_digits(llm):
    # \d must not admit other scripts' digits (llguidance's regex engine reads it as Unicode).
    outs = _generate(llm, [_params(GuidedDecodingParams(regex=IPV4_REGEX), 1.0, seed=s)
                           for s in range(16)])
    for out in outs:
        text = out.outputs[0].text
        assert re.fullmatch(IPV4_REGEX, text, re.ASCII), text
        assert all(0 <= int(octet) <= 255 for octet in text.split("."))


def test_mixed_batch_n_and_json_object(llm):
    free = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    params = [free, _params(GuidedDecodingParams(json=EMPLOYEE_PROFILE), 1.0, 7, n=3), free,
              _params(GuidedDecodingParams(json_object=True), 1.0, 9)]
    outs = _generate(llm, params)
    assert len(outs[0].outputs[0].token_ids) == 12 and len(outs[2].outputs[0].token_ids) == 12
    assert len(outs[1].outputs) == 3
    for comp in outs[1].outputs:
        _check_json(comp.text, EMPLOYEE_PROFILE)
    obj = outs[3].outputs[0]
    assert obj.finish_reason in ("stop", "length")
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text, parse_float=Decimal), dict)


def test_greedy_constrained_output_is_deterministic_and_unaffected_by_batch(llm):
    g = GuidedDecodingParams(json=SCHEMAS["recipe"])
    alone = _generate(llm, [_params(g, 0.0, 0)])[0].outputs[0].text
    batched = _generate(llm, [SamplingParams(max_tokens=30, temperature=1.0, seed=1),
                              _params(g, 0.0, 0)])[1].outputs[0].text
    assert alone == batched


def test_max_tokens_cut_reports_length(llm):
    out = _generate(llm, [SamplingParams(temperature=1.0, seed=0, max_tokens=5,
                                         guided_decoding=GuidedDecodingParams(
                                             json=EMPLOYEE_PROFILE))])[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_second_request_with_the_same_schema_compiles_nothing(llm):
    stats = llm.engine.core.guided.stats
    schema = {"type": "object", "properties": {"only_here": {"type": "integer", "minimum": 0,
                                                             "maximum": 5}},
              "required": ["only_here"], "additionalProperties": False}
    before = stats()["num_compiles"]
    _generate(llm, [_params(GuidedDecodingParams(json=schema), 1.0, 0)])
    assert stats()["num_compiles"] == before + 1
    hits = stats()["hits"]
    # Same schema as JSON text with other spacing: the normalised key is the same.
    _generate(llm, [_params(GuidedDecodingParams(json=json.dumps(schema, indent=2)), 1.0, 1)])
    assert stats()["num_compiles"] == before + 1
    assert stats()["hits"] == hits + 1


@pytest.mark.parametrize("guided,words", [
    (dict(json={"type": "foo"}), "guided_json"),
    (dict(json='{"type": '), "not valid JSON"),
    (dict(regex="a(b"), "guided_regex"),
    (dict(choice=[]), "guided_choice"),
    (dict(grammar="start: undefined_rule"), "guided_grammar"),
    (dict(json={"type": "object"}, regex="a"), "exactly one"),
    (dict(regex="a+", whitespace_pattern=" "), "guided_whitespace_pattern"),
    (dict(grammar="start: start"), "guided_grammar: no output can satisfy"),
])
def test_invalid_constraints_raise_before_the_engine(llm, guided, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        llm.generate("x", SamplingParams(guided_decoding=GuidedDecodingParams(**guided)),
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("depth,words", [(200, "recursion limit"), (5000, "nested too deeply")])
def test_deeply_nested_schema_is_a_clear_error(llm, depth, words):
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    with pytest.raises(ValueError, match=f"guided_json.*{words}"):
        llm.generate("x", SamplingParams(guided_decoding=GuidedDecodingParams(json=schema)),
                     use_tqdm=False)


def test_preemption_keeps_the_grammar_state(tiny_llama):
    # Few KV blocks: requests are preempted and recomputed mid-generation.
    small = LLM(model=tiny_llama, dtype="float32", max_model_len=512, num_kv_blocks=40,
                block_size=16, max_num_seqs=8, num_threads=1)
    params = [_params(GuidedDecodingParams(json=SCHEMAS["recipe"]), 1.0, seed=s)
              for s in range(8)]
    outs = small.generate(["Answer in JSON:"] * 8, params, use_tqdm=False)
    assert small.engine.core.scheduler.num_preemptions > 0
    for out in outs:
        _check_json(out.outputs[0].text, SCHEMAS["recipe"])


def test_grammar_failing_in_the_engine_fails_only_its_request(llm):
    # Bypass the front end's validation: the engine's compilation fails, and the request ends
    # with a grammar error (a 400 in the server) while a free request beside it completes.
    from bladellm.engine.messages import EngineCoreRequest
    from bladellm.errors import ErrorKind, request_error

    core = llm.engine.core
    bad = SamplingParams(max_tokens=5, guided_decoding=GuidedDecodingParams(
        grammar="start: no_such_rule"))
    core.add_request(EngineCoreRequest(request_id="bad", prompt_token_ids=[5, 6, 7],
                                       sampling_params=bad))
    core.add_request(EngineCoreRequest(request_id="ok", prompt_token_ids=[5, 6, 8],
                                       sampling_params=SamplingParams(max_tokens=3)))
    outputs = {}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            if out.finish_reason is not None:
                outputs[out.request_id] = out
    assert outputs["bad"].finish_reason == "error"
    assert outputs["bad"].error_kind is ErrorKind.INVALID_GRAMMAR
    assert outputs["bad"].error.startswith("guided_grammar")
    assert isinstance(request_error(outputs["bad"].error_kind, outputs["bad"].error), ValueError)
    assert outputs["ok"].finish_reason == "length"
    core.scheduler.check_invariants()


@pytest.mark.parametrize("grammar,reason", [
    ("start: start", "NoExtensionBias"), ('root ::= "a" root', "Too many items")])
def test_grammar_failing_at_the_first_token_in_the_engine_is_the_clients_error(
        llm, grammar, reason):
    # Bypass the front end's validation (which now rejects these): the matcher fails at the
    # first token whatever the model samples, and the request ends with a grammar error (a 400
    # in the server), not a rejected-token engine failure (a 500).
    from bladellm.engine.messages import EngineCoreRequest
    from bladellm.errors import ErrorKind, request_error

    core = llm.engine.core
    params = SamplingParams(max_tokens=5, guided_decoding=GuidedDecodingParams(grammar=grammar))
    core.add_request(EngineCoreRequest(request_id="dead", prompt_token_ids=[5, 6, 7],
                                       sampling_params=params))
    outputs = {}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            if out.finish_reason is not None:
                outputs[out.request_id] = out
    dead = outputs["dead"]
    assert dead.finish_reason == "error" and not dead.new_token_ids
    assert dead.error_kind is ErrorKind.INVALID_GRAMMAR
    assert dead.error.startswith("guided_grammar: no output can satisfy")
    assert reason in dead.error
    error = request_error(dead.error_kind, dead.error)
    assert isinstance(error, ValueError) and str(error).startswith("guided_grammar: ")
    core.scheduler.check_invariants()


def test_thousands_of_choices(llm):
    # 2000 or more choices overflowed llguidance's Earley row at the first token.
    choices = [f"option {i}" for i in range(2500)]
    outs = _generate(llm, [_params(GuidedDecodingParams(choice=choices), 1.0, seed=s)
                           for s in range(3)])
    for out in outs:
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text in choices


# Speculation with constraints: a KV pool small enough to preempt (recompute) mid-generation,
# block accounting checked every step. The free-text regex is where a self-draft's unconstrained
# proposals are valid, so sps gets accepted tokens there.
SPEC_CONFIG = dict(dtype="float32", max_model_len=250, num_kv_blocks=64, block_size=4,
                   max_num_seqs=8, num_threads=1, debug_block_accounting=True)
SPEC_CASES = ([("json", n) for n in ("recipe", "order_line", "many_props", "event")]
              + [("regex", n) for n in ("ipv4", "email", "word_list")]
              + [("regex", "free_text")])
SPEC_REGEXES = {**REGEXES, "free_text": r'[^"]{0,60}'}
# --spec_policy always: every step speculates (the cost rule would never run a self-draft).
SPEC_ALGOS = {"sps": {"decode_algo": "sps", "gamma": 3, "spec_policy": "always"}, "look_ahead": {
    "decode_algo": "look_ahead", "look_ahead_window_size": 3, "look_ahead_gram_size": 3,
    "guess_set_size": 3, "spec_policy": "always"}}


def _spec_guided(kind: str, name: str) -> GuidedDecodingParams:
    return (GuidedDecodingParams(json=SCHEMAS[name]) if kind == "json"
            else GuidedDecodingParams(regex=SPEC_REGEXES[name]))


def _check_spec_case(kind: str, name: str, comp) -> None:
    assert comp.finish_reason == "stop", (name, comp.text)
    if kind == "json":
        _check_json(comp.text, SCHEMAS[name])
    else:
        assert re.fullmatch(SPEC_REGEXES[name], comp.text, re.ASCII), (name, comp.text)


def _spec_generate(model: str, temperature: float, extra=(), **kwargs):
    llm = LLM(model=model, **SPEC_CONFIG, **kwargs)
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=200,
                             guided_decoding=_spec_guided(kind, name))
              for i, (kind, name) in enumerate(SPEC_CASES)]
    extra_prompts = [p for p, _ in extra]
    outs = llm.generate(["Answer in JSON:"] * len(params) + extra_prompts,
                        params + [sp for _, sp in extra], use_tqdm=False)
    core = llm.engine.core
    assert core.scheduler.kv_cache_manager.pool.num_used_blocks == 0
    return outs, core.scheduler.get_stats()


@pytest.fixture(scope="module")
def normal_constrained(tiny_llama):
    """Plain decoding's constrained outputs at temperature 0 and (seeded) 1."""
    result = {}
    for temperature in (0.0, 1.0):
        outs, stats = _spec_generate(tiny_llama, temperature)
        result[temperature] = [o.outputs[0].token_ids for o in outs]
        if temperature == 0.0:
            assert stats.num_preemptions > 0  # the configuration recomputes mid-generation
    return result


@pytest.mark.parametrize("algo", list(SPEC_ALGOS))
def test_constrained_greedy_is_token_identical_under_speculation(tiny_llama,
                                                                  normal_constrained, algo):
    """Constrained requests take part in sps / look_ahead: every verified position is masked by
    the grammar after the proposals before it, so greedy output is token-identical to plain
    decoding under the same constraint (through preemption and recompute), always valid, and
    proposals were accepted (the batch holds constrained requests only)."""
    kwargs = dict(SPEC_ALGOS[algo])
    if algo == "sps":
        kwargs["draft_model"] = tiny_llama  # self-draft
    outs, stats = _spec_generate(tiny_llama, 0.0, **kwargs)
    for (kind, name), out, expected in zip(SPEC_CASES, outs, normal_constrained[0.0]):
        _check_spec_case(kind, name, out.outputs[0])
        assert out.outputs[0].token_ids == expected, (name, out.outputs[0].text)
    assert stats.num_spec_draft_tokens > 0
    assert stats.num_spec_accepted_tokens > 0


@pytest.mark.parametrize("algo", list(SPEC_ALGOS))
def test_constrained_sampling_beside_free_requests_under_speculation(tiny_llama,
                                                                     normal_constrained, algo):
    """Sampled constrained requests stay valid under speculation (sps: rejection sampling on the
    masked target distribution; look_ahead's point-mass guesses: the very seeded tokens of plain
    decoding); a free request in the same batch still matches plain greedy decoding."""
    kwargs = dict(SPEC_ALGOS[algo])
    if algo == "sps":
        kwargs["draft_model"] = tiny_llama
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs, _ = _spec_generate(tiny_llama, 1.0, extra=[("the the the", free)], **kwargs)
    for (kind, name), out in zip(SPEC_CASES, outs):
        _check_spec_case(kind, name, out.outputs[0])
    if algo == "look_ahead":
        assert [o.outputs[0].token_ids for o in outs[:-1]] == normal_constrained[1.0]
    plain = LLM(model=tiny_llama, dtype="float32", max_model_len=512, num_kv_blocks=512,
                num_threads=1)
    [ref] = plain.generate(["the the the"], free, use_tqdm=False)
    assert outs[-1].outputs[0].token_ids == ref.outputs[0].token_ids


def _without(node, keywords):
    """``node`` without the schema keywords in ``keywords`` (what the grammar ignored)."""
    if isinstance(node, list):
        return [_without(x, keywords) for x in node]
    if not isinstance(node, dict):
        return node
    return {k: _without(v, keywords) for k, v in node.items() if k not in keywords}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_real_world_pydantic_schemas(llm, temperature):
    """Schemas from pydantic models, unenforceable keywords included (lenient): the output
    satisfies everything the grammar enforces, and the model parses it where nothing it
    checks was ignored."""
    names = [n for n in PYDANTIC_SCHEMAS if n not in PYDANTIC_UNBOUNDED]
    params = [_params(GuidedDecodingParams(json=PYDANTIC_SCHEMAS[n]), temperature, seed=i)
              for i, n in enumerate(names)]
    for name, out in zip(names, _generate(llm, params)):
        comp = out.outputs[0]
        assert comp.finish_reason == "stop", (name, comp.text)
        ignored = set(PYDANTIC_IGNORED[name])
        # Floats, not Decimals: jsonschema's multipleOf divides by a float.
        jsonschema.validate(json.loads(comp.text), _without(PYDANTIC_SCHEMAS[name], ignored))
        if not ignored - {"uniqueItems"}:  # a set takes duplicates in; nothing else ignored
            PYDANTIC_MODELS[name].model_validate_json(comp.text)
