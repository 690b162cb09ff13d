"""The KV tiers' index (engine/kv_tiers.py) and its place in the block pool and the
scheduler: where blocks go, the moves in their order, the budgets, and what the router
hears. Pure Python: the moves are read, not run (the model tests run them)."""

from __future__ import annotations

import pytest

from engine.block_pool import BlockPool, block_hashes
from engine.config import CacheConfig, ConfigError, SchedulerConfig
from engine.kv_tiers import FETCH_WAIT_S, CostModel, TierIndex
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, Status

pytestmark = pytest.mark.unit

BS = 4


def h(i: int) -> bytes:
    return bytes([i]) * 16


def toks(i: int) -> tuple[int, ...]:
    return (i,) * BS


def index(host=2, swap=0, disk=0, removed=None, on_device=lambda h: False) -> TierIndex:
    return TierIndex(BS, 1000, host, swap, disk, on_device=on_device,
                     emit_removed=(removed.append if removed is not None else lambda h: None))


def test_host_lru_spills_to_disk_and_fetches_back_in_order():
    removed: list[bytes] = []
    t = index(host=2, disk=2, removed=removed)
    assert t.offer(10, h(1), toks(1)) and t.offer(11, h(2), toks(2))
    assert t.take_moves() == [("save", 10, 1 - 1), ("save", 11, 1)]
    assert t.offer(12, h(3), toks(3))  # host full: the oldest (h1) goes to disk first, then h3 takes its slot
    assert t.take_moves() == [("spill", 0, h(1), toks(1)), ("save", 12, 0)]
    assert t.host_run([h(2), h(3)], lambda i: toks(2 + i)) == 2
    assert t.host_run([h(2)], lambda i: (9,) * BS) == 0  # same hash, other tokens: a miss
    t.offer(13, h(4), toks(4))
    t.offer(14, h(5), toks(5))  # disk full too: its oldest file is deleted (h1 leaves the worker), then h3 spills
    assert t.take_moves() == [("spill", 1, h(2), toks(2)), ("save", 13, 1),
                              ("unlink", h(1)), ("spill", 0, h(3), toks(3)), ("save", 14, 0)]
    assert removed == [h(1)]
    pending, n = t.fetch_run([h(2), h(3)], lambda i: toks(2 + i))
    assert (pending, n) == (False, 2)
    # bringing h2, h3 up pushes h4, h5 down; their files may not push out the two being read:
    # host and disk are full, so h4 and h5 are dropped, not spilled
    assert t.prefetch([h(2), h(3)]) == 2
    moves = t.take_moves()
    assert [m[0] for m in moves] == ["fetch", "fetch"] and t.stats.host_dropped == 2
    assert sorted(removed) == sorted([h(1), h(4), h(5)])
    assert t.fetch_run([h(2), h(3)], lambda i: toks(2 + i))[0] is True
    t.fetched(h(2), True, 0.01)
    t.fetched(h(3), False)  # its file failed its check: forgotten, deleted
    assert t.host_run([h(2), h(3)], lambda i: toks(2 + i)) == 1
    assert t.take_moves() == [("unlink", h(3))]
    assert t.stats.disk_errors == 1 and t.stats.disk_fetches == 1
    t.check_integrity()


def test_restore_frees_the_slot_after_the_load_and_hold_protects_from_eviction():
    t = index(host=1)
    t.offer(5, h(1), toks(1))
    t.take_moves()
    t.hold([h(1)])
    t.offer(6, h(2), toks(2))  # the held block keeps its slot: no room, h2 leaves (no disk)
    assert not t.holds(h(2))
    t.restore(h(1), 7)
    assert t.take_moves() == [("load", 0, 7)]
    assert t.offer(8, h(3), toks(3)) and t.take_moves() == [("save", 8, 0)]  # the slot, reused after the load
    t.check_integrity()


def test_held_blocks_count_against_the_budget_so_an_eviction_still_finds_a_slot():
    """The restores' own allocations evict device blocks into host memory: the held
    blocks keep their slots, so the LRU makes room from the others (a bug once: held
    slots were not counted, the free list ran dry, and the evicted blocks were lost)."""
    t = index(host=3, disk=8)
    for i in (1, 2, 3):
        t.offer(i, h(i), toks(i))
    t.take_moves()
    t.hold([h(3)])
    assert t.offer(9, h(9), toks(9))  # room made by spilling h1, the oldest
    assert t.take_moves() == [("spill", 0, h(1), toks(1)), ("save", 9, 0)]
    t.restore(h(3), 4)
    t.take_moves()
    t.check_integrity()


