"""Layers: TP sharding of weight loaders (simulated ranks), fused norm, quant-method hook."""

from __future__ import annotations

import pytest
import torch

from bladellm.model.layers import embedding as embedding_mod
from bladellm.model.layers import linear as linear_mod
from bladellm.model.layers import (ColumnParallelLinear, MergedColumnParallelLinear,
                                   QKVParallelLinear, RMSNorm, RowParallelLinear,
                                   UnquantizedLinearMethod, VocabParallelEmbedding)

F32 = torch.float32
# Layers take the kernel set of the model being built: the worker's, here --kernels auto's.
pytestmark = pytest.mark.usefixtures("layer_kernels")


def on_ranks(monkeypatch, tp_size, build):
    """build() on every simulated rank of a TP group of tp_size."""
    layers = []
    for rank in range(tp_size):
        monkeypatch.setattr(linear_mod, "get_tp_rank_and_size", lambda r=rank: (r, tp_size))
        monkeypatch.setattr(embedding_mod, "get_tp_rank_and_size", lambda r=rank: (r, tp_size))
        layers.append(build())
    return layers


def test_column_and_row_shards_reassemble(monkeypatch):
    w = torch.randn(8, 6)
    cols = on_ranks(monkeypatch, 2, lambda: ColumnParallelLinear(6, 8, bias=True,
                                                                 params_dtype=F32))
    rows = on_ranks(monkeypatch, 2, lambda: RowParallelLinear(8, 6, bias=False,
                                                              params_dtype=F32))
    for layer in cols:
        layer.weight.weight_loader(layer.weight, w)
        layer.bias.weight_loader(layer.bias, torch.arange(8.0))
    assert torch.equal(torch.cat([c.weight for c in cols]), w)
    assert torch.equal(torch.cat([c.bias for c in cols]), torch.arange(8.0))
    for layer in rows:
        layer.weight.weight_loader(layer.weight, w.T)
    assert torch.equal(torch.cat([r.weight for r in rows], dim=1), w.T)
    # Column -> row without gathering equals the unsharded product (after the all-reduce sum).
    x = torch.randn(3, 6)
    y = sum(r(c(x) - c.bias) for c, r in zip(cols, rows))
    torch.testing.assert_close(y, x @ w.T @ w.T.T)


def test_merged_gate_up_shards(monkeypatch):
    gate, up = torch.randn(4, 3), torch.randn(4, 3)
    layers = on_ranks(monkeypatch, 2, lambda: MergedColumnParallelLinear(
        3, [4, 4], bias=False, params_dtype=F32))
    for rank, layer in enumerate(layers):
        layer.weight.weight_loader(layer.weight, gate, 0)
        layer.weight.weight_loader(layer.weight, up, 1)
        assert torch.equal(layer.weight, torch.cat([gate[2 * rank:2 * rank + 2],
                                                    up[2 * rank:2 * rank + 2]]))


@pytest.mark.parametrize("num_kv_heads", [2, 1])  # split, and replicated across ranks
def test_qkv_shards(monkeypatch, num_kv_heads):
    head, heads = 2, 4
    q = torch.randn(heads * head, 5)
    k, v = torch.randn(num_kv_heads * head, 5), torch.randn(num_kv_heads * head, 5)
    layers = on_ranks(monkeypatch, 2, lambda: QKVParallelLinear(
        5, head, heads, num_kv_heads, bias=False, params_dtype=F32))
    for rank, layer in enumerate(layers):
        for shard_id, t in (("q", q), ("k", k), ("v", v)):
            layer.weight.weight_loader(layer.weight, t, shard_id)
        kv_rank = rank if num_kv_heads == 2 else 0
        want = torch.cat([q[rank * 4:rank * 4 + 4], k[kv_rank * 2:kv_rank * 2 + 2],
                          v[kv_rank * 2:kv_rank * 2 + 2]])
        assert layer.num_heads == 2 and layer.num_kv_heads == 1
        assert torch.equal(layer.weight, want)


def test_vocab_parallel_embedding_masks_foreign_ids(monkeypatch):
    table = torch.randn(7, 3)  # 7 rows over 2 ranks: 4 + 3 (uneven shards, no padding)
    layers = on_ranks(monkeypatch, 2, lambda: VocabParallelEmbedding(7, 3, params_dtype=F32))
    for layer in layers:
        layer.weight_loader(layer.weight, table)
        monkeypatch.setattr(embedding_mod, "tp_all_reduce", lambda x: x)
    ids = torch.tensor([0, 3, 4, 6])
    total = sum(layer(ids) for layer in layers)
    torch.testing.assert_close(total, table[ids])


def test_shape_mismatch_raises_value_error():
    layer = ColumnParallelLinear(6, 8, bias=False, params_dtype=F32)
    with pytest.raises(ValueError, match=r"shape \(9, 6\)"):
        layer.weight.weight_loader(layer.weight, torch.randn(9, 6))


def test_rmsnorm_fused_residual():
    norm = RMSNorm(16, eps=1e-5)
    norm.weight.data = torch.randn(16)
    x, res = torch.randn(3, 16), torch.randn(3, 16)
    out, new_res = norm(x, res)
    torch.testing.assert_close(new_res, x + res)
    torch.testing.assert_close(out, norm(x + res))
    h = x + res
    torch.testing.assert_close(out, norm.weight * h / torch.sqrt(h.pow(2).mean(-1, True) + 1e-5))


def test_quant_method_hook():
    """A quant config can swap the matmul (and its weights) without touching the layer."""
    calls = []

    class Doubling(UnquantizedLinearMethod):
        def apply(self, layer, x, bias=None):
            calls.append(layer.prefix)
            return 2 * super().apply(layer, x, bias)

    class QuantConfig:
        def get_quant_method(self, layer, prefix):
            return Doubling(layer.kernels) if prefix.endswith("qkv_proj") else None

    layer = QKVParallelLinear(4, 2, 2, 1, bias=False, params_dtype=F32,
                              quant_config=QuantConfig(), prefix="layers.0.qkv_proj")
    layer.weight.data = torch.randn(8, 4)
    x = torch.randn(3, 4)
    torch.testing.assert_close(layer(x), 2 * x @ layer.weight.T)
    assert calls == ["layers.0.qkv_proj"]
