"""A request's headers have a deadline: a client that trickles them (slowloris) gets 408
and its connection closed, on the first request of a connection and on a kept-alive
one's next; a prompt client is not affected. A real uvicorn server on 127.0.0.1 with
the router's protocol (router/header_timeout.py). Before it, such a socket stayed open
for as long as its client pleased."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import uvicorn

from router.header_timeout import with_header_timeout

pytestmark = pytest.mark.unit

TIMEOUT_S = 0.4


async def _ok(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def _response(sock: socket.socket) -> bytes:
    """One whole response: its head, then content-length bytes of body (they may come in
    separate segments: the app sends its start and its body apart)."""
    sock.settimeout(5)
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = sock.recv(4096)
        assert chunk, f"closed mid-response: {got!r}"
        got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(4096)
    return head + b"\r\n\r\n" + body


def _read_until_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and when it closed (or limit_s)."""
    sock.settimeout(0.05)
    got, t0 = b"", time.monotonic()
    while time.monotonic() - t0 < limit_s:
        try:
            chunk = sock.recv(4096)
        except socket.timeout:
            continue
        if not chunk:
            return got, time.monotonic() - t0
        got += chunk
    return got, limit_s


async def test_slow_headers_get_408_and_the_connection_closes():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(_ok, host="127.0.0.1", port=port, log_level="warning", lifespan="off", ws="none",
                            http=with_header_timeout(TIMEOUT_S), timeout_keep_alive=30)
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    try:
        for _ in range(200):
            if server.started:
                break
            await asyncio.sleep(0.01)

        def slow_first():
            with socket.create_connection(("127.0.0.1", port)) as c:
                c.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # and then nothing more
                return _read_until_closed(c, 5.0)

        got, closed_after = await asyncio.to_thread(slow_first)
        assert got.startswith(b"HTTP/1.1 408") and closed_after < TIMEOUT_S + 1.0, (got, closed_after)

        def prompt_then_slow():
            with socket.create_connection(("127.0.0.1", port)) as c:
                c.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                first = _response(c)
                time.sleep(TIMEOUT_S * 1.5)  # an idle kept-alive connection is not a slow request
                c.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                second = _response(c)
                c.sendall(b"GET / HTTP/1.1\r\n")  # the third trickles
                return first, second, _read_until_closed(c, 5.0)

        first, second, (third, closed_after) = await asyncio.to_thread(prompt_then_slow)
        assert first.startswith(b"HTTP/1.1 200") and first.endswith(b"ok")
        assert second.startswith(b"HTTP/1.1 200")
        assert third.startswith(b"HTTP/1.1 408") and closed_after < TIMEOUT_S + 1.0
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 10)


def test_the_bound_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        with_header_timeout(0)


def test_headers_waiting_unread_in_the_socket_are_the_servers_delay_not_the_clients():
    """A request whose headers arrived whole but wait unread in the socket when the
    timer fires (the loop held up, or reading paused) is served, not cut: the bound is
    extended while bytes wait. Reading is paused here past the bound to make that state
    happen every time; before, the timer answered 408 and closed (with the request
    unread, the close is a reset). A trickling client is still cut at the bound."""
    import threading

    import uvloop

    held_s = TIMEOUT_S * 1.5  # past the bound, within its one extension
    paused: list[float] = []

    class HeldProtocol(with_header_timeout(TIMEOUT_S)):
        def connection_made(self, transport):
            super().connection_made(transport)

            def hold():  # the loop does not read this socket for a while
                transport.pause_reading()
                paused.append(held_s)
                self.loop.call_later(held_s, transport.resume_reading)

            self.loop.call_soon(hold)  # once the transport reads (uvloop starts after this method)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(_ok, host="127.0.0.1", port=port, log_level="warning", lifespan="off", ws="none",
                            http=HeldProtocol, timeout_keep_alive=30)
    server = uvicorn.Server(config)
    loop = uvloop.new_event_loop()  # the router's loop
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(),), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with socket.create_connection(("127.0.0.1", port)) as c:
            time.sleep(0.1)  # reading is paused now
            c.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # prompt, and whole
            got = _response(c)
        assert paused and got.startswith(b"HTTP/1.1 200") and got.endswith(b"ok"), got
        with socket.create_connection(("127.0.0.1", port)) as c:
            c.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # and then nothing more
            got, closed_after = _read_until_closed(c, 5.0)
        # read at held_s, found short of its end: cut at the bound's recheck
        assert got.startswith(b"HTTP/1.1 408") and closed_after < held_s + 1.0, (got, closed_after)
    finally:
        server.should_exit = True
        thread.join(10)
