"""``--decode_algo sps``: a smaller draft model proposes ``--gamma`` tokens per step.

The draft has its own KV cache with the target's block layout: the same block ids index both
(one block = target bytes + draft bytes, so the cache budget is shared and every block the
scheduler hands out, shares through the prompt cache or frees holds both models' KV). At the end
of a step, a request that proposes first catches the draft up on every token since the draft
last ran for it (``_valid``: all known tokens are final, so this is exact; a new, resumed or
preempted request catches up from position 0, which also covers prompt-cache hits), then takes
``gamma`` single-token steps whose KV lands in the positions the scheduler reserved
(``Scheduler.num_lookahead_slots``). The draft runs only for the requests the scheduler's cost
rule picked (``SchedulerOutput.spec_propose``), not at all in a step where it picked none; a
request left out catches up lazily, in one batched forward, the next time it is picked. The
draft's KV only ever affects acceptance, never the emitted tokens.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from bladellm.attention import get_attn_backend
from bladellm.attention.backend import AttentionMetadata
from bladellm.attention.kv_cache import allocate_kv_caches, kv_bytes_per_block
from bladellm.config import EngineConfig, ModelConfig
from bladellm.kernels.interface import Kernels
from bladellm.kernels.scope import building_with
from bladellm.model.decoder_stack import attach_compiled_stack
from bladellm.model.forward_context import ForwardContext
from bladellm.sample.generators import step_generator
from bladellm.sample.rejection import target_probs

logger = logging.getLogger(__name__)

_DRAFT_SALT = 0x2545F4914F6CDD1D  # seeded requests: the draft's draws use their own generator


def draft_model_config(config: EngineConfig, max_model_len: int,
                       target_dtype: torch.dtype) -> ModelConfig:
    """The draft's ``ModelConfig``. A draft that is a hub model id comes from the target's
    ``--model_hub`` and ``--download_dir`` (as in vLLM, where the load config is shared); its
    revision is the hub's default branch: ``--revision`` names a revision of ``--model``'s
    repository, not the draft's. ``--draft.dtype auto`` is the target's resolved dtype: the
    draft proposes what the target would, in the same arithmetic."""
    from bladellm.checkpoint.hub import is_model_id

    d = config.draft
    hub = {}
    if d.model != "demo" and is_model_id(d.model):
        hub = {"download_dir": config.model.download_dir, "model_hub": config.model.model_hub}
    dtype = d.dtype if d.dtype != "auto" else str(target_dtype).removeprefix("torch.")
    return ModelConfig(model=d.model, dtype=dtype, attn_cls=d.attn_cls,
                       kernels=config.model.kernels, max_model_len=max_model_len,
                       trust_remote_code=config.model.trust_remote_code, **hub)


def check_draft_vocab(target_hf_config, draft_hf_config, draft_path: str) -> None:
    """The draft must share the target's vocabulary (ValueError naming the flag otherwise)."""
    tv = (getattr(target_hf_config, "text_config", None) or target_hf_config).vocab_size
    dv = draft_hf_config.vocab_size
    if tv != dv:
        raise ValueError(f"--draft.model: the draft {draft_path!r} has a vocabulary of {dv} "
                         f"tokens, the target {tv}; the draft must share the target's tokenizer")


