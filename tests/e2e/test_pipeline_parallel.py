"""Pipeline parallelism end to end (gloo, worker processes): greedy tokens identical to world
size 1 in fp32 under the stress configuration (prompt cache, chunked prefill, preemption, block
accounting checked every step) for (T, P) = (1, 2) with uneven stages and (2, 2) with a tied LM
head on the last stage; micro-batches really overlap; prompt logprobs and embeddings come from
the last stage; a dead stage fails the engine promptly."""

from __future__ import annotations

import os
import signal
import time

import pytest

from bladellm import LLM, SamplingParams
from bladellm.executor import WorkerDiedError
from prompt_logprobs_of import prompt_logprobs_of

from test_offline_llm import _prompts
from test_tensor_parallel import MAX_TOKENS, STRESS

# (arch, tensor_parallel_size, pipeline_parallel_size, config overrides)
CASES = {
    # 3 layers over 2 stages: 2 + 1.
    "llama-T1P2-uneven": ("llama", 1, 2, dict(num_hidden_layers=3)),
    # Tied embeddings: the last stage has no embedding and reads its LM head from the
    # checkpoint's embedding; qkv biases; 4 ranks.
    "qwen2-T2P2-tied": ("qwen2", 2, 2, dict(tie_word_embeddings=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_identical_to_one_rank_under_stress(tiny_model_factory, case):
    arch, tp, pp, overrides = CASES[case]
    model_dir = tiny_model_factory(arch, **overrides)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    llm1 = LLM(model=model_dir, **STRESS)
    prompts = _prompts(llm1.engine.model_info.vocab_size)[:10]
    want = [o.outputs[0].token_ids for o in llm1.generate(prompts, params, use_tqdm=False)]
    want_plp = prompt_logprobs_of(llm1, [prompts[1]], 2)[0]
    want_emb = llm1.embed([prompts[2]])[0].embedding
    llm = LLM(model=model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp, **STRESS)
    try:
        core = llm.engine.core
        depths = []
        submit = core.executor.execute_model_async

        def recording(sched):
            depths.append(len(core.batch_queue))
            return submit(sched)

        core.executor.execute_model_async = recording
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = core.scheduler.get_stats()
        got_plp = prompt_logprobs_of(llm, [prompts[1]], 2)[0]
        got_emb = llm.embed([prompts[2]])[0].embedding
    finally:
        llm.shutdown()
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"T={tp} P={pp} prompt {i}: {g} != one rank's {w}"
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.num_used_blocks == 0
    assert max(depths) == pp - 1, "micro-batches never overlapped"
    assert len(got_plp) == len(want_plp) == len(prompts[1]) - 1
    for (ids_g, lps_g, rank_g), (ids_w, lps_w, rank_w) in zip(got_plp, want_plp):
        assert ids_g == ids_w and rank_g == rank_w
        assert max(abs(a - b) for a, b in zip(lps_g, lps_w)) < 1e-4
    assert max(abs(x - y) for x, y in zip(got_emb, want_emb)) < 1e-4


def test_dead_stage_fails_the_engine_within_seconds(tiny_llama):
    llm = LLM(model=tiny_llama, pipeline_parallel_size=2, dtype="float32")
    try:
        procs = llm.engine.core.executor.procs
        os.kill(procs[0].pid, signal.SIGKILL)  # the first stage: the driver waits on it
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match="rank 0"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8), use_tqdm=False)
        assert time.monotonic() - start < 10
    finally:
        llm.shutdown()
    assert not any(p.is_alive() for p in procs)


def test_server_pp2_streams_the_offline_tokens(tiny_llama):
    """blade_llm_server -pp 2: concurrent streamed completions (micro-batches in flight in the
    engine-core process) give the offline world-size-1 text; a clean stop leaves no worker."""
    import concurrent.futures
    import json

    import httpx

    from test_server import ServerProcess, _alive, _children

    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]
    llm1 = LLM(model=tiny_llama, dtype="float32")
    want = [o.outputs[0].text for o in llm1.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        use_tqdm=False)]
    srv = ServerProcess(["--model", tiny_llama, "--host", "127.0.0.1", "--port", "0",
                         "--dtype", "float32", "-pp", "2", "--shutdown_timeout", "1"])
    try:
        url = srv.wait_ready(180)
        workers = [w for c in _children(srv.proc.pid) for w in _children(c)]

        def stream(prompt: list[int]) -> str:
            body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            text = ""
            with httpx.Client(base_url=url, timeout=60) as http:
                with http.stream("POST", "/v1/completions", json=body) as resp:
                    assert resp.status_code == 200
                    for line in resp.iter_lines():
                        if line.startswith("data: {"):
                            text += json.loads(line[6:])["choices"][0]["text"]
            return text

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(stream, prompts))
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    finally:
        srv.proc.terminate()
        srv.proc.wait(timeout=30)
    assert got == want
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in workers if _alive(p)]


_INJECT = '''
import json, sys
sys.path.insert(0, {tests!r})
import bladellm.model.models.llama as L

_forward = L.LlamaModel.forward


def forward(self, input_ids, positions, ctx, *args, **kwargs):
    # Stage {stage} fails every forward that holds token 77 (spawned workers re-run this).
    if self.start_layer == {start} and bool((input_ids == 77).any()):
        raise RuntimeError("injected failure")
    return _forward(self, input_ids, positions, ctx, *args, **kwargs)


L.LlamaModel.forward = forward


def main():
    from bladellm import LLM, SamplingParams
    llm = LLM(model={model!r}, pipeline_parallel_size=3, dtype="float32")
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = llm.generate([[77, 6, 7], [5, 6, 7], [8, 9, 10], [11, 12, 13]], sp, use_tqdm=False)
    again = llm.generate([[5, 6, 7]], sp, use_tqdm=False)
    (plp,) = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=1, prompt_logprobs=1),
                          use_tqdm=False)
    llm.shutdown()
    print(json.dumps({{"finish": [o.outputs[0].finish_reason for o in outs],
                      "tokens": [o.outputs[0].token_ids for o in outs],
                      "again": again[0].outputs[0].token_ids, "plp": len(plp.prompt_logprobs) - 1}}))


if __name__ == "__main__":
    main()
'''


@pytest.mark.parametrize("stage, start", [(0, 0), (1, 1)])
def test_a_step_failing_on_one_stage_fails_its_requests_not_the_engine(tiny_model_factory,
                                                                       tmp_path, stage, start):
    """A forward that raises on the first or a middle stage (3 stages of one layer each): that
    micro-batch's requests finish with an error, the other micro-batches (in flight at the
    same time) and later requests get the world-size-1 tokens, and no stage waits forever."""
    import json
    import subprocess
    import sys

    model = tiny_model_factory("llama", num_hidden_layers=3)
    llm1 = LLM(model=model, dtype="float32")
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm1.generate([[5, 6, 7], [8, 9, 10], [11, 12, 13]],
                                                          sp, use_tqdm=False)]
    script = tmp_path / "inject.py"
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script.write_text(_INJECT.format(tests=tests, stage=stage, start=start, model=model))
    # The script runs from tmp_path: import bladellm from this checkout, not an installed one.
    repo = os.path.dirname(tests)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, cwd=repo, env={**os.environ, "PYTHONPATH": repo})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["finish"][0] == "error"
    ok = [t for t, f in zip(got["tokens"], got["finish"]) if f != "error"]
    assert ok and all(t in want for t in ok)
    assert got["again"] == want[0] and got["plp"] == 3
