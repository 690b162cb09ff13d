"""Mutual TLS inside the cluster: one certificate authority for the cluster, and every
process (router, controller, worker) holding a certificate it signed.

Both sides of every connection present their certificate and check the other's against
the cluster CA: worker gRPC (worker_runtime/rpc.py), the TCP KV transfer (kv_transfer/tcp.py,
tcp_server.py) and the decode workers' token feed. Peers are found by address, and in
Kubernetes addresses change with every pod, so certificates are not issued per address:
the client checks the server's certificate for one cluster name (`server_name`, default
"tandem", a DNS name every certificate carries). The cluster token still rides on every
call; TLS adds privacy and proof of membership that does not travel in the clear.

NIXL's UCX transport has no TLS: with cluster TLS on, a NIXL transfer is not encrypted
(RDMA inside the cluster network, as vLLM's and Dynamo's NIXL paths run); the worker
says so in its log.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass

DEFAULT_SERVER_NAME = "tandem"


@dataclass(frozen=True)
class ClusterTLS:
    cert: str  # this process's certificate chain (PEM)
    key: str  # its private key (PEM)
    ca: str  # the cluster CA's certificate(s) (PEM): peers must chain to it
    server_name: str = DEFAULT_SERVER_NAME  # the name servers' certificates are checked for

    def __post_init__(self) -> None:
        for what, path in (("certificate", self.cert), ("key", self.key), ("CA", self.ca)):
            if not path or not os.access(path, os.R_OK):
                raise ValueError(f"cluster TLS: cannot read the {what} file {path!r}")
        if not self.server_name:
            raise ValueError("cluster TLS: the server name must be non-empty")

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(certificate chain, private key, CA) as bytes (what gRPC takes)."""
        with open(self.cert, "rb") as c, open(self.key, "rb") as k, open(self.ca, "rb") as a:
            return c.read(), k.read(), a.read()

    def server_context(self) -> ssl.SSLContext:
        """For a listening socket: present our certificate, require the client's."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert, self.key)
        ctx.load_verify_locations(self.ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def client_context(self) -> ssl.SSLContext:
        """For a connecting socket: present our certificate, check the server's against
        the CA and `server_name` (pass it as server_hostname)."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert, self.key)
        ctx.load_verify_locations(self.ca)
        return ctx
