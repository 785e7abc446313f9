import pytest

from bladellm.core.interface import ModelRunnerOutput
from bladellm.errors import ErrorKind
from bladellm.request import RequestStatus
from sched_utils import (EOS, FakeRunner, make_request, make_scheduler, run_to_completion,
                         step)


def assert_all_blocks_free(sched):
    pool = sched.kv_cache_manager.pool
    assert pool.num_used_blocks == 0
    assert pool.get_num_free_blocks() == pool.num_usable_blocks
    sched.check_invariants()


def test_pool_must_hold_one_max_model_len_request():
    with pytest.raises(ValueError, match="--num_kv_blocks / --kv_cache_memory"):
        make_scheduler(num_blocks=4, block_size=4, max_model_len=13)
    make_scheduler(num_blocks=5, block_size=4, max_model_len=16)


def test_chunked_prefill_under_small_budget_then_decode():
    sched = make_scheduler(max_num_batched_tokens=4)
    runner = FakeRunner(sched, scripted={"a": [21, 22, 23]})
    sched.add_request(make_request("a", 10, max_tokens=3))
    chunks = []
    for _ in range(3):
        so, outs = step(sched, runner)
        chunks.append(so.num_scheduled_tokens["a"])
        if len(chunks) < 3:
            assert outs == []  # nothing sampled until the prompt is done
    assert chunks == [4, 4, 2]
    stats = sched.get_stats()
    assert stats.num_running == 1 and stats.num_used_blocks == 3  # 11 tokens in 4-token blocks
    assert stats.kv_cache_usage == pytest.approx(3 / 63)
    assert [o.new_token_ids for o in outs] == [[21]]
    assert len(so.scheduled_cached_reqs) == 1 and not so.scheduled_new_reqs
    so, outs = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.scheduled_cached_reqs[0].new_token_ids == [21]
    so, outs = step(sched, runner)
    assert outs[0].new_token_ids == [23] and outs[0].finish_reason == "length"
    assert not sched.has_unfinished_requests()
    assert_all_blocks_free(sched)
    stats = sched.get_stats()
    assert stats.num_prompt_tokens == 10 and stats.num_generation_tokens == 3
    assert stats.num_steps == 5


def test_decodes_and_a_prefill_chunk_share_a_step():
    sched = make_scheduler(max_num_batched_tokens=6)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 3, max_tokens=5))
    sched.add_request(make_request("b", 3, max_tokens=5))
    step(sched, runner)  # both prefills: 3 + 3
    sched.add_request(make_request("c", 20, max_tokens=1))
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1, "c": 4}
    assert [n.req_id for n in so.scheduled_new_reqs] == ["c"]
    assert so.total_num_scheduled_tokens == 6


def test_max_num_seqs_limits_admission():
    sched = make_scheduler(max_num_seqs=2)
    runner = FakeRunner(sched)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 3, max_tokens=2))
    so, _ = step(sched, runner)
    assert set(so.num_scheduled_tokens) == {"r0", "r1"} and sched.num_waiting == 1
    results = run_to_completion(sched, runner)
    assert set(results) == {"r0", "r1", "r2"}


def test_first_output_reports_cache_hit_and_queue_time():
    now = [100.0]
    sched = make_scheduler(clock=lambda: now[0])
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 9, max_tokens=1, arrival_time=99.0))
    _, outs = step(sched, runner)
    assert outs[0].num_cached_tokens == 0 and outs[0].queued_time == pytest.approx(1.0)
    sched.add_request(make_request("b", 9, max_tokens=2, arrival_time=100.0))
    _, outs = step(sched, runner)
    assert outs[0].num_cached_tokens == 8
    _, outs = step(sched, runner)
    assert outs[0].num_cached_tokens == 0 and outs[0].queued_time == 0.0  # only the first
    stats = sched.get_stats()
    assert stats.prefix_cache_queries == 18 and stats.prefix_cache_hits == 8


def test_logprobs_are_converted_and_truncated_at_the_stop():
    sched = make_scheduler()
    runner = FakeRunner(sched, scripted={"a": [5, EOS, 6]})
    sched.add_request(make_request("a", 3))
    so = sched.schedule()
    outs = sched.update_from_output(so, runner.execute(so, tokens_per_step=3, logprobs=True))
    (out,) = outs
    assert out.new_token_ids == [5, EOS] and out.finish_reason == "stop"
    assert out.new_logprobs.token_ids == [[5, 5], [EOS, EOS]]
    assert out.new_logprobs.ranks == [1, 1]


