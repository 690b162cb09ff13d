"""The controller's membership long poll (controller/pools.py): routers wait on a
version number and wake as soon as a worker comes, changes state or goes."""

import asyncio
import time

import pytest

from controller.pools import PoolConfig, PoolManager
from worker_runtime.config import Role, WorkerConfig

pytestmark = pytest.mark.unit


def manager() -> PoolManager:
    return PoolManager(PoolConfig(WorkerConfig(role=Role.DECODE, worker_id="template")))


async def polls_waiting(pool: PoolManager, n: int) -> None:
    """Until `n` long polls are inside their wait (not merely created as tasks)."""
    for _ in range(1000):
        if pool.polls_waiting == n:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"{pool.polls_waiting} polls waiting, expected {n}")


async def test_a_waiting_router_wakes_on_a_change_not_at_its_timeout():
    pool = manager()
    first = await pool.membership(-1, 10.0)  # behind: answered at once
    assert first.workers == () and first.targets == {Role.PREFILL: 1, Role.DECODE: 1}
    t0 = time.monotonic()
    waiting = asyncio.create_task(pool.membership(first.version, 10.0))
    await polls_waiting(pool, 1)
    pool._note("decode-0 ready")
    got = await asyncio.wait_for(waiting, 2.0)
    assert got.version == first.version + 1 and time.monotonic() - t0 < 2.0
    assert pool.polls_waiting == 0


async def test_with_no_change_the_poll_returns_at_its_timeout_with_the_same_version():
    pool = manager()
    v = (await pool.membership(-1, 0)).version
    t0 = time.monotonic()
    again = await pool.membership(v, 0.3)
    assert again.version == v and 0.25 <= time.monotonic() - t0 < 2.0
    # every waiter wakes, and a later change wakes later waiters too
    a, b = (asyncio.create_task(pool.membership(v, 10.0)) for _ in range(2))
    await polls_waiting(pool, 2)
    pool._note("x")
    assert [r.version for r in await asyncio.gather(a, b)] == [v + 1, v + 1]
    c = asyncio.create_task(pool.membership(v + 1, 10.0))
    await polls_waiting(pool, 1)
    pool._note("y")
    assert (await asyncio.wait_for(c, 2.0)).version == v + 2


def test_a_shrinking_pool_drains_by_the_workers_own_counts():
    """The controller holds no router's counters (they live in the routers' processes):
    it picks whom to drain from each worker's own stats, starting ones first."""
    from controller.pools import PoolWorker, _victim_order
    from worker_runtime.membership import WorkerState
    from worker_runtime.stats import WorkerStats

    def worker(wid, state, running=0, waiting=0):
        w = PoolWorker(wid, Role.DECODE, actor=None, state=state)
        if state is WorkerState.READY:
            w.stats = WorkerStats(wid, 1, Role.DECODE, num_running=running, num_waiting=waiting)
        return w

    busy, idle, queued, starting = (worker("busy", WorkerState.READY, running=9),
                                    worker("idle", WorkerState.READY),
                                    worker("queued", WorkerState.READY, waiting=3),
                                    worker("starting", WorkerState.STARTING))
    order = sorted([busy, idle, queued, starting], key=_victim_order)
    assert [w.worker_id for w in order] == ["starting", "idle", "queued", "busy"]
    assert "in_flight" not in busy.as_dict()  # no always-zero field in the controller's answer
