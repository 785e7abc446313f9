"""The scheduler's side of speculative decoding: granting proposals, rolling back rejections,
and the cost rule that decides, per step, which proposals run and which requests the sps draft
proposes for (``SpecPolicy``, --spec_policy; docs/speculative.md).

Pure Python, like the rest of ``core/``. The runner proposes (a chain of tokens for sps / n-gram
lookup, or a look_ahead tree of query tokens) at the end of a step; the scheduler grants it the
next step within the token budget, trimmed near ``max_tokens``; the runner verifies and returns
the accepted tokens plus one from the target; the scheduler keeps the KV of accepted chain tokens
and rolls ``num_computed_tokens`` back over the rest.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from bladellm.config import SpeculativeConfig
from bladellm.request import Request

# The cost rule (docs/speculative.md, "Cost rule").
#
# Cost model: a step costs ``overhead + tokens`` in units of one query token with its LM-head
# row (the linear part of a + b*T, scaled by b; ``overhead`` = a/b is --spec_step_overhead). A
# query token without an LM-head row (look_ahead window levels below the last) costs
# ``1 - lm_head_share``; an sps draft forward costs ``draft_ratio`` times the target's per token
# and per fixed overhead (its share of the weights a step reads). Both shares come from the
# models' shapes (``model_costs``).
#
# Acceptance estimate: accepted / proposed tokens with a Beta-style prior (PRIOR_WEIGHT
# pseudo-tokens at the engine-wide rate, which itself starts at PRIOR_RATE): a new request
# starts at the rate the engine has been seeing, its own evidence takes over as it verifies,
# and all evidence fades (EVIDENCE_DECAY per verification, IDLE_DECAY per step without one), so
# a request that stopped speculating drifts back to the prior and is tried again only when
# the prior clears the bar, i.e. at low load.
#
# Grant: with D requests emitting a token in a step that costs C, a set S of proposals with
# expected accepted tokens g_i and cost k_i (plus, for sps, the draft's fixed cost F if S is
# not empty) gives (D + sum g) / (C + sum k + F) tokens per unit of cost. The best S is a
# prefix of the proposals sorted by g_i / k_i; ``choose`` takes the best prefix, or none when
# plain decoding is faster. Grants are summed: each one raises the cost of the next.
PRIOR_RATE = 0.5
PRIOR_WEIGHT = 4.0
EVIDENCE_DECAY = 0.7
IDLE_DECAY = 0.97


@dataclass(frozen=True)
class SpecCosts:
    """What the scheduler needs to price speculation, in units of one target query token with
    its LM-head row."""

    step_overhead: float  # a step's fixed cost (--spec_step_overhead)
    lm_head_share: float = 0.0  # of a query token's cost, its LM-head row
    draft_ratio: float = 0.0  # sps: a draft forward's cost / the target's (per token and fixed)
    always: bool = False  # --spec_policy always: grant everything within the budget


def approx_params(hf_config) -> tuple[float, float]:
    """Multiply-adds per token of (the decoder layers, the LM head), from a config's shapes."""
    c = getattr(hf_config, "text_config", None) or hf_config
    hidden = c.hidden_size
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    inter = getattr(c, "intermediate_size", None) or 4 * hidden
    experts = getattr(c, "num_experts_per_tok", None) or 1
    moe_inter = getattr(c, "moe_intermediate_size", None) or inter
    mlp = 3 * hidden * (moe_inter * experts if experts > 1 else inter)
    attn = hidden * head_dim * (2 * heads + 2 * kv_heads)
    return float(c.num_hidden_layers * (attn + mlp)), float(hidden * c.vocab_size)


def model_costs(config, target_hf_config, draft_hf_config=None,
                draft_ratio: float | None = None) -> SpecCosts:
    """The cost rule's constants for a target (and sps draft) model. ``draft_ratio``: a draft
    forward's measured time over the target's (the worker times both at start-up); without it,
    the ratio of their multiply-adds."""
    spec = config.speculative
    body, head = approx_params(target_hf_config)
    if draft_ratio is None:
        draft_ratio = 0.0
        if draft_hf_config is not None:
            d_body, d_head = approx_params(draft_hf_config)
            draft_ratio = (d_body + d_head) / (body + head)
    return SpecCosts(step_overhead=spec.spec_step_overhead, lm_head_share=head / (body + head),
                     draft_ratio=draft_ratio, always=spec.spec_policy == "always")


def estimate(req: Request, prior: float) -> float:
    """Expected accepted / proposed tokens of the request's next proposal."""
    s = req.spec_stats
    return (s.ev_accepted + PRIOR_WEIGHT * prior) / (s.ev_proposed + PRIOR_WEIGHT)


