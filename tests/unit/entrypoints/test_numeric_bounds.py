"""Numeric request fields at the boundary (issue 37 item 1): only values the engine can hold get
past the request models, as JSON numbers only, and anything that gets past them runs through
input processing, the process boundary's codec, the runner's sampling rows and the sampler
without an exception."""

from __future__ import annotations

import asyncio
import json

import httpx
import msgspec
import numpy as np
import pytest
import torch
from fake_engine import FakeAsyncLLM
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from bladellm.engine.messages import EngineCoreRequest
from bladellm.entrypoints.openai.config import ServerConfig
from bladellm.entrypoints.api_server import build_app
from bladellm.outputs import CompletionOutput, RequestOutput, TokenLogprob
from bladellm.sample.sampler import Sampler
from bladellm.sampling_params import SamplingParams
from bladellm.worker.sampling_rows import SamplingRows

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]


def _body(path: str, **fields) -> dict:
    base = {"prompt": [5, 6, 7]} if path == CMPL else {"messages": MSGS}
    return {**base, **fields}


class AdmittingEngine(FakeAsyncLLM):
    """Records every request admission produced, and finishes each choice after one token."""

    def __init__(self) -> None:
        super().__init__()
        self.admitted: list[EngineCoreRequest] = []

    async def generate(self, prompt, params, request_id, *, delta=True):
        reqs = self.input_processor.process(request_id, prompt, params, 0.0,
                                            validate_grammar=False)
        self.admitted.extend(reqs)
        lp = None
        if params.logprobs is not None:
            lp = [[TokenLogprob(97, -1.0, 1, "a")]
                  + [TokenLogprob(98 + k, -2.0 - k, k + 2, chr(98 + k))
                     for k in range(params.logprobs)]]
        yield RequestOutput(request_id, None, reqs[0].prompt_token_ids,
                            [CompletionOutput(j, "a", [97], lp, "length")
                             for j in range(params.n)], finished=True)


async def _post(engine, path: str, body: dict) -> httpx.Response:
    app = build_app(engine, ServerConfig())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as c:
        return await c.post(path, content=json.dumps(body),
                            headers={"content-type": "application/json"})


# ------------------------------------------------------------------ the reproductions

@pytest.mark.parametrize("path", [CMPL, CHAT])
@pytest.mark.parametrize("field,value", [
    ("top_k", 2**63), ("top_k", 2**31), ("top_k", 2**64), ("min_tokens", 2**31),
    ("min_tokens", 2**64), ("max_tokens", 2**64), ("seed", 2**64), ("seed", -(2**63) - 1),
    ("n", 2**64), ("logit_bias", {"5": 2**64}), ("stop_token_ids", [2**64]),
    ("top_k", "5"), ("top_k", True), ("max_tokens", "5"), ("max_tokens", True),
    ("temperature", "0.5"), ("temperature", True), ("min_tokens", 5.0), ("seed", "1"),
])
async def test_unrepresentable_or_non_numeric_is_400_naming_the_field(path, field, value):
    engine = AdmittingEngine()
    r = await _post(engine, path, _body(path, **{field: value}))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split(".")[0] == field
    assert not engine.admitted


async def test_chat_min_tokens_beyond_the_context_without_max_tokens_is_400():
    # Chat with no max_tokens used to let min_tokens >= 2**31 through to the runner's int32 row.
    for value in (2**31 - 1, 129, 127):
        r = await _post(AdmittingEngine(), CHAT, _body(CHAT, min_tokens=value))
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text


@pytest.mark.parametrize("path", [CMPL, CHAT])
async def test_min_tokens_is_treated_alike_by_chat_and_completions(path):
    # The fake model has a 128-token context; the prompt takes a few tokens of it.
    ok = await _post(AdmittingEngine(), path, _body(path, min_tokens=20, max_tokens=30))
    assert ok.status_code == 200, ok.text
    over = await _post(AdmittingEngine(), path, _body(path, min_tokens=40, max_tokens=30))
    assert over.status_code == 400 and over.json()["error"]["param"] == "min_tokens"
    # No max_tokens on either side: min_tokens is bounded by what the context leaves.
    fields = {"min_tokens": 126} if path == CHAT else {"min_tokens": 126, "max_tokens": None}
    r = await _post(AdmittingEngine(), path, _body(path, **fields))
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text


