"""engine/runner.py: a step's block tables and int lists laid out as host tensors."""

from __future__ import annotations

import random
from array import array

import pytest
import torch

from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager, PrefixHit
from engine.runner import _host_ints, _packed, _table_rows
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

pytestmark = pytest.mark.unit


def test_tables_of_any_length_become_one_padded_int32_matrix():
    rng = random.Random(0)
    for _ in range(50):
        tables = [rng.sample(range(1000), rng.randint(0, 12)) for _ in range(rng.randint(0, 9))]
        mixed = [array("i", t) if i % 2 else t for i, t in enumerate(tables)]  # arrays and lists alike
        flat, width = _table_rows(mixed)
        assert width == max((len(t) for t in tables), default=0)
        want = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32).view(len(tables), width)
        got = _host_ints(flat, "i").view(len(tables), width)
        assert got.dtype == torch.int32 and torch.equal(got, want)


def test_int_lists_keep_their_values_and_dtype():
    assert _host_ints(None, "q") is None
    for code, dtype, values in (("q", torch.int64, [0, -2, 2**40, 7]), ("i", torch.int32, [5, -1, 2**31 - 1])):
        t = _host_ints(values, code)
        assert t.dtype == dtype and t.tolist() == values
        empty = _host_ints([], code)
        assert empty.dtype == dtype and empty.shape == (0,)


def test_a_block_table_is_an_int_array_through_grow_trim_and_free():
    pool = BlockPool(num_blocks=12, block_size=4, enable_prefix_caching=False)
    cache = KVCacheManager(pool)
    seq = Sequence("a", list(range(10)), SamplingParams(max_tokens=8))
    cache.allocate(seq, PrefixHit(), 3)
    cache.grow(seq, 2)
    table = cache.block_table("a")
    assert isinstance(table, array) and table.typecode == "i" and len(table) == 5 == len(set(table))
    cache.trim(seq, 9)  # 9 tokens: 3 blocks kept, the last 2 back to the pool
    assert list(cache.block_table("a")) == list(table[:3]) and pool.num_free_blocks == 12 - 3
    cache.free(seq)
    assert len(cache.block_table("a")) == 0 and pool.num_free_blocks == 12
    cache.check_integrity(set())


def test_parts_sent_in_one_buffer_come_back_whole_and_aligned():
    rng = random.Random(1)
    for code, dtype in (("q", torch.int64), ("i", torch.int32)):
        for _ in range(30):
            parts = [None if rng.random() < 0.2 else [rng.randrange(-5, 2**30) for _ in range(rng.randint(0, 9))]
                     for _ in range(rng.randint(0, 7))]
            if code == "i" and parts and parts[0] is not None:
                parts[0] = array("i", parts[0])  # a block-table buffer travels as it is
            views = _packed(parts, code, torch.device("cpu"), pin=False)
            assert len(views) == len(parts)
            for x, v in zip(parts, views):
                if x is None:
                    assert v is None
                    continue
                assert v.dtype == dtype and v.tolist() == list(x)
                assert v.data_ptr() % 16 == 0 or len(x) == 0