# --- preemption ----------------------------------------------------------------------------------

def test_preempts_the_newest_and_recovers():
    # 4 usable blocks of 4 tokens; two requests of 6 prompt + 8 output need 4 blocks each.
    sched = make_scheduler(num_blocks=5, block_size=4, max_model_len=16)
    runner = FakeRunner(sched, scripted={"a": list(range(30, 38)), "b": list(range(40, 48))})
    sched.add_request(make_request("a", 6))
    sched.add_request(make_request("b", [50 + i for i in range(6)]))
    preempted = []
    results = {}
    for _ in range(100):
        if not sched.has_unfinished_requests():
            break
        so, outs = step(sched, runner)
        preempted.extend(so.preempted_req_ids)
        for o in outs:
            results[o.request_id] = results.get(o.request_id, []) + o.new_token_ids
    assert preempted and set(preempted) == {"b"}
    assert sched.get_stats().num_preemptions == len(preempted)
    assert results == {"a": list(range(30, 38)), "b": list(range(40, 48))}
    assert_all_blocks_free(sched)


def test_preempted_request_goes_to_the_front_and_resumes_in_full():
    sched = make_scheduler(num_blocks=5, block_size=4, max_model_len=16,
                           disable_prompt_cache=True)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 8))
    sched.add_request(make_request("b", 7))
    sched.add_request(make_request("c", 1, max_tokens=1))
    step(sched, runner)  # a: 2 blocks, b: 2 blocks, c cannot fit
    assert sched.num_running == 2
    so, _ = step(sched, runner)  # a needs a 3rd block: b (newest) is preempted
    assert so.preempted_req_ids == {"b"} and so.num_scheduled_tokens == {"a": 1}
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    b = sched.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_output_tokens == 1
    run_to_completion(sched, runner)
    assert_all_blocks_free(sched)


def test_request_being_scheduled_preempts_itself_when_it_is_the_newest():
    sched = make_scheduler(num_blocks=5, block_size=4, max_model_len=16,
                           disable_prompt_cache=True)
    runner = FakeRunner(sched)
    sched.add_request(make_request("old", 7))
    sched.add_request(make_request("new", 8))
    step(sched, runner)  # 2 blocks each; old now has 8 tokens, new has 9
    so, _ = step(sched, runner)  # old fits its 2 blocks; new needs a 3rd and is the newest
    assert so.preempted_req_ids == {"new"} and so.num_scheduled_tokens == {"old": 1}
    assert sched.get_stats().num_preemptions == 1
    results = run_to_completion(sched, runner)
    assert results["new"][1].finish_reason == "length" and len(results["new"][0]) == 8 - 1
    assert_all_blocks_free(sched)


# --- aborts --------------------------------------------------------------------------------------

def test_abort_at_every_stage():
    sched = make_scheduler(num_blocks=5, block_size=4, max_model_len=16,
                           max_num_batched_tokens=8)
    runner = FakeRunner(sched)
    for rid, n in [("decoding", 3), ("prefilling", 12), ("waiting", 4)]:
        sched.add_request(make_request(rid, n))
    step(sched, runner)  # decoding: 3, prefilling: first 5 tokens
    assert sched.requests["prefilling"].num_computed_tokens == 5
    outs = sched.abort_requests(["waiting", "prefilling", "nope"])
    assert [(o.request_id, o.finish_reason) for o in outs] == [
        ("waiting", "abort"), ("prefilling", "abort")]
    sched.check_invariants()
    so, _ = step(sched, runner)
    assert {"waiting", "prefilling"} <= so.finished_req_ids
    outs = sched.abort_requests(["decoding", "decoding"])
    assert len(outs) == 1
    assert sched.abort_requests(["decoding"]) == []  # already gone
    assert not sched.has_unfinished_requests()
    assert_all_blocks_free(sched)


def test_abort_between_schedule_and_update_is_ignored_by_update():
    sched = make_scheduler()
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 5))
    so = sched.schedule()
    result = runner.execute(so)
    sched.abort_requests(["a"])
    assert sched.update_from_output(so, result) == []
    assert_all_blocks_free(sched)