@pytest.mark.parametrize("field,value", [("top_k", 2**63), ("min_tokens", 2**31),
                                         ("max_tokens", 2**31), ("n", 2**40),
                                         ("stop_token_ids", [2**40]), ("logit_bias", {2**40: 1})])
def test_sampling_params_refuse_what_the_rows_cannot_hold(field, value):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**{field: value})


# ------------------------------------------------------------------------ the property test

_EDGES = [0, 1, -1, 2, 20, 21, 127, 128, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**63 - 1,
          2**63, -(2**63), -(2**63) - 1, 2**64, 2**64 + 1, 10**30, -(10**30)]
_JUNK = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                 st.sampled_from(["5", "0.5", "", "1e3"]), st.integers())
# Mostly plausible values and the edges of the engine's int32 / int64 rows, some junk: a
# request has several fields, and most must be valid for it to reach the rows at all.
_INT = st.one_of(st.integers(0, 30), st.sampled_from(_EDGES), st.sampled_from(_EDGES), _JUNK)
_FLOAT = st.one_of(st.floats(0.0, 1.0), st.floats(0.0, 1.0),
                   st.sampled_from([0, 1, 2, -2, 1e-9, 1e4, 1e5]), _JUNK)
_INT_FIELDS = ("max_tokens", "n", "seed", "top_k", "min_tokens")
_FLOAT_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p",
                 "repetition_penalty")
_NUMERIC = _INT_FIELDS + _FLOAT_FIELDS


@st.composite
def _requests(draw):
    path = draw(st.sampled_from([CMPL, CHAT]))
    fields = {name: draw(_INT if name in _INT_FIELDS else _FLOAT)
              for name in draw(st.sets(st.sampled_from(_NUMERIC), max_size=4))}
    if draw(st.booleans()):
        fields["n"] = draw(st.integers(1, 3))  # keep most admitted requests small
    if draw(st.booleans()):
        fields["stop_token_ids"] = draw(st.lists(_INT, max_size=3))
    if draw(st.booleans()):
        fields["logit_bias"] = {str(draw(st.sampled_from(_EDGES + [5, 299, 300]))):
                                draw(_FLOAT)}
    if draw(st.booleans()):
        if path == CMPL:
            fields["logprobs"] = draw(_INT)
        else:
            fields["logprobs"] = True
            fields["top_logprobs"] = draw(_INT)
    if path == CHAT and draw(st.booleans()):
        fields["max_completion_tokens"] = draw(_INT)
    if path == CMPL and draw(st.booleans()):
        fields["prompt"] = draw(st.lists(st.sampled_from(_EDGES + [5, 299]), min_size=1,
                                         max_size=4))
    return path, _body(path, **fields)


def _run_rows(req: EngineCoreRequest, vocab_size: int, max_model_len: int) -> None:
    """The request as the core receives it, written into a runner row, gathered and sampled."""
    codec = msgspec.msgpack.Decoder(EngineCoreRequest)
    req = codec.decode(msgspec.msgpack.encode(req))
    rows = SamplingRows(4, eos_token_ids=[1])
    rows.set_row(2, req.sampling_params)
    token_ids = np.zeros((4, max_model_len), np.int64)
    prompt = req.prompt_token_ids
    token_ids[2, :len(prompt)] = prompt
    num_tokens = np.zeros(4, np.int64)
    num_tokens[2] = len(prompt)
    md = rows.metadata(np.array([2]), token_ids, num_tokens, num_tokens.copy())
    out = Sampler()(torch.randn(1, vocab_size), md)
    assert 0 <= int(out.sampled_token_ids[0]) < vocab_size


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(_requests())
@example((CMPL, _body(CMPL, top_k=2**63)))  # the reproductions
@example((CHAT, _body(CHAT, top_k=2**63 - 1)))
@example((CHAT, _body(CHAT, min_tokens=2**31)))
@example((CMPL, _body(CMPL, min_tokens=2**64, max_tokens=2**64)))
def test_anything_the_api_accepts_runs_through_the_rows(case):
    path, body = case
    engine = AdmittingEngine()
    r = asyncio.run(_post(engine, path, body))
    assert r.status_code < 500, r.text
    if r.status_code != 200:
        assert not engine.admitted
        return
    info = engine.model_info
    for req in engine.admitted[:4]:
        _run_rows(req, info.vocab_size, info.max_model_len)
