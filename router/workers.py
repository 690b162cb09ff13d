"""A router's records of the workers it routes to (the controller keeps its own,
controller/pools.py; the two share only worker_runtime/membership.py's types)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from worker_runtime.client import WorkerClient
from worker_runtime.config import Role
from worker_runtime.membership import WorkerState
from worker_runtime.stats import WorkerStats


@dataclass
class Load:
    """What this router has sent a worker that the worker's own stats may not show yet:
    the one owner of those counters (ClusterBackend claims and ends them; routing and
    /admin/pools read them). They live in the router's process only.

        claim() -> in_flight+1, pending+1, blocks/tokens added
        settle  -> pending-1, blocks/tokens removed (first token seen: stats show it now)
        end     -> settle if not yet, in_flight-1
    """

    in_flight: int = 0  # requests routed here and not finished
    pending: int = 0  # of those, routed but not yet producing tokens
    blocks: int = 0  # decode: KV blocks those pending requests will claim
    tokens: int = 0  # prefill: prompt tokens those pending requests bring

    def claim(self, blocks: int = 0, tokens: int = 0) -> "Claim":
        self.in_flight += 1
        self.pending += 1
        self.blocks += blocks
        self.tokens += tokens
        return Claim(self, blocks, tokens)


@dataclass
class Claim:
    load: Load
    blocks: int
    tokens: int
    settled: bool = False
    ended: bool = False

    def settle(self) -> None:
        if not self.settled:
            self.settled = True
            self.load.pending -= 1
            self.load.blocks -= self.blocks
            self.load.tokens -= self.tokens

    def end(self) -> None:
        self.settle()
        if not self.ended:
            self.ended = True
            self.load.in_flight -= 1


@dataclass
class Worker:
    """One worker as this router sees it: reachable (a client), its stats as last
    polled, and the load this router has sent it."""

    worker_id: str
    role: Role
    client: WorkerClient
    state: WorkerState = WorkerState.STARTING
    epoch: int = 0
    metrics_address: str = ""
    pid: int = 0
    stats: WorkerStats | None = None
    load: Load = field(default_factory=Load)
    tasks: list[asyncio.Task] = field(default_factory=list)  # its KV event stream