def test_abort_of_a_preempted_request():
    sched = make_scheduler(num_blocks=5, block_size=4, max_model_len=16,
                           disable_prompt_cache=True)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 8))
    sched.add_request(make_request("b", 7))
    step(sched, runner)
    so, _ = step(sched, runner)
    assert so.preempted_req_ids == {"b"}
    (out,) = sched.abort_requests(["b"], status=RequestStatus.FINISHED_STOPPED)
    assert out.finish_reason == "stop"
    run_to_completion(sched, runner)
    assert_all_blocks_free(sched)


def test_errored_request_finishes_with_error_and_frees_blocks():
    sched = make_scheduler()
    runner = FakeRunner(sched)
    sched.add_request(make_request("bad", 5))
    sched.add_request(make_request("good", [50, 51, 52, 53, 54], max_tokens=1))
    so = sched.schedule()
    outs = sched.update_from_output(so, runner.execute(so, errored={"bad": "bad logit_bias"}))
    by_id = {o.request_id: o for o in outs}
    assert by_id["bad"].finish_reason == "error" and by_id["bad"].error == "bad logit_bias"
    assert by_id["bad"].error_kind is ErrorKind.FAILED
    assert by_id["good"].finish_reason == "length"
    assert_all_blocks_free(sched)


def test_missing_sample_for_a_finished_prefill_errors_instead_of_hanging():
    sched = make_scheduler()
    sched.add_request(make_request("a", 5))
    so = sched.schedule()
    (out,) = sched.update_from_output(so, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[]]))
    assert out.finish_reason == "error" and out.error
    assert not sched.has_unfinished_requests()


def test_prompt_longer_than_max_model_len_fails_the_request_not_the_pool():
    sched = make_scheduler(max_model_len=16)
    sched.add_request(make_request("long", 17, max_tokens=1))
    assert sched.has_unfinished_requests()
    so = sched.schedule()
    assert so.is_empty
    (out,) = sched.update_from_output(so, ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
    assert out.finish_reason == "error" and "max_model_len" in out.error
    assert not sched.has_unfinished_requests()
    with pytest.raises(ValueError, match="already"):
        sched.add_request(make_request("x", 3))
        sched.add_request(make_request("x", 3))


# --- queue timeout -------------------------------------------------------------------------------

def test_queue_timeout_fails_requests_that_never_started():
    now = [0.0]
    sched = make_scheduler(max_num_seqs=1, max_queue_time=5.0, clock=lambda: now[0])
    runner = FakeRunner(sched)
    sched.add_request(make_request("first", 3, max_tokens=20, arrival_time=0.0))
    sched.add_request(make_request("stuck", 3, arrival_time=0.0))
    step(sched, runner)
    now[0] = 5.0
    _, outs = step(sched, runner)
    assert [o.request_id for o in outs] == ["first"]  # 5 s is not past the limit
    now[0] = 5.5
    so, outs = step(sched, runner)
    by_id = {o.request_id: o for o in outs}
    assert by_id["stuck"].finish_reason == "error" and by_id["stuck"].error == "queue_timeout"
    assert by_id["stuck"].error_kind is ErrorKind.QUEUE_TIMEOUT
    assert by_id["stuck"].queued_time == pytest.approx(5.5)
    assert "first" not in by_id or by_id["first"].finish_reason is None  # running: untouched
    assert sched.num_waiting == 0 and "first" in sched.requests


def test_preempted_requests_do_not_time_out():
    now = [0.0]
    sched = make_scheduler(num_blocks=5, block_size=4, max_model_len=16,
                           disable_prompt_cache=True, max_queue_time=1.0,
                           clock=lambda: now[0])
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 8))
    sched.add_request(make_request("b", 7))
    step(sched, runner)
    so, _ = step(sched, runner)
    assert so.preempted_req_ids == {"b"}
    now[0] = 100.0
    results = run_to_completion(sched, runner)
    assert results["b"][1].finish_reason == "length"


# --- n > 1 / shared prefixes ------------------------------------------------------------------

