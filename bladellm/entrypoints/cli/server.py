"""``blade_llm_server``: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import gc
import sys

from bladellm.entrypoints.cli.args import parse_args


def main(argv: list[str] | None = None) -> int:
    engine_config, server_config = parse_args(argv)
    from bladellm.entrypoints.openai.server import run_server

    code = run_server(engine_config, server_config)
    # Everything is shut down. Python's final garbage collection of the heap (tokenizer, torch)
    # takes seconds on a busy machine; frozen objects are skipped, so exit is prompt.
    gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(main())
