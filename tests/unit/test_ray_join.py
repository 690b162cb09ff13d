"""Joining a Ray cluster (router/ray_join.py): the probe, the bound, and the retry of a
Ray Client join whose per-connection server died at birth. `init` stands in for
ray.init here only to inject those faults; the real joins are in tests/cluster."""

import asyncio
import socket

import pytest

from router import ray_join

pytestmark = pytest.mark.unit


@pytest.fixture
def listening():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


async def test_a_client_join_whose_server_failed_to_start_is_tried_again(listening):
    calls, resets = [], []

    def init():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionAbortedError("Initialization failure from server: RuntimeError: Starting Ray client "
                                         "server failed. See ray_client_server_23000.err for detailed logs.")

    await ray_join.join(f"ray://127.0.0.1:{listening}", init, 30, reset=lambda: resets.append(1))
    assert len(calls) == 3 and len(resets) == 2


async def test_other_failures_and_gcs_joins_are_not_retried(listening):
    calls = []

    def init():
        calls.append(1)
        raise ConnectionError("token authentication failed")

    with pytest.raises(ray_join.JoinError, match="token authentication failed"):
        await ray_join.join(f"ray://127.0.0.1:{listening}", init, 30)
    assert len(calls) == 1

    def client_failure():
        calls.append(1)
        raise ConnectionAbortedError(ray_join.CLIENT_SERVER_FAILED)

    with pytest.raises(ray_join.JoinError, match="What to check"):
        await ray_join.join(f"127.0.0.1:{listening}", client_failure, 30)  # a GCS address: not Ray Client
    assert len(calls) == 2


async def test_the_retries_give_up_after_three_and_a_join_is_bounded(listening):
    calls = []

    def failing():
        calls.append(1)
        raise ConnectionAbortedError(ray_join.CLIENT_SERVER_FAILED)

    with pytest.raises(ray_join.JoinError, match=ray_join.CLIENT_SERVER_FAILED):
        await ray_join.join(f"ray://127.0.0.1:{listening}", failing, 30)
    assert len(calls) == ray_join.CLIENT_ATTEMPTS
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(ray_join.JoinError, match="did not finish connecting within 0.5 s"):
        await ray_join.join(f"127.0.0.1:{listening}", lambda: __import__("time").sleep(5), 0.5)
    assert loop.time() - t0 < 3


async def test_an_address_nothing_listens_on_fails_the_probe_with_advice():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(ray_join.JoinError, match="cannot connect to 127.0.0.1"):
        await ray_join.join(f"ray://127.0.0.1:{port}", lambda: None, 5)
