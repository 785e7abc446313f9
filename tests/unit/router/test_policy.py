"""Routing policies and prompt hashing, without any HTTP."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from bladellm.router.config import RouterConfig
from bladellm.router.policy import LeastOutstandingTokens, PrefixAffinity, RoundRobin
from bladellm.router.pool import Instance, InstancePool
from bladellm.router.prompt import block_hashes, prompt_text, request_info


@dataclass
class Fake:
    url: str
    load_requests: int = 0
    load_tokens: int = 0


def info(text: str, max_tokens: int = 8):
    return request_info({"prompt": text, "max_tokens": max_tokens}, 16, 64)


def test_block_hashes_chain_and_share_exactly_the_common_prefix():
    a = block_hashes("x" * 40 + "A" * 40, 16, 64)
    b = block_hashes("x" * 40 + "B" * 40, 16, 64)
    assert len(a) == len(b) == 5  # full blocks only
    assert a[:2] == b[:2] and a[2] != b[2]  # block 2 holds chars 32..47: the first difference
    assert len(block_hashes("y" * 1000, 16, 3)) == 3


def test_prompt_text_of_chat_and_batches():
    chat = {"messages": [{"role": "system", "content": "S"},
                         {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert prompt_text(chat) == "system\nS\nuser\nhi\n"
    assert prompt_text({"prompt": ["first", "second"]}) == "first"
    assert prompt_text({"prompt": [1, 2, 3]}) == "1 2 3"
    r = request_info({"prompt": "abcd" * 10, "max_tokens": 5, "n": 2, "stream": True}, 16, 8)
    assert (r.prompt_tokens, r.max_tokens, r.stream) == (10, 10, True)
    assert request_info("not a dict", 16, 8).block_hashes == ()


def test_round_robin_cycles():
    rr, c = RoundRobin(), [Fake("a"), Fake("b"), Fake("c")]
    assert [rr.choose(info("p"), c).url for _ in range(6)] == list("abcabc")


def test_least_tokens_picks_fewest_outstanding_tokens():
    c = [Fake("a", 1, 500), Fake("b", 3, 100), Fake("c", 0, 200)]
    assert LeastOutstandingTokens().choose(info("p"), c).url == "b"


def test_affinity_sticks_to_the_instance_that_saw_the_prefix():
    pol = PrefixAffinity(overload_margin=2, cache_blocks=1000)
    c = [Fake("a"), Fake("b")]
    doc1, doc2 = "D" * 200, "E" * 200
    first = pol.choose(info(doc1 + "q1"), c)
    c[[x.url for x in c].index(first.url)].load_tokens = 50  # busier now
    second = pol.choose(info(doc2 + "q1"), c)
    assert second.url != first.url  # a new prefix goes to the least loaded
    for q in range(5):
        assert pol.choose(info(doc1 + f"question {q}"), c).url == first.url
        assert pol.choose(info(doc2 + f"question {q}"), c).url == second.url


def test_affinity_spills_over_when_the_preferred_instance_is_overloaded():
    pol = PrefixAffinity(overload_margin=2, cache_blocks=1000)
    a, b = Fake("a"), Fake("b", load_tokens=10)
    doc = "D" * 200
    assert pol.choose(info(doc), [a, b]).url == "a"
    a.load_requests = 2  # 2 more than b: within the margin
    assert pol.choose(info(doc + "x"), [a, b]).url == "a"
    a.load_requests = 3  # beyond the margin
    assert pol.choose(info(doc + "y"), [a, b]).url == "b"


def test_affinity_forgets_an_instance_that_came_back_and_evicts_lru():
    pol = PrefixAffinity(overload_margin=100, cache_blocks=4)
    a, b = Fake("a"), Fake("b", load_tokens=1)
    doc = "D" * 64  # 4 blocks of 16
    assert pol.choose(info(doc), [a, b]).url == "a"
    b.load_tokens, a.load_tokens = 0, 1
    assert pol.choose(info(doc), [a, b]).url == "a"
    pol.forget("a")
    assert pol.choose(info(doc), [a, b]).url == "b"
    pol.choose(info("Z" * 64), [Fake("b")])  # 4 new blocks push doc out of b's memory
    assert pol.choose(info(doc), [Fake("a", load_tokens=0), Fake("b", load_tokens=5)]).url == "a"


def test_pool_accounting_and_health_transitions():
    back = []
    pool = InstancePool(["http://a", "http://b"], failures_to_remove=2, on_back=back.append)
    a, b = pool.instances
    t = pool.admit(a, info("x" * 40, max_tokens=10))
    assert (a.in_flight, a.outstanding_tokens) == (1, 20)
    t.generated(4)
    assert a.outstanding_tokens == 16
    t.release()
    t.release()  # idempotent
    assert (a.in_flight, a.outstanding_tokens) == (0, 0)
    a.reported_requests = 3  # requests from elsewhere count with the mean request size
    assert a.load_requests == 3 and a.load_tokens == 3 * 20
    pool._poll_result(b, False, "down")
    assert b.healthy  # one failure is not enough
    pool._poll_result(b, False, "down")
    assert not b.healthy and pool.healthy() == [a]
    pool._poll_result(b, True)
    assert b.healthy and back == ["http://b"]


@pytest.mark.parametrize("kwargs, flag", [
    ({"instances": []}, "--instances"), ({"instances": ["localhost:1"]}, "--instances"),
    ({"instances": ["http://a", "http://a/"]}, "--instances"),
    ({"instances": ["http://a"], "policy": "random"}, "--policy"),
    ({"instances": ["http://a"], "overload_margin": -1}, "--overload_margin"),
    ({"instances": ["http://a"], "health_check_interval": 0}, "--health_check_interval"),
])
def test_config_errors_name_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        RouterConfig(**kwargs)


def test_metrics_of_instances_merge_with_an_instance_label():
    from bladellm.router.metrics import render_instance_metrics

    text = ("# HELP bladellm_prefix_cache_hits Hits.\n# TYPE bladellm_prefix_cache_hits counter\n"
            "bladellm_prefix_cache_hits_total 5.0\n")
    out = render_instance_metrics({"http://a": text, "http://b": text.replace("5.0", "7.0"),
                                   "http://c": ""}).decode()
    assert out.count("# TYPE bladellm_prefix_cache_hits_total counter") == 1
    assert 'bladellm_prefix_cache_hits_total{instance="http://a"} 5.0' in out
    assert 'bladellm_prefix_cache_hits_total{instance="http://b"} 7.0' in out
    assert "http://c" not in out
    assert Instance("u").external_requests == 0


def test_affinity_spreads_new_prefixes_over_idle_instances():
    pol = PrefixAffinity(overload_margin=4, cache_blocks=1000)
    c = [Fake("a"), Fake("b"), Fake("c")]
    firsts = [pol.choose(info(ch * 100), c).url for ch in "DEFG"]
    assert firsts[:3] == ["a", "b", "c"]
    assert [pol.choose(info(ch * 100 + "?"), c).url for ch in "DEFG"] == firsts


def test_bounded_loads_capacity_is_ceil_c_times_average_after_placement():
    pol = PrefixAffinity(overload_margin=100, cache_blocks=1000, balance_factor=1.25)
    # m = 3 in flight (external ones count too), n = 2: ceil(1.25 * 4 / 2) = 3
    assert pol.capacity([Fake("a", 2), Fake("b", 1)]) == 3
    assert pol.capacity([Fake("a", 0), Fake("b", 0)]) == 1  # idle: one each before spilling
    assert pol.capacity([Fake("a", 3), Fake("b", 1)]) == 4  # 1.25 * 5 / 2 = 3.125
    assert PrefixAffinity(100, 1000, balance_factor=1.0).capacity(
        [Fake("a", 1), Fake("b", 1), Fake("c", 1)]) == 2
    assert PrefixAffinity(100, 1000).capacity([Fake("a", 9)]) is None  # bound off
    with pytest.raises(ValueError, match="balance_factor"):
        PrefixAffinity(4, 1000, balance_factor=0.5)


def test_bounded_loads_keep_a_known_prefix_until_its_instance_is_full():
    pol = PrefixAffinity(overload_margin=100, cache_blocks=1000, balance_factor=1.25)
    a, b = Fake("a"), Fake("b", load_tokens=10)
    doc = "D" * 200
    assert pol.choose(info(doc + "q0"), [a, b]).url == "a"
    a.load_requests, a.load_tokens = 1, 60  # (1, 0): a may go to 2 <= ceil(1.25 * 2 / 2) = 2
    assert pol.choose(info(doc + "q1"), [a, b]).url == "a"
    a.load_requests = 2  # (2, 0): 3 > ceil(1.25 * 3 / 2) = 2: full, the idle b takes it
    assert pol.choose(info(doc + "q2"), [a, b]).url == "b"
    b.load_requests = 1  # (2, 1): 3 <= ceil(1.25 * 4 / 2) = 3; both now know doc, a matches
    a.load_tokens, b.load_tokens = 10, 500  # a is the less loaded of the two matches
    assert pol.choose(info(doc + "q3"), [a, b]).url == "a"


def test_without_the_bound_the_same_picture_stays_on_the_preferred_instance():
    pol = PrefixAffinity(overload_margin=100, cache_blocks=1000)
    a, b = Fake("a"), Fake("b", load_tokens=10)
    doc = "D" * 200
    assert pol.choose(info(doc + "q0"), [a, b]).url == "a"
    a.load_requests, a.load_tokens = 2, 120
    assert pol.choose(info(doc + "q2"), [a, b]).url == "a"  # only the margin (100) applies


def test_bounded_loads_spill_to_the_next_longest_match_with_room():
    pol = PrefixAffinity(overload_margin=100, cache_blocks=1000, balance_factor=1.0)
    a, b, c = Fake("a"), Fake("b", load_tokens=1), Fake("c", load_tokens=2)
    base = "B" * 64
    assert pol.choose(info(base + "x" * 64), [a, b, c]).url == "a"  # a knows base + x
    assert pol.choose(info("N" * 64), [Fake("a", 0, 5), b, Fake("c", 0, 5)]).url == "b"
    # c learns base (4 blocks) but not the x part: the longest match after a's
    assert pol.choose(info(base), [Fake("a", 5, 5), Fake("b", 5, 5), c]).url == "c"
    # a is full (m = 2, n = 3, c = 1: capacity 1): c has room and the next-longest match,
    # b has room, the least tokens and no match
    a.load_requests, a.load_tokens = 2, 100
    b.load_tokens, c.load_tokens = 0, 50
    assert pol.choose(info(base + "x" * 64 + "?"), [a, b, c]).url == "c"


def test_bounded_loads_send_new_prefixes_to_the_least_loaded():
    pol = PrefixAffinity(overload_margin=100, cache_blocks=1000, balance_factor=1.25)
    c = [Fake("a", 1, 300), Fake("b", 1, 40), Fake("c", 2, 900)]
    assert pol.choose(info("Q" * 100), c).url == "b"


def test_router_config_balance_factor_reaches_the_policy():
    from bladellm.router.proxy import Router

    assert Router(RouterConfig(instances=["http://a"])).policy.balance_factor is None  # off
    on = Router(RouterConfig(instances=["http://a"], affinity_balance_factor=1.25))
    assert on.policy.balance_factor == 1.25
    with pytest.raises(ValueError, match="--affinity_balance_factor"):
        RouterConfig(instances=["http://a"], affinity_balance_factor=0.9)


# The prefix_affinity knobs are read by that policy only (policy.py PrefixAffinity, the prompt's
# block hashes): with another --policy they are refused, not silently ignored.
@pytest.mark.parametrize("policy", ["round_robin", "least_tokens"])
@pytest.mark.parametrize("name,value", [
    ("affinity_block_chars", 64), ("affinity_max_blocks", 16), ("affinity_cache_blocks", 1024),
    ("overload_margin", 0), ("affinity_balance_factor", 1.25)])
def test_affinity_knobs_only_with_prefix_affinity(policy, name, value):
    with pytest.raises(ValueError,
                       match=f"^--{name}: only used with --policy prefix_affinity"):
        RouterConfig(instances=["http://a"], policy=policy, **{name: value})
    RouterConfig(instances=["http://a"], policy="prefix_affinity", **{name: value})
    RouterConfig(instances=["http://a"], policy=policy)  # defaults are not "given"


def test_affinity_knob_with_other_policy_is_a_usage_error(capsys):
    from bladellm.entrypoints.cli.router import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(["--instances", "http://a", "--policy", "round_robin",
                    "--overload_margin", "8"])
    assert exc.value.code == 2 and "error: --overload_margin" in capsys.readouterr().err
    assert parse_args(["--instances", "http://a", "--overload_margin", "8"]).overload_margin == 8
