"""``blade_llm_check``'s memory estimate against what the engine really allocates with the same
flags: real ``Worker``s (one per rank, shaped by ``tp_shape_for_split`` under TP/PP) load the
tiny model, and their weights, prepacked copies, sps draft, KV bytes per block and pool size
must be the check's numbers."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from bladellm.check.memory import all_rank_memory, check_memory, model_memory
from bladellm.config import EngineConfig
from bladellm.distributed.parallel_state import tp_shape_for_split
from bladellm.model.loader import load_resolved_model, resolve_model
from bladellm.platforms.cpu_defaults import model_weight_bytes
from bladellm.worker import model_runner, worker
from quant_checkpoints import quantize_checkpoint

MiB = 1 << 20


def _engine(cfg: EngineConfig) -> list[dict]:
    """What each rank's Worker loaded and sizes, as the engine core sees it."""
    par = cfg.parallel
    tp, pp = par.tensor_parallel_size, par.pipeline_parallel_size
    resolved = resolve_model(cfg.model)
    out = []
    for rank in range(par.world_size):
        shape = (tp_shape_for_split(rank % tp, tp, rank // tp, pp) if par.world_size > 1
                 else contextlib.nullcontext())
        with shape:
            w = worker.Worker(cfg, resolved, rank=rank, local_world_size=par.ranks_per_node)
        run = w.model_runner
        draft = run.spec.proposer.model if run.spec_bytes_per_block else None
        out.append(dict(weights=model_weight_bytes(run.model), packed=run.packed_weight_bytes,
                        draft=model_weight_bytes(draft) if draft is not None else 0,
                        per_block=run.bytes_per_block + run.spec_bytes_per_block,
                        blocks=w.determine_num_blocks()))
    return out


def _assert_matches(cfg: EngineConfig, packed_made: bool) -> None:
    engine = _engine(cfg)
    _, ranks = all_rank_memory(cfg)
    loaded, kv, _ = model_memory(cfg)
    for got, real in zip(ranks, engine):
        assert (got.weights, got.draft, got.bytes_per_block) == (
            real["weights"], real["draft"], real["per_block"])
        # The check counts the copies at their bound (``packed_bytes_bound``); random fp32
        # weights hold no exact bf16 values, so the runner's copies take all of it.
        assert (got.packed > 0) == packed_made == (real["packed"] > 0)
        assert real["packed"] <= got.packed
    blocks = min(r["blocks"] for r in engine)  # EngineCore: the least any rank can hold
    if all(g.packed == r["packed"] for g, r in zip(ranks, engine)):
        assert loaded == sum(r["weights"] + r["packed"] + r["draft"] for r in engine)
        assert kv == blocks * sum(r["per_block"] for r in engine)
    else:  # oneDNN's copies stay below the bound: the check may only be larger
        assert loaded >= sum(r["weights"] + r["packed"] + r["draft"] for r in engine)
        assert kv <= blocks * sum(r["per_block"] for r in engine)


@pytest.fixture
def machine(monkeypatch):
    """Fake the machine's memory (for the runner's prepack rule and the worker's auto pool) so
    that the auto pool is cut by the memory the weights leave, not by --max_num_seqs."""
    def set_total(n: int) -> None:
        for mod in (model_runner, worker):
            monkeypatch.setattr(mod, "total_memory_bytes", lambda: n)
    return set_total


@pytest.mark.parametrize("prepack", [True, False])
@pytest.mark.parametrize("draft", [False, True])
def test_estimate_is_what_the_worker_loads_and_sizes(tiny_model_factory, machine, prepack, draft):
    """Prepacked copies on (64 MiB of memory leaves room) and off (2 MiB: the copies would take
    more than a quarter of what the weights leave), with and without an sps draft (its weights,
    and its KV in every block)."""
    target = tiny_model_factory("llama")
    kw = dict(decode_algo="sps", draft_model=tiny_model_factory("llama", num_hidden_layers=1),
              gamma=2) if draft else {}
    machine(64 * MiB if prepack else 2 * MiB)
    cfg = EngineConfig.from_kwargs(model=target, dtype="float32", max_model_len=256,
                                   max_num_seqs=256, block_size=16, **kw)
    _assert_matches(cfg, packed_made=prepack)


def test_estimate_counts_the_lora_device_slots(tiny_llama, machine):
    """--enable_lora: every adapted projection holds --max_loras slots of --max_lora_rank
    A/B buffers, in the runner's weights (and so in the auto pool's budget)."""
    machine(64 * MiB)
    base = dict(model=tiny_llama, dtype="float32", max_model_len=256, max_num_seqs=256,
                block_size=16)
    _, (plain,) = all_rank_memory(EngineConfig.from_kwargs(**base))
    cfg = EngineConfig.from_kwargs(**base, enable_lora=True, max_loras=3, max_lora_rank=8)
    _assert_matches(cfg, packed_made=True)
    _, (rank,) = all_rank_memory(cfg)
    assert rank.weights > plain.weights


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_estimate_sums_every_rank_with_its_own_shard_and_pool(tiny_llama, machine, tp, pp):
    """TP splits the KV heads (one per rank here), PP the layers (and the embedding / LM head);
    every rank sizes its pool from its share of the machine, and --kv_cache_memory is per rank:
    two ranks on one machine hold twice its KV."""
    machine(64 * MiB)
    cfg = EngineConfig.from_kwargs(model=tiny_llama, dtype="float32", max_model_len=256,
                                   max_num_seqs=256, block_size=16,
                                   tensor_parallel_size=tp, pipeline_parallel_size=pp)
    _assert_matches(cfg, packed_made=True)
    per_rank = dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache,
                                                                  kv_cache_memory="1MiB"))
    _, kv, desc = model_memory(per_rank)
    assert kv == 2 * MiB and f"2 ranks here (TP {tp} x PP {pp})" in desc


