"""A bound on how long a request's headers may take to arrive.

uvicorn bounds an idle kept-alive connection (`timeout_keep_alive`) but not a request
whose headers trickle in: fifty such sockets (slowloris) held the router's connections
for as long as their clients pleased. Here a request's headers must be complete within
`--header-timeout-s` of its first byte (of the connection, for the first request);
otherwise the router answers 408 and closes the connection. Bodies are not timed here:
their size is bounded (413) and the handlers read them.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_TIMEOUT_RESPONSE = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, with a timer from a request's start to its headers' end."""

    header_timeout_s = 10.0
    _header_timer: asyncio.TimerHandle | None = None

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
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.write(_TIMEOUT_RESPONSE)
            self.transport.close()


def with_header_timeout(timeout_s: float) -> type[HeaderTimeoutProtocol]:
    """The protocol class for uvicorn.Config(http=...), bounded at `timeout_s`."""
    if timeout_s <= 0:
        raise ValueError(f"the header timeout must be positive, got {timeout_s}")
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": float(timeout_s)})
