"""Tensor parallelism end to end: worker processes on gloo, greedy tokens identical to world
size 1 (fp32) under the stress configuration (prompt cache, chunked prefill, preemption,
block accounting checked every step), including degrees that divide neither the heads nor the
intermediate size; a dead worker fails the engine promptly; bad degrees are refused before
any process starts."""

from __future__ import annotations

import os
import signal
import time

import pytest

from bladellm import LLM, SamplingParams
from bladellm.executor import WorkerDiedError
from prompt_logprobs_of import prompt_logprobs_of

from test_offline_llm import _prompts

MAX_TOKENS = 16
STRESS = dict(dtype="float32", block_size=4, max_num_batched_tokens=32, max_num_seqs=8,
              num_kv_blocks=48, max_model_len=160, debug_block_accounting=True)

# (arch, tensor_parallel_size, config overrides)
CASES = {
    # 12 query / 4 KV heads over 3 ranks: 2+1+1 KV groups; intermediate 100 = 34+33+33;
    # vocab not a multiple of 3 either.
    "llama-T3-uneven": ("llama", 3, dict(num_attention_heads=12, num_key_value_heads=4,
                                         hidden_size=96, intermediate_size=100)),
    # qkv biases (Qwen2), tied embeddings, 2 ranks.
    "qwen2-T2-tied": ("qwen2", 2, dict(tie_word_embeddings=True)),
}


def _generate(model_dir: str, tp: int, prompts: list[list[int]]):
    llm = LLM(model=model_dir, tensor_parallel_size=tp, **STRESS)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                            use_tqdm=False)
        stats = llm.engine.core.scheduler.get_stats()
        return [o.outputs[0].token_ids for o in outs], stats
    finally:
        llm.shutdown()


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_identical_to_one_rank_under_stress(tiny_model_factory, case):
    arch, tp, overrides = CASES[case]
    model_dir = tiny_model_factory(arch, **overrides)
    llm1 = LLM(model=model_dir, **STRESS)
    prompts = _prompts(llm1.engine.model_info.vocab_size)[:10]
    want = [o.outputs[0].token_ids for o in llm1.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)]
    got, stats = _generate(model_dir, tp, prompts)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"prompt {i}: tp={tp} {g} != tp=1 {w}"
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.num_used_blocks == 0


def test_dead_worker_fails_the_engine_within_seconds(tiny_llama):
    llm = LLM(model=tiny_llama, tensor_parallel_size=2, dtype="float32")
    try:
        procs = llm.engine.core.executor.procs
        os.kill(procs[1].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match="rank 1"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8), use_tqdm=False)
        assert time.monotonic() - start < 10
    finally:
        llm.shutdown()
    assert not any(p.is_alive() for p in procs)


def test_shutdown_leaves_no_worker(tiny_llama):
    llm = LLM(model=tiny_llama, tensor_parallel_size=2, dtype="float32")
    procs = list(llm.engine.core.executor.procs)
    assert len(procs) == 2 and all(p.is_alive() for p in procs)
    llm.shutdown()
    assert not any(p.is_alive() for p in procs)


@pytest.mark.parametrize("kwargs, flag", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size"),
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size"),
    (dict(pipeline_parallel_size=3), "pipeline_parallel_size"),  # 3 stages > 2 layers
    (dict(pipeline_parallel_size=2, decode_algo="look_ahead"), "decode_algo"),
    (dict(pipeline_parallel_size=2, enable_lora=True), "enable_lora"),
    (dict(tensor_parallel_size=5), "tensor_parallel_size"),  # 5 ranks > 4 query heads
    (dict(tensor_parallel_size=2, distributed_init_method="udp://x"), "distributed_init_method"),
    (dict(distributed_init_method="tcp://127.0.0.1:1234"), "distributed_init_method"),
    (dict(tensor_parallel_size=2, decode_algo="look_ahead"), "decode_algo"),
    (dict(tensor_parallel_size=2, decode_algo="sps", draft_model="x"), "decode_algo"),
])
def test_bad_parallel_config_is_refused_before_any_process_starts(tiny_llama, kwargs, flag):
    before = set(os.listdir("/proc"))
    with pytest.raises(ValueError, match=flag):
        LLM(model=tiny_llama, dtype="float32", **kwargs)
    spawned = [p for p in set(os.listdir("/proc")) - before if p.isdigit()
               and "spawn_main" in _cmdline(p)]
    assert not spawned


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def test_server_killed_worker_fails_the_stream_and_the_server(tiny_llama):
    """blade_llm_server -tp 2: a worker killed mid-stream ends the stream with an error event,
    the server exits 1 (engine dead) and no process is left behind."""
    import httpx

    from test_server import ServerProcess, _alive, _children

    srv = ServerProcess(["--model", tiny_llama, "--host", "127.0.0.1", "--port", "0",
                         "--dtype", "float32", "-tp", "2", "--shutdown_timeout", "1"])
    try:
        url = srv.wait_ready(180)
        (core,) = [p for p in _children(srv.proc.pid) if "spawn_main" in _cmdline(str(p))]
        workers = _children(core)  # the two ranks (and multiprocessing's resource tracker)
        ranks = [p for p in workers if "spawn_main" in _cmdline(str(p))]
        assert len(ranks) == 2
        body = {"prompt": "hello", "max_tokens": 300, "ignore_eos": True,
                "stream": True}
        with httpx.Client(base_url=url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body) as resp:
                lines = resp.iter_lines()
                assert next(lines).startswith("data: ")
                os.kill(ranks[-1], signal.SIGKILL)
                rest = [line for line in lines if line]
        assert any("engine_dead" in line for line in rest), rest[-3:]
        assert rest[-1] == "data: [DONE]"
        assert srv.proc.wait(timeout=30) == 1
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in [core, *workers]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in [core, *workers] if _alive(p)]
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()


