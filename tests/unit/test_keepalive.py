"""Both ends of a channel agree on keepalive: a client pinging at the rate it is set to
never draws GOAWAY too_many_pings from a worker's server. (Before, routers pinged every
10 s, idle or not, and the workers' servers, on gRPC's defaults of one ping in 5
minutes without data and none without calls, sent GOAWAY about once a minute.) gRPC's
client throttles pings far below 10 s, so a live check of this takes a minute; the
closing note of the change has one. Here: the two option sets, as the code builds them."""

from __future__ import annotations

import pytest

from worker_runtime import rpc

pytestmark = pytest.mark.unit


def test_servers_accept_the_pings_their_clients_send():
    client, server = dict(rpc.client_options()), dict(rpc.server_options())
    assert client["grpc.keepalive_permit_without_calls"] == 1  # routers keep idle channels checked
    assert server["grpc.keepalive_permit_without_calls"] == 1
    assert server["grpc.http2.min_recv_ping_interval_without_data_ms"] < client["grpc.keepalive_time_ms"]
    assert server["grpc.http2.max_ping_strikes"] >= 1  # still a bound on a client that pings faster


def test_servers_ping_their_clients_too():
    """A worker notices a router that vanished without closing its connections (its
    node lost) within keepalive time + timeout, and its calls end."""
    server = dict(rpc.server_options())
    assert server["grpc.keepalive_time_ms"] + server["grpc.keepalive_timeout_ms"] <= 30_000
