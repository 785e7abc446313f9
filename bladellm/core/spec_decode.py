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

# Fallback rule. A request's acceptance estimate is an exponential moving average of
# accepted / proposed tokens; below FALLBACK_RATE speculation costs more query tokens than it
# saves steps, so the request decodes plainly for FALLBACK_STEPS steps, then probes again.
EMA_WEIGHT = 0.3
FALLBACK_RATE = 0.15
FALLBACK_STEPS = 8
PROBE_RATE = 0.3  # estimate a probing request restarts from


@dataclass
class SpecGrant:
    tokens: list[int]  # chain tokens to verify
    tree: int  # look_ahead tree query tokens

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) + self.tree


NO_GRANT = SpecGrant([], 0)


def grant(req: Request, budget: int, max_model_len: int) -> SpecGrant:
    """What of the request's proposal runs this step. Called only when all of its own tokens
    are scheduled (the step reaches its end), with ``budget`` the tokens left after them."""
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
        return SpecGrant([], size)
    k = min(len(req.spec_token_ids), budget, room)
    return SpecGrant(req.spec_token_ids[:k], 0)


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
