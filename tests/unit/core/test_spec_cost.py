"""The speculation cost rule (core/spec_decode.py, docs/speculative.md "Cost rule"): proposals
run only where their expected accepted tokens pay for the tokens they add to the step, grants
within a step are summed, and the sps draft runs only for the requests picked."""

import pytest

from bladellm.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from bladellm.core import spec_decode
from bladellm.core.interface import ModelRunnerOutput
from bladellm.core.scheduler import Scheduler
from bladellm.core.spec_decode import Candidate, SpecCosts, choose
from bladellm.request import Request
from bladellm.sampling_params import SamplingParams

# The demo model's shares (SmolLM2-135M: LM head 21 % of a token; a 6-layer cut as draft).
COSTS = dict(step_overhead=14.0, lm_head_share=0.21)
# look_ahead W1 N8 G1: a 13-token tree (7 guess tokens, 6 window tokens).
LA = SpeculativeConfig(decode_algo="look_ahead", look_ahead_window_size=1,
                       look_ahead_gram_size=8, guess_set_size=1)


def _sched(spec: SpeculativeConfig, costs: SpecCosts, max_num_seqs: int = 32) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=1024),
                     CacheConfig(block_size=4), num_blocks=1024, max_model_len=256,
                     speculative=spec, spec_costs=costs)


def _decoding(sched: Scheduler, n: int, *, tree: int = 0, chain: int = 0) -> list[Request]:
    """n requests past their prefill, each with a proposal for the next step."""
    reqs = [Request(f"r{i}", list(range(10 * i + 1, 10 * i + 9)),  # no shared prefix
                    SamplingParams(max_tokens=40, temperature=0.0)) for i in range(n)]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    ids = [r.request_id for r in reqs]
    sched.update_from_output(out, ModelRunnerOutput(
        ids, [[100]] * n, spec_tree_sizes={i: tree for i in ids} if tree else {},
        spec_token_ids={i: list(range(200, 200 + chain)) for i in ids} if chain else {}))
    return reqs


def test_choose_takes_the_best_prefix_by_gain_per_cost():
    cands = [Candidate("a", 1.0, 10.0), Candidate("b", 4.0, 5.0), Candidate("c", 0.0, 1.0)]
    # Alone in a step of cost 15: b (0.8 tokens per unit) pays; then the step makes 5 / 20 =
    # 0.25 per unit, more than a's 0.1.
    assert [c.key for c in choose(cands, 1, 15.0)] == ["b"]
    # A step so costly that even a's 0.1 beats it (5 / 105 per unit): both, summed.
    assert [c.key for c in choose(cands, 1, 100.0)] == ["b", "a"]
    assert [c.key for c in choose(cands, 16, 30.0)] == ["b"]  # 0.53 per unit < 0.8
    assert choose(cands, 50, 60.0) == []  # 0.83 per unit already: nothing pays
    # A fixed cost (the sps draft's) that the gains cannot pay back: nothing runs.
    assert choose([Candidate("a", 1.0, 1.0)], 1, 15.0, fixed=20.0) == []
    assert choose([], 3, 17.0) == []


def test_look_ahead_tree_granted_alone_not_at_concurrency_16():
    """With the prior estimate a 13-token tree pays at concurrency 1 (the bar is ~1/15 of a
    token per unit) but not when 16 decodes already share the step."""
    sched = _sched(LA, SpecCosts(**COSTS))
    _decoding(sched, 1, tree=13)
    assert sched.schedule().scheduled_spec_tree == {"r0": 13}
    sched = _sched(LA, SpecCosts(**COSTS))
    _decoding(sched, 16, tree=13)
    out = sched.schedule()
    assert out.scheduled_spec_tree == {} and out.total_num_scheduled_tokens == 16


