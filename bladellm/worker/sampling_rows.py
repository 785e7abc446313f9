"""Per-row sampling state of the persistent batch, and the ``SamplingMetadata`` gathered from it.

A request's sampling parameters are written into preallocated per-row arrays once, when it joins
the batch. Each step gathers the rows that sample with a handful of vectorised numpy takes
instead of walking ``SamplingParams`` objects; optional fields stay ``None`` when no sampled row
uses them, so an all-greedy step without penalties builds almost nothing.
"""

from __future__ import annotations

import numpy as np
import torch

from bladellm.sample.generators import step_generator
from bladellm.sample.metadata import GREEDY_TEMPERATURE, SamplingMetadata
from bladellm.sampling_params import SamplingParams


class SamplingRows:
    def __init__(self, max_num_reqs: int, eos_token_ids: list[int] | tuple[int, ...] = ()) -> None:
        n = max_num_reqs
        # The model's EOS ids, banned below min_tokens unless ignore_eos (set once at start-up).
        self.eos_token_ids = list(eos_token_ids)
        self.temperature = np.ones(n, np.float32)
        self.top_p = np.ones(n, np.float32)
        self.top_k = np.zeros(n, np.int64)
        self.min_p = np.zeros(n, np.float32)
        self.repetition_penalty = np.ones(n, np.float32)
        self.presence_penalty = np.zeros(n, np.float32)
        self.frequency_penalty = np.zeros(n, np.float32)
        self.min_tokens = np.zeros(n, np.int32)
        # Rows that need anything beyond temperature/top-k/top-p/min-p: penalties, a logit bias,
        # min_tokens, logprobs or a seed. Most steps have none, and skip the per-row Python below.
        self.needs_python = np.zeros(n, np.bool_)
        self.params: list[SamplingParams | None] = [None] * n
        # Prompt logprobs: top-k per row (-1: none wanted), and how many rows want them.
        self.prompt_logprobs = np.full(n, -1, np.int64)
        self.num_prompt_logprobs_rows = 0
        self.banned: list[list[int]] = [[] for _ in range(n)]  # ids banned below min_tokens

    def set_row(self, row: int, params: SamplingParams) -> None:
        self.params[row] = params
        wanted = -1 if params.prompt_logprobs is None else params.prompt_logprobs
        # The count follows the column even if a row is set twice without clear_row.
        self.num_prompt_logprobs_rows += int(wanted >= 0) - int(self.prompt_logprobs[row] >= 0)
        self.prompt_logprobs[row] = wanted
        self.temperature[row] = params.temperature
        self.top_p[row] = params.top_p
        self.top_k[row] = params.top_k
        self.min_p[row] = params.min_p
        self.repetition_penalty[row] = params.repetition_penalty
        self.presence_penalty[row] = params.presence_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.min_tokens[row] = params.min_tokens
        banned = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            banned |= set(self.eos_token_ids)
        self.banned[row] = sorted(banned) if params.min_tokens > 0 else []
        self.needs_python[row] = bool(
            params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0 or params.logit_bias or params.min_tokens > 0
            or params.logprobs is not None or params.seed is not None)

    def stop_prompt_logprobs(self, row: int) -> None:
        """The row's prompt logprobs are all computed."""
        if self.prompt_logprobs[row] >= 0:
            self.prompt_logprobs[row] = -1
            self.num_prompt_logprobs_rows -= 1

    def clear_row(self, row: int) -> None:
        self.params[row] = None
        self.stop_prompt_logprobs(row)
        self.needs_python[row] = False

    def metadata(self, rows: np.ndarray, token_ids: np.ndarray, num_tokens: np.ndarray,
                 num_prompt_tokens: np.ndarray,
                 row_num_tokens: np.ndarray | None = None) -> SamplingMetadata:
        """Metadata for the requests in batch rows ``rows`` (metadata row i = ``rows[i]``);
        ``token_ids`` / ``num_tokens`` / ``num_prompt_tokens`` are the batch's row arrays.
        ``row_num_tokens``: per metadata row, the tokens to treat as known (speculative
        verification samples a batch row at several positions); default ``num_tokens[rows]``."""
        temp = self.temperature[rows]
        greedy = temp < GREEDY_TEMPERATURE
        all_greedy, all_random = bool(greedy.all()), not bool(greedy.any())
        temperature = top_p = top_k = min_p = None
        if not all_greedy:
            temperature = torch.from_numpy(temp)
            rand = ~greedy  # filters only matter on random rows
            if (self.top_p[rows][rand] < 1.0).any():
                top_p = torch.from_numpy(self.top_p[rows])
            if (self.top_k[rows][rand] > 0).any():
                top_k = torch.from_numpy(self.top_k[rows])
            if (self.min_p[rows][rand] > 0.0).any():
                min_p = torch.from_numpy(self.min_p[rows])
        md = SamplingMetadata(temperature=temperature, all_greedy=all_greedy,
                              all_random=all_random, top_p=top_p, top_k=top_k, min_p=min_p)
        if self.needs_python[rows].any():
            counts = num_tokens[rows] if row_num_tokens is None else row_num_tokens
            self._fill_per_row(md, rows, token_ids, counts, num_prompt_tokens)
        return md

    def _fill_per_row(self, md: SamplingMetadata, rows: np.ndarray, token_ids: np.ndarray,
                      counts: np.ndarray, num_prompt_tokens: np.ndarray) -> None:
        """``counts[i]``: tokens known for metadata row i (its batch row's prompt + output)."""
        rep = self.repetition_penalty[rows] != 1.0
        out = (self.presence_penalty[rows] != 0.0) | (self.frequency_penalty[rows] != 0.0)
        if rep.any():
            md.repetition_penalty = torch.from_numpy(self.repetition_penalty[rows])
            md.prompt_token_ids = [token_ids[r, :num_prompt_tokens[r]].tolist() if use else []
                                   for r, use in zip(rows, rep)]
        if out.any():
            md.presence_penalty = torch.from_numpy(self.presence_penalty[rows])
            md.frequency_penalty = torch.from_numpy(self.frequency_penalty[rows])
        if rep.any() or out.any():
            md.output_token_ids = [
                token_ids[r, num_prompt_tokens[r]:n].tolist() if use else []
                for r, n, use in zip(rows, counts, rep | out)]
        for i in np.flatnonzero(self.needs_python[rows]):
            row = int(rows[i])
            params = self.params[row]
            num_output = int(counts[i] - num_prompt_tokens[row])
            if num_output < params.min_tokens and self.banned[row]:
                md.min_tokens_banned[int(i)] = self.banned[row]
            if params.logit_bias:
                md.logit_bias[int(i)] = {int(t): float(b) for t, b in params.logit_bias.items()}
            if params.logprobs is not None:
                md.max_num_logprobs = max(md.max_num_logprobs or 0, params.logprobs)
            if params.seed is not None and not params.greedy:
                md.generators[int(i)] = step_generator(params.seed, num_output)



