"""Joining a running Ray cluster (`tandem serve --address ...`), bounded, with advice.

`ray.init(address=...)` on a cluster it cannot use does not fail well: an unreachable
GCS is retried for minutes (SIGTERM meanwhile does nothing), a loopback address is
silently replaced by this machine's external one, and a cluster with token
authentication (the default for `ray start` in recent Ray) refuses a driver without
its token with a bare ConnectionError. Here the address is probed first (a TCP
connect), the join is bounded, and every failure says what to check.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from pathlib import Path
from typing import Callable

PROBE_TIMEOUT_S = 5.0
CLIENT_ATTEMPTS = 3
# the head's client proxy could not start a server for this connection (it died at birth:
# "Starting Ray client server failed", or a zombie by the time the proxy looked)
CLIENT_SERVER_FAILED = "Initialization failure from server"

log = logging.getLogger(__name__)


class JoinError(RuntimeError):
    pass


def parse(address: str) -> tuple[str, int] | None:
    """(host, port) to probe; None for 'auto' (Ray looks the cluster up itself)."""
    if address == "auto":
        return None
    rest = address.split("://", 1)[1] if "://" in address else address
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit() or not host:
        default = 10001 if address.startswith("ray://") else 6379
        return (rest.strip("[]"), default)
    return host.strip("[]"), int(port)


def advice(address: str, what: str) -> str:
    lines = [f"cannot join the Ray cluster at {address}: {what}", "What to check:"]
    client = address.startswith("ray://")
    lines.append(
        "- the address: the head's GCS address as `ray status` on the head shows it (port 6379 unless "
        "set)" + (", or with ray:// the Ray Client server's port (10001 unless set)" if client else "")
        + ", reachable from this host"
    )
    lines.append(
        "- token authentication (Ray's default for clusters it starts with a token at hand): give this host "
        "the cluster's token, as ~/.ray/auth_token (copied from the head) or RAY_AUTH_TOKEN or "
        "RAY_AUTH_TOKEN_PATH (tandem then sets RAY_AUTH_MODE=token), or run every node with "
        "RAY_AUTH_MODE=disabled on a private network"
    )
    host = (parse(address) or ("", 0))[0]
    if host.startswith("127.") or host == "localhost":
        lines.append(
            "- loopback: Ray replaces a loopback address with this machine's external address, so a head "
            "started with --node-ip-address=127.0.0.1 cannot be joined that way; start the head on an "
            "address of the host and give that address here"
        )
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        lines.append("- RAY_AUTH_MODE=disabled is set here: a cluster with token authentication refuses it")
    return "\n".join(lines)


async def probe(address: str, timeout: float = PROBE_TIMEOUT_S) -> None:
    """A TCP connect to the cluster's address, or JoinError with advice."""
    target = parse(address)
    if target is None:
        return
    host, port = target
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        writer.close()
    except (OSError, asyncio.TimeoutError) as e:
        why = "no answer" if isinstance(e, asyncio.TimeoutError) else f"{type(e).__name__}: {e}"
        raise JoinError(advice(address, f"cannot connect to {host}:{port} ({why} within {timeout:g} s)")) from None


def token_mode_if_token_given() -> bool:
    """A driver joining a cluster sends Ray's token only in RAY_AUTH_MODE=token, which
    Ray does not turn on by itself for a token given in RAY_AUTH_TOKEN(_PATH) or found
    in ~/.ray/auth_token: turn it on then, unless the mode was set explicitly. Ray reads
    the mode once, so this runs before ray is imported (`tandem serve` calls it first)."""
    if os.environ.get("RAY_AUTH_MODE"):
        return False
    given = os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
    if given or (Path.home() / ".ray" / "auth_token").is_file():
        os.environ["RAY_AUTH_MODE"] = "token"
        return True
    return False


async def join(address: str, init: Callable[[], None], timeout: float,
               reset: Callable[[], None] | None = None) -> None:
    """Probe, then run `init` (ray.init) on a daemon thread for at most `timeout`
    seconds (a join stuck in Ray's retries must not keep the process alive). Through
    Ray Client (ray://) the head's client server forks a server per connection, and
    that fork sometimes dies at birth ("Initialization failure from server", as "Starting
    Ray client server failed" or a zombie; seen here about once in a few joins): such a
    join is tried again, up to CLIENT_ATTEMPTS times within `timeout`, after `reset`."""
    await probe(address)
    deadline = asyncio.get_running_loop().time() + timeout
    attempts = CLIENT_ATTEMPTS if address.startswith("ray://") else 1
    for attempt in range(1, attempts + 1):
        try:
            await _run_init(init, deadline - asyncio.get_running_loop().time())
            return
        except asyncio.TimeoutError:
            raise JoinError(advice(address, f"Ray did not finish connecting within {timeout:g} s")) from None
        except Exception as e:
            again = CLIENT_SERVER_FAILED in str(e) and attempt < attempts
            if not again or asyncio.get_running_loop().time() + 2 >= deadline:
                raise JoinError(advice(address, f"{type(e).__name__}: {e}")) from None
            log.warning("joining %s: the Ray client server failed to start a server for us; trying again "
                        "(%d of %d)", address, attempt + 1, attempts)
            if reset is not None:
                await asyncio.to_thread(reset)
            await asyncio.sleep(1.0)


async def _run_init(init: Callable[[], None], timeout: float) -> None:
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def hand_over(settle: Callable[[], object]) -> None:
        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop gave up waiting (timed out) and has closed since
            pass

    def run() -> None:
        try:
            init()
        except BaseException as e:  # handed to the waiting loop
            hand_over(lambda err=e: done.done() or done.set_exception(err))
        else:
            hand_over(lambda: done.done() or done.set_result(None))

    threading.Thread(target=run, name="ray-join", daemon=True).start()
    await asyncio.wait_for(asyncio.shield(done), max(timeout, 0.1))
