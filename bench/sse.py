"""Incremental Server-Sent Events parser (the WHATWG event-stream format).

Fed raw bytes as they arrive, it returns the complete events so far as (event, data)
pairs. Comment lines (": ping") are dropped, multi-line `data:` fields are joined with
"\n", CRLF / LF / CR line ends are all accepted, and a UTF-8 character split across
two network reads is kept until its second half arrives.
"""
from __future__ import annotations

import codecs


class SSEParser:
    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buf = ""
        self._event = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[tuple[str, str]]:
        self._buf += self._decoder.decode(chunk)
        events: list[tuple[str, str]] = []
        while True:
            line, found = self._next_line()
            if not found:
                return events
            self._line(line, events)

    def close(self) -> list[tuple[str, str]]:
        """Events left when the stream ends without a final blank line (lenient)."""
        self._buf += self._decoder.decode(b"", final=True)
        events: list[tuple[str, str]] = []
        while True:
            line, found = self._next_line()
            if not found:
                break
            self._line(line, events)
        if self._buf.rstrip("\r"):
            self._line(self._buf.rstrip("\r"), events)
            self._buf = ""
        self._line("", events)
        return events

    def _next_line(self) -> tuple[str, bool]:
        buf = self._buf
        lf, cr = buf.find("\n"), buf.find("\r")
        if lf == -1 and cr == -1:
            return "", False
        if cr == -1 or (lf != -1 and lf < cr):
            i, end = lf, lf + 1
        elif cr + 1 == len(buf):
            return "", False  # maybe the first half of a CRLF: wait for more
        else:
            i, end = cr, cr + 2 if buf[cr + 1] == "\n" else cr + 1
        self._buf = buf[end:]
        return buf[:i], True

    def _line(self, line: str, events: list[tuple[str, str]]) -> None:
        if not line:
            if self._data:
                events.append((self._event or "message", "\n".join(self._data)))
            self._event, self._data = "", []
            return
        if line.startswith(":"):
            return  # comment / keep-alive
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
