"""The listening socket of ``blade_llm_server`` and ``blade_llm_router``: bound by the process
itself (so ``--port 0`` works and the ready line names the real port), Nagle off."""

from __future__ import annotations

import ipaddress
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


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or name to listen on) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name that may resolve to any interface


def open_listener_warning(host: str, api_key: str | None) -> str | None:
    """The start-up warning for a server reachable beyond this machine without a key."""
    if api_key is not None or is_loopback(host):
        return None
    return (f"listening on {host} without --api_key: anyone who can reach this address can "
            f"use the server; pass --api_key (or --host 127.0.0.1 to serve this machine only)")
