"""`blade_llm_bench`: serving benchmark against any OpenAI-compatible streaming server.

    blade_llm_bench --base_url http://127.0.0.1:8081 --request_rate 1,2,4,inf --num_prompts 100 \
        --slo ttft:500,tpot:50 --output_dir results --label bladellm
    blade_llm_bench plot results/bladellm.json results/vllm.json --output_dir results
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import random
import sys
import tempfile
import time
from datetime import datetime, timezone
from typing import Any

from bladellm.bench.client import (RequestOptions, count_tokens_without_usage,
                                   fetch_model_name)
from bladellm.bench.mm_dataset import ImageConfig, check_image_config, parse_image_sizes
from bladellm.bench.datasets import (BenchRequest, DatasetConfig, assign_priority_classes,
                                     build_dataset, check_dataset_args, load_tokenizer,
                                     parse_range)
from bladellm.bench.metrics import SLO, max_qps_meeting_slo, parse_slo
from bladellm.bench.plots import plot_runs
from bladellm.bench.report import (format_markdown_comparison, format_table, load_json,
                                   rate_entry, rate_name, resummarize, write_csv, write_json)
from bladellm.bench.runner import SweepConfig, make_session, parse_rates, run_rate, warm_up


_SLO_TARGET_DEFAULT = 0.9


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's default in its help line (unless the help already explains it); the
    description and epilog keep their line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or "default" in text
                or action.default in (None, argparse.SUPPRESS)):
            return text
        return f"{text} (default: %(default)s)"


def _add(parser: argparse.ArgumentParser, name: str, **kw: Any) -> None:
    """Add ``--foo_bar`` and its dash spelling ``--foo-bar``."""
    names = [name]
    if "_" in name:
        names.append(name.replace("_", "-"))
    parser.add_argument(*names, **kw)


def build_run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="blade_llm_bench", formatter_class=_HelpFormatter,
        usage="blade_llm_bench [run options]\n       blade_llm_bench plot FILE.json [FILE.json "
              "...] [plot options]",
        description="Stream requests to an OpenAI-compatible server at a sweep of request rates "
                    "and report TTFT, ITL/TBT, TPOT, E2E, throughput and goodput.",
        epilog="subcommands:\n  plot  draw TTFT-vs-QPS and TBT-vs-QPS curves and a comparison "
               "table from result files (blade_llm_bench plot --help)")
    _add(p, "--base_url", default="http://127.0.0.1:8081", help="server root URL")
    _add(p, "--model", default=None,
         help="model name sent in requests (default: the first id at /v1/models)")
    _add(p, "--endpoint", choices=("completions", "chat"), default="completions",
         help="API to call: /v1/completions or /v1/chat/completions")
    _add(p, "--dataset", default="random",
         help="random | random_mm | shared_prefix | sharegpt:FILE | jsonl:FILE")
    _add(p, "--tokenizer", default=None,
         help="HF tokenizer dir for exact prompt token counts (default: --model if it is a dir; "
              "else random words, one word ~ one token)")
    _add(p, "--input_len_range", default="128,128",
         help="prompt tokens A,B (uniform); random and shared_prefix only")
    _add(p, "--output_len_range", default="128,128", help="max output tokens A,B (uniform)")
    _add(p, "--num_groups", type=int, default=DatasetConfig.num_groups,
         help="shared_prefix: number of system prompts")
    _add(p, "--prefix_len", type=int, default=DatasetConfig.prefix_len,
         help="shared_prefix: system prompt tokens")
    _add(p, "--num_images", type=int, default=None,
         help="random_mm: images per request (default 1)")
    _add(p, "--image_size", default=None,
         help="random_mm: image sizes WxH[,WxH...], one drawn per image (default 336x336)")
    _add(p, "--image_repeat_ratio", type=float, default=None,
         help="random_mm: chance that an image repeats one sent before (default 0)")
    _add(p, "--num_prompts", type=int, default=100, help="requests per rate")
    _add(p, "--request_rate", default="inf",
         help="comma list of req/s to sweep, 'inf' sends all at once (e.g. 1,2,4,8,inf)")
    _add(p, "--burstiness", type=float, default=1.0,
         help="gamma shape of inter-arrival gaps at finite rates: 1 = Poisson, <1 burstier, "
              ">1 more regular")
    _add(p, "--max_concurrency", type=int, default=None, help="cap on in-flight requests")
    _add(p, "--ignore_eos", action="store_true", help="send ignore_eos: true")
    _add(p, "--eos_logit_bias", default=None,
         help="ID[,ID]: send logit_bias -100 on these token ids (for servers that drop ignore_eos)")
    _add(p, "--temperature", type=float, default=0.0, help="sampling temperature sent")
    _add(p, "--seed", type=int, default=0, help="seeds prompts and arrival times")
    _add(p, "--slo", default=None, help="goodput targets in ms, e.g. ttft:500,tpot:50[,e2e:MS]")
    _add(p, "--slo_target", type=float, default=_SLO_TARGET_DEFAULT,
         help="with --slo: a rate meets the SLO when this fraction of its requests does "
              "(for plots); in (0, 1]")
    _add(p, "--num_warmup", type=int, default=0, help="requests sent first and not measured")
    _add(p, "--output_dir", default="bench_results",
         help="where the result JSON, CSV and plots are written")
    _add(p, "--label", default=None, help="name of this run/server (file names, plot legend)")
    _add(p, "--request_timeout", type=float, default=3600.0,
         help="seconds per request (> 0, finite)")
    _add(p, "--no_usage", action="store_true",
         help="don't send stream_options.include_usage (output tokens: the generated text "
              "encoded with the tokenizer if there is one, else one per chunk)")
    _add(p, "--priority_mix", type=float, default=None,
         help="two priority classes: this fraction of requests (drawn with --seed) is sent "
              "with priority 0, the rest with priority 1 (lower first, as vLLM); TTFT and E2E "
              "are reported per class. For a server with --scheduling_policy priority")
    _add(p, "--no_priority_field", action="store_true",
         help="with --priority_mix: keep the classes client-side only and send no priority "
              "field (the fcfs baseline: such a server refuses a priority other than 0)")
    _add(p, "--plot_stat", choices=("mean", "p50", "p90", "p99"), default="mean",
         help="statistic drawn on the latency axes of the plots")
    _add(p, "--disable_tqdm", action="store_true",
         help="no progress bar and no per-rate line (failed requests are still reported)")
    return p


def build_plot_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="blade_llm_bench plot",
                                formatter_class=_HelpFormatter,
                                description="TTFT-vs-QPS and TBT-vs-QPS, one line per file, "
                                            "and comparison.md: one Markdown table of all.")
    p.add_argument("files", nargs="+", help="result JSON files from blade_llm_bench")
    _add(p, "--output_dir", default=".", help="where the plots and comparison.md go")
    _add(p, "--slo", default=None, help="re-judge goodput under this SLO (default: the files')")
    _add(p, "--slo_target", type=float, default=0.9,
         help="a rate meets the SLO when this fraction of its requests does; in (0, 1]")
    _add(p, "--stat", choices=("mean", "p50", "p90", "p99"), default="mean",
         help="statistic drawn on the latency axes")
    _add(p, "--labels", default=None, help="comma list of legend names, one per file "
         "(default: each file's label)")
    return p


def _dataset_config(args: argparse.Namespace, seed: str) -> DatasetConfig:
    return DatasetConfig(spec=args.dataset, num_prompts=args.num_prompts, images=args.image_cfg,
                         input_len_range=args.input_len_range,
                         output_len_range=args.output_len_range,
                         num_groups=args.num_groups, prefix_len=args.prefix_len, seed=seed)


def _parse_eos_ids(text: str | None) -> tuple[int, ...]:
    """'2,7' -> (2, 7); errors name --eos_logit_bias (int() alone named nothing)."""
    if not text:
        return ()
    ids = []
    for part in text.split(","):
        if not part.strip():
            continue
        try:
            ids.append(int(part))
        except ValueError:
            raise ValueError(f"--eos_logit_bias: token ids are integers, got {part!r}") from None
        if ids[-1] < 0:
            raise ValueError(f"--eos_logit_bias: token ids are >= 0, got {part!r}")
    return tuple(ids)


def _build_dataset(cfg: DatasetConfig, tokenizer: Any) -> list[BenchRequest]:
    """``build_dataset`` with a malformed file as one line naming it, not a traceback."""
    try:
        return build_dataset(cfg, tokenizer)
    except ValueError as exc:
        raise SystemExit(f"blade_llm_bench: {exc}") from None


def _image_config(args: argparse.Namespace) -> ImageConfig:
    """random_mm's knobs: validated, refused with any other dataset or endpoint."""
    given = [f"--{n}" for n in ("num_images", "image_size", "image_repeat_ratio")
             if getattr(args, n) is not None]
    if args.dataset != "random_mm":
        if given:
            raise ValueError(f"{given[0]}: only used with --dataset random_mm")
        return ImageConfig()
    if args.endpoint != "chat":
        raise ValueError("--dataset random_mm: images are sent as chat content parts; "
                         "pass --endpoint chat")
    cfg = ImageConfig()
    if args.num_images is not None:
        cfg.num_images = args.num_images
    if args.image_size is not None:
        cfg.sizes = parse_image_sizes(args.image_size)
    if args.image_repeat_ratio is not None:
        cfg.repeat_ratio = args.image_repeat_ratio
    check_image_config(cfg)
    return cfg


