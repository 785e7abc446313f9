"""The listening socket of blade_llm_server / blade_llm_router: Nagle off on every connection."""

from __future__ import annotations

import asyncio
import socket

from bladellm.http.listen import bind_socket


async def test_accepted_connections_have_nagle_off():
    """With Nagle on, a streamed answer on a reused keep-alive connection waited for the
    client's delayed ACK (~40 ms, then every token at once). asyncio turns it off only on
    sockets whose proto is TCP, so the listener must say so."""
    loop = asyncio.get_running_loop()
    accepted: asyncio.Future = loop.create_future()

    class Accept(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            accepted.set_result(transport.get_extra_info("socket"))

    sock = bind_socket("127.0.0.1", 0)
    server = await loop.create_server(Accept, sock=sock)
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        conn = await asyncio.wait_for(accepted, 10)
        assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        writer.close()
    finally:
        server.close()
        await server.wait_closed()
