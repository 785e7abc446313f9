"""Single-stream decode on a shared machine: idle vs a competing CPU-bound process, per thread
policy (thread count + OpenMP wait policy).

Each policy runs the offline engine in its own process (libgomp reads OMP_WAIT_POLICY /
GOMP_SPINCOUNT only when torch is first imported); all are loaded up front and then take turns,
one at a time, so every policy sees the same background. The competitor is
``python -c "while True: pass"``, either left to the scheduler or pinned to the last CPU.
Rounds repeat ``--repeats`` times in rotated order and the median is reported, since other work
on the machine makes single runs noisy.

    python benchmarks/shared_machine.py                      # demo model, float32
    python benchmarks/shared_machine.py --model /tmp/bladellm-bench-llama-88m-bpe \\
        --load_format dummy --policies old,new,1thread --repeats 5

Reports per cell: the median over runs of the mean ms/token over the decode steps; the fastest
single step of the first load (the least disturbed one, the closest this gets to an idle
machine when the machine is never idle); involuntary context
switches and CPU time per token of the engine process (getrusage, all threads): CPU time
above the wall time is cores held, spinning or working, that a neighbour could have used.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

# name -> (extra environment, --num_threads or None for the engine default)
POLICIES = {
    "old": ({}, "all"),                                   # before: all CPUs, libgomp spins
    "new": (None, None),                                  # engine_process_env() + defaults
    "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, "all"),
    "spin100k": ({"GOMP_SPINCOUNT": "100000"}, "all"),
    "spin30k": ({"GOMP_SPINCOUNT": "30000"}, "all"),
    "spin10k": ({"GOMP_SPINCOUNT": "10000"}, "all"),
    "spin3k": ({"GOMP_SPINCOUNT": "3000"}, "all"),
    "spin1k": ({"GOMP_SPINCOUNT": "1000"}, "all"),
    "spin300": ({"GOMP_SPINCOUNT": "300"}, "all"),
    "spin100": ({"GOMP_SPINCOUNT": "100"}, "all"),
    "passive-bind": ({"OMP_WAIT_POLICY": "PASSIVE", "OMP_PROC_BIND": "close",
                      "OMP_PLACES": "cores"}, "all"),   # one thread per core, no migration
    "1thread": ({}, 1),
}
LOADS = ("idle", "busy", "busy-pinned")


def child(spec: dict) -> None:
    """The engine's own process: load and warm up, print ``ready``, then decode one request per
    line read from stdin and print one JSON line per request."""
    import torch

    from bladellm import LLM, SamplingParams

    llm = LLM(model=spec["model"], dtype=spec["dtype"], load_format=spec["load_format"],
              num_threads=spec["num_threads"], kv_cache_memory="256MiB", max_num_seqs=4,
              max_model_len=1024)
    engine = llm.engine
    prompt = list(range(10, 10 + spec["prompt_len"]))
    llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    print("ready", flush=True)
    for n, _ in enumerate(sys.stdin):
        engine.add_request(str(n), prompt, SamplingParams(
            temperature=0.0, max_tokens=spec["tokens"] + 1, ignore_eos=True))
        engine.step()  # prefill + first token: not decode
        before, steps = resource.getrusage(resource.RUSAGE_SELF), []
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        print(json.dumps({
            "threads": torch.get_num_threads(),
            "mean_ms": 1e3 * sum(steps) / len(steps),
            "median_ms": 1e3 * statistics.median(steps),
            "min_ms": 1e3 * min(steps),  # the least disturbed step: near the idle-machine cost
            "cpu_ms_per_token": 1e3 * cpu_s / len(steps),
            "nivcsw_per_token": (after.ru_nivcsw - before.ru_nivcsw) / len(steps),
            "loadavg_1m": os.getloadavg()[0],
        }), flush=True)


def start_competitor(load: str) -> subprocess.Popen | None:
    if load == "idle":
        return None
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    if load == "busy-pinned":
        os.sched_setaffinity(proc.pid, {max(os.sched_getaffinity(0))})
    time.sleep(0.5)  # let it reach the run queue
    return proc


class Engine:
    """One policy's engine process, loaded once and asked for a measurement at a time."""

    def __init__(self, policy: str, args: argparse.Namespace) -> None:
        from bladellm.platforms.cpu import detect_cpu
        from bladellm.platforms.threads import engine_process_env

        extra, threads = POLICIES[policy]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
        env.update(engine_process_env(env) if extra is None else extra)
        spec = {"model": args.model, "dtype": args.dtype, "load_format": args.load_format,
                "num_threads": detect_cpu().num_cpus if threads == "all" else threads,
                "tokens": args.tokens, "prompt_len": args.prompt_len}
        self.proc = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(spec)],
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        for line in self.proc.stdout:  # skip anything a library printed first
            if line.strip() == "ready":
                break
        else:
            raise RuntimeError(f"{policy}: engine process failed to start")

    def measure(self) -> dict:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError("engine process died")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--load_format", default="auto")
    ap.add_argument("--policies", default="old,new,1thread")
    ap.add_argument("--loads", default=",".join(LOADS))
    ap.add_argument("--tokens", type=int, default=64, help="decode steps measured per run")
    ap.add_argument("--prompt_len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="also write all runs here")
    args = ap.parse_args()
    if args.child:
        return child(json.loads(args.child))

    from bladellm.platforms.cpu import detect_cpu

    policies, loads = args.policies.split(","), args.loads.split(",")
    engines = {p: Engine(p, args) for p in policies}  # all loaded up front, idle until asked
    runs: dict[tuple[str, str], list[dict]] = {}
    try:
        for rep in range(args.repeats):
            for load in loads:
                comp = start_competitor(load)
                try:
                    k = rep % len(policies)  # rotate the order: no policy always runs first
                    for policy in policies[k:] + policies[:k]:
                        r = engines[policy].measure()
                        runs.setdefault((policy, load), []).append(r)
                        print(f"  round {rep + 1} {policy:>12} {load:>11}: {r['mean_ms']:7.1f} "
                              f"ms/tok (median step {r['median_ms']:.1f}, min {r['min_ms']:.1f}), "
                              f"{r['cpu_ms_per_token']:.0f} CPU ms/tok, "
                              f"{r['nivcsw_per_token']:.1f} invol. cs/tok, "
                              f"load avg {r['loadavg_1m']:.1f}", file=sys.stderr)
                finally:
                    if comp is not None:
                        comp.kill()
                        comp.wait()
    finally:
        for engine in engines.values():
            engine.close()
    print(f"\n{detect_cpu().describe()}; model {args.model} {args.dtype}; "
          f"{args.tokens} decode steps, median of {args.repeats} runs\n")
    print(f"| policy | threads | {' | '.join(loads)} | fastest step ({loads[0]}) "
          f"| CPU ms/token ({loads[-1]}) | invol. cs/token ({loads[-1]}) |")
    print(f"|---|---|{'---|' * len(loads)}---|---|---|")
    for policy in policies:
        cells = []
        for load in loads:
            rs = runs[(policy, load)]
            cells.append(f"{statistics.median(r['mean_ms'] for r in rs):.1f} ms")
        fastest = min(r["min_ms"] for r in runs[(policy, loads[0])])
        last = runs[(policy, loads[-1])]
        cpu = statistics.median(r["cpu_ms_per_token"] for r in last)
        cs = statistics.median(r["nivcsw_per_token"] for r in last)
        print(f"| {policy} | {runs[(policy, loads[0])][0]['threads']} | {' | '.join(cells)} "
              f"| {fastest:.1f} ms | {cpu:.0f} | {cs:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"policy": p, "load": l, **r} for (p, l), rs in runs.items() for r in rs],
                      f, indent=1)


if __name__ == "__main__":
    main()
