"""Partition math of uneven tensor parallelism, and the layers' shards under simulated ranks."""

from __future__ import annotations

import pytest
import torch

from bladellm.distributed.parallel_state import tp_shape_for_split
from bladellm.distributed.partition import (attention_partition, attention_partitions,
                                            even_shard, shard_range, split_evenly)
from bladellm.model.layers import embedding as embedding_mod
from bladellm.model.layers import (MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear,
                                   RowParallelLinear, VocabParallelEmbedding)

F32 = torch.float32
# Layers take the kernel set of the model being built: the worker's, here --kernels auto's.
pytestmark = pytest.mark.usefixtures("layer_kernels")


@pytest.mark.parametrize("total,parts,want", [
    (10, 3, [4, 3, 3]), (9, 3, [3, 3, 3]), (11, 3, [4, 4, 3]), (7, 1, [7]), (2, 4, [1, 1, 0, 0]),
    (0, 2, [0, 0]), (100, 8, [13, 13, 13, 13, 12, 12, 12, 12])])
def test_split_evenly(total, parts, want):
    assert split_evenly(total, parts) == want


def test_split_evenly_invariants():
    for total in range(0, 40):
        for parts in range(1, 10):
            sizes = split_evenly(total, parts)
            assert sum(sizes) == total and len(sizes) == parts
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    with pytest.raises(ValueError):
        split_evenly(3, 0)


def test_shard_ranges():
    assert [shard_range([4, 3, 3], i) for i in range(3)] == [(0, 4), (4, 3), (7, 3)]
    assert even_shard(100, 3, 2) == (67, 33)
    with pytest.raises(ValueError, match="tensor_parallel_size 4"):
        even_shard(3, 4, 0, "vocab_size")


def test_attention_h12_k4_t3():
    # T <= K: the 4 KV groups (3 q heads each) split 2/1/1 over the ranks.
    assert attention_partitions(12, 4, 3) == [(0, 6, 0, 2), (6, 3, 2, 1), (9, 3, 3, 1)]
    assert attention_partition(12, 4, 3, 1) == (6, 3, 2, 1)


def test_attention_h12_k4_t8():
    # T > K: 2 ranks per KV head (replicated), its 3 q heads split 2/1.
    assert attention_partitions(12, 4, 8) == [
        (0, 2, 0, 1), (2, 1, 0, 1), (3, 2, 1, 1), (5, 1, 1, 1),
        (6, 2, 2, 1), (8, 1, 2, 1), (9, 2, 3, 1), (11, 1, 3, 1)]


def test_attention_h12_k2_t3():
    # T > K: KV head 0 on 2 ranks (3 + 3 q heads), KV head 1 on 1 rank (6 q heads).
    assert attention_partitions(12, 2, 3) == [(0, 3, 0, 1), (3, 3, 0, 1), (6, 6, 1, 1)]


def test_attention_t1_is_everything():
    assert attention_partition(12, 4, 1, 0) == (0, 12, 0, 4)
    assert attention_partition(4, 1, 1, 0) == (0, 4, 0, 1)


@pytest.mark.parametrize("H,K,T", [(4, 4, 5), (12, 4, 13), (2, 1, 3)])
def test_attention_more_ranks_than_heads_is_an_error(H, K, T):
    with pytest.raises(ValueError, match=f"tensor_parallel_size {T}"):
        attention_partitions(H, K, T)


def test_attention_heads_must_be_a_multiple_of_kv_heads():
    with pytest.raises(ValueError, match="not a multiple"):
        attention_partitions(6, 4, 2)
    with pytest.raises(ValueError, match="rank 3 outside"):
        attention_partition(12, 4, 3, 3)


@pytest.mark.parametrize("H,K", [(12, 4), (12, 2), (12, 12), (8, 1), (6, 3), (32, 8), (28, 4),
                                 (14, 2), (40, 8), (64, 8)])
def test_attention_coverage_and_gqa_mapping(H, K):
    g = H // K
    for T in range(1, H + 1):
        shards = attention_partitions(H, K, T)
        assert len(shards) == T
        owners = [0] * H
        kv_used = [0] * K
        for q0, nq, kv0, nkv in shards:
            assert nq > 0 and nkv > 0 and nq % nkv == 0
            local_group = nq // nkv
            for j in range(nq):
                owners[q0 + j] += 1
                # Local GQA mapping == the model's mapping (q head h uses kv head h // g).
                assert kv0 + j // local_group == (q0 + j) // g
            for j in range(nkv):
                kv_used[kv0 + j] += 1
        assert owners == [1] * H  # every q head owned exactly once
        assert all(n >= 1 for n in kv_used)  # every kv head held (maybe replicated)
        if T <= K:
            assert kv_used == [1] * K
        nq = [s.num_q_heads for s in shards]
        assert sum(nq) == H


# ---- layers on simulated ranks (no process group): shards cover the full tensors ----

def on_ranks(monkeypatch, tp_size, build):
    """build() as every rank of a TP group of tp_size (shapes only: no process group)."""
    layers = []
    for rank in range(tp_size):
        with tp_shape_for_split(rank, tp_size):
            layers.append(build())
    return layers


