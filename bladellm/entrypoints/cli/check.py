"""``blade_llm_check``: check this environment against a deployment (docs/check.md).

Takes the server's own flags, so ``blade_llm_check --model M --kv_cache_memory 8GiB --port
8081`` checks exactly what ``blade_llm_server`` with those flags needs. Prints one line per
check, ``name PASS|WARNING|FAILED detail``, then ``PASS n, WARNING n, FAILED n``; exits 0 only
when nothing failed. ``--json`` prints the same as JSON.
"""

from __future__ import annotations

import argparse
import logging
import sys

from bladellm.check.result import FAILED, CheckResult, exit_code, format_json, format_text
from bladellm.check.runner import CheckOptions, run_checks
from bladellm.entrypoints.cli.args import configs_from_namespace, make_parser

_TP = "parallel__tensor_parallel_size"
_PP = "parallel__pipeline_parallel_size"


def build_parser() -> argparse.ArgumentParser:
    parser = make_parser(prog="blade_llm_check")
    parser.description = ("Check that this machine can run blade_llm_server with the given "
                          "flags: versions, CPU, threads, /dev/shm, memory for --model, GPUs, "
                          "all-reduce across --tensor_parallel_size ranks, --port.")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    return parser


def options_from_namespace(ns: argparse.Namespace) -> tuple[CheckOptions, list[CheckResult]]:
    """The checks' options, and a FAILED ``flags`` line when the engine would reject them (the
    other checks still run, with parallel sizes of 1 where those were the problem)."""
    tp = getattr(ns, _TP, 1)
    flags: list[CheckResult] = []
    try:
        engine, server = configs_from_namespace(ns)
    except ValueError as exc:
        flags.append(CheckResult("flags", FAILED, str(exc)))
        for dest in (_TP, _PP):
            if hasattr(ns, dest):
                delattr(ns, dest)
        try:
            engine, server = configs_from_namespace(ns)
        except ValueError:
            engine, server = None, None
    host = server.host if server else "0.0.0.0"
    port = server.port if server else 8081
    return CheckOptions(engine, host, [port] if port else [], tp), flags


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.ERROR)  # the report is the output, not the loaders' logs
    ns = build_parser().parse_args(argv)
    opts, results = options_from_namespace(ns)
    results += run_checks(opts)
    print(format_json(results) if ns.json else format_text(results))
    return exit_code(results)


if __name__ == "__main__":
    sys.exit(main())
