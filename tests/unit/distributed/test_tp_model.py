"""Tensor-parallel models on real spawned gloo ranks, any degree: logits equal the T=1 model's.

Each rank builds the model after ``init_model_parallel`` (the layers read the TP group at
construction), loads the full checkpoint through its layers' weight loaders (each narrows to its
uneven shard), then runs a prefill and two decode steps through its own paged KV cache (per-rank
KV heads). Sizes are chosen so nothing divides evenly: 12 q heads / 4 KV heads over 3 ranks
(q 6/3/3, kv 2/1/1), an intermediate size and a vocabulary not divisible by T.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import socket
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "models"))  # tiny_paged_kv

from tiny_models import make_tiny_model  # noqa: E402

PROMPT_LEN = 7
DECODE_STEPS = 2
ATOL = 1e-4
TIMEOUT_S = 90  # per test: a hung collective fails instead of hanging


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@torch.no_grad()
def _run_model(model_dir: str, ids: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """Build + load the model for this process's TP group; prefill ids[:PROMPT_LEN], then decode
    the following tokens one at a time (teacher-forced). Returns (fp32 logits [n, V], kv spec)."""
    from safetensors.torch import load_file

    from bladellm.attention import get_attn_backend
    from bladellm.checkpoint.hf_config import load_hf_config
    from bladellm.kernels import resolve_kernels
    from bladellm.kernels.scope import building_with
    from bladellm.model.loader import build_model, check_all_loaded, find_weight_files
    from tiny_paged_kv import PagedKV, Seq

    cfg = load_hf_config(model_dir, trust_remote_code=False)
    kernels = resolve_kernels("auto", "cpu")  # what each rank's worker resolves by default
    with building_with(kernels):
        model = build_model(cfg, torch.float32, "cpu", get_attn_backend(None, kernels))

    def weights():
        for f in find_weight_files(model_dir):
            yield from load_file(f).items()

    check_all_loaded(model, model.load_weights(weights()))
    model.eval()
    spec = model.get_kv_cache_spec()
    kv = PagedKV(spec, num_blocks=16, block_size=4)
    seq = Seq()
    ctx, pos = kv.step([seq], [PROMPT_LEN])
    out = [model.compute_logits(model(ids[:PROMPT_LEN], pos, ctx))]
    for i in range(PROMPT_LEN, PROMPT_LEN + DECODE_STEPS):
        ctx, pos = kv.step([seq], [1])
        out.append(model.compute_logits(model(ids[i:i + 1], pos, ctx)))
    return torch.cat(out), (spec.num_layers, spec.num_kv_heads, spec.head_dim)


def _rank_main(rank: int, tp: int, port: int, model_dir: str, ids: torch.Tensor,
               out: "mp.Queue") -> None:
    try:
        torch.set_num_threads(1)
        from bladellm.distributed import parallel_state as ps

        ps.init_model_parallel(rank, tp, 1, f"tcp://127.0.0.1:{port}", "gloo",
                               timeout_s=TIMEOUT_S)
        logits, spec = _run_model(model_dir, ids)
        out.put((rank, logits, spec))
        ps.reset_model_parallel()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        import traceback

        out.put((rank, f"{e!r}\n{traceback.format_exc()}", None))


def run_tp(model_dir: str, tp: int, ids: torch.Tensor) -> dict[int, tuple]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, tp, port, model_dir, ids, out), daemon=True)
             for r in range(tp)]
    for p in procs:
        p.start()
    results: dict[int, tuple] = {}
    try:
        for _ in procs:
            try:
                rank, logits, spec = out.get(timeout=TIMEOUT_S)
            except queue.Empty:
                pytest.fail(f"TP={tp}: ranks {sorted(set(range(tp)) - set(results))} gave no "
                            f"result within {TIMEOUT_S} s (hung collective?)")
            if isinstance(logits, str):
                pytest.fail(f"TP={tp} rank {rank} failed: {logits}")
            results[rank] = (logits, spec)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return results


def expected_kv_heads(H: int, K: int, T: int) -> list[int]:
    from bladellm.distributed.partition import attention_partitions

    return [s.num_kv_heads for s in attention_partitions(H, K, T)]


CASES = {
    # name: (arch, overrides, T)
    "llama-h12-k4-t2": ("llama", {"num_attention_heads": 12, "num_key_value_heads": 4,
                                  "hidden_size": 96, "intermediate_size": 100,
                                  "vocab_size": 383}, 2),
    "llama-h12-k4-t3": ("llama", {"num_attention_heads": 12, "num_key_value_heads": 4,
                                  "hidden_size": 96, "intermediate_size": 100,
                                  "vocab_size": 383}, 3),
    # More ranks than KV heads: KV head 0 replicated on 2 ranks (3 + 3 q heads), head 1: 6 q.
    "llama-h12-k2-t3-tied": ("llama", {"num_attention_heads": 12, "num_key_value_heads": 2,
                                       "hidden_size": 96, "intermediate_size": 100,
                                       "vocab_size": 383, "tie_word_embeddings": True}, 3),
    # q/k/v biases; 3 KV heads over 2 ranks (kv 2/1, q 4/2).
    "qwen2-h6-k3-t2": ("qwen2", {"num_attention_heads": 6, "num_key_value_heads": 3,
                                 "hidden_size": 48, "intermediate_size": 75,
                                 "vocab_size": 383}, 2),
}


def shrink_vocab(model_dir: str, vocab_size: int) -> None:
    """make_tiny_model sizes the vocabulary to its tokenizer (384, divisible by 2 and 3): keep the
    first ``vocab_size`` rows of the embedding / LM head so the vocab splits unevenly."""
    from safetensors.torch import load_file, save_file

    cfg_path = Path(model_dir) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["vocab_size"] = vocab_size
    cfg_path.write_text(json.dumps(cfg))
    for f in Path(model_dir).glob("*.safetensors"):
        tensors = load_file(f)
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name in tensors:
                tensors[name] = tensors[name][:vocab_size].contiguous()
        save_file(tensors, f, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    cache: dict = {}

    def get(arch, overrides):
        key = (arch, tuple(sorted(overrides.items())))
        if key not in cache:
            d = tmp_path_factory.mktemp(f"tp-{arch}")
            config = {k: v for k, v in overrides.items() if k != "vocab_size"}
            cache[key] = make_tiny_model(d, arch, **config)
            shrink_vocab(cache[key], overrides["vocab_size"])
        return cache[key]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_tp_logits_match_single_rank(model_dirs, case):
    arch, overrides, tp = CASES[case]
    model_dir = model_dirs(arch, overrides)
    vocab = overrides["vocab_size"]
    ids = torch.randint(3, vocab, (PROMPT_LEN + DECODE_STEPS,),
                        generator=torch.Generator().manual_seed(0))
    want, want_spec = _run_model(model_dir, ids)  # this process: world size 1
    assert want.shape == (PROMPT_LEN + DECODE_STEPS, vocab)
    results = run_tp(model_dir, tp, ids)
    kv_heads = expected_kv_heads(overrides["num_attention_heads"],
                                 overrides["num_key_value_heads"], tp)
    for rank, (logits, spec) in sorted(results.items()):
        assert spec == (want_spec[0], kv_heads[rank], want_spec[2]), (rank, spec)
        torch.testing.assert_close(logits, want, atol=ATOL, rtol=0,
                                   msg=lambda m, r=rank: f"rank {r}: {m}")


def test_world_size_1_model_is_unchanged_by_partitioning(model_dirs, layer_kernels):
    """At T=1 the layers hold the full tensors (same shapes as the checkpoint)."""
    from safetensors.torch import load_file

    from bladellm.attention import get_attn_backend
    from bladellm.checkpoint.hf_config import load_hf_config
    from bladellm.model.loader import build_model, find_weight_files

    arch, overrides, _ = CASES["llama-h12-k4-t3"]
    model_dir = model_dirs(arch, overrides)
    ckpt = {}
    for f in find_weight_files(model_dir):
        ckpt.update(load_file(f))
    model = build_model(load_hf_config(model_dir, False), torch.float32, "cpu",
                        get_attn_backend(None, layer_kernels))
    params = dict(model.named_parameters())
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert params["model.embed_tokens.weight"].shape == ckpt["model.embed_tokens.weight"].shape
    assert params["lm_head.weight"].shape == ckpt["lm_head.weight"].shape
    assert attn.num_heads == 12 and attn.num_kv_heads == 4
    assert attn.o_proj.weight.shape == ckpt["model.layers.0.self_attn.o_proj.weight"].shape
    assert mlp.down_proj.weight.shape == ckpt["model.layers.0.mlp.down_proj.weight"].shape
    assert mlp.gate_up_proj.weight.shape == (200, 96)
    assert os.path.isdir(model_dir)
