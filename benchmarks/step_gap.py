"""The host gap between two decode steps, with and without --async_scheduling (CPU).

Runs ``batch`` requests of ``--prompt_len`` random tokens (``ignore_eos``) through the offline
engine and times, with ``time.perf_counter`` spans, every phase of each step: schedule, prepare
(apply the diffs, build the flat inputs), forward, logits (the LM head), sample, collect (read
the sampled ids to the host), update (the scheduler's stop checks and accounting), detok (the
front end's output processing). Over the decode steps of the full batch it reports the median
forward time and the gap from the end of one forward to the start of the next, split into the
phases that ran in it ("other": the rest, e.g. staging, the step loop).

On a CPU the forward runs in this thread, so the overlap cannot hide anything here: the gap is
the same host work in both modes, in another order. What changes is what that work waits for.
Synchronous, every phase of the gap comes after the previous step's sampled ids are read, so on
a device the device idles for all of it (``device idle``, projected = the gap). With
--async_scheduling the next step is scheduled, prepared and launched before those ids are read;
on a device that work overlaps the forward, which idles only when the host work of one step
exceeds the device work (projected: ``max(0, host - forward - logits - sample)``). The projection assumes a device
forward as long as this CPU's; the measured columns are this machine's.

    python benchmarks/step_gap.py --batch_sizes 1,64 --steps 32
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Host phases, then the device's (on a GPU they run on the device: the host only launches them).
HOST = ("schedule", "prepare", "collect", "update", "detok")
DEVICE = ("logits", "sample")


class Spans:
    """(phase, start, end) of every timed call, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float, float]] = []

    def wrap(self, phase: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.events.append((phase, start, time.perf_counter()))
        return timed


def _instrument(llm, spans: Spans) -> None:
    """Time the phases on this engine's objects (instance attributes: nothing global)."""
    core = llm.engine.core
    runner = core.executor.worker.model_runner
    sched = core.scheduler
    sched.schedule = spans.wrap("schedule", sched.schedule)
    sched.update_from_output = spans.wrap("update", sched.update_from_output)
    batch = runner.input_batch
    batch.apply = spans.wrap("prepare", batch.apply)
    batch.prepare = spans.wrap("prepare", batch.prepare)
    runner.model.forward = spans.wrap("forward", runner.model.forward)
    runner.model.compute_logits = spans.wrap("logits", runner.model.compute_logits)
    runner.sampler.forward = spans.wrap("sample", runner.sampler.forward)
    runner._host_output = spans.wrap("collect", runner._host_output)
    out = llm.engine.output_processor
    out.process_outputs = spans.wrap("detok", out.process_outputs)


def _decode_gaps(events, first: int, last: int) -> dict:
    """Median forward time and gap between consecutive forwards (and the phases in it), over
    forwards ``first`` to ``last`` (decodes of the full batch)."""
    fwd = [i for i, e in enumerate(events) if e[0] == "forward"][first:last]
    gaps, hosts, per_phase = [], [], defaultdict(list)
    for a, b in zip(fwd, fwd[1:]):
        end, start = events[a][2], events[b][1]
        gaps.append(start - end)
        inside = defaultdict(float)
        for phase, s, e in events[a + 1:b]:
            if s >= end and e <= start:
                inside[phase] += e - s
        for phase in HOST + DEVICE:
            per_phase[phase].append(inside[phase])
        per_phase["other"].append(start - end - sum(inside.values()))
        hosts.append(start - end - inside["logits"] - inside["sample"])
    ms = {p: statistics.median(v) * 1e3 for p, v in per_phase.items()}
    forward = statistics.median(events[i][2] - events[i][1] for i in fwd) * 1e3
    gap = statistics.median(gaps) * 1e3
    device = forward + ms["logits"] + ms["sample"]  # a step's device work
    # A step's host work between two forwards; the minimum is the least disturbed by other
    # processes on a shared machine.
    host = statistics.median(hosts) * 1e3
    return {"forward_ms": forward, "gap_ms": gap, "gap_min_ms": min(gaps) * 1e3,
            "phases_ms": ms, "host_ms": host, "host_min_ms": min(hosts) * 1e3,
            "device_ms": device}


def run(model_dir: str, batch: int, steps: int, prompt_len: int, overlap: bool,
        dtype: str) -> dict:
    import numpy as np

    from bladellm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype=dtype, async_scheduling=overlap, max_num_seqs=batch,
              max_num_batched_tokens=max(2048, batch * prompt_len),
              max_model_len=prompt_len + steps + 8)
    try:
        vocab = llm.engine.model_info.vocab_size
        rng = np.random.default_rng(0)
        prompts = [rng.integers(10, vocab - 10, prompt_len).tolist() for _ in range(batch)]
        params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
        spans = Spans()
        _instrument(llm, spans)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
    finally:
        llm.shutdown()
    # Decode forwards of the full batch: after the prefill's, before the batch drains.
    result = _decode_gaps(spans.events, 2, steps - 2)
    result["device_idle_projected_ms"] = (max(0.0, result["host_ms"] - result["device_ms"])
                                          if overlap else result["host_ms"])
    result["wall_s"] = wall
    return result


def _cpu_name() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-88m", help="a shape of offline_throughput.py")
    ap.add_argument("--batch_sizes", default="1,64")
    ap.add_argument("--steps", type=int, default=32, help="output tokens per request")
    ap.add_argument("--prompt_len", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()

    from offline_throughput import make_model_dir

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(args.shape, Path(tmp) / args.shape)
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            for overlap in (False, True):
                r = run(model_dir, batch, args.steps, args.prompt_len, overlap, args.dtype)
                r.update(batch=batch, async_scheduling=overlap)
                rows.append(r)
    print(f"CPU: {_cpu_name()}; model {args.shape} ({args.dtype}), prompt {args.prompt_len}, "
          f"{args.steps} output tokens; ms, medians over the full-batch decode steps")
    cols = HOST + ("other",) + DEVICE
    print(f"{'batch':>5} {'async':>5} {'forward':>8} {'gap':>7} {'gap min':>7} | " + " ".join(
        f"{p:>8}" for p in cols) + f" | {'host':>7} {'host min':>8} {'dev idle*':>9}")
    for r in rows:
        ph = r["phases_ms"]
        print(f"{r['batch']:>5} {str(r['async_scheduling']):>5} {r['forward_ms']:8.2f} "
              f"{r['gap_ms']:7.2f} {r['gap_min_ms']:7.2f} | "
              + " ".join(f"{ph[p]:8.2f}" for p in cols)
              + f" | {r['host_ms']:7.2f} {r['host_min_ms']:8.2f} "
              f"{r['device_idle_projected_ms']:9.2f}")
    print("gap: end of one forward to the start of the next, split into its phases; host: the "
          "gap less logits and sample (device work on a GPU)")
    print("* projected device idle per step: synchronous, the host work (it all waits for the "
          "sampled ids); async, max(0, host - forward - logits - sample)")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": _cpu_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
