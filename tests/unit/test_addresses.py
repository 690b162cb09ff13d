"""--worker-host specs resolve on the worker's node to (bind, advertise)."""

from __future__ import annotations

import ipaddress

import pytest

from worker_runtime.addresses import AddressError, Endpoint, _ipv4_addresses, node_address, resolve

pytestmark = pytest.mark.unit


def test_an_ip_binds_and_advertises_itself():
    assert resolve("127.0.0.1") == Endpoint("127.0.0.1", "127.0.0.1")
    assert resolve(" 127.0.0.5 ") == Endpoint("127.0.0.5", "127.0.0.5")


def test_all_interfaces_advertise_the_node_address():
    ep = resolve("0.0.0.0")
    assert ep.bind == "0.0.0.0" and ep.advertise == node_address() != "0.0.0.0"
    assert resolve("node") == Endpoint(node_address(), node_address())
    ipaddress.ip_address(node_address())


def test_an_interface_or_a_network_names_this_nodes_address_in_it():
    assert resolve("lo") == Endpoint("127.0.0.1", "127.0.0.1")
    assert resolve("127.0.0.0/8") == Endpoint("127.0.0.1", "127.0.0.1")


def test_unknown_specs_say_what_would_work():
    mine = [ipaddress.ip_address(a) for addrs in _ipv4_addresses().values() for a in addrs]
    absent = next(n for n in ("198.51.100.0/24", "203.0.113.0/24", "192.0.2.0/24", "10.254.253.0/24")
                  if not any(a in ipaddress.ip_network(n) for a in mine))
    with pytest.raises(AddressError, match="no address in that network"):
        resolve(absent)
    with pytest.raises(AddressError, match="interface name") as e:
        resolve("no-such-nic0")
    assert "lo" in str(e.value)
    with pytest.raises(AddressError, match="not a network"):
        resolve("10.0.0.0/99")
