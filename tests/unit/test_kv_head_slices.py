"""Writes of some KV heads (tensor-parallel ranks whose blocks hold different heads) over
the TCP transport, sender and receiver in this process: the heads land where named, the
rest of each block is untouched, and writes that name heads outside either side fail
up front."""

from __future__ import annotations

import pytest
import torch

from kv_transfer.base import HeadSlice, TransferError, TransportConfig, XferState
from kv_transfer.tcp import TcpTransport

pytestmark = pytest.mark.unit


def kv(heads: int, seed: int | None) -> torch.Tensor:
    t = torch.zeros(3, 2, 8, 4, heads, 16, dtype=torch.bfloat16)  # [L, 2, N, block, heads, dim]
    if seed is not None:
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(seed)))
    return t


@pytest.fixture
def pair():
    made = []

    def make(src_heads: int, dst_heads: int):
        src, dst = TcpTransport(TransportConfig("prefill-0")), TcpTransport(TransportConfig("decode-0"))
        made.extend([src, dst])
        a, b = kv(src_heads, 1), kv(dst_heads, None)
        src.register(a)
        dst.register(b)
        return src, dst, a, b, src.add_peer(dst.local_descriptor())

    yield make
    for t in made:
        t.close()


def test_a_rank_of_four_heads_writes_two_into_a_rank_of_two(pair):
    src, dst, a, b, peer = pair(4, 2)
    h = src.write_blocks(peer, [1, 5], [6, 0], layers=range(0, 2), heads=HeadSlice(src=2, dst=0, count=2))
    last = src.write_blocks(peer, [1, 5], [6, 0], layers=range(2, 3), heads=HeadSlice(2, 0, 2), notify=b"n",
                            after=[h])
    assert src.wait(last, 10).state is XferState.DONE
    assert torch.equal(b[:, :, [6, 0]], a[:, :, [1, 5], :, 2:4])
    assert not b[:, :, [1, 2, 3, 4, 5, 7]].any()  # no other block written
    assert [n.message for n in dst.notifications()] == [b"n"]


def test_a_rank_of_one_head_fills_half_of_a_rank_of_two(pair):
    src, dst, a, b, peer = pair(1, 2)
    h = src.write_blocks(peer, [3], [4], heads=HeadSlice(src=0, dst=1, count=1))
    assert src.wait(h, 10).state is XferState.DONE
    assert torch.equal(b[:, :, 4, :, 1], a[:, :, 3, :, 0])
    assert not b[:, :, 4, :, 0].any()


def test_heads_outside_either_side_or_whole_blocks_of_unequal_heads_are_refused(pair):
    src, _, _, _, peer = pair(4, 2)
    with pytest.raises(TransferError, match=r"heads \(0, 1, 2\)"):
        src.write_blocks(peer, [1], [1], heads=HeadSlice(0, 1, 2))
    with pytest.raises(TransferError, match="its blocks hold 2 KV heads, ours 4"):
        src.write_blocks(peer, [1], [1])