def _check_slo_target(value: float) -> None:
    if not 0 < value <= 1:  # also refuses nan
        raise ValueError(f"--slo_target: must be a fraction in (0, 1], got {value}")


def _validate(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every run option is checked here, before any server is contacted."""
    try:
        args.input_len_range = parse_range(args.input_len_range, "--input_len_range")
        args.output_len_range = parse_range(args.output_len_range, "--output_len_range")
        check_dataset_args(args.dataset, args.num_groups, args.prefix_len, args.input_len_range)
        args.image_cfg = _image_config(args)
        _check_slo_target(args.slo_target)
        if not (args.request_timeout > 0 and math.isfinite(args.request_timeout)):
            raise ValueError(f"--request_timeout: must be a positive number of seconds, "
                             f"got {args.request_timeout}")
        args.rates = parse_rates(args.request_rate)
        args.slo_obj = parse_slo(args.slo)
        # A knob that would change nothing is refused rather than silently ignored:
        if args.slo_target != _SLO_TARGET_DEFAULT and not args.slo_obj.is_set():
            raise ValueError("--slo_target: only used with --slo (the fraction of requests "
                             "that must meet it)")
        if args.burstiness != 1.0 and all(math.isinf(r) for r in args.rates):
            raise ValueError("--burstiness: only shapes the gaps of a finite --request_rate; "
                             "rate inf sends every request at once")
        args.eos_ids = _parse_eos_ids(args.eos_logit_bias)
        # The server refuses these (HTTP 400 on every request, exit status 0 before).
        if not (args.temperature >= 0 and math.isfinite(args.temperature)):
            raise ValueError(f"--temperature: must be a finite number >= 0, "
                             f"got {args.temperature}")
        if args.num_prompts < 1:
            raise ValueError("--num_prompts must be >= 1")
        if args.max_concurrency is not None and args.max_concurrency < 1:
            raise ValueError("--max_concurrency must be >= 1")
        if not (args.burstiness > 0 and math.isfinite(args.burstiness)):
            raise ValueError("--burstiness must be > 0")
        if args.num_warmup < 0:
            raise ValueError("--num_warmup must be >= 0")
        if args.priority_mix is not None and not 0 < args.priority_mix < 1:
            raise ValueError(f"--priority_mix: the fraction of requests at priority 0 must be "
                             f"in (0, 1), got {args.priority_mix}")
        if args.no_priority_field and args.priority_mix is None:
            raise ValueError("--no_priority_field: only used with --priority_mix")
    except ValueError as exc:
        p.error(str(exc))


def _prepare_output_dir(path: str) -> None:
    """Make ``--output_dir`` and write a probe file in it, before the sweep: the results are
    written after the whole sweep, and a directory that couldn't be made or written lost them
    all (a traceback at the end). A real write, since os.access says yes to root on a
    read-only or special file system (/proc)."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ValueError(f"--output_dir: cannot write in {path!r} "
                         f"({type(exc).__name__}: {exc.strerror or exc})") from None


