"""A router's side of the controller: joining Ray, finding the controller actor by
name, calling it. The controller's code (controller/) never loads here: the actor is
reached by name (worker_runtime/membership.py), its answers are the membership types.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time

from router import ray_join
from worker_runtime.membership import CONTROLLER_NAME, NAMESPACE

log = logging.getLogger(__name__)

# A local runtime advertises at least this many CPUs, so pools can grow past the core
# count on one machine; workers share cores (pinned round-robin, PoolConfig.cores).
LOCAL_LOGICAL_CPUS = 64
SHUTDOWN_FLUSH_MS = 500  # the local Ray's bound on the driver's last task-event flush (connect)


async def connect(address: str | None, join_timeout_s: float = 60.0) -> bool:
    """Start a local Ray runtime (address None) or join a running cluster (probed,
    bounded, with advice on failure: router/ray_join.py). True when this process
    started the runtime and must end it (`shutdown_local_ray`)."""
    import ray

    if ray.is_initialized():
        return False
    kw = {}
    if address is None:
        kw["num_cpus"] = max(os.cpu_count() or 1, LOCAL_LOGICAL_CPUS)
        kw["_system_config"] = {
            # Ray starts worker processes at nice 15, below the router and Ray's own
            # daemons: on a busy CPU host the engines, which make every token, then
            # lose each contended time slice (docs/performance.md). Equal footing.
            "worker_niceness": 0,
            # At ray.shutdown the driver flushes its task events to the GCS for up to
            # 5 s. A signal to the whole process group (`kill -- -PGID`, systemd's
            # stop) ends the GCS first, and then every stop waited that long for
            # nothing. tandem reads no task events.
            "task_events_shutdown_flush_timeout_ms": SHUTDOWN_FLUSH_MS,
        }
    init = functools.partial(
        ray.init,
        # "local": a fresh runtime of our own; with no address, ray.init would attach to
        # whatever cluster `ray start` last ran on this machine (/tmp/ray/ray_current_cluster)
        address=address or "local",
        include_dashboard=False,
        ignore_reinit_error=True,
        logging_level=logging.WARNING,
        log_to_driver=True,
        **kw,
    )
    if address is None:
        await asyncio.to_thread(init)
    else:
        await ray_join.join(address, init, join_timeout_s, reset=ray.shutdown)
    return address is None


def find():
    """The running controller's handle, or None."""
    import ray

    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
    except ValueError:
        return None


async def wait_for(wait_s: float):
    """The controller's handle once it exists (a router may come up before it)."""
    deadline = time.monotonic() + wait_s
    while True:
        handle = await asyncio.to_thread(find)
        if handle is not None:
            return handle
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"no tandem controller in this Ray cluster after {wait_s:.0f} s: start one with "
                "`tandem controller --address ADDR` (or `tandem serve --address ADDR`)"
            )
        await asyncio.sleep(1.0)


async def stop(handle, timeout_s: float = 120.0) -> None:
    """Stop the controller's workers, then the controller."""
    import ray

    try:
        await asyncio.wait_for(result(handle.shutdown.remote()), timeout_s)
    except Exception as e:  # noqa: BLE001 - it may be gone already; it is killed below in any case
        log.warning("controller shutdown: %s", remote_cause(e))
    with contextlib.suppress(Exception):
        ray.kill(handle, no_restart=True)


def result(ref):
    """An awaitable for a Ray call's result whose cancellation (a timeout, the router
    stopping) leaves Ray's own future alone: Ray Client (ray://) later completes that
    future from its thread and fails with InvalidStateError if it was cancelled."""
    inner = asyncio.wrap_future(ref.future())
    # a call still pending when the router stops (a membership long-poll) fails once the
    # controller is gone; nobody awaits it then, and asyncio would log it as an error
    inner.add_done_callback(lambda f: f.cancelled() or f.exception())
    return asyncio.shield(inner)


def unavailable(e: BaseException) -> bool:
    """A call failed because the actor is away for now (restarting, its node being
    replaced), not because it refused or raised."""
    from ray.exceptions import ActorUnavailableError

    return isinstance(e, ActorUnavailableError)


def remote_cause(e: BaseException) -> BaseException:
    """The exception raised inside an actor, without Ray's wrapping and traceback."""
    return getattr(e, "cause", None) or e


def shutdown_local_ray(grace_s: float = 3.0) -> None:
    """End the local Ray runtime this process started: ray.shutdown(), then whatever of
    its processes (raylet, agents, actor workers; all descendants of this process)
    outlive it. Ray's agents otherwise linger for a minute after their raylet is gone."""
    import psutil
    import ray

    me = psutil.Process()
    children = me.children(recursive=True)
    ray.shutdown()
    for p in children:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(children, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
