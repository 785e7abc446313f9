"""Structured-output overhead: TTFT and TPOT of JSON-schema requests vs the same requests
unconstrained, at a given concurrency, through ``blade_llm_server``; plus the compile time of a
schema (cold and cached).

Each round sends every prompt twice, interleaved: first constrained (``response_format``
``json_schema``), then unconstrained with ``max_tokens`` = the constrained answer's length and
``ignore_eos``, so both generate the same number of tokens. TPOT = (e2e - TTFT) / (tokens - 1).
The schema is compiled by a warm-up request first, so the constrained TTFT is the cached-schema
TTFT. Ratios are over the medians of the rounds' means.

    python benchmarks/structured_output.py --concurrency 1 32 --rounds 2
    python benchmarks/structured_output.py --schema benchmarks/schemas/employee_profile.json \\
        -- --model DIR --dtype bfloat16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time

import aiohttp

HERE = os.path.dirname(os.path.abspath(__file__))
READY = re.compile(r"ready at (http://[\d.]+:\d+)")
NAMES = ["Alice Chen", "Bob Martin", "Carla Diaz", "Dev Patel", "Eun-ji Kim", "Farid Haddad",
         "Greta Olsen", "Hiro Tanaka", "Ines Costa", "Jamal Wright", "Kofi Mensah", "Lena Vogel",
         "Marco Rossi", "Nadia Petrova", "Omar Farouk", "Priya Nair"]
DEPTS = ["engineering", "sales", "marketing", "finance"]


def prompts(n: int, tag: str = "") -> list[str]:
    """``tag`` starts each prompt (a pass's own nonce) so that no pass hits the prompt cache
    filled by the one before it."""
    return [f"{tag}Write the employee profile of {NAMES[i % len(NAMES)]}, who works in "
            f"{DEPTS[i % len(DEPTS)]}, as JSON." for i in range(n)]


async def one(session, url, model, prompt, *, schema=None, max_tokens=256) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if schema is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "profile", "schema": schema}}
    else:
        body["ignore_eos"] = True
    start = time.perf_counter()
    ttft, tokens, text, finish = None, 0, "", None
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
            for choice in data.get("choices", []):
                if choice["delta"].get("content") and ttft is None:
                    ttft = time.perf_counter() - start
                text += choice["delta"].get("content") or ""
                finish = choice.get("finish_reason") or finish
    e2e = time.perf_counter() - start
    tpot = (e2e - ttft) / (tokens - 1) if tokens > 1 else float("nan")
    return {"ttft": ttft, "tpot": tpot, "tokens": tokens, "text": text, "finish": finish}


async def run_pass(url, model, items, concurrency) -> list[dict]:
    """``items``: (prompt, schema or None, max_tokens); at most ``concurrency`` in flight."""
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        async def go(item):
            async with sem:
                return await one(session, url, model, item[0], schema=item[1],
                                 max_tokens=item[2])
        return await asyncio.gather(*(go(i) for i in items))


def mean(results, key):
    return statistics.fmean(r[key] for r in results)


async def bench(url, model, schema, concurrency, rounds, max_tokens) -> dict:
    n = concurrency if concurrency > 1 else 4
    rows = []
    for k in range(rounds):
        ps = prompts(n, f"[c{concurrency} r{k} guided] ")
        guided = await run_pass(url, model, [(p, schema, max_tokens) for p in ps], concurrency)
        for r in guided:
            assert r["finish"] == "stop", f"constrained answer cut: {r['text'][:200]}"
            json.loads(r["text"])
        ps = prompts(n, f"[c{concurrency} r{k} free..] ")  # same length, not cached
        free = await run_pass(url, model, [(p, None, r["tokens"]) for p, r in zip(ps, guided)],
                              concurrency)
        rows.append({"guided_ttft": mean(guided, "ttft"), "free_ttft": mean(free, "ttft"),
                     "guided_tpot": mean(guided, "tpot"), "free_tpot": mean(free, "tpot"),
                     "tokens": mean(guided, "tokens")})
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    med["tpot_ratio"] = med["guided_tpot"] / med["free_tpot"]
    med["ttft_delta_ms"] = (med["guided_ttft"] - med["free_ttft"]) * 1e3
    med["rounds"] = rows
    return med


def compile_times(schema: dict, model: str) -> dict:
    """Cold compile of ``schema`` for the served model's tokenizer, and the cached path."""
    sys.path.insert(0, os.path.dirname(HERE))
    from bladellm.config import ModelConfig
    from bladellm.engine.model_info import model_info_for
    from bladellm.guided.backend import LLGuidanceBackend, validate
    from bladellm.guided.manager import GuidedDecodingManager
    from bladellm.model.loader import resolve_model
    from bladellm.sampling_params import GuidedDecodingParams

    info = model_info_for(resolve_model(ModelConfig(model=model)))
    t = time.perf_counter()
    backend = LLGuidanceBackend(info.tokenizer, info.vocab_size, info.eos_token_ids)
    bridge = time.perf_counter() - t
    params = GuidedDecodingParams(json=schema)
    t = time.perf_counter()
    validate(params)
    validate_s = time.perf_counter() - t
    t = time.perf_counter()
    backend.compile(params)
    cold = time.perf_counter() - t
    manager = GuidedDecodingManager(lambda: backend, info.vocab_size, 4, 8, 10.0)
    manager.grammar_for(params).future.result()
    t = time.perf_counter()
    state = manager.grammar_for(params)
    state.future.result()
    state.is_ready()
    cached = time.perf_counter() - t
    return {"tokenizer_bridge_ms": bridge * 1e3, "validate_ms": validate_s * 1e3,
            "compile_cold_ms": cold * 1e3, "cached_ms": cached * 1e3}


def start_server(extra: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "bladellm.entrypoints.cli.server",
                             "--host", "127.0.0.1", "--port", "0", "--disable_access_log",
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=os.path.dirname(HERE))
    for line in proc.stdout:  # type: ignore[union-attr]
        match = READY.search(line)
        if match:
            return proc, match.group(1)
    raise RuntimeError("server exited before it was ready")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schema", default=os.path.join(HERE, "schemas", "employee_profile.json"))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max_tokens", type=int, default=300)
    ap.add_argument("--first_only", action="store_true",
                    help="only the first constrained request's TTFT (e.g. with "
                         "-- --model demo --enable_json_warmup)")
    ap.add_argument("server_args", nargs="*", help="after --: blade_llm_server flags")
    args = ap.parse_args()
    with open(args.schema) as f:
        schema = json.load(f)
    server_args = args.server_args or ["--model", "demo"]
    model = server_args[server_args.index("--model") + 1] if "--model" in server_args else "demo"
    if not args.first_only:
        print(json.dumps({"compile": compile_times(schema, model)}), flush=True)
    proc, url = start_server(server_args)
    try:
        import urllib.request

        with urllib.request.urlopen(url + "/v1/models") as resp:
            served = json.load(resp)["data"][0]["id"]
        # Warm-up: compiles the schema (cached afterwards) and touches both paths.
        t = time.perf_counter()
        first = asyncio.run(run_pass(url, served, [(prompts(1)[0], schema, args.max_tokens)], 1))
        print(json.dumps({"first_request": {"ttft_ms": first[0]["ttft"] * 1e3,
                                            "wall_s": time.perf_counter() - t}}), flush=True)
        if args.first_only:
            return
        asyncio.run(run_pass(url, served, [(prompts(1)[0], None, 16)], 1))
        for c in args.concurrency:
            result = asyncio.run(bench(url, served, schema, c, args.rounds, args.max_tokens))
            print(json.dumps({"concurrency": c, **result}), flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()
