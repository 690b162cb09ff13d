import pytest

from engine.block_pool import BlockPool, NoFreeBlocks, block_hashes, hash_block

pytestmark = pytest.mark.unit
BS = 4


def cache_seq(pool, blocks, tokens):
    for i, h in enumerate(block_hashes(tokens, BS)):
        pool.cache_block(blocks[i], h, tokens[i * BS:(i + 1) * BS])


def test_allocate_fifo_and_release_order():
    pool = BlockPool(6, BS)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert pool.num_free_blocks == 1
    pool.release([1, 0])
    assert pool.allocate(3) == [5, 1, 0]  # unhashed blocks return to the free tail
    pool.check_integrity({b: 1 for b in range(6)})


def test_allocate_is_all_or_nothing():
    pool = BlockPool(3, BS)
    pool.allocate(2)
    with pytest.raises(NoFreeBlocks):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    pool.check_integrity({0: 1, 1: 1})


def test_prefix_hit_miss_and_ref_counts():
    pool = BlockPool(8, BS)
    toks = list(range(10))  # 2 full blocks + 2 tokens
    a = pool.allocate(3)
    cache_seq(pool, a, toks)
    hs = block_hashes(toks, BS)
    assert len(hs) == 2
    assert pool.match_prefix(hs, toks) == [0, 1]
    # a different second block: hit on the first only
    other = toks[:4] + [99, 5, 6, 7]
    assert pool.match_prefix(block_hashes(other, BS), other) == [0]
    # a different first block: no hit at all (chained hashes)
    assert pool.match_prefix(block_hashes([7] + toks[1:8], BS), [7] + toks[1:8]) == []
    pool.acquire_cached([0, 1])
    assert pool.ref_counts[:3] == [2, 2, 1]
    pool.check_integrity({0: 2, 1: 2, 2: 1})


def test_token_recheck_rejects_hash_collision():
    pool = BlockPool(4, BS)
    [b] = pool.allocate(1)
    h = hash_block(None, [1, 2, 3, 4])
    pool.cache_block(b, h, [1, 2, 3, 4])
    # the same hash offered with other tokens (a forged collision) must miss
    assert pool.match_prefix([h], [9, 9, 9, 9]) == []
    assert pool.match_prefix([h], [1, 2, 3, 4]) == [b]


def test_lru_eviction_order_prefers_plain_free_then_oldest_cached():
    pool = BlockPool(5, BS)
    a, b, c = pool.allocate(1), pool.allocate(1), pool.allocate(1)
    for blk, t in ((a, [1] * 4), (b, [2] * 4), (c, [3] * 4)):
        pool.cache_block(blk[0], hash_block(None, t), t)
    pool.release(b)  # cached-free order: b, then a, then c
    pool.release(a)
    pool.release(c)
    assert pool.num_free_blocks == 5
    # plain free blocks 3, 4 go first; then the least recently released cached block (b=1)
    assert pool.allocate(3) == [3, 4, 1]
    assert pool.match_prefix([hash_block(None, [2] * 4)], [2] * 4) == []  # evicted
    assert pool.match_prefix([hash_block(None, [1] * 4)], [1] * 4) == [0]  # still cached
    events = pool.drain_events()
    assert [e.kind for e in events] == ["stored", "stored", "stored", "removed"]
    pool.check_integrity({3: 1, 4: 1, 1: 1})


def test_hit_on_cached_free_block_takes_it_out_of_lru():
    pool = BlockPool(3, BS)
    [a] = pool.allocate(1)
    h = hash_block(None, [5] * 4)
    pool.cache_block(a, h, [5] * 4)
    pool.release([a])
    assert pool.num_free_blocks == 3
    hit = pool.match_prefix([h], [5] * 4)
    pool.acquire_cached(hit)
    assert pool.num_free_blocks == 2
    assert pool.allocate(2) == [1, 2]  # the hit block is not evicted
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)
    pool.check_integrity({0: 1, 1: 1, 2: 1})


def test_first_writer_wins_and_double_release_raises():
    pool = BlockPool(4, BS)
    x, y = pool.allocate(2)
    h = hash_block(None, [1, 1, 1, 1])
    pool.cache_block(x, h, [1] * 4)
    pool.cache_block(y, h, [1] * 4)  # same content elsewhere: y stays unnamed
    pool.release([x, y])
    assert pool.allocate(3) == [2, 3, y]  # y is plain free, x is cached-free (evicted last)
    with pytest.raises(RuntimeError):
        pool.release([x])
    pool.check_integrity({2: 1, 3: 1, y: 1})


def test_integrity_detects_leak():
    pool = BlockPool(4, BS)
    pool.allocate(2)
    with pytest.raises(AssertionError, match="ref counts differ"):
        pool.check_integrity({0: 1})


def test_reset_prefix_cache():
    pool = BlockPool(2, BS)
    [a] = pool.allocate(1)
    pool.cache_block(a, hash_block(None, [1] * 4), [1] * 4)
    pool.release([a])
    assert pool.reset_prefix_cache() == 1
    assert pool.cached_hashes() == []
    pool.check_integrity({})


def test_block_hashes_are_stable_across_processes():
    # golden value: the router and every worker must name a block the same way
    assert hash_block(None, [1, 2, 3, 4]).hex() == "7077f7c78cbaa9547bb8ede0e304f4f3"
    assert hash_block(hash_block(None, [1, 2, 3, 4]), [5, 6, 7, 8]) == block_hashes(list(range(1, 9)), BS)[1]
    assert len(block_hashes(list(range(9)), BS)) == 2
