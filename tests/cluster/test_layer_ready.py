"""A layer-wise push waits for the KV it carries to be computed.

On a GPU a layer's kernels run after the call that launched them returns, so the
prefill worker hands each layer's write an event (`ready`) and the transport's thread
reads the blocks only once it has fired. Here the device is stood in for by a "late
kernel": an object whose `query()` says whether the source blocks have their values
yet. It writes them only while the transport is waiting on it, or, when the transport
never asks, only after the transfer has finished: the race the wait exists to prevent,
made deterministic. Real transports, a sender and a receiver in this process.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from kv_transfer.base import TransportConfig, XferState
from kv_transfer.registry import create_transport

pytestmark = pytest.mark.cluster

SHAPE = (3, 2, 8, 4, 2, 8)  # layers, k|v, blocks, block size, kv heads, head dim
LAYER, LOCAL, REMOTE = 1, [2, 5], [6, 0]


class LateKernel:
    """The kernels that write `LAYER` of the sender's blocks, still queued."""

    def __init__(self, kv: torch.Tensor, polls_until_done: int = 3) -> None:
        self.kv, self.polls, self.until = kv, 0, polls_until_done
        self.done = False

    def run(self) -> None:
        self.kv[LAYER, :, LOCAL] = 7.0
        self.done = True

    def query(self) -> bool:
        self.polls += 1
        if not self.done and 0 < self.until <= self.polls:
            self.run()
        return self.done


@pytest.fixture(params=["tcp", "nixl"])
def pair(request, monkeypatch):
    kind = request.param
    made = []
    # NIXL's transport sets UCX's defaults in this process's environment; put them back
    # afterwards, or the processes later tests start inherit them (loopback-only UCX)
    for var, default in (("UCX_NET_DEVICES", "lo"), ("NIXL_LOG_LEVEL", "WARN")):
        monkeypatch.setenv(var, os.environ.get(var, default))

    def make(name: str, wait: bool):
        t = create_transport(kind, TransportConfig(worker_name=name, xfer_timeout_s=2.0, wait_for_ready=wait))
        made.append(t)
        return t

    def build(wait: bool):
        try:
            sender, receiver = make(f"prefill-{len(made)}", wait), make(f"decode-{len(made) + 1}", True)
        except Exception as e:  # noqa: BLE001 - NIXL may be unable to make agents here
            if kind == "nixl":
                pytest.skip(f"nixl cannot create two agents in this process: {e}")
            raise
        src, dst = torch.zeros(SHAPE), torch.full(SHAPE, -1.0)
        sender.register(src)
        receiver.register(dst)
        peer = sender.add_peer(receiver.local_descriptor())
        return sender, peer, src, dst

    yield build
    for t in made:
        t.close()


def _write(sender, peer, ready):
    h = sender.write_blocks(peer, LOCAL, REMOTE, layers=range(LAYER, LAYER + 1), ready=ready)
    return sender.wait(h, timeout=5.0)


def test_the_transport_waits_for_the_layer_to_be_computed(pair):
    sender, peer, src, dst = pair(wait=True)
    late = LateKernel(src)
    status = _write(sender, peer, late)
    assert status.state is XferState.DONE, status
    assert late.polls >= 3  # it waited while the "kernel" was queued
    assert bool((dst[LAYER, :, REMOTE] == 7.0).all())  # the computed values landed


def test_without_the_wait_the_stale_blocks_are_sent(pair):
    """The race, shown: the write reads the blocks before the kernel has written them."""
    sender, peer, src, dst = pair(wait=False)
    late = LateKernel(src, polls_until_done=0)  # completes only when told to
    status = _write(sender, peer, late)
    late.run()  # the kernel finishes after the transfer
    assert status.state is XferState.DONE, status
    assert late.polls == 0
    assert bool((dst[LAYER, :, REMOTE] == 0.0).all())  # what was there before: wrong KV at the peer


def test_a_layer_never_computed_fails_the_write_within_its_deadline(pair):
    sender, peer, src, dst = pair(wait=True)
    t0 = time.monotonic()
    status = _write(sender, peer, LateKernel(src, polls_until_done=0))
    assert status.state is XferState.FAILED and "computed" in status.reason, status
    assert time.monotonic() - t0 < 4.0
    assert bool((dst == -1.0).all())  # nothing was written
