"""Per-request seeded generators: a seeded request's draws depend on its seed and position only.

Every sampler of a seeded request (the normal draw, the speculative acceptance test, the sps
draft) takes its generator from here, salting the seed where two draws at one position must be
independent.
"""

from __future__ import annotations

import torch

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: decorrelates (seed, step) pairs


def step_generator(seed: int, num_output_tokens: int) -> torch.Generator:
    """A generator that depends only on the request's seed and how many tokens it has made.

    Sampling then does not depend on what else is in the batch, nor on preemption/recompute.
    """
    gen = torch.Generator()
    gen.manual_seed((seed * _SEED_MIX + num_output_tokens) & ((1 << 63) - 1))
    return gen
