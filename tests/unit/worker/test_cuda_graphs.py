"""CUDA graph sizes, step selection and padding (worker/cuda_graphs.py), without a model.

The padding is what a replayed graph computes on, so its invariants are checked here directly:
padded requests point only at the null block, real rows are copied verbatim, and rows left
over from a larger earlier step are cleared."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bladellm.attention.backend import AttentionMetadata, TreeAttention
from bladellm.config import EngineConfig
from bladellm.worker.cuda_graphs import (GraphKey, StaticStepBuffers, StepGraphs, batch_sizes,
                                         check_graph_flags, default_batch_sizes, graph_key,
                                         graph_query_lens, pad_size)
from bladellm.worker.input_batch import StepInputs

BLOCK = 4


def test_default_sizes_follow_vllm_and_end_at_the_cap():
    assert default_batch_sizes(512)[:6] == [1, 2, 4, 8, 16, 24]
    assert default_batch_sizes(512)[-3:] == [480, 496, 512]
    assert 256 in default_batch_sizes(512) and 264 not in default_batch_sizes(512)
    assert default_batch_sizes(64)[-1] == 64
    assert default_batch_sizes(100)[-2:] == [96, 100]  # the cap is added: 97..100 padded
    assert default_batch_sizes(3) == [1, 2, 3]


def test_batch_sizes_capped_by_flags_and_scheduler():
    cfg = EngineConfig.from_kwargs(max_num_seqs=256)
    assert batch_sizes(cfg)[-1] == 256
    cfg = EngineConfig.from_kwargs(max_num_seqs=256, cuda_graph_max_batch_size=32)
    assert batch_sizes(cfg) == [1, 2, 4, 8, 16, 24, 32]
    cfg = EngineConfig.from_kwargs(max_num_seqs=64, max_num_batched_tokens=40)
    assert batch_sizes(cfg)[-1] == 40
    cfg = EngineConfig.from_kwargs(cuda_graph_batch_sizes=[8, 1, 4])
    assert batch_sizes(cfg) == [1, 4, 8]


def test_query_lens_per_decode_algo(tiny_llama):
    assert graph_query_lens(EngineConfig.from_kwargs()) == (1,)
    sps = EngineConfig.from_kwargs(decode_algo="sps", gamma=3, draft_model=tiny_llama)
    assert graph_query_lens(sps) == (1, 4)


def test_pad_size_picks_the_nearest_captured_size_and_none_above():
    sizes = [1, 2, 4, 8]
    assert [pad_size(sizes, n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, None]


@pytest.mark.parametrize("kwargs, flag", [
    (dict(cuda_graph_batch_sizes=[0, 2]), "--cuda_graph_batch_sizes"),
    (dict(cuda_graph_batch_sizes=[2, 2]), "--cuda_graph_batch_sizes"),
    (dict(cuda_graph_max_batch_size=0), "--cuda_graph_max_batch_size"),
    (dict(cuda_graph_batch_sizes=[4, 64], cuda_graph_max_batch_size=32),
     "--cuda_graph_batch_sizes"),
    (dict(cuda_graph_batch_sizes=[8], max_num_seqs=4), "--cuda_graph_batch_sizes"),
    (dict(disable_cuda_graph=True, cuda_graph_batch_sizes=[1]), "--disable_cuda_graph"),
    (dict(device="cpu", cuda_graph_batch_sizes=[1, 2]), "--cuda_graph_batch_sizes"),
    (dict(device="cpu", cuda_graph_max_batch_size=8), "--cuda_graph_max_batch_size"),
])
def test_bad_graph_flags_name_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        EngineConfig.from_kwargs(**kwargs)


def test_size_flags_refused_when_auto_resolves_to_a_cpu():
    cfg = EngineConfig.from_kwargs(device="auto", cuda_graph_batch_sizes=[1, 2])
    with pytest.raises(ValueError, match="--cuda_graph_batch_sizes: CUDA graphs are captured "
                                         "on GPU devices only"):
        check_graph_flags(cfg, torch.device("cpu"))
    check_graph_flags(EngineConfig.from_kwargs(device="cpu", disable_cuda_graph=True),
                      torch.device("cpu"))  # asks for no graphs, gets none


def _metadata(q_lens: list[int], seq_lens: list[int], tables: list[list[int]],
              tree: TreeAttention | None = None) -> AttentionMetadata:
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    seq = np.array(seq_lens, np.int32)
    slots = []
    for q, s, row in zip(q_lens, seq_lens, tables):
        slots += [row[p // BLOCK] * BLOCK + p % BLOCK for p in range(s - q, s)]
    return AttentionMetadata(
        num_reqs=len(q_lens), num_actual_tokens=int(qsl[-1]), max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), query_start_loc=torch.from_numpy(qsl),
        seq_lens=torch.from_numpy(seq), block_tables=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc_cpu=qsl,
        seq_lens_cpu=seq, tree=tree)


def test_only_uniform_query_lengths_without_a_tree_are_graphable():
    sizes, lens = [1, 2, 4, 8], (1, 3)
    decode = _metadata([1, 1, 1], [5, 9, 2], [[1, 2, 0], [3, 4, 5], [6, 0, 0]])
    assert graph_key(decode, sizes, lens) == GraphKey(4, 1)
    verify = _metadata([3, 3], [7, 9], [[1, 2, 0], [3, 4, 5]])
    assert graph_key(verify, sizes, lens) == GraphKey(2, 3)
    assert graph_key(_metadata([2, 2], [7, 9], [[1, 2, 0], [3, 4, 5]]), sizes, lens) is None
    mixed = _metadata([1, 5], [5, 9], [[1, 2, 0], [3, 4, 5]])
    assert graph_key(mixed, sizes, lens) is None  # a prefill chunk beside a decode
    tree = TreeAttention(entries=[(0, 0, 1, 4, torch.ones(1, 1, dtype=torch.bool))])
    assert graph_key(_metadata([1], [5], [[1, 2]], tree), sizes, lens) is None
    big = _metadata([1] * 9, [3] * 9, [[i + 1] for i in range(9)])
    assert graph_key(big, sizes, lens) is None  # above the largest size: eager


def _step(md: AttentionMetadata, start_id: int = 100) -> StepInputs:
    T = md.num_actual_tokens
    positions = torch.cat([torch.arange(s - (qe - qs), s) for s, qs, qe in zip(
        md.seq_lens_cpu.tolist(), md.query_start_loc_cpu[:-1].tolist(),
        md.query_start_loc_cpu[1:].tolist())]).long()
    return StepInputs(req_ids=[f"r{i}" for i in range(md.num_reqs)],
                      input_ids=torch.arange(start_id, start_id + T), positions=positions,
                      attn_metadata=md, sample_indices=np.arange(md.num_reqs),
                      logits_indices=md.query_start_loc[1:].long() - 1, sampling=None,
                      token_lora_ids=np.full(T, 2, np.int64))


def _buffers(num_groups: int = 1) -> StaticStepBuffers:
    return StaticStepBuffers(max_reqs=8, max_tokens=24, table_width=6,
                             num_extra_groups=num_groups - 1, block_size=BLOCK,
                             max_model_len=24, device=torch.device("cpu"))


def _check_padding(p: StepInputs, n: int, key: GraphKey) -> None:
    md, q = p.attn_metadata, key.query_len
    t = n * q
    assert md.num_reqs == key.num_reqs and md.num_actual_tokens == key.num_tokens
    assert md.max_query_len == q
    assert md.query_start_loc.tolist() == [i * q for i in range(key.num_reqs + 1)]
    assert md.seq_lens[n:].tolist() == [q] * (key.num_reqs - n)
    assert not md.block_tables[n:].any()  # padded rows see only the null block
    pad_slots = md.slot_mapping[t:]
    assert ((pad_slots >= 0) & (pad_slots < BLOCK)).all()  # and write only into it
    assert p.positions[t:].tolist() == [j % q for j in range(key.num_tokens - t)]
    assert not p.input_ids[t:].any()
    assert not p.token_lora_ids[t:].any()  # padded tokens run the base model


def test_fill_copies_real_rows_and_pads_with_the_null_block():
    buf = _buffers()
    md = _metadata([1, 1, 1], [5, 9, 2], [[1, 2, 0], [3, 4, 5], [6, 0, 0]])
    step = _step(md)
    p = buf.fill(step, GraphKey(4, 1))
    assert p.input_ids[:3].tolist() == step.input_ids.tolist()
    assert p.positions[:3].tolist() == step.positions.tolist()
    assert p.attn_metadata.slot_mapping[:3].tolist() == md.slot_mapping.tolist()
    assert p.attn_metadata.seq_lens[:3].tolist() == [5, 9, 2]
    assert p.attn_metadata.block_tables[:3, :3].tolist() == md.block_tables.tolist()
    assert p.req_ids == step.req_ids and p.logits_indices is step.logits_indices
    _check_padding(p, 3, GraphKey(4, 1))
    assert p.attn_metadata.seq_lens_cpu.tolist() == [5, 9, 2, 1]


def test_rows_of_a_larger_earlier_step_are_cleared():
    buf = _buffers()
    big = _metadata([3] * 4, [7, 8, 9, 10], [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]])
    buf.fill(_step(big), GraphKey(4, 3))
    small = _metadata([3], [6], [[13, 14]])
    p = buf.fill(_step(small, start_id=7), GraphKey(4, 3))
    assert p.input_ids.tolist()[:3] == [7, 8, 9]
    _check_padding(p, 1, GraphKey(4, 3))


def test_all_padding_step_for_capture_and_hybrid_groups():
    buf = _buffers(num_groups=2)
    p = buf.fill(None, GraphKey(8, 3))
    _check_padding(p, 0, GraphKey(8, 3))
    (tables, slots), = p.group_tables
    assert not tables.any() and ((slots >= 0) & (slots < BLOCK)).all()
    md = _metadata([1, 1], [5, 9], [[1, 2, 0], [3, 4, 5]])
    step = _step(md)
    step.group_tables = [(md.block_tables + 20, md.slot_mapping + 80)]
    p = buf.fill(step, GraphKey(4, 1))
    (tables, slots), = p.group_tables
    assert tables[:2, :3].tolist() == (md.block_tables + 20).tolist()
    assert slots[:2].tolist() == (md.slot_mapping + 80).tolist()
    assert not tables[2:].any() and (slots[2:] < BLOCK).all()


def test_eager_padded_run_slices_the_real_tokens_and_counts_padding():
    graphs = StepGraphs([2, 4], (1,), lambda r, t: _buffers(), capture=False)
    md = _metadata([1, 1, 1], [5, 9, 2], [[1, 2, 0], [3, 4, 5], [6, 0, 0]])
    step = _step(md)
    key = graphs.key_of(step)
    seen = {}

    def forward(p: StepInputs) -> torch.Tensor:
        seen["tokens"] = p.input_ids.shape[0]
        return p.input_ids.float()[:, None] * 2

    out = graphs.run(key, step, forward, kv_caches=[])
    assert seen["tokens"] == 4  # the model saw the padded batch
    assert out[:, 0].tolist() == [2.0 * i for i in step.input_ids.tolist()]
    assert graphs.num_steps == {GraphKey(4, 1): 1} and graphs.num_padded_reqs == 1


@pytest.mark.gpu
def test_capture_and_replay_match_eager_forward_on_cuda():
    """A graph replayed on fresh inputs computes what the eager forward does on them."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dev = torch.device("cuda")
    bufs = StaticStepBuffers(8, 8, 6, 0, BLOCK, 24, dev)
    graphs = StepGraphs([2, 4, 8], (1,), lambda r, t: bufs, capture=True)
    weight = torch.randn(1000, 16, device=dev)

    def forward(p: StepInputs) -> torch.Tensor:
        md = p.attn_metadata
        return weight[p.input_ids] * md.seq_lens.repeat_interleave(1).float()[:, None] \
            + p.positions.float()[:, None]

    caches: list[torch.Tensor] = []
    graphs.capture(forward, caches, max_num_tokens=8)
    assert set(graphs.graphs) == {GraphKey(2, 1), GraphKey(4, 1), GraphKey(8, 1)}
    md = _metadata([1, 1, 1], [5, 9, 2], [[1, 2, 0], [3, 4, 5], [6, 0, 0]])
    step = _step(md)
    step = StepInputs(**{**step.__dict__, "input_ids": step.input_ids.to(dev),
                         "positions": step.positions.to(dev)})
    step.attn_metadata = AttentionMetadata(**{
        **md.__dict__, **{k: getattr(md, k).to(dev) for k in
                          ("query_start_loc", "seq_lens", "block_tables", "slot_mapping")}})
    key = graphs.key_of(step)
    out = graphs.run(key, step, forward, caches)
    expect = weight[step.input_ids] * step.attn_metadata.seq_lens.float()[:, None] \
        + step.positions.float()[:, None]
    torch.testing.assert_close(out, expect)
    with pytest.raises(RuntimeError, match="another KV cache"):
        graphs.run(key, step, forward, [])


def test_cli_takes_the_size_list():
    from bladellm.entrypoints.cli.args import parse_args

    engine, _ = parse_args(["--device", "cuda", "--cuda_graph_batch_sizes", "1", "2", "4",
                            "--cuda_graph_max_batch_size", "8"])
    assert engine.model.cuda_graph_batch_sizes == [1, 2, 4]
    assert engine.model.cuda_graph_max_batch_size == 8
    engine, _ = parse_args(["--disable_cuda_graph"])
    assert engine.model.disable_cuda_graph