def test_siblings_wait_for_the_shared_prompt_and_get_cache_hits():
    sched = make_scheduler(max_num_batched_tokens=8)
    runner = FakeRunner(sched)
    prompt = list(range(100, 114))  # 14 tokens: 3 full blocks + 2
    for i in range(3):
        sched.add_request(make_request(f"s{i}", prompt, max_tokens=2))
    so, _ = step(sched, runner)
    assert set(so.num_scheduled_tokens) == {"s0"}  # siblings held back: their blocks are pending
    so, _ = step(sched, runner)
    assert set(so.num_scheduled_tokens) == {"s0"}  # s0's 2nd chunk covers block 2, pending
    so, outs = step(sched, runner)
    assert {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs} == {"s1": 12,
                                                                                 "s2": 12}
    results = run_to_completion(sched, runner)
    assert all(results[f"s{i}"][1].finish_reason == "length" for i in (1, 2))
    stats = sched.get_stats()
    assert stats.prefix_cache_hits == 24 and stats.num_prompt_tokens == 14 + 2 + 2
    assert_all_blocks_free(sched)


def test_without_prompt_cache_siblings_all_start_at_once():
    sched = make_scheduler(disable_prompt_cache=True)
    runner = FakeRunner(sched)
    for i in range(3):
        sched.add_request(make_request(f"s{i}", 14, max_tokens=2))
    so, _ = step(sched, runner)
    assert len(so.scheduled_new_reqs) == 3
    assert sched.get_stats().prefix_cache_queries == 0


def test_held_back_sibling_does_not_block_others_and_owner_abort_releases_it():
    sched = make_scheduler(max_num_batched_tokens=8)
    runner = FakeRunner(sched)
    sched.add_request(make_request("owner", 14))
    sched.add_request(make_request("sib", 14))
    sched.add_request(make_request("other", [200, 201, 202]))
    so, _ = step(sched, runner)
    assert set(so.num_scheduled_tokens) == {"owner"}  # owner took the whole budget
    sched.abort_requests(["owner"])
    so, _ = step(sched, runner)
    # No deadlock: sib starts from the owner's two computed blocks and computes the rest itself.
    assert so.num_scheduled_tokens == {"sib": 6, "other": 2}
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8
    results = run_to_completion(sched, runner)
    assert set(results) == {"sib", "other"}
    assert_all_blocks_free(sched)


def test_reset_prefix_cache_forgets_finished_prompts():
    sched = make_scheduler()
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 9, max_tokens=1))
    run_to_completion(sched, runner)
    assert sched.reset_prefix_cache() == 2
    sched.add_request(make_request("b", 9, max_tokens=1))
    so, _ = step(sched, runner)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0


def test_spec_tokens_scheduled_trimmed_and_rolled_back():
    """1 + k tokens granted, rejected ones rolled back, never past max_tokens; pool empties."""
    from bladellm.config import CacheConfig, SchedulerConfig, SpeculativeConfig
    from bladellm.core.interface import ModelRunnerOutput
    from bladellm.core.scheduler import Scheduler
    from bladellm.request import Request
    from bladellm.sampling_params import SamplingParams

    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), CacheConfig(block_size=4),
                      num_blocks=64, max_model_len=128,
                      speculative=SpeculativeConfig(decode_algo="sps", gamma=3))
    req = Request("r", list(range(10)), SamplingParams(max_tokens=6, temperature=0.0))
    sched.add_request(req)
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(["r"], [[100]],
                                                    spec_token_ids={"r": [1, 2, 3]}))
    assert req.num_computed_tokens == 10 and req.num_tokens == 11
    out = sched.schedule()
    assert out.num_scheduled_tokens["r"] == 4 and out.scheduled_spec_tokens["r"] == [1, 2, 3]
    # One proposal accepted, then the target's own token: two of the three are rolled back.
    sched.update_from_output(out, ModelRunnerOutput(["r"], [[1, 200]],
                                                    spec_token_ids={"r": [7, 8, 9]}))
    assert req.num_tokens == 13 and req.num_computed_tokens == 12
    sched.check_invariants()
    out = sched.schedule()
    # 3 output tokens so far, max_tokens 6: at most 2 proposals (+1 from the target).
    assert out.scheduled_spec_tokens["r"] == [7, 8]
    sched.update_from_output(out, ModelRunnerOutput(["r"], [[7, 8, 300]]))
    assert req.is_finished and req.num_output_tokens == 6
    assert sched.kv_cache_manager.pool.num_used_blocks == 0
    stats = sched.get_stats()
    assert (stats.num_spec_draft_tokens, stats.num_spec_accepted_tokens) == (5, 3)

