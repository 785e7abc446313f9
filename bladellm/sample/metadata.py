"""What the sampler needs to know about the rows it samples this step.

The runner builds one ``SamplingMetadata`` per step (``worker/sampling_rows.SamplingRows``).
Row ``i`` is the ``i``-th request that samples this step. Every optional field is ``None`` (or empty) when no row
uses it, so that the sampler can skip the whole step: an all-greedy batch without penalties,
biases or ``min_tokens`` builds almost nothing and samples with a single ``argmax``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


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
