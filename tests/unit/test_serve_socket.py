"""`tandem serve` binds its HTTP socket itself (before Ray starts). Accepted connections
must get TCP_NODELAY, as uvicorn's own bind gives them: asyncio sets it only for a
socket whose protocol is IPPROTO_TCP, and without it every small SSE write waits for
the client's delayed ACK (+40 ms to a single stream's first token)."""

import asyncio
import socket

import pytest

from cli.serve import _bind

pytestmark = pytest.mark.unit


async def test_connections_accepted_on_the_bound_socket_have_nodelay():
    sock = _bind("127.0.0.1", 0)
    assert sock.proto == socket.IPPROTO_TCP
    seen: list[int] = []

    async def handle(reader, writer):
        seen.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(handle, sock=sock)
    async with server:
        _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.01)
        writer.close()
    assert seen and seen[0] != 0


def test_a_port_in_use_is_an_error_before_anything_starts():
    taken = _bind("127.0.0.1", 0)
    taken.listen()
    with pytest.raises(OSError):
        _bind("127.0.0.1", taken.getsockname()[1])
    taken.close()