def test_guided_json_embeddings_and_logprobs_across_ranks(tiny_llama):
    """The other paths through the workers under TP=2 give what one rank gives: a grammar
    bitmask resolved before the step is published, sampled logprobs and prompt logprobs
    (logits all-gathered on every rank), pooled embeddings."""
    import json

    from bladellm.sampling_params import GuidedDecodingParams

    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
              "additionalProperties": False}
    params = [SamplingParams(temperature=0.0, max_tokens=40,
                             guided_decoding=GuidedDecodingParams(json=schema)),
              SamplingParams(temperature=0.0, max_tokens=6, logprobs=2)]
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13]]
    results = []
    for tp in (1, 2):
        llm = LLM(model=tiny_llama, dtype="float32", tensor_parallel_size=tp)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            emb = llm.embed([[5, 6, 7]])[0].embedding
            plp = prompt_logprobs_of(llm, [prompts[1]], 1)[0]
            results.append((outs, emb, plp))
        finally:
            llm.shutdown()
    (one, emb1, plp1), (two, emb2, plp2) = results
    assert isinstance(json.loads(two[0].outputs[0].text)["a"], bool)
    for a, b in zip(one, two):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    lp1, lp2 = one[1].outputs[0].logprobs, two[1].outputs[0].logprobs
    assert len(lp1) == len(lp2) == 6
    for row1, row2 in zip(lp1, lp2):  # per output token: sampled + top-2
        assert [t.token_id for t in row1] == [t.token_id for t in row2]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(row1, row2)) < 1e-4
    assert len(plp1) == len(plp2) == 4  # every prompt token after the first
    for (ids1, lps1, rank1), (ids2, lps2, rank2) in zip(plp1, plp2):
        assert ids1 == ids2 and rank1 == rank2
        assert max(abs(a - b) for a, b in zip(lps1, lps2)) < 1e-4
    assert max(abs(x - y) for x, y in zip(emb1, emb2)) < 1e-4


def test_failed_start_after_the_workers_leaves_none(tiny_llama, tmp_path):
    """The workers are up when a later part of the engine start fails (here: a JSON warm-up
    schema that does not exist): the error reaches the caller and no worker outlives it."""
    import multiprocessing

    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError):
        LLM(model=tiny_llama, dtype="float32", tensor_parallel_size=2, enable_json_warmup=True,
            json_warmup_schemas=[str(tmp_path / "missing.json")])
    assert not [p for p in multiprocessing.active_children()
                if p not in before and p.name.startswith("bladellm-worker")]


def test_lora_across_uneven_ranks_matches_one_rank(tiny_model_factory, tmp_path):
    """Several adapters in one batch under TP=3 with uneven shards: each rank cuts the adapters'
    A/B like its base weights (column-parallel: B rows of its heads/columns; row-parallel: A
    columns of its inputs, delta added before the all-reduce); greedy tokens equal one rank's."""
    from tiny_lora import make_adapter

    arch, tp, overrides = CASES["llama-T3-uneven"]
    model_dir = tiny_model_factory(arch, **overrides)
    adapters = {
        "attn": make_adapter(model_dir, tmp_path / "attn", r=4,
                             targets=["q_proj", "k_proj", "v_proj", "o_proj"], seed=1),
        "mlp": make_adapter(model_dir, tmp_path / "mlp", r=8,
                            targets=["gate_proj", "up_proj", "down_proj"], seed=2),
    }
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]
    jobs = [(name, p) for name in (None, "attn", "mlp") for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    results = []
    for degree in (1, tp):
        llm = LLM(model=model_dir, dtype="float32", tensor_parallel_size=degree,
                  enable_lora=True, max_loras=2, max_lora_rank=8)
        try:
            loras = {n: llm.lora_request(n, path) for n, path in adapters.items()}
            outs = llm.generate([p for _, p in jobs], params, use_tqdm=False,
                                lora_request=[loras[n] if n else None for n, _ in jobs])
            results.append([o.outputs[0].token_ids for o in outs])
        finally:
            llm.shutdown()
    one, many = results
    assert many == one
    by_job = dict(zip([(n, tuple(p)) for n, p in jobs], one))
    for name in adapters:  # the adapters change the output: the comparison can fail
        assert any(by_job[(name, tuple(p))] != by_job[(None, tuple(p))] for p in prompts), name


def test_server_notices_a_worker_that_dies_while_idle(tiny_llama):
    """No request in flight: the idle engine core's health poll sees the dead rank, the
    engine reports dead and the server exits 1 within seconds, without waiting for traffic."""
    from test_server import ServerProcess, _children

    srv = ServerProcess(["--model", tiny_llama, "--host", "127.0.0.1", "--port", "0",
                         "--dtype", "float32", "-tp", "2", "--shutdown_timeout", "1"])
    try:
        srv.wait_ready(180)
        (core,) = [p for p in _children(srv.proc.pid) if "spawn_main" in _cmdline(str(p))]
        ranks = [p for p in _children(core) if "spawn_main" in _cmdline(str(p))]
        os.kill(ranks[0], signal.SIGKILL)
        assert srv.proc.wait(timeout=30) == 1
        assert "worker rank 0" in srv.log()
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
