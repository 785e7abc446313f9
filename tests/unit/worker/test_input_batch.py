"""The persistent batch under random add / step / finish / abort / preempt churn produces exactly
the inputs that building them from scratch (per request, in Python) produces."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from bladellm.core.interface import CachedRequestData, NewRequestData, SchedulerOutput
from bladellm.sampling_params import SamplingParams
from bladellm.worker.input_batch import InputBatch

BLOCK = 4
MAX_LEN = 64
MAX_REQS = 6
MAX_TOKENS = 48


@dataclass
class Truth:
    """What the scheduler knows of one request."""

    tokens: list[int]
    num_prompt: int
    params: SamplingParams
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    sent_tokens: int = 0  # how many tokens / blocks the runner has been told about
    sent_blocks: int = 0
    known: bool = False  # in the runner's batch


def from_scratch(sched: SchedulerOutput, truth: dict[str, Truth]):
    """The flat inputs, one request at a time (what the runner did before the persistent batch)."""
    ids, pos, slots, qsl, seq_lens, tables, sample, logits_idx = [], [], [], [0], [], [], [], []
    for i, (req_id, n) in enumerate(sched.num_scheduled_tokens.items()):
        t = truth[req_id]
        start, end = t.computed, t.computed + n
        for p in range(start, end):
            ids.append(t.tokens[p])
            pos.append(p)
            slots.append(t.blocks[p // BLOCK] * BLOCK + p % BLOCK)
        qsl.append(qsl[-1] + n)
        seq_lens.append(end)
        tables.append(t.blocks)
        if end == len(t.tokens):
            sample.append(i)
            logits_idx.append(qsl[-1] - 1)
    return ids, pos, slots, qsl, seq_lens, tables, sample, logits_idx


def params_strategy():
    return st.builds(
        SamplingParams,
        temperature=st.sampled_from([0.0, 0.7, 1.0]),
        top_p=st.sampled_from([1.0, 0.9]),
        top_k=st.sampled_from([0, 5]),
        repetition_penalty=st.sampled_from([1.0, 1.2]),
        min_tokens=st.sampled_from([0, 2]),
        seed=st.sampled_from([None, 3]),
        max_tokens=st.just(8))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_persistent_batch_matches_from_scratch(data):
    batch = InputBatch(MAX_REQS, MAX_LEN, MAX_TOKENS, BLOCK)
    batch.sampling.eos_token_ids = [2]  # what ModelRunner.set_eos_token_ids does at start-up
    truth: dict[str, Truth] = {}
    next_block, next_id = 1, 0
    finished: set[str] = set()
    preempted: set[str] = set()
    for _ in range(data.draw(st.integers(5, 25))):
        # Admit a new request (or re-admit a preempted one with its output so far).
        if len(truth) < MAX_REQS and data.draw(st.booleans()):
            n_prompt = data.draw(st.integers(1, 20))
            toks = data.draw(st.lists(st.integers(0, 999), min_size=n_prompt, max_size=n_prompt))
            truth[f"r{next_id}"] = Truth(toks, n_prompt, data.draw(params_strategy()))
            next_id += 1
        # Schedule a random subset with random query lengths (cached prefix on first admission).
        new_reqs, cached, num_sched = [], [], {}
        budget = MAX_TOKENS
        for req_id in data.draw(st.permutations(sorted(truth))):
            t = truth[req_id]
            remaining = len(t.tokens) - t.computed
            if remaining <= 0 or budget == 0 or not data.draw(st.booleans()):
                continue
            if not t.known and t.computed == 0 and len(t.tokens) > 1:
                t.computed = data.draw(st.integers(0, (len(t.tokens) - 1) // BLOCK)) * BLOCK
                remaining = len(t.tokens) - t.computed
            n = data.draw(st.integers(1, min(remaining, budget)))
            budget -= n
            while len(t.blocks) * BLOCK < t.computed + n:
                t.blocks.append(next_block)
                next_block += 1
            if t.known:
                cached.append(CachedRequestData(req_id, t.tokens[t.sent_tokens:],
                                                t.blocks[t.sent_blocks:], t.computed))
            else:
                new_reqs.append(NewRequestData(req_id, list(t.tokens), t.num_prompt, t.params,
                                               list(t.blocks), t.computed))
            t.known, t.sent_tokens, t.sent_blocks = True, len(t.tokens), len(t.blocks)
            num_sched[req_id] = n
        sched = SchedulerOutput(new_reqs, cached, num_sched, sum(num_sched.values()),
                                finished_req_ids=finished, preempted_req_ids=preempted)
        batch.apply(sched)
        finished, preempted = set(), set()
        if not num_sched:
            continue
        got = batch.prepare(sched)
        ids, pos, slots, qsl, seq_lens, tables, sample, logits_idx = from_scratch(sched, truth)
        md = got.attn_metadata
        assert got.req_ids == list(num_sched)
        assert got.input_ids.tolist() == ids
        assert got.positions.tolist() == pos
        assert md.slot_mapping.tolist() == slots
        assert md.query_start_loc.tolist() == qsl
        assert md.seq_lens.tolist() == seq_lens
        assert md.num_actual_tokens == len(ids) and md.max_seq_len == max(seq_lens)
        width = md.block_tables.shape[1]
        assert width == -(-max(seq_lens) // BLOCK)
        for row, table in zip(md.block_tables.tolist(), tables):
            assert row[:min(width, len(table))] == table[:width]
        assert got.sample_indices.tolist() == sample
        assert got.logits_indices.tolist() == logits_idx
        if sample:
            sampled_params = [truth[got.req_ids[i]].params for i in sample]
            temps = [p.temperature for p in sampled_params]
            if all(tmp < 1e-5 for tmp in temps):
                assert got.sampling.all_greedy and got.sampling.temperature is None
            else:
                np.testing.assert_allclose(got.sampling.temperature.numpy(), temps)
            for j, p in enumerate(sampled_params):
                t = truth[got.req_ids[sample[j]]]
                banned = j in got.sampling.min_tokens_banned
                assert banned == (len(t.tokens) - t.num_prompt < p.min_tokens)
                assert (j in got.sampling.generators) == (p.seed is not None and not p.greedy)
        # Advance: computed catches up; requests at their end sample one token.
        for i, req_id in enumerate(got.req_ids):
            t = truth[req_id]
            t.computed += num_sched[req_id]
            if i in sample:
                t.tokens.append(data.draw(st.integers(0, 999)))
        # Churn: finish / abort, or preempt (the runner forgets it; it comes back as new).
        for req_id in list(truth):
            t = truth[req_id]
            choice = data.draw(st.sampled_from(["keep"] * 4 + ["finish", "preempt"]))
            if choice == "finish" or len(t.tokens) >= MAX_LEN - 2:
                del truth[req_id]
                finished.add(req_id)
            elif choice == "preempt" and t.known:
                t.known, t.computed, t.blocks, t.sent_tokens, t.sent_blocks = False, 0, [], 0, 0
                preempted.add(req_id)


def test_kv_cache_groups_get_their_own_tables_and_slots():
    """Hybrid KV cache groups: group 1's table (null entries where its window freed blocks)
    gives its own block tables and slot mapping, group 0's are unchanged."""
    batch = InputBatch(MAX_REQS, MAX_LEN, 32, BLOCK, num_kv_groups=2)
    params = SamplingParams(max_tokens=4)
    sched = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", list(range(10)), 10, params, [3, 4, 5], 0,
                                           group_block_ids=([7, 8, 9],))],
        num_scheduled_tokens={"a": 10}, total_num_scheduled_tokens=10)
    batch.apply(sched)
    inputs = batch.prepare(sched)
    md = inputs.attn_metadata
    [(tables, slots)] = inputs.group_tables
    assert md.block_tables.tolist() == [[3, 4, 5]] and tables.tolist() == [[7, 8, 9]]
    pos = np.arange(10)
    assert md.slot_mapping.tolist() == (np.array([3, 4, 5])[pos // 4] * 4 + pos % 4).tolist()
    assert slots.tolist() == (np.array([7, 8, 9])[pos // 4] * 4 + pos % 4).tolist()
    # A decode step that takes a new block in each group, group 1 having freed its first.
    batch.group_block_tables[0][batch.row_of["a"], 0] = 0
    step = SchedulerOutput(
        scheduled_cached_reqs=[CachedRequestData("a", [42, 43], [6], 10, ([11],))],
        num_scheduled_tokens={"a": 2}, total_num_scheduled_tokens=2)
    batch.apply(step)
    inputs = batch.prepare(step)
    [(tables, slots)] = inputs.group_tables
    assert inputs.attn_metadata.block_tables.tolist() == [[3, 4, 5]]
    assert tables.tolist() == [[0, 8, 9]] and slots.tolist() == [9 * 4 + 2, 9 * 4 + 3]
    assert inputs.attn_metadata.slot_mapping.tolist() == [5 * 4 + 2, 5 * 4 + 3]
