"""Reading a streamed completion the way the fault tests do: token ids as they come."""

from __future__ import annotations

import json
from typing import Awaitable, Callable

import httpx


async def stream_token_ids(client: httpx.AsyncClient, body: dict,
                           after_chunk: Callable[[list[int]], Awaitable[None]]) -> list[int]:
    """One streamed completion (`body` gets stream and return_token_ids), read to its
    end: its token ids. `after_chunk(ids so far)` is awaited after every chunk: where a
    test injects its fault mid-stream. An error event fails the test."""
    ids: list[int] = []
    async with client.stream("POST", "/v1/completions",
                             json={**body, "stream": True, "return_token_ids": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            ids.extend(chunk["choices"][0]["token_ids"] or [])
            await after_chunk(ids)
    return ids
