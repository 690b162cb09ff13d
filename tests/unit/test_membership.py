"""The controller's membership long poll (router/pool.py): routers wait on a version
number and wake as soon as a worker comes, changes state or goes."""

import asyncio
import time

import pytest

from router.pool import PoolConfig, PoolManager
from worker_runtime.config import Role, WorkerConfig

pytestmark = pytest.mark.unit


def manager() -> PoolManager:
    return PoolManager(PoolConfig(WorkerConfig(role=Role.DECODE, worker_id="template")))


async def test_a_waiting_router_wakes_on_a_change_not_at_its_timeout():
    pool = manager()
    first = await pool.membership(-1, 10.0)  # behind: answered at once
    assert first["workers"] == [] and first["targets"] == {"prefill": 1, "decode": 1}
    t0 = time.monotonic()
    waiting = asyncio.create_task(pool.membership(first["version"], 10.0))
    await asyncio.sleep(0.1)
    assert not waiting.done()
    pool._note("decode-0 ready")
    got = await asyncio.wait_for(waiting, 2.0)
    assert got["version"] == first["version"] + 1 and time.monotonic() - t0 < 2.0


async def test_with_no_change_the_poll_returns_at_its_timeout_with_the_same_version():
    pool = manager()
    v = (await pool.membership(-1, 0))["version"]
    t0 = time.monotonic()
    again = await pool.membership(v, 0.3)
    assert again["version"] == v and 0.25 <= time.monotonic() - t0 < 2.0
    # every waiter wakes, and a later change wakes later waiters too
    a, b = (asyncio.create_task(pool.membership(v, 10.0)) for _ in range(2))
    await asyncio.sleep(0.05)
    pool._note("x")
    assert [r["version"] for r in await asyncio.gather(a, b)] == [v + 1, v + 1]
    c = asyncio.create_task(pool.membership(v + 1, 10.0))
    await asyncio.sleep(0.05)
    pool._note("y")
    assert (await asyncio.wait_for(c, 2.0))["version"] == v + 2
