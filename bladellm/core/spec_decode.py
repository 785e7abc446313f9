"""The scheduler's side of speculative decoding: granting proposals, rolling back rejections,
and the per-request fallback to plain decoding (docs/speculative.md).

Pure Python, like the rest of ``core/``. The runner proposes (a chain of tokens for sps / n-gram
lookup, or a look_ahead tree of query tokens) at the end of a step; the scheduler grants it the
next step within the token budget, trimmed near ``max_tokens``; the runner verifies and returns
the accepted tokens plus one from the target; the scheduler keeps the KV of accepted chain tokens
and rolls ``num_computed_tokens`` back over the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from bladellm.request import Request

# Fallback rules (docs/speculative.md).
# 1. Acceptance: a request's estimate is an exponential moving average of accepted / proposed
#    tokens; below FALLBACK_RATE it decodes plainly for FALLBACK_STEPS steps, then probes again.
# 2. Cost: a step of T query tokens takes about a + b*T (fitted online, ``StepCostModel``).
#    A step of R query tokens in which D requests emit a token gives D / (a + b*R) tokens per
#    second; adding K proposal tokens that yield g*K accepted tokens raises that iff
#    g > D*b / (a + b*R): the more the batch already fills the machine, the more a proposal
#    token must be worth. A request speculates only when its
#    expected accepted tokens per proposal query token clear that bar.
EMA_WEIGHT = 0.3
FALLBACK_RATE = 0.15
FALLBACK_STEPS = 8
PROBE_RATE = 0.3  # estimate a probing request restarts from


class StepCostModel:
    """Least-squares fit of step seconds = a + b * tokens over recent steps (exponentially
    forgotten), from the scheduler's own clock around each executed step."""

    DECAY = 0.98
    # Prior until the fit has spread: 10 extra tokens double a one-token step's cost.
    PRIOR_B_OVER_A = 0.1

    def __init__(self) -> None:
        self.sw = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        d = self.DECAY
        self.sw = self.sw * d + 1.0
        self.sx = self.sx * d + tokens
        self.sy = self.sy * d + seconds
        self.sxx = self.sxx * d + tokens * tokens
        self.sxy = self.sxy * d + tokens * seconds

    def b_over_a(self) -> float:
        var = self.sxx * self.sw - self.sx * self.sx
        if self.sw < 8 or var <= 1e-9 * max(self.sxx * self.sw, 1.0):
            return self.PRIOR_B_OVER_A
        b = (self.sxy * self.sw - self.sx * self.sy) / var
        a = (self.sy - b * self.sx) / self.sw
        if a <= 0:
            return 1.0  # cost grows faster than linearly from zero: speculation rarely pays
        return max(b, 0.0) / a

    def min_gain(self, step_tokens: int, num_emitting: int) -> float:
        """Accepted tokens a proposal query token must bring for speculation to pay, in a step
        of ``step_tokens`` query tokens where ``num_emitting`` requests emit a token."""
        ratio = self.b_over_a()
        return max(num_emitting, 1) * ratio / (1.0 + ratio * max(step_tokens, 1))


@dataclass
class SpecGrant:
    tokens: list[int]  # chain tokens to verify
    tree: int  # look_ahead tree query tokens

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) + self.tree


NO_GRANT = SpecGrant([], 0)


def grant(req: Request, budget: int, max_model_len: int, min_gain: float = 0.0,
          tree_guess_len: int = 0) -> SpecGrant:
    """What of the request's proposal runs this step. Called only when all of its own tokens
    are scheduled (the step reaches its end), with ``budget`` the tokens left after them;
    ``min_gain``: the cost rule's bar (accepted tokens per proposal query token)."""
    stats = req.spec_stats
    if not (req.spec_token_ids or req.spec_tree_size) or budget <= 0:
        return NO_GRANT
    if stats.skip_steps > 0:
        stats.skip_steps -= 1
        if stats.skip_steps == 0:
            stats.accept_rate = PROBE_RATE
        return NO_GRANT
    # Accepted tokens plus the target's own one may not pass max_tokens (nor the context).
    room = req.max_tokens - req.num_output_tokens - 1
    if room <= 0:
        return NO_GRANT
    if req.spec_tree_size:
        size = req.spec_tree_size
        if size > budget or req.num_tokens + size > max_model_len:
            return NO_GRANT
        if stats.accept_rate * min(tree_guess_len, room) < min_gain * size:
            return NO_GRANT
        return SpecGrant([], size)
    k = min(len(req.spec_token_ids), budget, room)
    if stats.accept_rate < min_gain:
        return NO_GRANT
    return SpecGrant(req.spec_token_ids[:k], 0)


def grammar_cut(req: Request, spec: SpecGrant) -> SpecGrant:
    """A constrained request's proposal, cut where its grammar rejects a token.

    The verification masks every position with the grammar after the proposals before it
    (``guided.manager``), so the target's choice is always valid and a proposal past a rejected
    token could never be reached. A greedy request drops the rejected token itself (the masked
    argmax never equals it). A sampled request keeps it: a draft model drew it from q, and the
    modified rejection sampling is exact only if the test runs on the token drawn (p = 0 there,
    so it is rejected for sure and the residual (p - q)+ is drawn); dropping it would sample
    from p instead, which biases the output toward the tokens the draft under-proposes.
    look_ahead trees are never verified under a grammar (the proposer gives constrained
    requests a chain), so a tree is not granted.
    """
    if spec.tree or not spec.tokens:
        return NO_GRANT
    grammar = req.grammar
    num_valid = grammar.accept_tokens(list(spec.tokens))
    grammar.rollback(num_valid)
    keep = num_valid
    if num_valid < len(spec.tokens) and not req.sampling_params.greedy:
        keep += 1
    return SpecGrant(list(spec.tokens[:keep]), 0) if keep else NO_GRANT


def record(req: Request, num_proposed: int, num_accepted: int) -> None:
    """Update the request's counters and acceptance estimate after a verification."""
    if num_proposed <= 0:
        return
    stats = req.spec_stats
    stats.num_drafts += 1
    stats.num_draft_tokens += num_proposed
    stats.num_accepted_tokens += num_accepted
    stats.accept_rate += EMA_WEIGHT * (num_accepted / num_proposed - stats.accept_rate)
    if stats.accept_rate < FALLBACK_RATE:
        stats.skip_steps = FALLBACK_STEPS
