"""The runner's persistent batch: one row per running request, kept across steps.

A request gets a row when it first arrives (``scheduled_new_reqs``) and keeps it until it
finishes or is preempted; running requests arrive as diffs (tokens sampled since, new blocks, the
new ``num_computed_tokens``) that are written into the row in place. Token ids, counts, block
tables and sampling parameters live in arrays preallocated from ``--max_num_seqs``,
``--max_model_len`` and ``--max_num_batched_tokens``; each step's flat inputs are gathered from
them with vectorised numpy into preallocated step buffers that the tensors handed to the model
share memory with. Nothing is rebuilt for rows that did not change, and there is no per-request
Python loop beyond mapping request ids to rows.

Hybrid KV cache groups (core/kv_groups.py): each group after the first has its own block table
per row (``group_block_tables``, the same length as ``block_table``, group 0's) and gets its own
slot mapping and block tables each step (``StepInputs.group_tables``).

``--async_scheduling`` (docs/scheduler.md): a step may be scheduled before the previous one's
sampled ids reach the host. A row whose last scheduled token is such a pending token
(``CachedRequestData.pending_token``) has it at position ``num_tokens[row]``, one past what the
host knows; ``prepare`` lists those positions (``StepInputs.pending``) and ``fill_pending``
writes them into the staged input ids from the sampled-id tensor of the step that sampled each
(``record_sampled``), a gather on the device with no host round-trip. The host copy arrives
later as an ordinary ``new_token_ids`` diff.

Every request contributes ``q >= 1`` query tokens to the flat batch (prefill chunk, one decode
token, or 1 + k to verify); it samples when the step reaches the end of its known tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from bladellm.attention.backend import AttentionMetadata
from bladellm.core.interface import NewRequestData, SchedulerOutput
from bladellm.sample.metadata import SamplingMetadata
from bladellm.worker.sampling_rows import SamplingRows


@dataclass
class StepInputs:
    req_ids: list[str]  # flat-batch order (the scheduler's)
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn_metadata: AttentionMetadata
    # Requests that sample this step, as indices into req_ids, and the flat token index whose
    # hidden state gives each one's logits.
    sample_indices: np.ndarray  # [S] int64
    logits_indices: torch.Tensor  # [S] int64
    sampling: SamplingMetadata | None  # None when nothing samples
    token_lora_ids: np.ndarray | None = None  # [T] each token's LoRA adapter (0: base model)
    # KV cache groups 1, 2, ...: (block_tables, slot_mapping) of each, as attn_metadata's.
    group_tables: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    # Batch row of each request that samples (aligned with sample_indices).
    sample_rows: np.ndarray | None = None
    # --async_scheduling: (step number, index into that step's sampled ids, flat token index)
    # of each pending input token, grouped by the step that sampled it (one in a steady state).
    pending: list[tuple[int, torch.Tensor, torch.Tensor]] | None = None


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_batched_tokens: int,
                 block_size: int, num_kv_groups: int = 1) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.max_num_tokens = max_num_batched_tokens
        self.block_size = block_size
        self.max_blocks_per_req = -(-max_model_len // block_size)
        R, B, T = max_num_reqs, self.max_blocks_per_req, max_num_batched_tokens
        # Per-row state.
        self.token_ids = np.zeros((R, max_model_len), np.int64)
        self.num_tokens = np.zeros(R, np.int64)
        self.num_prompt_tokens = np.zeros(R, np.int64)
        self.num_computed_tokens = np.zeros(R, np.int64)
        self.block_table = np.zeros((R, B), np.int32)
        self.num_blocks = np.zeros(R, np.int64)
        self.group_block_tables = [np.zeros((R, B), np.int32) for _ in range(num_kv_groups - 1)]
        self.sampling = SamplingRows(R)
        self.lora_ids = np.zeros(R, np.int64)  # the row's LoRA adapter (0: the base model)
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(R - 1, -1, -1))  # pop() hands out the lowest row
        # Step buffers: the model's input tensors are views of these (torch.from_numpy shares).
        self._input_ids = np.zeros(T, np.int64)
        self._positions = np.zeros(T, np.int64)
        self._slot_mapping = np.zeros(T, np.int64)
        self._query_start_loc = np.zeros(R + 1, np.int32)
        self._seq_lens = np.zeros(R, np.int32)
        self._block_tables = np.zeros(R * B, np.int32)  # flat: a [n, b] prefix is contiguous
        self._group_buffers = [(np.zeros(R * B, np.int32), np.zeros(T, np.int64))
                               for _ in range(num_kv_groups - 1)]
        self._arange = np.arange(max(T, max_model_len) + 1, dtype=np.int64)
        # --async_scheduling: rows whose last token this step is pending (set by ``apply``), and
        # where each row's latest sampled id is: the step that sampled it, its index there.
        self.pending = np.zeros(R, np.bool_)
        self.sampled_step = np.full(R, -1, np.int64)
        self.sampled_index = np.zeros(R, np.int64)
        self._sampled: dict[int, torch.Tensor] = {}  # step number -> its sampled ids
        self._step_no = 0

    # ---- applying the scheduler's diffs ---------------------------------------------------------
    def apply(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids | sched.preempted_req_ids:
            self.remove(req_id)
        for new in sched.scheduled_new_reqs:
            self.add(new)
        self.pending[:] = False
        for diff in sched.scheduled_cached_reqs:
            row = self.row_of[diff.req_id]
            self.pending[row] = diff.pending_token
            if diff.new_token_ids:
                n = int(self.num_tokens[row])
                self.token_ids[row, n:n + len(diff.new_token_ids)] = diff.new_token_ids
                self.num_tokens[row] = n + len(diff.new_token_ids)
            if diff.new_block_ids:
                b = int(self.num_blocks[row])
                self.block_table[row, b:b + len(diff.new_block_ids)] = diff.new_block_ids
                for table, ids in zip(self.group_block_tables, diff.new_group_block_ids):
                    table[row, b:b + len(ids)] = ids
                self.num_blocks[row] = b + len(diff.new_block_ids)
            self.num_computed_tokens[row] = diff.num_computed_tokens

    def add(self, new: NewRequestData) -> None:
        if new.req_id in self.row_of:  # resumed without a preemption notice: start over
            self.remove(new.req_id)
        row = self._free_rows.pop()
        self.row_of[new.req_id] = row
        n, b = len(new.token_ids), len(new.block_ids)
        self.token_ids[row, :n] = new.token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = new.num_prompt_tokens
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.block_table[row, :b] = new.block_ids
        for table, ids in zip(self.group_block_tables, new.group_block_ids):
            table[row, :b] = ids
        self.num_blocks[row] = b
        self.sampling.set_row(row, new.sampling_params)
        self.lora_ids[row] = new.lora_id

    def active_lora_ids(self) -> set[int]:
        """Adapters of every request in the batch (pinned on the device while they run)."""
        rows = np.fromiter(self.row_of.values(), np.int64, len(self.row_of))
        return {int(i) for i in np.unique(self.lora_ids[rows]) if i}

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.sampling.clear_row(row)
            self.pending[row] = False
            self.sampled_step[row] = -1
            self.lora_ids[row] = 0
            self._free_rows.append(row)

    # ---- one step's flat inputs -----------------------------------------------------------------
    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        num_sched = sched.num_scheduled_tokens
        req_ids = list(num_sched)
        n = len(req_ids)
        rows = np.fromiter(map(self.row_of.__getitem__, req_ids), np.int64, n)
        q_lens = np.fromiter(num_sched.values(), np.int32, n)
        qsl = self._query_start_loc[:n + 1]
        np.cumsum(q_lens, out=qsl[1:], dtype=np.int32)
        T = int(qsl[n])
        if T > self.max_num_tokens:
            raise ValueError(f"step has {T} tokens; --max_num_batched_tokens is "
                             f"{self.max_num_tokens}")
        computed = self.num_computed_tokens[rows]
        seq_lens = self._seq_lens[:n]
        np.add(computed, q_lens, out=seq_lens)

        positions = self._positions[:T]
        if T == n:  # one token per request: no repeat needed
            tok_rows = rows
            positions[:] = computed
        else:
            tok_rows = np.repeat(rows, q_lens)
            np.add(np.repeat(computed - qsl[:n], q_lens), self._arange[:T], out=positions)
        input_ids = self._input_ids[:T]
        np.take(self.token_ids.reshape(-1), tok_rows * self.max_model_len + positions,
                out=input_ids)
        block_idx = tok_rows * self.max_blocks_per_req + positions // self.block_size
        slots = self._slot_mapping[:T]
        slots[:] = self.block_table.reshape(-1)[block_idx]
        slots *= self.block_size
        slots += positions % self.block_size

        max_seq_len = int(seq_lens.max())
        width = -(-max_seq_len // self.block_size)
        tables = self._block_tables[:n * width].reshape(n, width)
        np.take(self.block_table[:, :width], rows, axis=0, out=tables)
        group_tables = None
        if self.group_block_tables:
            group_tables = []
            offsets = positions % self.block_size
            for table, (tables_buf, slots_buf) in zip(self.group_block_tables,
                                                      self._group_buffers):
                g_slots = slots_buf[:T]
                g_slots[:] = table.reshape(-1)[block_idx]
                g_slots *= self.block_size
                g_slots += offsets
                g_tables = tables_buf[:n * width].reshape(n, width)
                np.take(table[:, :width], rows, axis=0, out=g_tables)
                group_tables.append((torch.from_numpy(g_tables), torch.from_numpy(g_slots)))

        # A request samples when this step reaches the end of its known tokens (a pending one
        # counts: the device knows it).
        pending_rows = self.pending[rows]
        has_pending = bool(pending_rows.any())
        known = self.num_tokens[rows] + pending_rows if has_pending else self.num_tokens[rows]
        sample_indices = np.flatnonzero(seq_lens >= known)
        sampling = None
        if len(sample_indices):
            sampling = self.sampling.metadata(
                rows[sample_indices], self.token_ids, self.num_tokens, self.num_prompt_tokens,
                row_num_tokens=known[sample_indices] if has_pending else None)
        metadata = AttentionMetadata(
            num_reqs=n, num_actual_tokens=T, max_query_len=int(q_lens.max()),
            max_seq_len=max_seq_len, query_start_loc=torch.from_numpy(qsl),
            seq_lens=torch.from_numpy(seq_lens), block_tables=torch.from_numpy(tables),
            slot_mapping=torch.from_numpy(slots), query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens)
        return StepInputs(
            req_ids=req_ids, input_ids=torch.from_numpy(input_ids),
            positions=torch.from_numpy(positions), attn_metadata=metadata,
            sample_indices=sample_indices,
            logits_indices=torch.from_numpy(qsl[1:][sample_indices].astype(np.int64) - 1),
            sampling=sampling, token_lora_ids=self.lora_ids[tok_rows], group_tables=group_tables,
            sample_rows=rows[sample_indices],
            pending=self._pending_sources(rows, qsl) if has_pending else None)

    # ---- async scheduling: pending tokens from the device ---------------------------------------
    def _pending_sources(self, rows: np.ndarray,
                         qsl: np.ndarray) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Where each pending input token comes from (a pending token is a row's last)."""
        idx = np.flatnonzero(self.pending[rows])
        steps = self.sampled_step[rows[idx]]
        sources = []
        for step in np.unique(steps).tolist():
            if step not in self._sampled:
                raise RuntimeError(f"a pending input token of step {step}, whose sampled ids "
                                   f"are gone (rows {rows[idx[steps == step]].tolist()})")
            sel = idx[steps == step]
            sources.append((step, torch.from_numpy(self.sampled_index[rows[sel]]),
                            torch.from_numpy(qsl[sel + 1].astype(np.int64) - 1)))
        return sources

    def fill_pending(self, inputs: StepInputs) -> None:
        """Write the pending input tokens into ``inputs.input_ids`` (staged: on the device)
        from the sampled ids of the steps that sampled them."""
        for step, src, dst in inputs.pending or ():
            inputs.input_ids[dst] = self._sampled[step][src]

    def record_sampled(self, inputs: StepInputs, sampled_ids: torch.Tensor) -> None:
        """This step's sampled ids ([S], on the device, aligned with ``inputs.sample_rows``),
        kept for later steps' pending tokens. Older steps' ids are let go once no row's latest
        sampled id is in them."""
        self._step_no += 1
        rows = inputs.sample_rows
        self.sampled_step[rows] = self._step_no
        self.sampled_index[rows] = self._arange[:len(rows)]
        self._sampled[self._step_no] = sampled_ids
        if len(self._sampled) > 2:
            live = set(np.unique(self.sampled_step).tolist())
            for step in [s for s in self._sampled if s not in live]:
                del self._sampled[step]
