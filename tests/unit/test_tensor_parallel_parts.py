"""The pieces of tensor parallelism that need no model: which heads a rank holds, the
checks on sizes, and the shared-memory collectives (ranks as threads here; as
processes in tests/model/test_tensor_parallel.py)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from engine.config import ConfigError, ModelConfig
from engine.parallel.comm import RankLost, ShmComm
from engine.parallel.shard import Shard, check_divisible, holds, kv_heads_of, local_config, shard_tensor

pytestmark = pytest.mark.unit


def cfg(heads=8, kv=4, inter=64, hd=4):
    return ModelConfig(architecture="llama", vocab_size=32, hidden_size=heads * hd, intermediate_size=inter,
                       num_layers=1, num_heads=heads, num_kv_heads=kv, head_dim=hd, max_position_embeddings=64)


@pytest.mark.parametrize("kv,size,want", [
    (4, 2, [range(0, 2), range(2, 4)]),
    (4, 4, [range(i, i + 1) for i in range(4)]),
    (2, 4, [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]),  # replicated: two ranks a head
    (1, 2, [range(0, 1), range(0, 1)]),
])
def test_each_rank_holds_the_kv_heads_its_query_heads_read(kv, size, want):
    c = cfg(kv=kv)
    got = [kv_heads_of(c, Shard(r, size)) for r in range(size)]
    assert got == want
    group = c.num_heads // c.num_kv_heads
    for r in range(size):  # every query head of rank r reads a KV head rank r holds
        q = range(r * c.num_heads // size, (r + 1) * c.num_heads // size)
        assert {h // group for h in q} <= set(got[r])
        local = local_config(c, Shard(r, size))
        assert local.num_kv_heads == len(got[r]) and local.num_heads == c.num_heads // size


def test_sizes_that_do_not_divide_the_model_are_named():
    with pytest.raises(ConfigError, match="8 attention heads"):
        check_divisible(cfg(), 3)
    with pytest.raises(ConfigError, match="intermediate size 65"):
        check_divisible(cfg(inter=65), 2)
    with pytest.raises(ConfigError, match="3 KV heads"):
        check_divisible(cfg(heads=6, kv=3), 2)
    check_divisible(cfg(kv=2), 8)  # 8 ranks, 2 KV heads: replicated


def test_row_parallel_slices_and_a_bias_added_once():
    c = cfg()
    w = torch.arange(c.hidden_size * c.num_heads * c.head_dim, dtype=torch.float32).view(c.hidden_size, -1)

    def get_of(t):
        return lambda rows, cols: t[:, cols.start:cols.stop] if cols is not None else (
            t[rows.start:rows.stop] if rows is not None else t)

    parts = [shard_tensor("model.layers.0.self_attn.o_proj.weight", get_of(w), c, Shard(r, 2))
             for r in range(2)]
    assert torch.equal(torch.cat(parts, dim=1), w)
    b = torch.ones(c.hidden_size)
    biases = [shard_tensor("model.layers.0.mlp.down_proj.bias", get_of(b), c, Shard(r, 2))
              for r in range(2)]
    assert torch.equal(biases[0] + biases[1], b)


def _ranks(size, slot_bytes, fn, timeout_s=10.0, path=None):
    path = path or f"/dev/shm/tandem-test-{os.getpid()}-{threading.get_ident()}"
    comms = [ShmComm(path, 0, size, slot_bytes, timeout_s, create=True)]
    comms += [ShmComm(path, r, size, slot_bytes, timeout_s) for r in range(1, size)]
    out, errors = [None] * size, []

    def body(r):
        try:
            out[r] = fn(comms[r])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for c in comms:
        c.close()
    return out, errors


def moe_cfg(experts=4, inter=48):
    return ModelConfig(architecture="mixtral", vocab_size=32, hidden_size=16, intermediate_size=inter, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=4, max_position_embeddings=64, num_experts=experts,
                       num_experts_per_tok=2, moe_intermediate_size=inter, moe_layers=(0, 1))


def test_experts_split_or_spread_over_the_ranks():
    """Split: each rank half of every expert's rows (gate, up) or columns (down).
    Expert parallel: rank r holds experts [r*E/N, (r+1)*E/N) whole and reads no other."""
    c = moe_cfg(experts=6)
    w1 = torch.arange(48 * 16).view(48, 16)
    w2 = torch.arange(16 * 48).view(16, 48)

    def get(t):
        return lambda rows, cols: t[rows.start:rows.stop] if rows else t[:, cols.start:cols.stop] if cols else t

    name = "model.layers.0.block_sparse_moe.experts.{}.{}.weight"
    split = Shard(1, 2)
    assert local_config(c, split).moe_intermediate_size == 24 and local_config(c, split).expert_range == range(6)
    assert torch.equal(shard_tensor(name.format(0, "w1"), get(w1), c, split), w1[24:48])
    assert torch.equal(shard_tensor(name.format(0, "w2"), get(w2), c, split), w2[:, 24:48])
    spread = Shard(1, 2, expert_parallel=True)
    local = local_config(c, spread)
    assert local.expert_range == range(3, 6) and local.moe_intermediate_size == 48
    assert [e for e in range(6) if holds(name.format(e, "w1"), c, spread)] == [3, 4, 5]
    assert holds("model.layers.0.block_sparse_moe.gate.weight", c, spread)  # the router: every rank
    assert torch.equal(shard_tensor(name.format(3, "w2"), get(w2), c, spread), w2)
    with pytest.raises(ConfigError, match="5 experts"):
        check_divisible(moe_cfg(experts=5), 2, expert_parallel=True)
    with pytest.raises(ConfigError, match="experts' intermediate size 50"):
        check_divisible(moe_cfg(inter=50), 4)


def test_shared_memory_all_reduce_sums_in_pieces_and_every_rank_gets_the_same_bits():
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(3001, generator=g, dtype=torch.float32) for _ in range(3)]
    want = inputs[0] + inputs[1] + inputs[2]

    def fn(comm):
        x = inputs[comm.rank].clone()
        for _ in range(5):  # the slot sets alternate; reuse must not mix calls
            y = comm.all_reduce(x.clone())
        z = comm.broadcast(torch.full((10,), float(comm.rank)), src=2)
        return y, z, comm.all_min(100 - comm.rank)

    out, errors = _ranks(3, 4096, fn)  # 4 KiB slots: 3001 floats go in 3 pieces
    assert not errors
    for y, z, m in out:
        assert torch.equal(y, out[0][0]) and torch.allclose(y, want)
        assert torch.equal(z, torch.full((10,), 2.0))
        assert m == 98


def test_a_rank_that_never_arrives_ends_the_wait_with_rank_lost():
    def fn(comm):
        if comm.rank == 1:
            return None
        comm.all_reduce(torch.ones(4))

    out, errors = _ranks(2, 4096, fn, timeout_s=1.0)
    assert len(errors) == 1 and isinstance(errors[0], RankLost)
    assert "ranks [1] did not reach collective 1" in str(errors[0])
