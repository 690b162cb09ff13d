"""KV groups (engine/kv_groups.py): how interleaved windowed and global layers are split
into groups with tables of their own, and the cache manager's bookkeeping of them: a
windowed group's blocks go back as a sequence grows, a prefix hit needs only the
blocks a window reaches, and nothing leaks."""

from __future__ import annotations

import pytest

from engine.block_pool import BlockPool
from engine.kv_cache_manager import NO_BLOCK, KVCacheManager
from engine.kv_groups import KVGroup, KVGroups
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

pytestmark = pytest.mark.unit

BS = 16


def test_groups_of_each_family_shape():
    gemma2 = KVGroups.plan(4, lambda i: None if i % 2 else 48)  # windowed layers 0, 2
    assert gemma2 == KVGroups((KVGroup((1, 3), None), KVGroup((0, 2), 48)), slots=2)
    assert gemma2.place(2) == (1, 1) and gemma2.place(3) == (0, 1)
    gemma3 = KVGroups.plan(12, lambda i: None if i % 6 == 5 else 512)  # five windowed to one global
    assert gemma3.slots == 2 and [g.layers for g in gemma3.groups] == [
        (5, 11), (0, 1), (2, 3), (4, 6), (7, 8), (9, 10)]
    assert gemma3.windows == (None, 512, 512, 512, 512, 512)
    short = KVGroups.plan(5, lambda i: None if i < 2 else 64)  # 2 global, 3 windowed: a short last group
    assert [g.layers for g in short.groups] == [(0, 1), (2, 3), (4,)] and short.slots == 2
    assert KVGroups.plan(4, lambda i: 64) == KVGroups((KVGroup((0, 1, 2, 3), 64),), 4)  # every layer windowed
    assert KVGroups.plan(3, lambda i: None) == KVGroups((KVGroup((0, 1, 2), None),), 3)
    one = KVGroups.plan(4, lambda i: None if i % 2 else 48, hybrid=False)
    assert one == KVGroups((KVGroup((0, 1, 2, 3), None),), 4) and not one.hybrid


def _seq(sid: str, tokens: list[int]) -> Sequence:
    return Sequence(sid, list(tokens), SamplingParams(max_tokens=1000))


def _run(cache: KVCacheManager, seq: Sequence, upto: int) -> None:
    """Compute `seq` up to `upto` tokens a block at a time, as the scheduler would (grow,
    compute, name the full blocks, give back what the windows passed)."""
    while seq.num_computed < upto:
        n = min(BS, upto - seq.num_computed)
        need = cache.num_blocks_needed(seq, seq.num_computed + n)
        if need:
            cache.grow(seq, need)
        seq.num_computed += n
        cache.commit_full_blocks(seq)
        cache.release_outside_windows(seq)


def test_a_windowed_group_holds_its_window_and_gives_the_rest_back():
    pool = BlockPool(64, BS)
    cache = KVCacheManager(pool, group_windows=(40,))
    assert cache.num_groups == 2
    tokens = list(range(1000, 1400))
    seq = _seq("a", tokens)
    hit = cache.match(seq, max_tokens=len(tokens) - 1)
    assert hit.num_blocks == 0 and cache.can_fit(hit, 3)
    cache.allocate(seq, hit, 1)
    assert [len(t) for t in cache.block_tables("a")] == [1, 1] and pool.num_used_blocks == 2
    held = []
    for upto in range(BS, 400, BS):
        _run(cache, seq, upto)
        held.append(cache.num_held_by_group("a"))
        cache.check_integrity({"a"})
    # the global group holds every block; the windowed one those its 40-token window reaches
    assert held[-1] == [24, 3] and max(w for _, w in held) <= 40 // BS + 2
    first, windowed = cache.block_tables("a")
    assert NO_BLOCK not in first.tolist() and windowed.tolist()[:20] == [NO_BLOCK] * 20
    assert set(windowed.tolist()[20:]).isdisjoint(first.tolist())
    # a drafted tail trimmed: both tables lose it
    cache.grow(seq, cache.num_blocks_needed(seq, 400))
    cache.trim(seq, 384)
    assert [len(t) for t in cache.block_tables("a")] == [24, 24]
    cache.free(seq)
    cache.check_integrity(set())
    assert pool.num_free_blocks == 64  # every block back (named ones cached-free)


