"""``--decode_algo sps``: a smaller draft model proposes ``--gamma`` tokens per step.

The draft has its own KV cache with the target's block layout: the same block ids index both
(one block = target bytes + draft bytes, so the cache budget is shared and every block the
scheduler hands out, shares through the prompt cache or frees holds both models' KV). The draft
stays in step by running, at the end of every step, over exactly the tokens the target ran (its
KV for accepted tokens is then right, for rejected ones it is overwritten later, as the
target's), then from the last emitted token ``gamma`` single-token steps that write KV at the
positions the scheduler reserved (``Scheduler.num_lookahead_slots``). Its KV is therefore valid
for every position the target has computed, including blocks found in the prompt cache and
requests recomputed after preemption.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from bladellm.attention import get_attn_backend
from bladellm.attention.backend import AttentionMetadata
from bladellm.config import EngineConfig, ModelConfig
from bladellm.model.forward_context import ForwardContext
from bladellm.sample.rejection import target_probs
from bladellm.worker.sampling_rows import step_generator

logger = logging.getLogger(__name__)

_DRAFT_SALT = 0x2545F4914F6CDD1D  # seeded requests: the draft's draws use their own generator


def draft_model_config(config: EngineConfig, max_model_len: int) -> ModelConfig:
    d = config.draft
    return ModelConfig(model=d.model, dtype=d.dtype, attn_cls=d.attn_cls,
                       max_model_len=max_model_len,
                       trust_remote_code=config.model.trust_remote_code)


def check_draft_vocab(target_hf_config, draft_hf_config, draft_path: str) -> None:
    """The draft must share the target's vocabulary (ValueError naming the flag otherwise)."""
    tv, dv = target_hf_config.vocab_size, draft_hf_config.vocab_size
    if tv != dv:
        raise ValueError(f"--draft.model: the draft {draft_path!r} has a vocabulary of {dv} "
                         f"tokens, the target {tv}; the draft must share the target's tokenizer")


class DraftModelProposer:
    def __init__(self, config: EngineConfig, target_resolved, device: torch.device,
                 block_size: int) -> None:
        from bladellm.model.checkpoint import resolve_model

        self.gamma = config.speculative.gamma
        self.block_size = block_size
        self.device = device
        resolved = resolve_model(draft_model_config(config, target_resolved.max_model_len))
        check_draft_vocab(target_resolved.hf_config, resolved.hf_config, resolved.path)
        self.model = resolved.load_model(device, get_attn_backend(config.draft.attn_cls, device))
        self.model.eval()
        self.dtype = resolved.dtype
        spec = self.model.get_kv_cache_spec()
        self.num_layers, self.num_kv_heads, self.head_dim = (
            spec.num_layers, spec.num_kv_heads, spec.head_dim)
        self.kv_caches: list[torch.Tensor] = []
        self._probs: dict[str, torch.Tensor] = {}  # req -> [k, V] draft distributions
        logger.info("draft model %s (%s, %d layers), gamma %d", resolved.architecture,
                    self.dtype, self.num_layers, self.gamma)

    @property
    def bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def initialize_kv_cache(self, num_blocks: int) -> None:
        shape = (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [torch.empty(shape, dtype=self.dtype, device=self.device)
                          for _ in range(self.num_layers)]

    # ---- the proposer interface -----------------------------------------------------------------
    def draft_probs(self, req_id: str, k: int) -> torch.Tensor | None:
        q = self._probs.get(req_id)
        return None if q is None or k == 0 else q

    def drop(self, req_id: str) -> None:
        self._probs.pop(req_id, None)

    def logit_rows(self) -> dict[str, list[int]]:
        return {}

    def propose(self, sched, inputs, ib, emitted: dict[str, list[int]], extra_logits
                ) -> tuple[dict[str, list[int]], dict[str, int]]:
        # 1. The step's tokens, as the target ran them: keeps the draft's KV in step.
        ctx = ForwardContext(attn_metadata=inputs.attn_metadata, kv_caches=self.kv_caches)
        self.model(inputs.input_ids, inputs.positions, ctx)
        self._probs = {}
        reqs = [r for r, toks in emitted.items() if toks]
        if not reqs:
            return {}, {}
        rows = np.array([ib.row_of[r] for r in reqs], np.int64)
        last = torch.tensor([emitted[r][-1] for r in reqs])
        # Position of the last emitted token, and how many draft steps fit the reserved blocks.
        pos = np.array([ib.num_tokens[ib.row_of[r]] + len(emitted[r]) - 1 for r in reqs],
                       np.int64)
        cap = np.minimum(ib.num_blocks[rows] * self.block_size, ib.max_model_len)
        steps = np.clip(cap - pos, 0, self.gamma)
        params = [ib.sampling.params[row] for row in rows]
        proposals: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        tokens = last
        for j in range(int(steps.max(initial=0))):
            live = np.flatnonzero(steps > j)
            logits = self._step(ib, rows[live], pos[live] + j, tokens[live])
            nxt = tokens.clone()
            for li, i in enumerate(live.tolist()):
                p = params[i]
                if p.greedy:
                    tok = int(logits[li].argmax())
                else:
                    q = target_probs(logits[li:li + 1], torch.tensor([p.temperature]),
                                     None if p.top_k <= 0 else torch.tensor([p.top_k]),
                                     None if p.top_p >= 1.0 else torch.tensor([p.top_p]),
                                     None if p.min_p <= 0.0 else torch.tensor([p.min_p]))[0]
                    gen = None
                    if p.seed is not None:
                        gen = step_generator(p.seed ^ _DRAFT_SALT, int(pos[i]) + j)
                    tok = int(torch.multinomial(q.double(), 1, generator=gen))
                    probs[i].append(q)
                proposals[i].append(tok)
                nxt[i] = tok
            tokens = nxt
        for i, r in enumerate(reqs):
            if probs[i]:
                self._probs[r] = torch.stack(probs[i])
        return {r: p for r, p in zip(reqs, proposals) if p}, {}

    def _step(self, ib, rows: np.ndarray, positions: np.ndarray, tokens: torch.Tensor
              ) -> torch.Tensor:
        """One token per request at ``positions``: writes its draft KV, returns draft logits."""
        n = len(rows)
        bs = self.block_size
        seq_lens = (positions + 1).astype(np.int32)
        width = int(-(-seq_lens.max() // bs))
        tables = np.ascontiguousarray(ib.block_table[rows, :width])
        slots = tables[np.arange(n), positions // bs].astype(np.int64) * bs + positions % bs
        qsl = np.arange(n + 1, dtype=np.int32)
        md = AttentionMetadata(
            num_reqs=n, num_actual_tokens=n, max_query_len=1, max_seq_len=int(seq_lens.max()),
            query_start_loc=torch.from_numpy(qsl), seq_lens=torch.from_numpy(seq_lens),
            block_tables=torch.from_numpy(tables), slot_mapping=torch.from_numpy(slots),
            query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)
        ctx = ForwardContext(attn_metadata=md, kv_caches=self.kv_caches)
        hidden = self.model(tokens, torch.from_numpy(positions.astype(np.int64)), ctx)
        return self.model.compute_logits(hidden).float()
