"""The runner's side of speculative decoding: one verification path for every proposer.

Per step (docs/speculative.md):
1. ``write_proposals``: the chain tokens the scheduler granted go into the batch's token rows
   right after each request's known tokens, so the flat batch carries 1 + k query tokens for it
   (``InputBatch.prepare`` gathers them like any others); a look_ahead proposer lays out its
   tree (``proposer.lay_out``).
2. The model runs once over the flat batch.
3. ``verify``: logits at every verified position (the last known token and each proposal), the
   normal sampler's processing and draw per position (penalties, min_tokens and seeds see the
   proposals before it as emitted; a constrained request's grammar mask at position j is the
   grammar after its first j proposals), then ``sample.rejection``: ``walk`` for proposals without
   probabilities and greedy requests, ``rejection_sample`` for a draft model's random proposals.
4. The proposer proposes for the next step from the emitted tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from bladellm.core.interface import ModelRunnerOutput, SchedulerOutput
from bladellm.core.outputs import Logprobs
from bladellm.sample.generators import step_generator
from bladellm.sample.logprobs import token_logprobs
from bladellm.sample.rejection import rejection_sample, target_probs, walk
from bladellm.sample.sampler import Sampler
from bladellm.worker.input_batch import InputBatch, StepInputs
from bladellm.worker.sampling_rows import attach_grammar_bitmask_rows

# Salt for the generator of a seeded request's acceptance test and residual draw, so it is
# independent of the generator its normal draw at the same position uses.
_REJECTION_SALT = 0x5DEECE66D


@dataclass
class VerifyPlan:
    """Verification rows of one step: which flat tokens give logits and what they verify."""

    flat_index: list[int] = field(default_factory=list)  # flat token index -> logits row
    batch_rows: list[int] = field(default_factory=list)  # InputBatch row of each logits row
    counts: list[int] = field(default_factory=list)  # tokens known at that position
    extra_out: dict[int, list[int]] = field(default_factory=dict)  # logits row -> guess prefix
    # Per sampling request (index into inputs.req_ids): root row, guesses and their rows.
    requests: list[tuple[int, int, list[list[int]], list[list[int]]]] = field(
        default_factory=list)


class SpecDecoder:
    def __init__(self, proposer, input_batch: InputBatch, sampler: Sampler) -> None:
        self.proposer = proposer
        self.input_batch = input_batch
        self.sampler = sampler  # the runner's (its kernel set applies grammar bitmasks)

    # ---- before the forward ---------------------------------------------------------------------
    def write_proposals(self, sched: SchedulerOutput) -> None:
        ib = self.input_batch
        for req_id, tokens in sched.scheduled_spec_tokens.items():
            row = ib.row_of[req_id]
            n = int(ib.num_tokens[row])
            ib.token_ids[row, n:n + len(tokens)] = tokens

    def lay_out(self, sched: SchedulerOutput, inputs: StepInputs) -> None:
        if sched.scheduled_spec_tree:
            self.proposer.lay_out(sched, inputs, self.input_batch)

    # ---- after the forward ----------------------------------------------------------------------
    def plan(self, sched: SchedulerOutput, inputs: StepInputs) -> VerifyPlan:
        ib = self.input_batch
        qsl = inputs.attn_metadata.query_start_loc_cpu
        plan = VerifyPlan()
        for i in inputs.sample_indices.tolist():
            req_id = inputs.req_ids[i]
            row = ib.row_of[req_id]
            n = int(ib.num_tokens[row])
            chain = sched.scheduled_spec_tokens.get(req_id)
            tree = sched.scheduled_spec_tree.get(req_id, 0)
            if tree:
                root_flat = int(qsl[i + 1]) - tree - 1
                guesses, guess_flat = self.proposer.guesses(req_id, root_flat)
            else:
                k = len(chain) if chain else 0
                root_flat = int(qsl[i + 1]) - 1 - k
                guesses = [list(chain)] if k else []
                guess_flat = [list(range(root_flat + 1, root_flat + 1 + k))] if k else []
            root = self._add_row(plan, root_flat, row, n)
            guess_rows = []
            for g, flats in zip(guesses, guess_flat):
                rows = []
                for j, f in enumerate(flats):
                    r = self._add_row(plan, f, row, n + j + 1)
                    if tree:
                        plan.extra_out[r] = g[:j + 1]
                    rows.append(r)
                guess_rows.append(rows)
            plan.requests.append((i, root, guesses, guess_rows))
        return plan

    @staticmethod
    def _add_row(plan: VerifyPlan, flat: int, batch_row: int, count: int) -> int:
        plan.flat_index.append(flat)
        plan.batch_rows.append(batch_row)
        plan.counts.append(count)
        return len(plan.flat_index) - 1

    def verify(self, model, hidden: torch.Tensor, sched: SchedulerOutput, inputs: StepInputs
               ) -> ModelRunnerOutput:
        ib = self.input_batch
        plan = self.plan(sched, inputs)
        sampled: list[list[int]] = [[] for _ in inputs.req_ids]
        logprobs: dict[str, Logprobs] = {}
        emitted_by_req: dict[str, list[int]] = {}
        # The proposer's own rows (look_ahead's window outputs) share the one lm_head call.
        extra_rows = self.proposer.logit_rows()
        extra_flat = [f for rows in extra_rows.values() for f in rows]
        extra_logits: dict[str, torch.Tensor] = {}
        if plan.requests or extra_flat:
            all_logits = model.compute_logits(hidden[torch.tensor(plan.flat_index + extra_flat)])
            logits = all_logits[:len(plan.flat_index)]
            at = len(plan.flat_index)
            for req_id, rows in extra_rows.items():
                extra_logits[req_id] = all_logits[at:at + len(rows)]
                at += len(rows)
        if plan.requests:
            rows = np.asarray(plan.batch_rows, np.int64)
            md = ib.sampling.metadata(rows, ib.token_ids, ib.num_tokens, ib.num_prompt_tokens,
                                      row_num_tokens=np.asarray(plan.counts, np.int64))
            if plan.extra_out and md.output_token_ids:
                for r, prefix in plan.extra_out.items():
                    if md.output_token_ids[r]:
                        b = plan.batch_rows[r]
                        md.output_token_ids[r] = (
                            ib.token_ids[b, ib.num_prompt_tokens[b]:ib.num_tokens[b]].tolist()
                            + list(prefix))
            if sched.grammar_bitmask is not None:
                # A constrained request's mask row j applies at its j-th verified position:
                # the last known token, then after each chain proposal (constrained requests
                # never run look_ahead trees: the proposer gives them chains).
                chains = sched.scheduled_spec_tokens
                attach_grammar_bitmask_rows(md, sched.grammar_bitmask, {
                    inputs.req_ids[i]: [root] + (guess_rows[0] if inputs.req_ids[i] in chains
                                                 and guess_rows else [])
                    for i, root, _, guess_rows in plan.requests})
            out = self.sampler(logits, md)
            row_tokens = out.sampled_token_ids.tolist()
            raw_lp = logits.float().log_softmax(-1) if md.max_num_logprobs is not None else None
            processed = None
            for i, root, guesses, guess_rows in plan.requests:
                req_id = inputs.req_ids[i]
                row = plan.batch_rows[root]
                params = ib.sampling.params[row]
                q = self.proposer.draft_probs(req_id, len(guesses[0]) if guesses else 0)
                if guesses and q is not None and not params.greedy:
                    if processed is None:
                        processed = (logits.float() if md.no_logits_processing else
                                     self.sampler.process_logits(logits.float().clone(), md))
                    emitted, rows_used = self._rejection(processed, md, root, guess_rows[0],
                                                         guesses[0], q, params, plan)
                else:
                    emitted, rows_used = walk(row_tokens, root, guesses, guess_rows)
                sampled[i] = emitted
                emitted_by_req[req_id] = emitted
                if raw_lp is not None and params.logprobs is not None:
                    logprobs[req_id] = token_logprobs(raw_lp[torch.tensor(rows_used)],
                                                      torch.tensor(emitted), params.logprobs)
        spec_tokens, tree_sizes = self.proposer.propose(sched, inputs, ib, emitted_by_req,
                                                        extra_logits)
        return ModelRunnerOutput(req_ids=inputs.req_ids, sampled_token_ids=sampled,
                                 logprobs=logprobs, spec_token_ids=spec_tokens,
                                 spec_tree_sizes=tree_sizes)

    @staticmethod
    def _rejection(processed: torch.Tensor, md, root: int, rows: list[int], draft: list[int],
                   q: torch.Tensor, params, plan: VerifyPlan) -> tuple[list[int], list[int]]:
        all_rows = [root] + rows
        idx = torch.tensor(all_rows)
        n = len(all_rows)
        p = target_probs(processed[idx], torch.full((n,), params.temperature),
                         None if params.top_k <= 0 else torch.full((n,), params.top_k),
                         None if params.top_p >= 1.0 else torch.full((n,), params.top_p),
                         None if params.min_p <= 0.0 else torch.full((n,), params.min_p))
        gen = None
        if params.seed is not None:
            gen = step_generator(params.seed ^ _REJECTION_SALT, plan.counts[root])
        emitted, last = rejection_sample(p, q[:len(draft)], draft, gen)
        return emitted, all_rows[:last + 1]

    def drop(self, req_ids) -> None:
        for req_id in req_ids:
            self.proposer.drop(req_id)