@pytest.mark.parametrize("T", [1, 2, 3, 4])
def test_mlp_uneven_columns_and_rows(monkeypatch, T):
    hidden, inter = 5, 10
    gate, up, down = torch.randn(inter, hidden), torch.randn(inter, hidden), \
        torch.randn(hidden, inter)
    x = torch.randn(3, hidden)
    ups = on_ranks(monkeypatch, T, lambda: MergedColumnParallelLinear(
        hidden, [inter, inter], bias=False, params_dtype=F32))
    downs = []
    for rank, gu in enumerate(ups):
        with tp_shape_for_split(rank, T):
            downs.append(RowParallelLinear(inter, hidden, bias=True, params_dtype=F32,
                                           input_partition=gu.output_shards[0]))
    cols = []
    for gu, dn in zip(ups, downs):
        gu.weight.weight_loader(gu.weight, gate, 0)
        gu.weight.weight_loader(gu.weight, up, 1)
        dn.weight.weight_loader(dn.weight, down)
        dn.bias.weight_loader(dn.bias, torch.arange(float(hidden)))
        start, size = gu.output_shards[0]
        assert gu.output_shards[1] == (start, size)
        assert size == split_evenly(inter, T)[gu.tp_rank]
        cols.extend(range(start, start + size))
        torch.testing.assert_close(gu.weight, torch.cat([gate[start:start + size],
                                                         up[start:start + size]]))
    assert cols == list(range(inter))  # every intermediate column owned exactly once

    def act(y):
        a, b = y.chunk(2, dim=-1)
        return torch.nn.functional.silu(a) * b
    want = act(x @ torch.cat([gate, up]).T) @ down.T + torch.arange(float(hidden))
    got = sum(dn(act(gu(x))) for gu, dn in zip(ups, downs))  # the all-reduce, by hand
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("H,K,T", [(12, 4, 3), (12, 4, 8), (12, 2, 3), (6, 3, 2), (4, 2, 1)])
def test_qkv_and_o_proj_shards(monkeypatch, H, K, T):
    d, hidden = 2, 7
    q, k, v = torch.randn(H * d, hidden), torch.randn(K * d, hidden), torch.randn(K * d, hidden)
    qb, kb, vb = torch.randn(H * d), torch.randn(K * d), torch.randn(K * d)
    o = torch.randn(hidden, H * d)
    layers = on_ranks(monkeypatch, T, lambda: QKVParallelLinear(
        hidden, d, H, K, bias=True, params_dtype=F32))
    q_rows = []
    for rank, layer in enumerate(layers):
        for sid, w, b in (("q", q, qb), ("k", k, kb), ("v", v, vb)):
            layer.weight.weight_loader(layer.weight, w, sid)
            layer.bias.weight_loader(layer.bias, b, sid)
        q0, nq, kv0, nkv = attention_partition(H, K, T, rank)
        assert (layer.q_head_start, layer.num_heads) == (q0, nq)
        assert (layer.kv_head_start, layer.num_kv_heads) == (kv0, nkv)
        qs, ks = slice(q0 * d, (q0 + nq) * d), slice(kv0 * d, (kv0 + nkv) * d)
        assert torch.equal(layer.weight, torch.cat([q[qs], k[ks], v[ks]]))
        assert torch.equal(layer.bias, torch.cat([qb[qs], kb[ks], vb[ks]]))
        q_rows.extend(range(qs.start, qs.stop))
        with tp_shape_for_split(rank, T):
            o_proj = RowParallelLinear(H * d, hidden, bias=False, params_dtype=F32,
                                       input_partition=layer.output_shards[0])
        o_proj.weight.weight_loader(o_proj.weight, o)
        assert torch.equal(o_proj.weight, o[:, qs])
    assert q_rows == list(range(H * d))


@pytest.mark.parametrize("T", [1, 2, 3])
def test_vocab_uneven_rows(monkeypatch, T):
    V, E = 11, 3
    table, bias = torch.randn(V, E), torch.randn(V)
    embs = on_ranks(monkeypatch, T, lambda: VocabParallelEmbedding(V, E, params_dtype=F32))
    heads = on_ranks(monkeypatch, T, lambda: ParallelLMHead(V, E, params_dtype=F32, bias=True))
    monkeypatch.setattr(embedding_mod, "tp_all_reduce", lambda x: x)
    rows = []
    for emb, head in zip(embs, heads):
        emb.weight.weight_loader(emb.weight, table)
        head.weight.weight_loader(head.weight, table)
        head.bias.weight_loader(head.bias, bias)
        assert emb.weight.shape[0] == split_evenly(V, T)[emb.tp_rank]  # no padding
        rows.extend(range(emb.vocab_start, emb.vocab_end))
    assert rows == list(range(V))
    ids = torch.tensor([0, 3, 4, 6, 10])
    torch.testing.assert_close(sum(e(ids) for e in embs), table[ids])
    h = torch.randn(2, E)
    logits = torch.cat([h @ hd.weight.T + hd.bias for hd in heads], dim=-1)
    torch.testing.assert_close(logits, h @ table.T + bias)