class DraftModelProposer:
    def __init__(self, config: EngineConfig, target_resolved, device: torch.device,
                 block_size: int, kernels: Kernels) -> None:
        """``kernels``: the worker's kernel set, which the draft is built with too."""
        from bladellm.model.loader import load_resolved_model, resolve_model

        self.gamma = config.speculative.gamma
        self.block_size = block_size
        self.device = device
        self.kv_cache_quant = config.cache.kv_cache_quant  # the draft's KV is stored alike
        resolved = resolve_model(draft_model_config(config, target_resolved.max_model_len,
                                                    target_resolved.dtype),
                                 snapshot_config=True)
        check_draft_vocab(target_resolved.hf_config, resolved.hf_config, resolved.path)
        attn_backend = get_attn_backend(config.draft.attn_cls, kernels, "--draft.attn_cls")
        with building_with(kernels):
            self.model = load_resolved_model(resolved, device, attn_backend)
        self.model.eval()
        if not config.model.enforce_eager:
            # its decode steps in one call, as the target's
            attach_compiled_stack(self.model, kernels)
        self.dtype = resolved.dtype
        spec = self.model.get_kv_cache_spec()
        self.num_layers, self.num_kv_heads, self.head_dim = (
            spec.num_layers, spec.num_kv_heads, spec.head_dim)
        self.kv_caches: list[torch.Tensor] = []
        self._probs: dict[str, torch.Tensor] = {}  # req -> [k, V] draft distributions
        self._valid: dict[str, int] = {}  # req -> the draft's KV is right below this position
        logger.info("draft model %s (%s, %d layers), gamma %d", resolved.architecture,
                    self.dtype, self.num_layers, self.gamma)

    @property
    def bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.num_layers, self.block_size, self.num_kv_heads,
                                  self.head_dim, self.dtype, self.kv_cache_quant)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(self.num_layers, num_blocks, self.block_size,
                                            self.num_kv_heads, self.head_dim, self.dtype,
                                            self.device, self.kv_cache_quant)

    # ---- the proposer interface -----------------------------------------------------------------
    def draft_probs(self, req_id: str, k: int) -> torch.Tensor | None:
        q = self._probs.get(req_id)
        return None if q is None or k == 0 else q

    def drop(self, req_id: str) -> None:
        self._probs.pop(req_id, None)
        self._valid.pop(req_id, None)

    def logit_rows(self) -> dict[str, list[int]]:
        return {}

    def propose(self, sched, inputs, ib, emitted: dict[str, list[int]], extra_logits
                ) -> tuple[dict[str, list[int]], dict[str, int]]:
        self._probs = {}
        # Only the requests the cost rule picked: the others' draft KV stays where it is and
        # catches up when they are next picked.
        reqs = [r for r, toks in emitted.items() if toks and r in sched.spec_propose]
        if not reqs:
            return {}, {}
        rows = np.array([ib.row_of[r] for r in reqs], np.int64)
        n_new = np.array([ib.num_tokens[ib.row_of[r]] + len(emitted[r]) for r in reqs],
                         np.int64)
        pos = n_new - 1  # position of the last emitted token
        cap = np.minimum(ib.num_blocks[rows] * self.block_size, ib.max_model_len)
        steps = np.clip(cap - pos, 0, self.gamma)
        keep = steps > 0
        reqs = [r for r, k in zip(reqs, keep) if k]
        rows, n_new, pos, steps = rows[keep], n_new[keep], pos[keep], steps[keep]
        if not reqs:
            return {}, {}
        # First draft step: catch up on every token since the draft last ran (the accepted
        # ones, the target's own, a whole prompt for a new request) — its KV is then right
        # wherever the request's tokens are known — and predict the first proposal.
        chunks = []
        for r, row, n in zip(reqs, rows.tolist(), n_new.tolist()):
            start = min(self._valid.get(r, 0), n - 1)
            known = int(ib.num_tokens[row])
            toks = ib.token_ids[row, start:min(known, n)].tolist() + emitted[r][
                max(start - known, 0):]
            chunks.append((start, toks))
            self._valid[r] = n
        params = [ib.sampling.params[row] for row in rows]
        proposals: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        live = np.arange(len(reqs))
        logits = self._step(ib, rows, chunks)
        for j in range(int(steps.max())):
            if j:
                live = np.flatnonzero(steps > j)
                logits = self._step(ib, rows[live], [(int(pos[i]) + j, [proposals[i][-1]])
                                                     for i in live.tolist()])
            for li, i in enumerate(live.tolist()):
                p = params[i]
                if p.greedy:
                    tok = int(logits[li].argmax())
                else:
                    q = target_probs(logits[li:li + 1], torch.tensor([p.temperature]),
                                     None if p.top_k <= 0 else torch.tensor([p.top_k]),
                                     None if p.top_p >= 1.0 else torch.tensor([p.top_p]),
                                     None if p.min_p <= 0.0 else torch.tensor([p.min_p]))[0]
                    if not bool(torch.isfinite(q).all()):
                        break  # a broken draft distribution: propose no further
                    gen = None
                    if p.seed is not None:
                        gen = step_generator(p.seed ^ _DRAFT_SALT, int(pos[i]) + j)
                    tok = int(torch.multinomial(q.double(), 1, generator=gen))
                    probs[i].append(q)
                proposals[i].append(tok)
        for i, r in enumerate(reqs):
            if probs[i]:
                self._probs[r] = torch.stack(probs[i])
        return {r: p for r, p in zip(reqs, proposals) if p}, {}

    def _step(self, ib, rows: np.ndarray, chunks: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Run the draft on ``chunks[i] = (start position, tokens)`` of batch row ``rows[i]``:
        writes their draft KV, returns the draft's logits after each chunk's last token."""
        n = len(rows)
        bs = self.block_size
        q_lens = np.array([len(t) for _, t in chunks], np.int32)
        qsl = np.zeros(n + 1, np.int32)
        np.cumsum(q_lens, out=qsl[1:])
        starts = np.array([s for s, _ in chunks], np.int64)
        positions = np.repeat(starts - qsl[:n], q_lens) + np.arange(int(qsl[n]))
        seq_lens = (starts + q_lens).astype(np.int32)
        width = int(-(-seq_lens.max() // bs))
        tables = np.ascontiguousarray(ib.block_table[rows, :width])
        tok_rows = np.repeat(np.arange(n), q_lens)
        slots = tables[tok_rows, positions // bs].astype(np.int64) * bs + positions % bs
        md = AttentionMetadata(
            num_reqs=n, num_actual_tokens=int(qsl[n]), max_query_len=int(q_lens.max()),
            max_seq_len=int(seq_lens.max()), query_start_loc=torch.from_numpy(qsl),
            seq_lens=torch.from_numpy(seq_lens), block_tables=torch.from_numpy(tables),
            slot_mapping=torch.from_numpy(slots), query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens)
        ctx = ForwardContext(attn_metadata=md, kv_caches=self.kv_caches)
        tokens = torch.tensor([t for _, toks in chunks for t in toks], dtype=torch.int64)
        hidden = self.model(tokens, torch.from_numpy(positions), ctx)
        return self.model.compute_logits(hidden[torch.from_numpy(qsl[1:] - 1).long()]).float()