@dataclass
class Candidate:
    key: object
    gain: float  # expected accepted tokens
    cost: float  # extra step cost (target tokens, LM-head rows, per-request draft work)


def choose(cands: list[Candidate], emitting: int, base_cost: float,
           fixed: float = 0.0) -> list[Candidate]:
    """The best prefix of ``cands`` sorted by gain per cost: the set of proposals that
    maximizes the step's expected tokens per unit of cost (empty: plain decoding wins)."""
    order = sorted((c for c in cands if c.gain > 0), key=lambda c: c.gain / max(c.cost, 1e-9),
                   reverse=True)
    best_n, best = 0, emitting / base_cost
    gain, cost = float(emitting), base_cost + fixed
    for n, c in enumerate(order, 1):
        gain += c.gain
        cost += c.cost
        if gain / cost > best:
            best_n, best = n, gain / cost
    return order[:best_n]


def _fold(ev, num_proposed: int, num_accepted: int) -> None:
    """Fold one verification into fading evidence (``ev_accepted`` / ``ev_proposed``)."""
    ev.ev_accepted = ev.ev_accepted * EVIDENCE_DECAY + num_accepted
    ev.ev_proposed = ev.ev_proposed * EVIDENCE_DECAY + num_proposed


def _fade(ev) -> None:
    """A step without a verification: the evidence fades toward the prior."""
    ev.ev_accepted *= IDLE_DECAY
    ev.ev_proposed *= IDLE_DECAY


class GlobalRate:
    """The engine-wide acceptance rate: the prior of every request's estimate (the same fading
    evidence as a request's, around the fixed PRIOR_RATE)."""

    def __init__(self) -> None:
        self.ev_accepted = self.ev_proposed = 0.0

    @property
    def rate(self) -> float:
        return (self.ev_accepted + PRIOR_WEIGHT * PRIOR_RATE) / (self.ev_proposed + PRIOR_WEIGHT)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        _fold(self, num_proposed, num_accepted)

    def idle(self) -> None:
        _fade(self)