def test_grants_in_a_step_are_summed():
    """At concurrency 4, two requests with a strong record and two with a weak one: the weak
    ones' trees would beat the plain batch judged alone (gain per cost above 4 / 18), but not
    the step that already carries the strong ones' trees."""
    sched = _sched(LA, SpecCosts(**COSTS))
    reqs = _decoding(sched, 4, tree=13)
    for _ in range(6):
        for r in reqs[:2]:
            spec_decode.record(r, 7, 7)
        for r in reqs[2:]:
            spec_decode.record(r, 7, 3)
    prior = sched.spec_policy.rate.rate
    tree_cost = 13 * 0.79 + 8 * 0.21
    weak = spec_decode.estimate(reqs[2], prior) * 7 / tree_cost
    assert 4 / 18 < weak < (4 + 2 * 7 * spec_decode.estimate(reqs[0], prior)) / (18 + 2 * tree_cost)
    assert sched.schedule().scheduled_spec_tree == {"r0": 13, "r1": 13}


def test_window_only_tree_is_not_granted():
    """A tree without guesses (only the Jacobi window) brings no accepted token this step."""
    sched = _sched(LA, SpecCosts(**COSTS))
    _decoding(sched, 1, tree=6)
    assert sched.schedule().scheduled_spec_tree == {}


def test_always_grants_everything():
    spec = SpeculativeConfig(decode_algo="look_ahead", look_ahead_window_size=1,
                             look_ahead_gram_size=8, guess_set_size=1, spec_policy="always")
    sched = _sched(spec, SpecCosts(**COSTS, always=True))
    _decoding(sched, 16, tree=13)
    assert len(sched.schedule().scheduled_spec_tree) == 16


def test_estimate_learns_then_fades_back_to_the_prior():
    req = Request("r", [1, 2], SamplingParams(max_tokens=8))
    prior = spec_decode.PRIOR_RATE
    assert spec_decode.estimate(req, prior) == prior
    for _ in range(3):
        spec_decode.record(req, 7, 0)
    low = spec_decode.estimate(req, prior)
    assert low < 0.15
    for _ in range(300):
        spec_decode.idle(req)
    assert low < spec_decode.estimate(req, prior) == pytest.approx(prior, abs=0.03)
    for _ in range(3):
        spec_decode.record(req, 3, 3)
    assert spec_decode.estimate(req, prior) > 0.8


SPS = SpeculativeConfig(decode_algo="sps", gamma=3)


def test_sps_draft_runs_only_when_it_pays():
    """The draft's fixed cost (gamma forwards at its share of the weights) is paid when anyone
    proposes: a cheap draft with a good record runs at concurrency 1, a 6-layer cut of the
    target (0.37 of its cost) at the prior does not run at concurrency 16."""
    sched = _sched(SPS, SpecCosts(**COSTS, draft_ratio=0.05))
    sched.add_request(Request("a", list(range(1, 9)), SamplingParams(max_tokens=40)))
    out = sched.schedule()
    assert out.spec_propose == {"a"}  # the prompt's last token is sampled this step
    sched = _sched(SPS, SpecCosts(**COSTS, draft_ratio=0.37))
    _decoding(sched, 16, chain=3)
    out = sched.schedule()
    assert out.spec_propose == set()
    assert out.scheduled_spec_tokens == {}  # nor are the chains worth their query tokens
    # A request whose draft has been in step accepts a lot: worth proposing again.
    sched = _sched(SPS, SpecCosts(**COSTS, draft_ratio=0.37))
    (req,) = _decoding(sched, 1, chain=3)
    for _ in range(4):
        spec_decode.record(req, 3, 3)
    req.spec_stats.draft_known = req.num_tokens
    out = sched.schedule()
    assert out.scheduled_spec_tokens == {"r0": [200, 201, 202]} and out.spec_propose == {"r0"}


def test_sps_catch_up_is_priced():
    """A request the draft has never seen must catch up on its whole prompt: with a long
    prompt and few tokens left to spread it over, the draft is not started for it."""
    sched = _sched(SPS, SpecCosts(**COSTS, draft_ratio=0.2))
    sched.add_request(Request("long", list(range(1, 201)), SamplingParams(max_tokens=3)))
    assert sched.schedule().spec_propose == set()
    sched = _sched(SPS, SpecCosts(**COSTS, draft_ratio=0.2))
    sched.add_request(Request("short", list(range(1, 9)), SamplingParams(max_tokens=40)))
    assert sched.schedule().spec_propose == {"short"}
