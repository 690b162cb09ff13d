"""Length-prefixed frames on a plain TCP connection: a 4-byte little-endian length, then
that many bytes. The token feed uses them (decode_worker/feed.py FeedSocket, router/
token_feed.py): a gRPC stream message cost about 80 us of CPU at each end on the
development machine, a frame on a socket 12-32 us (docs/performance.md, eighth round),
and at one stream a decode worker sends one message a token. No torch."""

from __future__ import annotations

import asyncio
import struct

HEADER = struct.Struct("<I")
MAX_FRAME = 64 << 20  # a FeedBatch of a few thousand requests' tokens is well under 1 MB


def frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader, limit: int = MAX_FRAME) -> bytes:
    """The next frame's bytes. Raises asyncio.IncompleteReadError at the end of the
    stream, ValueError for a frame longer than `limit`."""
    (n,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    if n > limit:
        raise ValueError(f"frame of {n} bytes is over the limit of {limit}")
    return await reader.readexactly(n)