class SpecPolicy:
    """The cost rule applied to a step: which requests' proposals are verified (``choose_grants``)
    and, for sps, which requests the draft proposes for at the end of it (``choose_proposers``).
    Without ``costs`` (speculation off) or with --spec_policy always, everything runs."""

    def __init__(self, speculative: SpeculativeConfig | None,
                 costs: SpecCosts | None = None) -> None:
        # Without the models' shapes (a unit test's scheduler) the LM-head and draft shares are 0.
        if costs is None and speculative is not None and speculative.enabled:
            costs = SpecCosts(speculative.spec_step_overhead,
                              always=speculative.spec_policy == "always")
        self.costs = costs
        self.rate = GlobalRate()
        self.gamma = (speculative.gamma if speculative is not None
                      and speculative.decode_algo == "sps" else 0)
        # look_ahead: tokens one verified guess can add (what a tree step "proposes").
        self.tree_guess_len = (speculative.look_ahead_gram_size - 1
                               if speculative is not None else 0)
        # look_ahead: tree tokens of the Jacobi window, and its rows that get logits.
        self.tree_window = ((speculative.look_ahead_window_size
                             * (speculative.look_ahead_gram_size - 1) - 1)
                            if speculative is not None else 0)
        self.tree_window_rows = speculative.look_ahead_window_size if speculative else 0
        # sps: request-steps whose draft did not run, by reason (cumulative; /metrics):
        # "cost" (the cost rule found plain decoding faster), "length" (too few tokens left).
        self.num_declined = {"cost": 0, "length": 0}

    def draft_break_even(self) -> float | None:
        """sps, --spec_policy cost: the acceptance rate a lone request must be expected to
        reach for the draft to run for it (the best case: larger batches need more); None
        when the policy never declines. Above 1, the draft never runs.

        From ``choose_proposers`` with one request whose draft is caught up: proposing k tokens
        gains p*k for a cost of k (target) + r*k (draft) + r*k*o (its fixed cost), against a
        step of o + 1; it wins when p > 1 / (o + 1) + r."""
        costs = self.costs
        if costs is None or costs.always or not self.gamma:
            return None
        return 1.0 / (costs.step_overhead + 1.0) + costs.draft_ratio

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.rate.record(num_proposed, num_accepted)

    def idle(self) -> None:
        """A step in which no request verified anything: the engine-wide rate fades."""
        if self.costs is not None:
            self.rate.idle()

    def _tree_shape(self, size: int) -> tuple[int, int]:
        """Guess tokens and LM-head rows of a look_ahead tree of ``size`` query tokens."""
        guess = max(size - self.tree_window, 0)
        return guess, guess + self.tree_window_rows

    def choose_grants(self, running: list[Request], budget: int, room: int,
                      skip: Collection[str]) -> set[str] | None:
        """Requests of ``running`` (in scheduling order) whose proposal runs this step, given
        the step's token ``budget`` and request ``room`` (None: all of them)."""
        costs = self.costs
        if costs is None or costs.always:
            return None
        if not any(r.spec_token_ids or r.spec_tree_size for r in running):
            return set()
        s = costs.lm_head_share
        prior = self.rate.rate
        emitting, base = 0, costs.step_overhead
        cands = []
        for req in running:
            if budget <= 0 or room <= 0:
                break
            left = req.num_tokens - req.num_computed_tokens
            n = min(left, budget)
            if n <= 0 or req.request_id in skip:
                continue
            budget -= n
            room -= 1
            base += n * (1 - s)  # the step's own tokens; an LM-head row where one is sampled
            if n < left:
                continue
            emitting += 1
            base += s
            max_accept = req.max_tokens - req.num_output_tokens - 1
            if max_accept <= 0:
                continue
            p = estimate(req, prior)
            if req.spec_tree_size:
                guess, rows = self._tree_shape(req.spec_tree_size)
                gain = p * min(guess, self.tree_guess_len, max_accept)
                cost = req.spec_tree_size * (1 - s) + rows * s
            elif req.spec_token_ids:
                k = min(len(req.spec_token_ids), max_accept)
                gain, cost = p * k, float(k)  # drafted already: only the target's tokens
            else:
                continue
            cands.append(Candidate(req.request_id, gain, cost))
        return {c.key for c in choose(cands, emitting, base)}

    def choose_proposers(self, sampling: list[Request]) -> set[str]:
        """sps: of the requests that sample this step, those the draft runs for at its end,
        priced for the next step (about this step's decodes): per request its proposal's
        target tokens and draft tokens (the catch-up, paid once, spread over the request's
        remaining steps), plus the draft's fixed cost of ``gamma`` forwards if anyone
        proposes."""
        gamma = self.gamma
        costs = self.costs
        if costs is None or costs.always or not sampling:
            return {r.request_id for r in sampling}
        prior = self.rate.rate
        r_d = costs.draft_ratio
        cands = []
        for req in sampling:
            remaining = req.max_tokens - req.num_output_tokens - 1  # after this step's token
            k = min(gamma, remaining - 1)
            if k <= 0:
                self.num_declined["length"] += 1
                continue
            gain = estimate(req, prior) * k
            catch_up = req.num_tokens + 1 - req.spec_stats.draft_known
            per_step = 1 + gain  # tokens the draft sees per step once in step
            spread = max(remaining / per_step, 1.0)
            draft = r_d * (min(catch_up, per_step) + max(catch_up - per_step, 0) / spread
                           + k - 1)
            cands.append(Candidate(req, gain, k + draft))
        chosen = choose(cands, len(sampling), costs.step_overhead + len(sampling),
                        fixed=gamma * r_d * costs.step_overhead)
        for c in chosen:
            c.key.spec_stats.draft_known = c.key.num_tokens + 1
        self.num_declined["cost"] += len(cands) - len(chosen)
        return {c.key.request_id for c in chosen}


@dataclass
class SpecGrant:
    tokens: list[int]  # chain tokens to verify
    tree: int  # look_ahead tree query tokens

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) + self.tree


NO_GRANT = SpecGrant([], 0)


def grant(req: Request, budget: int, max_model_len: int) -> SpecGrant:
    """The request's proposal trimmed to the step: ``budget`` is the tokens left after its own
    ones (all scheduled); accepted tokens plus the target's own one may not pass
    ``max_tokens`` nor the context. Whether it pays was decided before (``choose``)."""
    if not (req.spec_token_ids or req.spec_tree_size) or budget <= 0:
        return NO_GRANT
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
    """Update the request's counters and its evidence after a verification."""
    if num_proposed <= 0:
        return
    stats = req.spec_stats
    stats.num_drafts += 1
    stats.num_draft_tokens += num_proposed
    stats.num_accepted_tokens += num_accepted
    evidence(req, num_proposed, num_accepted)


def evidence(req: Request, num_proposed: int, num_accepted: int) -> None:
    """Fold one proposal's outcome into the request's acceptance estimate."""
    _fold(req.spec_stats, num_proposed, num_accepted)


def idle(req: Request) -> None:
    """A step in which the request verified nothing: its evidence fades toward the prior."""
    _fade(req.spec_stats)
