"""``blade_llm_server``: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import os

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
        from bladellm.entrypoints.api_server import run_server
    except BaseException:
        if client is not None:
            client.close()
        raise
    return run_server(engine_config, server_config, client=client)


def cli() -> None:
    """The ``blade_llm_server`` command. When the server has shut down (engine core joined,
    sockets closed, logs written), the process ends without interpreter finalization: tearing
    down torch, the tokenizer and the HTTP stack would spend the shutdown budget (grace + 2 s)
    that orchestrators wait for on nothing."""
    code = main()
    from bladellm.engine.core_proc import exit_process_now

    exit_process_now(code)


if __name__ == "__main__":
    cli()
