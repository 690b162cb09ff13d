"""The worker options as command-line flags: one definition, shared by `tandem serve`
(which hands them to every worker it starts) and `python -m prefill_worker|decode_worker`."""

from __future__ import annotations

import argparse
import os

from engine.config import EngineConfig
from kv_transfer.tls import DEFAULT_SERVER_NAME, ClusterTLS
from worker_runtime.config import TRANSPORTS, HandoffTimeouts, Role, WorkerConfig


def add_worker_args(p: argparse.ArgumentParser, host_flag: str = "--host", host_default: str = "127.0.0.1",
                    host_help: str = "") -> None:
    """`host_flag` names the bind-address flag (`tandem serve` has its own --host for HTTP)."""
    g = p.add_argument_group("worker")
    g.add_argument(host_flag, dest="worker_host", default=host_default,
                   help=host_help or "where a worker listens for gRPC, /metrics and KV transfer, resolved on its node: "
                   "an IP, 'node' (the node's address), 0.0.0.0 (all interfaces, advertising the node's address), "
                   "an interface name or a network (10.0.0.0/8) (default %(default)s)")
    g.add_argument("--transport", default="auto", choices=TRANSPORTS, help="KV transfer backend (default auto)")
    g.add_argument("--cluster-token", default=None, help="shared secret every worker gRPC call must carry (default: "
                   "env TANDEM_CLUSTER_TOKEN, which keeps it off the command line)")
    g.add_argument("--no-layerwise-transfer", action="store_true",
                   help="prefill: push KV after the whole forward, not layer by layer")
    g.add_argument("--reservation-lease-s", type=float, default=HandoffTimeouts.reservation_lease_s,
                   help="decode: how long reserved blocks wait for their KV (default %(default)s)")
    g.add_argument("--reservation-quarantine-s", type=float, default=HandoffTimeouts.quarantine_s,
                   help="decode: blocks of a reservation that ended before its KV landed stay unused this long "
                        "(default %(default)s)")
    g.add_argument("--transfer-timeout-s", type=float, default=None,
                   help="prefill: fail a KV write not acknowledged in this time (default: half the quarantine)")
    add_cluster_tls_args(p)


def add_cluster_tls_args(p: argparse.ArgumentParser) -> None:
    """Mutual TLS between the cluster's processes (kv_transfer/tls.py): all three files or none."""
    g = p.add_argument_group("cluster TLS (worker gRPC, TCP KV transfer, token feeds)")
    g.add_argument("--cluster-tls-cert", default=None,
                   help="this process's certificate (PEM), signed by the cluster CA")
    g.add_argument("--cluster-tls-key", default=None, help="its private key (PEM)")
    g.add_argument("--cluster-tls-ca", default=None, help="the cluster CA's certificate (PEM); peers must chain to it")
    g.add_argument("--cluster-tls-server-name", default=DEFAULT_SERVER_NAME,
                   help="the DNS name every cluster certificate carries, checked by clients (default %(default)s)")


def tls_from_args(a: argparse.Namespace) -> ClusterTLS | None:
    """The cluster TLS the flags ask for, or None; ValueError naming what is missing."""
    files = (a.cluster_tls_cert, a.cluster_tls_key, a.cluster_tls_ca)
    if not any(files):
        return None
    if not all(files):
        raise ValueError("cluster TLS needs --cluster-tls-cert, --cluster-tls-key and --cluster-tls-ca together")
    return ClusterTLS(*files, server_name=a.cluster_tls_server_name)


def worker_config_from_args(a: argparse.Namespace, role: Role | str, worker_id: str, engine: EngineConfig,
                            port: int = 0, metrics_port: int | None = None,
                            cluster_token: str | None = None, shutdown_grace_s: float = 30.0) -> WorkerConfig:
    handoff = HandoffTimeouts(reservation_lease_s=a.reservation_lease_s, quarantine_s=a.reservation_quarantine_s,
                              transfer_timeout_s=a.transfer_timeout_s)
    return WorkerConfig(role=role, worker_id=worker_id, engine=engine, host=a.worker_host, port=port,
                        transport=a.transport,
                        cluster_token=cluster_token or a.cluster_token or os.environ.get("TANDEM_CLUSTER_TOKEN"),
                        layerwise_transfer=not a.no_layerwise_transfer, handoff=handoff, metrics_port=metrics_port,
                        shutdown_grace_s=shutdown_grace_s, tls=tls_from_args(a))
