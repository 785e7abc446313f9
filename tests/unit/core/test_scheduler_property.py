"""Any interleaving of add / abort / step / clock on a small pool keeps the block accounting
exact, every request ends exactly once, and the pool returns to all-free when they have."""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from bladellm.config import SpeculativeConfig
from sched_utils import EOS, FakeRunner, make_request, make_scheduler

BASE_PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [30, 31, 32, 33, 34, 35]]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4]), extra_blocks=st.integers(0, 4),
                budget=st.integers(1, 10), max_num_seqs=st.integers(1, 4),
                disable_cache=st.booleans(), queue_time=st.sampled_from([None, 3.0]),
                gamma=st.sampled_from([0, 0, 1, 3]))
    def setup(self, block_size, extra_blocks, budget, max_num_seqs, disable_cache, queue_time,
              gamma):
        self.max_model_len = 16
        self.now = 0.0
        self.sched = make_scheduler(
            num_blocks=self.max_model_len // block_size + 1 + extra_blocks,
            block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
            max_model_len=self.max_model_len, disable_prompt_cache=disable_cache,
            max_queue_time=queue_time, clock=lambda: self.now,
            speculative=SpeculativeConfig(decode_algo="sps", gamma=gamma, spec_policy="always")
            if gamma else None)
        self.tokens = [EOS, 3, 4, 5]
        self.token_index = 0
        self.runner = FakeRunner(self.sched, sampler=self._sample)
        if gamma:  # proposals of varying length, accepted in part: rejections roll back
            self.runner.propose = lambda _r: [self._sample(_r) for _ in range(
                self.token_index % (gamma + 1))]
            self.runner.accept = lambda _r, k: self.token_index % (k + 1)
        self.added: list[str] = []
        self.finished: dict[str, str] = {}  # req_id -> finish reason

    def _sample(self, _req_id: str) -> int:
        self.token_index += 1
        return self.tokens[self.token_index % len(self.tokens)]

    def _collect(self, outputs):
        for out in outputs:
            assert out.request_id not in self.finished, f"output after finish: {out}"
            if out.finish_reason is not None:
                self.finished[out.request_id] = out.finish_reason

    @rule(base=st.integers(0, 1), prefix=st.integers(0, 10),
          suffix=st.lists(st.integers(3, 9), max_size=6), max_tokens=st.integers(1, 6),
          min_tokens=st.integers(0, 2),
          ignore_eos=st.booleans(), copies=st.integers(1, 3))
    def add(self, base, prefix, suffix, max_tokens, min_tokens, ignore_eos, copies):
        prompt = (BASE_PROMPTS[base][:prefix] + suffix)[:self.max_model_len] or [7]
        for _ in range(copies):  # copies > 1: like n > 1 siblings
            req_id = f"r{len(self.added)}"
            self.added.append(req_id)
            self.sched.add_request(make_request(
                req_id, prompt, max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens),
                ignore_eos=ignore_eos, arrival_time=self.now,
                max_model_len=self.max_model_len, stop_token_ids=[5]))

    @precondition(lambda self: self.added)
    @rule(index=st.integers(0, 100), also_unknown=st.booleans())
    def abort(self, index, also_unknown):
        ids = [self.added[index % len(self.added)]] + (["unknown"] if also_unknown else [])
        self._collect(self.sched.abort_requests(ids))
        self.sched.check_invariants()

    @rule(shift=st.integers(0, 3), fail=st.booleans(), tokens_per_step=st.integers(1, 2))
    def step(self, shift, fail, tokens_per_step):
        self.token_index += shift
        so = self.sched.schedule()
        errored = {}
        if fail and so.num_scheduled_tokens:
            errored[sorted(so.num_scheduled_tokens)[0]] = "boom"
        result = self.runner.execute(so, tokens_per_step=tokens_per_step, errored=errored)
        self._collect(self.sched.update_from_output(so, result))

    @rule(seconds=st.floats(0.5, 2.0))
    def advance_clock(self, seconds):
        self.now += seconds

    @invariant()
    def accounting_is_exact(self):
        if hasattr(self, "sched"):
            self.sched.check_invariants()
            stats = self.sched.get_stats()
            assert stats.num_running + stats.num_waiting == len(self.sched.requests)

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(2000):  # progress guarantee: everything finishes without aborts
            if not self.sched.has_unfinished_requests():
                break
            self.step(0, False, 1)
            self.sched.check_invariants()
        assert not self.sched.has_unfinished_requests(), "scheduler stopped making progress"
        assert set(self.finished) == set(self.added)
        pool = self.sched.kv_cache_manager.pool
        assert pool.num_used_blocks == 0
        assert pool.get_num_free_blocks() == pool.num_usable_blocks


SchedulerMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestSchedulerMachine = SchedulerMachine.TestCase
