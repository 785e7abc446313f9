"""Stop conditions, checked per sampled token: stop tokens / EOS, then length."""

import pytest

from sched_utils import EOS, FakeRunner, make_request, make_scheduler, run_to_completion


def finish(tokens, *, max_model_len=64, tokens_per_step=1, prompt=4, **req_kwargs):
    """Run one request whose sampler emits ``tokens``; returns (output tokens, last output)."""
    sched = make_scheduler(max_model_len=max_model_len)
    runner = FakeRunner(sched, scripted={"r": list(tokens)})
    req_kwargs["max_model_len"] = req_kwargs.pop("request_max_model_len", None)
    sched.add_request(make_request("r", prompt, **req_kwargs))
    got, last = [], None
    for _ in range(100):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        for o in sched.update_from_output(so, runner.execute(so, tokens_per_step=tokens_per_step)):
            got += o.new_token_ids
            last = o
        sched.check_invariants()
    assert sched.kv_cache_manager.pool.num_used_blocks == 0
    return got, last


def test_eos_stops_with_no_stop_reason():
    got, last = finish([5, 6, EOS, 7])
    assert got == [5, 6, EOS]
    assert last.finish_reason == "stop" and last.stop_reason is None


def test_ignore_eos():
    got, last = finish([5, EOS, 6, EOS], max_tokens=4, ignore_eos=True)
    assert got == [5, EOS, 6, EOS] and last.finish_reason == "length"


def test_stop_token_ids_report_the_token():
    got, last = finish([5, 9, 6], stop_token_ids=[9])
    assert got == [5, 9]
    assert last.finish_reason == "stop" and last.stop_reason == 9


def test_stop_token_wins_over_length_on_the_last_token():
    got, last = finish([5, 9], max_tokens=2, stop_token_ids=[9])
    assert last.finish_reason == "stop" and last.stop_reason == 9


@pytest.mark.parametrize("stop", [{"stop_token_ids": [EOS]}, {}])
def test_min_tokens_suppresses_stops(stop):
    got, last = finish([EOS, EOS, EOS, 5], min_tokens=2, **stop)
    assert got == [EOS, EOS, EOS] and last.finish_reason == "stop"


def test_max_tokens():
    got, last = finish([5] * 10, max_tokens=3)
    assert got == [5, 5, 5] and last.finish_reason == "length"


def test_max_model_len():
    got, last = finish([5] * 10, max_model_len=8, max_tokens=None, prompt=5,
                       request_max_model_len=8)
    assert len(got) == 3 and last.finish_reason == "length"


def test_max_model_len_when_the_request_does_not_cap_max_tokens():
    # The request was built without max_model_len: the scheduler still stops at the limit.
    got, last = finish([5] * 20, max_model_len=8, max_tokens=50, prompt=5)
    assert len(got) == 3 and last.finish_reason == "length"


def test_several_tokens_per_step_are_cut_at_the_stop():
    got, last = finish([5, 6, EOS, 7, 8, 9], tokens_per_step=3)
    assert got == [5, 6, EOS] and last.finish_reason == "stop"
    got, last = finish([5, 6, 7, 8, 9, 10], tokens_per_step=3, max_tokens=4)
    assert got == [5, 6, 7, 8] and last.finish_reason == "length"


def test_many_requests_each_get_their_own_tokens():
    sched = make_scheduler(max_num_batched_tokens=16, num_blocks=16, max_model_len=32)
    scripted = {f"r{i}": [100 + i] * i + [EOS] for i in range(6)}
    runner = FakeRunner(sched, scripted={k: list(v) for k, v in scripted.items()})
    for i in range(6):
        sched.add_request(make_request(f"r{i}", [50 + i] * (3 + 2 * i), max_tokens=20))
    results = run_to_completion(sched, runner)
    assert {k: v[0] for k, v in results.items()} == scripted
