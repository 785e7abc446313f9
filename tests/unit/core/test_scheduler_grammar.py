"""The scheduler with structured output: a request whose grammar is still compiling waits
without holding back others; every output token advances the grammar; a complete grammar ends
the request with "stop" (its last token is text); a rejected token fails only that request."""

from __future__ import annotations

from dataclasses import dataclass, field

from bladellm.request import RequestStatus
from sched_utils import FakeRunner, make_request, make_scheduler, step


@dataclass
class FakeGrammar:
    ready: bool = True
    allowed: set[int] | None = None  # None: every token
    complete_after: int | None = None  # terminated once this many tokens were accepted
    accepted: list[int] = field(default_factory=list)

    def is_ready(self) -> bool:
        return self.ready

    @property
    def error(self) -> str | None:
        return None

    def accept_tokens(self, token_ids: list[int]) -> int:
        n = 0
        for t in token_ids:
            if self.allowed is not None and t not in self.allowed:
                break
            self.accepted.append(t)
            n += 1
        return n

    def rollback(self, num_tokens: int) -> None:
        del self.accepted[len(self.accepted) - num_tokens:]

    def is_terminated(self) -> bool:
        return self.complete_after is not None and len(self.accepted) >= self.complete_after


def _with_grammar(req_id, grammar, **kw):
    req = make_request(req_id, 5, **kw)
    req.grammar = grammar
    return req


def test_compiling_request_waits_and_others_run():
    sched = make_scheduler()
    runner = FakeRunner(sched)
    compiling = FakeGrammar(ready=False)
    sched.add_request(_with_grammar("g", compiling, max_tokens=3))
    sched.add_request(make_request("free", 5, max_tokens=3))
    so, _ = step(sched, runner)
    assert list(so.num_scheduled_tokens) == ["free"]
    assert sched.requests["g"].status == RequestStatus.WAITING
    compiling.ready = True
    so, _ = step(sched, runner)
    assert set(so.num_scheduled_tokens) == {"free", "g"}


def test_tokens_advance_the_grammar_and_completion_stops_with_the_text_kept():
    sched = make_scheduler()
    runner = FakeRunner(sched, scripted={"g": [30, 31, 32, 33]})
    grammar = FakeGrammar(complete_after=3)
    sched.add_request(_with_grammar("g", grammar, max_tokens=10))
    outputs = []
    while sched.has_unfinished_requests():
        outputs += step(sched, runner)[1]
    assert grammar.accepted == [30, 31, 32]
    final = outputs[-1]
    assert final.finish_reason == "stop" and final.grammar_complete
    assert sum((o.new_token_ids for o in outputs), []) == [30, 31, 32]


def test_max_tokens_before_completion_is_length():
    sched = make_scheduler()
    runner = FakeRunner(sched)
    sched.add_request(_with_grammar("g", FakeGrammar(complete_after=50), max_tokens=4))
    outputs = []
    while sched.has_unfinished_requests():
        outputs += step(sched, runner)[1]
    assert outputs[-1].finish_reason == "length" and not outputs[-1].grammar_complete


def test_rejected_token_fails_only_that_request():
    sched = make_scheduler()
    runner = FakeRunner(sched, default_token=9)
    sched.add_request(_with_grammar("g", FakeGrammar(allowed={1})))
    sched.add_request(make_request("free", [50, 51, 52], max_tokens=2))
    _, outs = step(sched, runner)
    by_id = {o.request_id: o for o in outs}
    assert by_id["g"].finish_reason == "error" and "rejected" in by_id["g"].error
    assert by_id["free"].finish_reason is None
    assert "g" not in sched.requests
    sched.check_invariants()