def _load_tokenizer(path: str | None, flag: str) -> Any:
    """``load_tokenizer`` with its failure (a missing dir: a Hugging Face traceback about repo
    ids) turned into one line that names where the path came from."""
    try:
        if path == "demo":  # the demo model's folder, not a hub id
            from bladellm.checkpoint.demo import demo_hf_dir

            path = demo_hf_dir()
        return load_tokenizer(path)
    except Exception as exc:  # noqa: BLE001 - OSError, HFValidationError, ValueError, ...
        raise ValueError(f"{flag}: cannot load a tokenizer from {path!r} "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")


async def _run(args: argparse.Namespace, tokenizer: Any = None,
               state: dict[str, Any] | None = None) -> dict[str, Any]:
    """The sweep. ``state["run"]`` is the result being built, rate by rate, so that the
    caller still has the finished rates when Ctrl-C cancels this coroutine."""
    state = {} if state is None else state
    cfg = SweepConfig(base_url=args.base_url, options=None, max_concurrency=args.max_concurrency,
                      burstiness=args.burstiness, seed=args.seed,
                      request_timeout_s=args.request_timeout,
                      show_progress=not args.disable_tqdm)
    model = args.model
    if model is None:
        try:
            async with make_session(cfg) as session:
                model = await fetch_model_name(session, args.base_url)
        except Exception as exc:  # noqa: BLE001 - report, don't trace
            raise SystemExit(f"blade_llm_bench: cannot list models at {args.base_url}/v1/models "
                             f"({type(exc).__name__}: {exc}); is the server up? (or pass --model)")
    cfg.options = RequestOptions(model=model, endpoint=args.endpoint, ignore_eos=args.ignore_eos,
                                 eos_logit_bias=args.eos_ids, temperature=args.temperature,
                                 include_usage=not args.no_usage,
                                 send_priority=not args.no_priority_field)
    tok_path = args.tokenizer or (model if os.path.isdir(model) else None)
    if tokenizer is None and tok_path:  # --tokenizer was loaded before contacting the server
        try:
            tokenizer = _load_tokenizer(tok_path, "--model (a directory, used as the tokenizer)")
        except ValueError as exc:
            raise SystemExit(f"blade_llm_bench: {exc}; pass --tokenizer") from None

    run: dict[str, Any] = {
        "label": args.label, "base_url": args.base_url, "model": model,
        "endpoint": args.endpoint, "dataset": args.dataset, "tokenizer": tok_path,
        "slo": args.slo_obj.to_dict() or None, "slo_target": args.slo_target,
        "args": {k: v for k, v in vars(args).items() if k not in ("slo_obj", "rates", "image_cfg")},
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(),
                 "python": platform.python_version()},
        "rates": [],
    }
    state["run"] = run
    if args.num_warmup:
        wcfg = _dataset_config(args, f"{args.seed}:warmup")
        wcfg.num_prompts = args.num_warmup
        warm = await warm_up(cfg, _build_dataset(wcfg, tokenizer))
        if not any(r.success for r in warm):
            print(f"warning: all {len(warm)} warm-up requests failed: {warm[0].error}",
                  file=sys.stderr)
    for i, rate in enumerate(args.rates):
        # Fresh prompts per rate so a server's prompt cache can't reuse an earlier rate's.
        requests = _build_dataset(_dataset_config(args, f"{args.seed}:{i}"), tokenizer)
        if args.priority_mix is not None:  # the same classes for the same --seed
            assign_priority_classes(requests, args.priority_mix,
                                    random.Random(f"{args.seed}:priority:{i}"))
        res = await run_rate(cfg, rate, requests, random.Random(f"{args.seed}:arrivals:{i}"))
        if tokenizer is not None:
            count_tokens_without_usage(res.results, tokenizer)
        entry = rate_entry(rate, res.results, res.duration_s, args.slo_obj,
                           spec_decode=res.spec_decode)
        run["rates"].append(entry)
        if not args.disable_tqdm:
            print(f"rate {rate_name(rate)}: {entry['completed']} ok, {entry['errors']} errors, "
                  f"{entry['request_throughput']:.2f} req/s", file=sys.stderr)
    run["finished_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return run


def run_main(argv: list[str]) -> int:
    parser = build_run_parser()
    args = parser.parse_args(argv)
    _validate(parser, args)
    tokenizer = None
    if args.tokenizer:
        try:
            tokenizer = _load_tokenizer(args.tokenizer, "--tokenizer")
        except ValueError as exc:
            parser.error(str(exc))
    try:  # last: a usage error above leaves no directory behind
        _prepare_output_dir(args.output_dir)
    except ValueError as exc:
        parser.error(str(exc))
    t0 = time.perf_counter()
    state: dict[str, Any] = {}
    try:
        run = asyncio.run(_run(args, tokenizer, state))
    except KeyboardInterrupt:
        # Keep what was measured: the rates that finished (the interrupted one is cut short,
        # its numbers would mislead, so it is left out).
        run = state.get("run")
        if not run or not run["rates"]:
            print("blade_llm_bench: interrupted before a rate finished; nothing written",
                  file=sys.stderr)
            return 130
        run["interrupted"] = True
        run["finished_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        print(f"blade_llm_bench: interrupted; writing the {len(run['rates'])} rate(s) that "
              "finished", file=sys.stderr)
        _write_results(args, run, t0)
        return 130
    return _write_results(args, run, t0)


def _write_results(args: argparse.Namespace, run: dict[str, Any], t0: float) -> int:
    """Files, table and failure report of a (possibly interrupted) run; the exit status."""
    label = args.label or _default_label(run["model"])
    run["label"] = label
    os.makedirs(args.output_dir, exist_ok=True)
    base = os.path.join(args.output_dir, label)
    write_json(base + ".json", run)
    write_csv(base + ".csv", run)
    plots = plot_runs([run], args.output_dir, args.plot_stat, args.slo_obj, args.slo_target,
                      prefix=label + "_")
    print(format_table(run))
    best = max_qps_meeting_slo(run["rates"], args.slo_target)
    if args.slo_obj.is_set():
        print("max rate meeting the SLO: " + (f"{best['request_rate']} "
              f"({best['request_throughput']:.2f} req/s achieved)" if best else "none"))
    print(f"wrote {base}.json, {base}.csv, {', '.join(plots)} ({time.perf_counter() - t0:.1f} s)")
    return _report_failures(run["rates"])


def _report_failures(rates: list[dict[str, Any]]) -> int:
    """Failed requests on stderr, whatever --disable_tqdm says (they were only in the JSON);
    exit status 1 when none succeeded: a wrong --model or a dead server is not a benchmark."""
    for e in rates:
        if e["errors"]:
            print(f"rate {e['request_rate']}: {e['errors']} of {e['num_requests']} requests "
                  f"failed: " + " | ".join(s[:300] for s in e["error_samples"]),
                  file=sys.stderr)
    if rates and not any(e["completed"] for e in rates):
        print("blade_llm_bench: every request failed (errors above); the numbers are empty",
              file=sys.stderr)
        return 1
    return 0


def _default_label(model: str) -> str:
    name = os.path.basename(os.path.normpath(model)) or "run"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def plot_main(argv: list[str]) -> int:
    parser = build_plot_parser()
    args = parser.parse_args(argv)
    try:
        _check_slo_target(args.slo_target)
        slo = parse_slo(args.slo) if args.slo else None
        runs = [load_json(f) for f in args.files]
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    if slo is not None:
        for run in runs:
            run["rates"] = [resummarize(e, slo) for e in run["rates"]]
    elif runs and all(r.get("slo") == runs[0].get("slo") for r in runs) and runs[0].get("slo"):
        slo = SLO(**runs[0]["slo"])  # one common SLO: draw its lines
    labels = args.labels.split(",") if args.labels else []
    if labels and len(labels) != len(runs):
        parser.error(f"--labels: {len(labels)} names for {len(runs)} files")
    for i, (run, path) in enumerate(zip(runs, args.files)):
        run["label"] = (labels[i] if labels else run.get("label")
                        or os.path.splitext(os.path.basename(path))[0])
    paths = plot_runs(runs, args.output_dir, args.stat, slo, args.slo_target)
    table = os.path.join(args.output_dir, "comparison.md")
    with open(table, "w", encoding="utf-8") as f:
        f.write(format_markdown_comparison(runs, args.slo_target) + "\n")
    paths.append(table)
    for run in runs:
        best = max_qps_meeting_slo(run["rates"], args.slo_target)
        print(f"{run['label']}: max rate meeting SLO: "
              + (f"{best['request_throughput']:.2f} req/s" if best else "none"))
    print("wrote " + ", ".join(paths))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "plot":
        return plot_main(argv[1:])
    return run_main(argv)


if __name__ == "__main__":
    sys.exit(main())
