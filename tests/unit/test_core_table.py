"""The core ledger (engine/cores.py): workers of one host see each other's idle cores,
and the pool hands each worker its share and the ledger."""

import os

import pytest

from engine.config import DeviceConfig
from engine.cores import LEDGER_BYTES, CoreTable, create_core_table, open_core_table
from worker_runtime.loop import EngineLoop

pytestmark = pytest.mark.unit


@pytest.fixture
def ledger_path():
    path = create_core_table("tandem-cores-test")
    yield path
    os.unlink(path)


def test_a_worker_borrows_the_shared_cores_whose_owners_are_idle(ledger_path):
    assert os.path.getsize(ledger_path) == LEDGER_BYTES
    shared = (0, 1, 2, 3)
    prefill = CoreTable(ledger_path, (0, 1), shared)
    decode = CoreTable(ledger_path, (2,), shared)
    assert decode.borrowable() == (0, 1, 3)  # core 3 has no owner: lendable too
    assert prefill.borrowable() == (2, 3)
    prefill.busy()
    assert decode.borrowable() == (3,) and prefill.borrowable() == (2, 3)  # its own cores never count
    decode.busy()
    assert prefill.borrowable() == (3,)
    prefill.idle()
    assert decode.borrowable() == (0, 1, 3)
    decode.close()  # a worker that stops gives its cores back
    assert prefill.borrowable() == (2, 3)
    prefill.close()


def test_no_ledger_without_a_shared_set_or_a_file(ledger_path, tmp_path, caplog):
    assert open_core_table(None, (0,), (0, 1)) is None
    assert open_core_table(ledger_path, (0, 1), (0, 1)) is None  # owns every shared core: nothing to borrow
    assert open_core_table(ledger_path, None, (0, 1)) is None
    assert open_core_table(str(tmp_path / "gone"), (0,), (0, 1)) is None  # another host's path: not lent, logged
    assert "cores are not lent" in caplog.text
    got = open_core_table(ledger_path, (1,), (0, 1))
    assert got is not None and got.others == (0,)
    got.close()


def test_the_pool_gives_workers_their_share_and_the_ledger():
    from controller.pools import PoolConfig, PoolManager
    from worker_runtime.config import Role, WorkerConfig

    template = WorkerConfig(role=Role.DECODE, worker_id="template")
    mgr = PoolManager(PoolConfig(template, cores=(0, 1)))
    try:
        assert mgr.core_table is not None and os.path.exists(mgr.core_table)
        dev = mgr._worker_config(Role.PREFILL, "prefill-0", 0).engine.device
        assert dev.cpu_affinity == (0,) and dev.shared_cores == (0, 1) and dev.core_table == mgr.core_table
        assert mgr._worker_config(Role.DECODE, "decode-0", 1).engine.device.cpu_affinity == (1,)
    finally:
        os.unlink(mgr.core_table)
    assert PoolManager(PoolConfig(template, cores=(0,))).core_table is None  # one core: nothing to lend
    assert PoolManager(PoolConfig(template)).core_table is None
    assert DeviceConfig().core_table is None


async def test_the_engine_loop_reports_idle_before_it_sleeps():
    import asyncio

    idle: list[int] = []
    work = [3]

    def step():
        work[0] -= 1
        return []

    loop = EngineLoop(step=step, wait_s=lambda: 0.0 if work[0] > 0 else None, on_results=lambda r: None,
                      on_fatal=lambda m: None, on_idle=lambda: idle.append(work[0]))
    loop.idle_tick_s = 0.01
    loop.start()
    try:
        for _ in range(100):
            if idle:
                break
            await asyncio.sleep(0.01)
    finally:
        loop.stop()
    assert idle and idle[0] == 0  # not while it had work


def test_each_pool_sizes_its_own_kv_cache():
    from cli.main import build_parser
    from cli.serve import pool_config
    from controller.pools import PoolManager
    from worker_runtime.config import Role

    args = build_parser().parse_args(["serve", "--num-blocks", "38", "--decode-num-blocks", "96",
                                      "--prefill-kv-cache-memory-gb", "0.5", "--pin-cores", "none"])
    mgr = PoolManager(pool_config(args, "/nonexistent"))
    prefill = mgr._worker_config(Role.PREFILL, "prefill-0", 0).engine.cache
    decode = mgr._worker_config(Role.DECODE, "decode-0", 1).engine.cache
    assert (decode.num_blocks, prefill.num_blocks, prefill.kv_cache_memory_gb) == (96, None, 0.5)
    shared = PoolManager(pool_config(build_parser().parse_args(["serve", "--num-blocks", "38", "--pin-cores", "none"]),
                                     "/nonexistent"))
    assert shared._worker_config(Role.PREFILL, "prefill-0", 0).engine.cache.num_blocks == 38
    assert shared._worker_config(Role.DECODE, "decode-0", 0).engine.cache.num_blocks == 38
