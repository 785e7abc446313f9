"""``blade_llm_server``: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import gc
import os
import sys

from bladellm.entrypoints.cli.args import parse_args


def _is_local(model: str) -> bool:
    """'demo' or a path that exists: nothing to fetch before the engine core can load it."""
    return model == "demo" or os.path.exists(os.path.expanduser(model))


def main(argv: list[str] | None = None) -> int:
    engine_config, server_config = parse_args(argv)
    # Start the engine-core process before importing the HTTP stack and the tokenizer: its own
    # imports and model load run beside ours (a few seconds of a cold start on 2 cores). A hub
    # model id is fetched by the API process first, which then starts the core itself.
    client = None
    if _is_local(engine_config.model.model):
        from bladellm.engine.core_client import AsyncMPClient

        client = AsyncMPClient(engine_config, wait=False, log_level=server_config.py_log_level)
    try:
        from bladellm.entrypoints.openai.server import run_server
    except BaseException:
        if client is not None:
            client.close()
        raise
    code = run_server(engine_config, server_config, client=client)
    # Everything is shut down. Python's final garbage collection of the heap (tokenizer, torch)
    # takes seconds on a busy machine; frozen objects are skipped, so exit is prompt.
    gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(main())
