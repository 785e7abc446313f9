"""``blade_llm_router``: one OpenAI endpoint in front of several instances (docs/router.md).

    blade_llm_router --port 8080 --instances http://127.0.0.1:8081 http://127.0.0.1:8082 \
        --policy prefix_affinity
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from typing import Any

from bladellm.entrypoints.cli.args import add_dataclass_flags, dataclass_from_namespace
from bladellm.http.listen import bind_socket
from bladellm.router.config import RouterConfig

logger = logging.getLogger("bladellm.router")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="blade_llm_router", allow_abbrev=False,
        description="Route OpenAI-compatible requests over several instances by load and "
                    "prompt-cache affinity; aggregate their /health and /metrics.")
    add_dataclass_flags(parser, RouterConfig)
    return parser


def parse_args(argv: list[str] | None = None) -> RouterConfig:
    parser = make_parser()
    ns = parser.parse_args(argv)
    try:
        return dataclass_from_namespace(ns, RouterConfig)
    except ValueError as exc:
        parser.error(str(exc))
        raise


async def _serve(config: RouterConfig, sock: socket.socket) -> None:
    import uvicorn

    from bladellm.router.proxy import build_router_app

    from bladellm.http.connections import (
        RateLimitedErrors, effective_max_connections, raise_open_file_limit, uvicorn_limits)

    class _Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            asyncio.get_running_loop().set_exception_handler(RateLimitedErrors())
            await super().startup(sockets)
            if self.started and sockets:
                host, port = sockets[0].getsockname()[:2]
                logger.info("BladeLLM router ready at http://%s:%d (%d instances, policy %s)",
                            host, port, len(config.instances), config.policy)

    app = build_router_app(config)
    # The server's connection hygiene (bladellm/http/connections.py), with the same flags.
    limits = effective_max_connections(config.connection_limits, raise_open_file_limit())
    uv = uvicorn.Config(app, log_level=config.log_level, access_log=False,
                        timeout_graceful_shutdown=5, **uvicorn_limits(limits))
    await _Server(uv).serve(sockets=[sock])


def _interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        sock = bind_socket(config.host, config.port)
    except OSError as exc:
        logger.error("cannot listen on %s:%d: %s", config.host, config.port, exc)
        return 1
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    try:
        asyncio.run(_serve(config, sock))
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    logger.info("router stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
