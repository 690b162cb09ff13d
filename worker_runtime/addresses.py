"""Where a worker listens and the address it gives others, from one operator setting
(`--worker-host`), resolved on the worker's own node:

    127.0.0.1, 10.0.0.5, ...   an IP: listen on it and advertise it
    node                        this node's address: Ray's node IP inside a Ray worker,
                                else the first non-loopback IPv4 interface address
    0.0.0.0                     listen on every interface; advertise the node address
    eth0, ens5, ...             an interface: its IPv4 address
    10.0.0.0/8, ...             a network: this node's IPv4 address inside it

gRPC, the worker's /metrics and the KV transport all follow it. A loopback address
keeps NIXL/UCX on the loopback device (kv_transfer/nixl_agent.py); any other lets UCX
pick per peer (shared memory on the same host, TCP/RDMA to others).
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

import psutil


class AddressError(ValueError):
    pass


@dataclass(frozen=True)
class Endpoint:
    bind: str  # what the servers listen on
    advertise: str  # what other processes connect to


def _ipv4_addresses() -> dict[str, list[str]]:
    """Interface name -> its IPv4 addresses."""
    return {name: [a.address for a in addrs if a.family == socket.AF_INET]
            for name, addrs in psutil.net_if_addrs().items()}


def node_address() -> str:
    """This node's address: Ray's idea of it when running in a Ray worker, else the
    first non-loopback IPv4 address, else 127.0.0.1."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    for addrs in _ipv4_addresses().values():
        for a in addrs:
            if not ipaddress.ip_address(a).is_loopback:
                return a
    return "127.0.0.1"


def resolve(spec: str) -> Endpoint:
    spec = spec.strip()
    if spec in ("node", ""):
        a = node_address()
        return Endpoint(a, a)
    if spec in ("0.0.0.0", "::"):
        return Endpoint(spec, node_address())
    if "/" in spec:
        try:
            net = ipaddress.ip_network(spec, strict=False)
        except ValueError as e:
            raise AddressError(f"worker host {spec!r}: not a network: {e}") from None
        for addrs in _ipv4_addresses().values():
            for a in addrs:
                if ipaddress.ip_address(a) in net:
                    return Endpoint(a, a)
        raise AddressError(f"worker host {spec!r}: this node has no address in that network")
    try:
        ipaddress.ip_address(spec)
        return Endpoint(spec, spec)
    except ValueError:
        pass
    interfaces = _ipv4_addresses()
    if spec in interfaces:
        if not interfaces[spec]:
            raise AddressError(f"worker host {spec!r}: the interface has no IPv4 address")
        a = interfaces[spec][0]
        return Endpoint(a, a)
    raise AddressError(f"worker host {spec!r}: use an IP address, 'node', 0.0.0.0, an interface name "
                       f"(this node has {', '.join(sorted(interfaces))}) or a network such as 10.0.0.0/8")
