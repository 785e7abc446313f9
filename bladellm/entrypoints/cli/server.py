"""``blade_llm_server``: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import sys

from bladellm.entrypoints.cli.args import parse_args


def main(argv: list[str] | None = None) -> int:
    engine_config, server_config = parse_args(argv)
    # Start the engine-core process before importing the HTTP stack and the tokenizer: its own
    # imports and model load run beside ours (a few seconds of a cold start on 2 cores).
    from bladellm.engine.core_client import AsyncMPClient

    client = AsyncMPClient(engine_config, wait=False, log_level=server_config.py_log_level)
    try:
        from bladellm.entrypoints.openai.server import run_server
    except BaseException:
        client.close()
        raise
    return run_server(engine_config, server_config, client=client)


if __name__ == "__main__":
    sys.exit(main())