def test_a_prefix_hit_takes_the_windowed_groups_blocks_its_window_reaches():
    pool = BlockPool(64, BS)
    cache = KVCacheManager(pool, group_windows=(40,))
    tokens = list(range(2000, 2200))
    a = _seq("a", tokens)
    cache.allocate(a, cache.match(a, 199), 1)
    _run(cache, a, 160)  # ten full blocks named; the windowed group gave back its first seven
    cache.forget(a)
    b = _seq("b", tokens[:160] + [5, 6, 7])
    hit = cache.match(b, max_tokens=162)
    assert hit.num_blocks == 10
    # the first position after the hit (160) sees 121.. in a 40-token window: blocks 7, 8, 9
    assert hit.groups[0][:7] == (NO_BLOCK,) * 7 and NO_BLOCK not in hit.groups[0][7:]
    assert hit.num_taken == 13  # ten global blocks and three windowed, all cached-free
    cache.allocate(b, hit, 1)
    assert cache.num_held_by_group("b") == [11, 4]
    cache.check_integrity({"b"})
    cache.forget(b)

    # the windowed group's block 8 evicted: hits of ten or nine blocks would need it (their
    # windows start at blocks 7 and 6); eight blocks need 5-7 only, so the hit shrinks to 8
    from engine.block_pool import group_key
    c = _seq("c", tokens[:160] + [5, 6, 7])
    hashes = cache._hashes_of(c, 10)
    victim = pool.lookup(group_key(hashes[8], 1), tokens[128:144])
    assert victim is not None
    pool._cached_free.move_to_end(victim, last=False)  # the oldest: evicted once the free list is empty
    pool.allocate(len(pool._free) + 1)
    assert pool.lookup(group_key(hashes[8], 1), tokens[128:144]) is None
    hit = cache.match(c, max_tokens=162)
    assert hit.num_blocks == 8 and hit.groups[0][:5] == (NO_BLOCK,) * 5
    assert all(b != NO_BLOCK for b in hit.groups[0][5:8])


def test_new_blocks_never_evict_the_hit_they_join():
    """Every group's hit is taken before a new block is: with no free block left, the new
    ones come from the LRU of cached-free blocks, where the windowed group's hit waits too
    (a bug once: a hit block evicted, handed out as new, and held twice by one sequence)."""
    pool = BlockPool(24, BS)
    cache = KVCacheManager(pool, group_windows=(40,))
    tokens = list(range(3000, 3200))
    a = _seq("a", tokens)
    cache.allocate(a, cache.match(a, 199), 1)
    _run(cache, a, 96)
    cache.forget(a)  # six blocks a group, all cached-free
    filler = pool.allocate(len(pool._free))  # nothing free: new blocks must evict
    b = _seq("b", tokens[:96] + [1, 2, 3])
    hit = cache.match(b, max_tokens=98)
    assert hit.num_blocks == 6 and hit.groups[0][3:] and NO_BLOCK not in hit.groups[0][3:]
    for x in hit.groups[0][3:]:  # the windowed hit the oldest in the LRU: the first an eviction takes
        pool._cached_free.move_to_end(x, last=False)
    cache.allocate(b, hit, 1)
    held = [x for t in cache.block_tables("b") for x in t.tolist() if x != NO_BLOCK]
    assert len(held) == len(set(held)), cache.block_tables("b")  # no block twice
    assert all(pool.ref_counts[x] == 1 for x in held)
    pool.release(filler)
    cache.check_integrity({"b"})


def test_a_layers_kv_moves_as_one_slot_of_its_groups_blocks():
    """The prefill side's per-layer push (worker_runtime/tp_kv.py `layer_writes`): with one
    group a layer is its own slot of every block; with groups, layer l moves slot s of
    group g's blocks only (the block lists hold each group's blocks in turn), and a first
    write catches up on the layers before it, one write each."""
    from worker_runtime.tp_kv import layer_writes

    local, remote = [1, 2, 3, 4, 5, 6], [11, 12, 13, 14, 15, 16]
    assert layer_writes(local, remote, None, 2, caught_up=True) == [(local, remote, range(2, 3))]
    assert layer_writes(local, remote, None, 2, caught_up=False) == [(local, remote, range(0, 3))]
    places = [KVGroups.plan(4, lambda i: None if i % 2 else 48).place(n) for n in range(4)]  # Gemma 2's
    assert places == [(1, 0), (0, 0), (1, 1), (0, 1)]
    assert layer_writes(local, remote, places, 2, caught_up=True) == [([4, 5, 6], [14, 15, 16], range(1, 2))]
    assert layer_writes(local, remote, places, 1, caught_up=False) == [
        ([4, 5, 6], [14, 15, 16], range(0, 1)), ([1, 2, 3], [11, 12, 13], range(0, 1))]
