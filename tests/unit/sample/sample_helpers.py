"""Shared helpers for the sampler tests: the runner's metadata builder and independent float64 references."""

from __future__ import annotations

import numpy as np
import torch

from bladellm.sample.metadata import SamplingMetadata
from bladellm.sampling_params import SamplingParams
from bladellm.worker.sampling_rows import SamplingRows


def build_md(params: list[SamplingParams], *, prompts=None, outputs=None, eos=0,
             generators=None) -> SamplingMetadata:
    """The runner's metadata (``SamplingRows``) for one row per ``params``; ``generators``
    (row -> generator) replace the ones seeded rows would get."""
    n = len(params)
    prompts = prompts if prompts is not None else [[] for _ in range(n)]
    outputs = outputs if outputs is not None else [[] for _ in range(n)]
    width = max([len(p) + len(o) for p, o in zip(prompts, outputs)] + [1])
    token_ids = np.zeros((n, width), np.int64)
    rows = SamplingRows(n, [eos])
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        token_ids[i, :len(p) + len(o)] = list(p) + list(o)
        rows.set_row(i, params[i])
    num_prompt = np.array([len(p) for p in prompts], np.int64)
    num_tokens = num_prompt + np.array([len(o) for o in outputs], np.int64)
    md = rows.metadata(np.arange(n), token_ids, num_tokens, num_prompt)
    md.generators = dict(generators or {})
    return md


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