def test_quantized_checkpoint_counts_its_packed_tensors(tiny_llama, tmp_path):
    """A 4-bit GPTQ checkpoint: its packed integer tensors as the safetensors header gives them
    (no tensor read), not its parameters at the dtype's 4 bytes each; the whole is what the loader
    allocates, within the kernels' unpacking (fp32 zero points) of what stays after loading."""
    from safetensors import safe_open

    from bladellm.attention import get_attn_backend
    from bladellm.check.memory import meta_model
    from bladellm.kernels import resolve_kernels
    from bladellm.kernels.scope import building_with

    qdir = tmp_path / "gptq"
    quantize_checkpoint(tiny_llama, qdir, "gptq", bits=4, group_size=32)
    cfg = EngineConfig.from_kwargs(model=str(qdir), dtype="float32")
    target, (rank,) = all_rank_memory(cfg)
    _, (dense,) = all_rank_memory(EngineConfig.from_kwargs(model=tiny_llama, dtype="float32"))
    packed = ("qweight", "qzeros")  # (g_idx: one tensor for fused q/k/v in memory, three on disk)
    with safe_open(str(qdir / "model.safetensors"), framework="pt") as f:
        disk_int = sum(torch.Size(f.get_slice(n).get_shape()).numel() * 4 for n in f.keys()
                       if n.endswith(packed))
    kernels = resolve_kernels("auto", "cpu")  # as the worker (and the check) resolve it
    meta = meta_model(target, None, kernels)
    meta_int = sum(p.numel() * p.element_size() for n, p in meta.named_parameters()
                   if n.endswith(packed))
    assert meta_int == disk_int and rank.weights == model_weight_bytes(meta)
    assert rank.weights < 0.6 * dense.weights
    with building_with(kernels):
        real = load_resolved_model(target, torch.device("cpu"), get_attn_backend(None, kernels))
    assert abs(model_weight_bytes(real) - rank.weights) < 0.05 * rank.weights
    assert check_memory(cfg, available=1 << 30).status == "PASS"
