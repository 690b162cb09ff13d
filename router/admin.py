"""What the router's /admin routes drive: the worker pools (implemented by the
cluster's PoolManager). The HTTP layer only authenticates and validates."""

from __future__ import annotations

import abc


class AdminInterface(abc.ABC):
    @abc.abstractmethod
    async def get_pools(self) -> dict:
        """The pools as JSON-able data: at least target and live worker counts per
        pool (`prefill`, `decode`)."""

    @abc.abstractmethod
    async def set_pools(self, prefill: int | None, decode: int | None) -> dict:
        """Set the target size of each pool given (None: unchanged); returns what
        `get_pools` would after the change was accepted (scaling may still be under
        way). Raise ValueError for a target the cluster cannot take (answered 400)."""
