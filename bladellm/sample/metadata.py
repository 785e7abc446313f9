"""What the sampler needs to know about the rows it samples this step.

The runner builds one ``SamplingMetadata`` per step (usually with ``from_params``). Row ``i`` is the
``i``-th request that samples this step. Every optional field is ``None`` (or empty) when no row
uses it, so that the sampler can skip the whole step: an all-greedy batch without penalties,
biases or ``min_tokens`` builds almost nothing and samples with a single ``argmax``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from bladellm.sampling_params import SamplingParams

# A row whose temperature is below this samples greedily (same threshold as SamplingParams.greedy).
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingMetadata:
    """Per-step sampling inputs, one row per request that samples this step.

    Greedy rows are the rows whose ``temperature`` is below ``GREEDY_TEMPERATURE``; their top-k,
    top-p, min-p and generator are ignored. ``top_k`` 0 means off for that row, ``top_p`` 1.0 and
    ``min_p`` 0.0 likewise.
    """

    temperature: torch.Tensor | None  # [R] float32; None if all greedy
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None  # [R] float32, None if no row uses it
    top_k: torch.Tensor | None  # [R] int64 (0 = off), None if no row uses it
    min_p: torch.Tensor | None  # [R] float32, None if no row uses it
    # Row index -> generator, already seeded by the runner (seeded rows only).
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # Penalties; the tensors are None when no row uses them.
    prompt_token_ids: list[list[int]] | None = None  # for the repetition penalty; None if unused
    output_token_ids: list[list[int]] = field(default_factory=list)
    repetition_penalty: torch.Tensor | None = None  # [R] float32 (1.0 = off)
    presence_penalty: torch.Tensor | None = None  # [R] float32 (0.0 = off)
    frequency_penalty: torch.Tensor | None = None  # [R] float32 (0.0 = off)
    # Rows still below min_tokens -> token ids they may not sample (eos + stop_token_ids).
    min_tokens_banned: dict[int, list[int]] = field(default_factory=dict)
    logit_bias: dict[int, dict[int, float]] = field(default_factory=dict)  # row -> {token: bias}
    max_num_logprobs: int | None = None  # max over rows of SamplingParams.logprobs
    # Structured output: rows under a grammar and their token bitmasks ([G] int64 row indices,
    # [G, ceil(V / 32)] int32 numpy; see bladellm.guided.bitmask). Applied before everything
    # else that changes logits.
    grammar_rows: torch.Tensor | None = None
    grammar_bitmask: Any = None

    @property
    def no_penalties(self) -> bool:
        return (self.repetition_penalty is None and self.presence_penalty is None
                and self.frequency_penalty is None)

    @property
    def no_logits_processing(self) -> bool:
        """True when the processed logits equal the model's (before temperature and filters)."""
        return (self.no_penalties and not self.min_tokens_banned and not self.logit_bias
                and self.grammar_rows is None)

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        eos_token_ids: list[frozenset[int]],
        generators: dict[int, torch.Generator],
        device: torch.device | str,
    ) -> "SamplingMetadata":
        """Build the metadata for rows sampled with ``params`` (one entry per row).

        ``eos_token_ids[i]`` is the set of end-of-sequence ids of row ``i``'s model (a
        generation config may list several). Per-row token lists are kept by reference, not copied;
        rows that do not use a penalty get ``[]`` so that the sampler scatters only what it needs.
        """
        num_rows = len(params)
        if not (len(prompt_token_ids) == len(output_token_ids) == len(eos_token_ids) == num_rows):
            raise ValueError("from_params: params, prompt_token_ids, output_token_ids and "
                             "eos_token_ids must have one entry per row")
        greedy = [p.greedy for p in params]
        all_greedy = all(greedy)
        all_random = not any(greedy)

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        temperature = top_p = top_k = min_p = None
        if not all_greedy:
            temperature = floats([p.temperature for p in params])
            # Filters only matter on random rows; a greedy row's values are ignored.
            random_params = [p for p, g in zip(params, greedy) if not g]
            if any(p.top_p < 1.0 for p in random_params):
                top_p = floats([p.top_p for p in params])
            if any(p.top_k > 0 for p in random_params):
                top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device)
            if any(p.min_p > 0.0 for p in random_params):
                min_p = floats([p.min_p for p in params])

        uses_rep = [p.repetition_penalty != 1.0 for p in params]
        uses_out = [p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params]
        repetition_penalty = presence_penalty = frequency_penalty = None
        prompts: list[list[int]] | None = None
        if any(uses_rep):
            repetition_penalty = floats([p.repetition_penalty for p in params])
            prompts = [ids if use else [] for ids, use in zip(prompt_token_ids, uses_rep)]
        if any(uses_out):
            presence_penalty = floats([p.presence_penalty for p in params])
            frequency_penalty = floats([p.frequency_penalty for p in params])
        outputs = [ids if (rep or out) else []
                   for ids, rep, out in zip(output_token_ids, uses_rep, uses_out)]

        min_tokens_banned: dict[int, list[int]] = {}
        logit_bias: dict[int, dict[int, float]] = {}
        max_num_logprobs: int | None = None
        for row, p in enumerate(params):
            if len(output_token_ids[row]) < p.min_tokens:
                banned = set(p.stop_token_ids or ())
                if not p.ignore_eos:
                    banned |= eos_token_ids[row]
                if banned:
                    min_tokens_banned[row] = sorted(banned)
            if p.logit_bias:
                logit_bias[row] = {int(tok): float(b) for tok, b in p.logit_bias.items()}
            if p.logprobs is not None:
                max_num_logprobs = max(max_num_logprobs or 0, p.logprobs)

        return cls(
            temperature=temperature,
            all_greedy=all_greedy,
            all_random=all_random,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            generators=dict(generators),
            prompt_token_ids=prompts,
            output_token_ids=outputs,
            repetition_penalty=repetition_penalty,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            min_tokens_banned=min_tokens_banned,
            logit_bias=logit_bias,
            max_num_logprobs=max_num_logprobs,
        )


def validate_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Reject token ids the model cannot produce; raises ``ValueError`` naming the field.

    Meant for input processing (a 400 for the request). The sampler itself ignores out-of-range
    ``logit_bias`` and banned ids rather than failing the whole batch.
    """
    for tok in params.logit_bias or {}:
        if int(tok) >= vocab_size:
            raise ValueError(f"logit_bias: token id {tok} is out of range "
                             f"(vocabulary size {vocab_size})")
    for tok in params.stop_token_ids or ():
        if tok >= vocab_size:
            raise ValueError(f"stop_token_ids: token id {tok} is out of range "
                             f"(vocabulary size {vocab_size})")
