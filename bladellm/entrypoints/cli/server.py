"""``blade_llm_server``: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import sys

from bladellm.entrypoints.cli.args import parse_args


def main(argv: list[str] | None = None) -> int:
    engine_config, server_config = parse_args(argv)
    from bladellm.entrypoints.openai.server import run_server

    return run_server(engine_config, server_config)


if __name__ == "__main__":
    sys.exit(main())
