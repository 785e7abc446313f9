"""Shared helpers for the sampler tests: metadata builders and independent float64 references."""

from __future__ import annotations

import numpy as np
import torch

from bladellm.sample.metadata import SamplingMetadata
from bladellm.sampling_params import SamplingParams


def build_md(params: list[SamplingParams], *, prompts=None, outputs=None, eos=0,
             generators=None) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.from_params(
        params,
        prompt_token_ids=prompts if prompts is not None else [[] for _ in range(n)],
        output_token_ids=outputs if outputs is not None else [[] for _ in range(n)],
        eos_token_ids=[frozenset({eos})] * n,
        generators=generators or {},
        device="cpu",
    )


def reference_distribution(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                           top_p_inclusive=True) -> np.ndarray:
    """The distribution a row should be drawn from, computed token by token in float64.

    ``top_p_inclusive=False`` is a deliberately wrong variant (drops the token that crosses p)
    used to show that the tests can tell them apart.
    """
    z = np.asarray(logits, dtype=np.float64) / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    keep = np.ones_like(probs, dtype=bool)
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    if top_k > 0:
        for i in order[top_k:]:
            keep[i] = False
    if top_p < 1.0:
        renorm = np.where(keep, probs, 0.0) / np.where(keep, probs, 0.0).sum()
        mass = 0.0
        for i in order:
            if not keep[i]:
                continue
            if mass >= top_p or (not top_p_inclusive and mass + renorm[i] > top_p):
                keep[i] = False
            mass += renorm[i]
    if min_p > 0.0:
        kept_max = probs[keep].max()
        keep &= probs >= min_p * kept_max
    out = np.where(keep, probs, 0.0)
    return out / out.sum()


def empirical(tokens: torch.Tensor, vocab_size: int) -> np.ndarray:
    counts = np.bincount(tokens.numpy(), minlength=vocab_size).astype(np.float64)
    return counts / counts.sum()


def total_variation(p: np.ndarray, q: np.ndarray) -> float:
    return 0.5 * float(np.abs(p - q).sum())
