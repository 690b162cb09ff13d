"""A bound on how long a request's headers may take to arrive.

uvicorn bounds an idle kept-alive connection (`timeout_keep_alive`) but not a request
whose headers trickle in: fifty such sockets (slowloris) held the router's connections
for as long as their clients pleased. Here a request's headers must be complete within
`--header-timeout-s` of its first byte (of the connection, for the first request);
otherwise the router answers 408 and closes the connection. Bodies are not timed here:
their size is bounded (413) and the handlers read them.

The timer measures the client, not the server: when it fires while request bytes wait
unread in the socket (the loop was held up, or reading is paused), those bytes are the
server's delay, so the bound is extended (at most once more over) until they are read.
On by default (30 s, `--header-timeout-s`): nginx's client_header_timeout is 60 s,
Apache's mod_reqtimeout 20-40 s; a loop stall that long would be an outage of its own.
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import termios

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# while bytes wait unread at the deadline: look again this often, up to the bound once more
_RECHECK_S = 0.25
_TIMEOUT_RESPONSE = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, with a timer from a request's start to its headers' end."""

    header_timeout_s = 30.0
    _header_timer: asyncio.TimerHandle | None = None
    _extended_until: float | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._header_timer is None:  # a kept-alive connection's next request
            self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._extended_until = None
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        now = self.loop.time()
        if self._extended_until is None:
            self._extended_until = now + self.header_timeout_s
        if now < self._extended_until and unread_bytes(self.transport) > 0:
            self._header_timer = self.loop.call_later(_RECHECK_S, self._headers_late)
            return
        self.transport.write(_TIMEOUT_RESPONSE)
        self.transport.close()


def unread_bytes(transport: asyncio.BaseTransport) -> int:
    """Bytes the kernel holds for this socket that the loop has not read yet (0 when it
    cannot tell)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        buf = array.array("i", [0])
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, buf, True)
        return buf[0]
    except (OSError, ValueError):
        return 0


def with_header_timeout(timeout_s: float) -> type[HeaderTimeoutProtocol]:
    """The protocol class for uvicorn.Config(http=...), bounded at `timeout_s`."""
    if timeout_s <= 0:
        raise ValueError(f"the header timeout must be positive, got {timeout_s}")
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": float(timeout_s)})
