"""Pieces both worker kinds build the same way."""

from __future__ import annotations

from engine import envs
from engine.config import WorkerConfig
from kv_transfer.base import Transport, TransportConfig, create_transport


def make_transport(cfg: WorkerConfig, epoch: int) -> Transport:
    """The configured KV transport, named by worker id and this incarnation's epoch;
    wrapped with injected faults when TANDEM_FAULTS asks for them."""
    transport = create_transport(cfg.transport, TransportConfig(
        worker_name=cfg.worker_id, epoch=f"{epoch:016x}", bind_host=cfg.host, token=cfg.cluster_token))
    faults = envs.faults()
    if faults.transfer_delay_s or faults.fail_transfers:
        from kv_transfer.faults import FaultyTransport

        transport = FaultyTransport(transport, faults)
    return transport
