"""The listening socket of ``blade_llm_server`` and ``blade_llm_router``: bound by the process
itself (so ``--port 0`` works and the ready line names the real port), Nagle off."""

from __future__ import annotations

import socket


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not the default 0: asyncio turns Nagle off (TCP_NODELAY) only on accepted
    # sockets whose ``proto`` says TCP, and accepted sockets copy the listener's. With Nagle
    # on, a streamed response on a reused keep-alive connection waited for the client's
    # delayed ACK before its tokens went out, in one burst.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # Linux: accepted ones inherit
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock
