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


def _with_grammar(req_id, grammar, prompt=5, **kw):
    req = make_request(req_id, prompt, **kw)
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


@dataclass
class BrokenGrammar(FakeGrammar):
    """A matcher llguidance put in its error state (e.g. no token can start the grammar)."""

    broken: bool = True

    @property
    def error(self) -> str | None:
        return "NoExtensionBias\n<non-verbose/>" if self.broken else None


def test_grammar_failing_before_any_output_is_the_clients_error():
    from bladellm.errors import ErrorKind
    from bladellm.sampling_params import GuidedDecodingParams

    sched = make_scheduler()
    runner = FakeRunner(sched, default_token=9)
    params = GuidedDecodingParams(grammar="start: start")
    # Different prompts: with one prompt, the others would wait a step for the first's prefix.
    sched.add_request(_with_grammar("first", BrokenGrammar(allowed=set()),
                                    guided_decoding=params, prompt=[11, 12, 13, 14, 15]))
    # Only banned by the grammar (no llguidance error): an engine failure, even at first.
    sched.add_request(_with_grammar("banned", FakeGrammar(allowed={1}), guided_decoding=params,
                                    prompt=[21, 22, 23, 24, 25]))
    later = BrokenGrammar(broken=False)
    sched.add_request(_with_grammar("later", later, guided_decoding=params,
                                    prompt=[31, 32, 33, 34, 35]))
    _, outs = step(sched, runner)
    errors = {o.request_id: (o.error_kind, o.error) for o in outs}
    assert errors["first"] == (ErrorKind.INVALID_GRAMMAR, "guided_grammar: no output can satisfy "
                               "the grammar constraint (it fails at the first token: "
                               "NoExtensionBias)")
    assert errors["banned"] == (ErrorKind.FAILED,
                                "grammar: token 9 rejected (not allowed by the grammar)")
    assert errors["later"] == (None, None) and later.accepted == [9]
    # llguidance fails after output was produced (e.g. a right-recursive rule past its row
    # limit): still the constraint's doing, a 400 that says after how many tokens.
    later.allowed, later.broken = set(), True
    _, outs = step(sched, runner)
    assert (outs[0].error_kind, outs[0].error) == (
        ErrorKind.INVALID_GRAMMAR,
        "guided_grammar: the grammar constraint failed after 1 output tokens: NoExtensionBias")
    sched.check_invariants()


def _spec_scheduler():
    from bladellm.config import CacheConfig, SchedulerConfig, SpeculativeConfig
    from bladellm.core.scheduler import Scheduler

    return Scheduler(SchedulerConfig(max_num_batched_tokens=64), CacheConfig(block_size=4),
                     num_blocks=64, max_model_len=128,
                     speculative=SpeculativeConfig(decode_algo="sps", gamma=4))


def test_constrained_proposals_are_cut_where_the_grammar_rejects_and_advance_it():
    """A constrained request speculates: its proposal is cut at the first token the grammar
    rejects (a greedy request drops it; a sampled one keeps it so that rejection sampling stays
    exact), the cut leaves the grammar untouched, and the accepted tokens advance it."""
    from bladellm.core.interface import ModelRunnerOutput

    sched = _spec_scheduler()
    greedy = FakeGrammar(allowed={31, 32, 33, 100, 200})
    sampled = FakeGrammar(allowed={31, 32, 33, 100, 200})
    for req_id, grammar, temperature, prompt in (("g", greedy, 0.0, [10, 11, 12, 13, 14]),
                                                 ("s", sampled, 1.0, [20, 21, 22, 23, 24])):
        req = make_request(req_id, prompt, max_tokens=20, temperature=temperature)
        req.grammar = grammar
        sched.add_request(req)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"g": 5, "s": 5}
    sched.update_from_output(out, ModelRunnerOutput(
        ["g", "s"], [[100], [100]], spec_token_ids={"g": [31, 32, 39, 33], "s": [31, 32, 39, 33]}))
    out = sched.schedule()
    assert out.scheduled_spec_tokens == {"g": [31, 32], "s": [31, 32, 39]}
    assert out.num_scheduled_tokens == {"g": 3, "s": 4}
    assert greedy.accepted == [100] and sampled.accepted == [100]  # cut rolled back
    # g: both proposals accepted, then the target's token; s: one accepted.
    sched.update_from_output(out, ModelRunnerOutput(
        ["g", "s"], [[31, 32, 200], [31, 33]], spec_token_ids={"g": [39], "s": [33, 33]}))
    assert greedy.accepted == [100, 31, 32, 200] and sampled.accepted == [100, 31, 33]
    assert sched.requests["g"].num_computed_tokens == 5 + 3  # rejected KV rolled back
    assert sched.requests["s"].num_computed_tokens == 5 + 2
    sched.check_invariants()
    out = sched.schedule()
    # g's whole proposal is rejected: nothing to verify; s keeps both valid tokens.
    assert "g" not in out.scheduled_spec_tokens and out.num_scheduled_tokens["g"] == 1
    assert out.scheduled_spec_tokens["s"] == [33, 33]
    stats = sched.get_stats()
    assert (stats.num_spec_draft_tokens, stats.num_spec_accepted_tokens) == (5, 3)


def test_constrained_request_is_never_granted_a_tree():
    from bladellm.core.interface import ModelRunnerOutput

    sched = _spec_scheduler()
    sched.add_request(_with_grammar("g", FakeGrammar(), max_tokens=20))
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(["g"], [[100]],
                                                    spec_tree_sizes={"g": 6}))
    out = sched.schedule()
    assert not out.scheduled_spec_tree and out.num_scheduled_tokens == {"g": 1}
