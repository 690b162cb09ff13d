"""The transport contract without processes: layout, descriptors, checks, registry."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from kv_transfer import registry
from kv_transfer.base import (
    DONE,
    KVLayout,
    LayoutMismatch,
    PeerDescriptor,
    PeerId,
    TransferError,
    TransferStatus,
    TransportConfig,
    XferState,
    resolve_write,
)
from kv_transfer.handles import HandleBook
from kv_transfer.registry import create_transport

pytestmark = pytest.mark.unit

TINY = KVLayout(
    num_layers=4, num_blocks=64, block_size=16, num_kv_heads=2, head_dim=64, dtype="float32"
)
PEER = PeerId("decode-0", "e1")


def test_layout_arithmetic_of_the_builtin_model() -> None:
    assert TINY.region_bytes == 8 << 10  # one (layer, k|v, block)
    assert TINY.block_bytes == 64 << 10  # one block across layers, K and V
    assert TINY.region_offset(0, 1, 0) == 64 * TINY.region_bytes
    assert TINY.region_offset(2, 1, 5) == ((2 * 2 + 1) * 64 + 5) * TINY.region_bytes


def test_layout_of_a_tensor_and_compatibility() -> None:
    import torch

    kv = torch.zeros(4, 2, 10, 16, 2, 64, dtype=torch.bfloat16)
    layout = KVLayout.of(kv)
    assert (layout.num_blocks, layout.dtype, layout.itemsize) == (10, "bfloat16", 2)
    layout.check_compatible(dataclasses.replace(TINY, dtype="bfloat16"), "p")
    with pytest.raises(LayoutMismatch, match="dtype: ours=bfloat16 theirs=float32"):
        layout.check_compatible(TINY, "decode-0@e1")
    with pytest.raises(ValueError, match="contiguous"):
        KVLayout.of(kv.transpose(0, 2))


def test_descriptor_round_trip() -> None:
    desc = PeerDescriptor("nixl", "decode-0", "e1", TINY, base_addr=1 << 40, blob=b"\x00md\xff")
    back = PeerDescriptor.from_bytes(desc.to_bytes())
    assert back == desc and back.peer_id == PEER and str(back.peer_id) == "decode-0@e1"
    with pytest.raises(TransferError, match="bad magic"):
        PeerDescriptor.from_bytes(b"garbage")


def test_resolve_write() -> None:
    small = KVLayout(4, 8, 16, 2, 64, "float32")
    local, remote, layers = resolve_write(TINY, small, PEER, [60, 1], [7, 0], None)
    assert local.tolist() == [60, 1] and remote.tolist() == [7, 0] and layers == range(4)
    with pytest.raises(
        TransferError, match="decode-0@e1: remote block id 8 out of range \\[0, 8\\)"
    ):
        resolve_write(TINY, small, PEER, [1], [8], None)
    with pytest.raises(TransferError, match="step-1 range"):
        resolve_write(TINY, small, PEER, [1], [1], range(0, 4, 2))


def test_handle_book_statuses_are_sticky() -> None:
    book = HandleBook(timeout_s=60)
    w = book.open(PEER, 10)
    assert book.status(w.handle.id).state is XferState.PENDING
    assert book.finish(w.handle.id, TransferStatus.failed("peer gone")) is w
    assert book.finish(w.handle.id, DONE) is None  # the first terminal status wins
    assert book.status(w.handle.id).reason == "peer gone"
    assert "unknown" in book.status(w.handle.id + 1).reason
    with pytest.raises(TransferError, match="targets"):
        book.open(PeerId("other", "e2"), 1, after=[w.handle])


def test_registry_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown KV transport 'rdma'"):
        create_transport("rdma", TransportConfig(worker_name="w"))
    with pytest.raises(ValueError, match="worker_name"):
        TransportConfig(worker_name="a@b")


def test_auto_falls_back_to_tcp_with_one_line(monkeypatch, caplog) -> None:
    def no_nixl(config):
        raise ImportError("No module named 'nixl'")

    monkeypatch.setattr(registry, "_make_nixl", no_nixl)
    with caplog.at_level(logging.INFO, logger="tandem.kv_transfer"):
        t = create_transport("auto", TransportConfig(worker_name="w"))
    t.close()
    assert t.name == "tcp"
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "kv_transfer: using tcp fallback (nixl unavailable: ImportError: No module named 'nixl')"
    ]


def test_nixl_by_name_refuses_to_fall_back(monkeypatch) -> None:
    def no_nixl(config):
        raise ImportError("No module named 'nixl'")

    monkeypatch.setattr(registry, "_make_nixl", no_nixl)
    with pytest.raises(RuntimeError, match=r"--transport nixl: NIXL is unavailable here \(ImportError: No module"):
        create_transport("nixl", TransportConfig(worker_name="w"))


def test_auto_prefers_nixl_and_says_so(monkeypatch, caplog) -> None:
    class FakeNixl:
        name = "nixl"

        def describe(self) -> str:
            return "nixl_cu13, UCX backend, agent w@e"

    monkeypatch.setattr(registry, "_make_nixl", lambda config: FakeNixl())
    with caplog.at_level(logging.INFO, logger="tandem.kv_transfer"):
        t = create_transport("auto", TransportConfig(worker_name="w"))
    assert t.name == "nixl"
    assert [r.getMessage() for r in caplog.records] == [
        "kv_transfer: using nixl (nixl_cu13, UCX backend, agent w@e)"
    ]