def test_swap_budget_pins_a_preempted_sequences_blocks_out_of_the_lru():
    t = index(host=1, swap=2)
    assert t.swap_out("s", [h(1), h(2)], num_tokens=8)
    for i in (1, 2):
        t.offer(i, h(i), toks(i))
    for i in (3, 4, 5):  # ordinary evictions churn the LRU slot; the swapped blocks stay
        t.offer(i, h(i), toks(i))
    assert t.host_run([h(1), h(2)], lambda i: toks(1 + i)) == 2 and t.num_pinned == 2
    t.unpin("s")  # it ended: its blocks are ordinary now, over the LRU budget, the oldest go
    assert t.num_pinned == 0 and t.num_host_used == 1
    t.check_integrity()
    t.cost = CostModel(copy_bytes_per_s=1e3)  # a slow copy, against a million tokens a second measured
    t.cost.observe_prefill(1000, 0.001)
    assert not t.swap_out("q", [h(7)], num_tokens=4) and t.stats.recomputes == 1


def test_a_fetch_waits_only_so_long_and_prefetch_keeps_the_prefix_it_extends():
    t = index(host=2, disk=4)
    for i in (1, 2, 3):
        t.offer(i, h(i), toks(i))  # h1 spills
    t.offer(4, h(4), toks(4))  # h2 spills
    t.take_moves()
    # the prefix h3 (in host) then h1 (on disk): fetching h1 must not evict h3
    assert t.prefetch([h(1)], protect=[h(3)]) == 1
    assert t.host_run([h(3)], lambda i: toks(3)) == 1
    assert t.fetch_run([h(1)], lambda i: toks(1), now=1e12) == (False, 0)  # waited too long: compute it
    assert t.fetch_run([h(1)], lambda i: toks(1))[0]
    assert FETCH_WAIT_S > 0


def test_block_pool_offers_evictions_and_reports_removed_only_when_the_worker_lets_go():
    pool = BlockPool(2, BS)
    removed: list[bytes] = []
    t = TierIndex(BS, 1000, host_blocks=1, on_device=pool.holds, emit_removed=pool.emit_removed)
    pool.lower = t
    ids = list(range(3 * BS))
    hs = block_hashes(ids, BS)
    for i in range(2):
        (b,) = pool.allocate(1)
        pool.cache_block(b, hs[i], ids[i * BS:(i + 1) * BS])
        pool.release([b])
    pool.drain_events()
    pool.allocate(1)  # evicts block 0's content to host memory: still on this worker, below its device
    assert [(e.kind, e.hashes) for e in pool.drain_events()] == [("offloaded", [hs[0]])]
    assert set(pool.cached_hashes()) == set(hs[:2]) and pool.offloaded_hashes() == [hs[0]]
    pool.allocate(1)  # evicts the second: host memory holds one, so the first leaves the worker
    assert [(e.kind, e.hashes) for e in pool.drain_events()] == [("removed", [hs[0]]), ("offloaded", [hs[1]])]
    removed.extend(pool.cached_hashes())
    assert removed == [hs[1]]
    assert pool.reset_prefix_cache() == 1 and t.num_host_used == 0


def test_scheduler_restores_a_prefix_from_host_memory_and_counts_it_computed():
    pool = BlockPool(6, BS)
    pool.lower = TierIndex(BS, 1000, host_blocks=8, on_device=pool.holds, emit_removed=pool.emit_removed)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64, watermark=0.0), pool)
    params = SamplingParams(max_tokens=1, temperature=0)

    def run(seq_id, prompt):
        seq = Sequence(seq_id, prompt, params, frozenset())
        s.add(seq)
        out = s.schedule()
        moves = s.cache.take_moves()
        s.update(out, {seq_id: 1})
        s.check_integrity()
        return seq, out, moves

    a = list(range(100, 100 + 4 * BS + 1))
    run("a", a)
    run("b", list(range(300, 300 + 5 * BS + 1)))  # evicts a's blocks into host memory
    seq, out, moves = run("a2", a)
    assert [m[0] for m in moves].count("load") == 4
    (work,) = out.plan.works()
    assert work.start_pos == 4 * BS and len(work.token_ids) == 1
    assert seq.num_cached_tokens == 4 * BS and seq.status is Status.FINISHED


def test_tier_flags_are_checked():
    with pytest.raises(ConfigError, match="disk-path"):
        CacheConfig(offload_host_gb=1, offload_disk_gb=1)
    with pytest.raises(ConfigError, match="fed from host memory"):
        CacheConfig(offload_disk_gb=1, offload_disk_path="/tmp/x")
    with pytest.raises(ConfigError, match="prefix caching"):
        CacheConfig(offload_host_gb=1, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="host tier"):
        TierIndex(BS, 1000, host_blocks=0, disk_blocks=3)