def attach_grammar_bitmask(inputs, step_bitmask) -> None:
    """Put this step's grammar bitmask (``bladellm.guided.manager.StepBitmask``, filled while the
    model ran) into the sampling metadata, rows matched by request id."""
    sampling_row = {inputs.req_ids[i]: s for s, i in enumerate(inputs.sample_indices.tolist())}
    attach_grammar_bitmask_rows(inputs.sampling, step_bitmask, sampling_row)


def attach_grammar_bitmask_rows(md, step_bitmask, sampling_row: dict) -> None:
    """``attach_grammar_bitmask`` for sampling metadata ``md`` whose row of each request is
    ``sampling_row[req_id]``: an int, or, for a request verifying speculative tokens, the list
    of its rows by position (the verification step samples it at the last known token and after
    each proposal). A request's id appears in ``step_bitmask.req_ids`` once per position; its
    j-th bitmask row goes to its j-th sampling row."""
    bitmask = step_bitmask.result()
    rows: list[int] = []
    keep: list[int] = []
    seen: dict[str, int] = {}
    for k, req_id in enumerate(step_bitmask.req_ids):
        j = seen.get(req_id, 0)
        seen[req_id] = j + 1
        target = sampling_row.get(req_id, -1)
        if not isinstance(target, int):
            target = target[j] if j < len(target) else -1
        elif j:
            target = -1  # one sampling row: the first bitmask row (the current position)
        if target >= 0:
            keep.append(k)
            rows.append(target)
    if not keep:
        return
    if len(keep) < len(step_bitmask.req_ids):
        bitmask = bitmask[keep]
    md.grammar_rows = torch.tensor(rows, dtype=torch.int64)
    md.grammar_bitmask = bitmask
