"""The control plane: one named Ray actor per cluster that owns the worker pools.

The controller runs a PoolManager (router/pool.py): it creates the worker actors (so
they live as long as it does, not as long as any router), checks their health,
replaces the dead, and resizes the pools on command. Routers (router/view.py) find it
by name, follow its membership (a long poll), and talk to the workers themselves:
requests, stats and KV events never pass through it.

    tandem serve                  starts a local Ray, the controller and one router;
                                  stopping it stops all three
    tandem controller --address   starts a detached controller in a running cluster
    tandem router --address       one more router for the controller found there
    tandem controller --address ADDR --stop
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import time

from router import ray_join
from router.autoscale import Autoscaler, RouterReport
from router.pool import PoolConfig, PoolManager
from worker_runtime.config import Role
from worker_runtime.host import LOG_FORMAT

log = logging.getLogger(__name__)

NAME, NAMESPACE = "tandem-controller", "tandem"
# A local runtime advertises at least this many CPUs, so pools can grow past the core
# count on one machine; workers share cores (pinned round-robin, PoolConfig.cores).
LOCAL_LOGICAL_CPUS = 64
SHUTDOWN_FLUSH_MS = 500  # the local Ray's bound on the driver's last task-event flush (connect)


class Controller:
    """The actor's class (made remote in `create`). Every method is async: one event
    loop in the actor runs the pool's loops and answers the routers."""

    def __init__(self, config: PoolConfig, info: dict) -> None:
        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
        # the controller reads stats only for `tandem status` (drains poll for themselves);
        # routers poll every 0.25 s for routing, so no need to wake every worker as often here
        self.pool = PoolManager(dataclasses.replace(config, stats_interval_s=max(config.stats_interval_s, 1.0)))
        self._info = {**info, "cluster_token": config.template.cluster_token,
                      "lease_s": config.template.handoff.reservation_lease_s,
                      "autoscale": config.autoscale is not None}
        self._start: asyncio.Task | None = None
        self._autoscale_task: asyncio.Task | None = None
        self.autoscaler = Autoscaler(config.autoscale, colocated=bool(info.get("colocated"))) \
            if config.autoscale else None
        self._reports: dict[str, tuple[float, RouterReport]] = {}  # router id -> (when, its report)
        self._decisions: dict[tuple[str, str], int] = {}  # (role, up|down) -> count
        self._last: dict[str, dict] = {}  # role -> the last decision, with its reason

    def __repr__(self) -> str:  # Ray prefixes this actor's log lines with it: "(controller pid=...)"
        return "controller"

    async def info(self) -> dict:
        """What a router needs besides the members: the model path (its tokenizer), the
        cluster token (every worker RPC carries it), routing facts."""
        return self._info

    async def start(self) -> None:
        """Bring the pools to their targets; once (a second caller waits for the first)."""
        if self._start is None:
            self._start = asyncio.create_task(self.pool.start())
        await asyncio.shield(self._start)
        if self.autoscaler is not None and self._autoscale_task is None:
            self._autoscale_task = asyncio.create_task(self._autoscale_loop())

    async def membership(self, since: int = -1, wait_s: float = 0.0) -> dict:
        return {**await self.pool.membership(since, min(wait_s, 30.0)), "autoscaler": self.autoscale_status()}

    async def get_pools(self) -> dict:
        return {**await self.pool.get_pools(), "autoscaler": self.autoscale_status()}

    # ---- the autoscaler (router/autoscale.py) ----------------------------------------
    async def report(self, router_id: str, report: dict) -> None:
        """A router's own side of the load (its queue, its recent SLO attainment)."""
        now = time.monotonic()
        self._reports = {k: v for k, v in self._reports.items() if now - v[0] < self._stale_s()}  # routers gone
        self._reports[router_id] = (now, RouterReport(**report))

    def autoscale_status(self) -> dict | None:
        if self.autoscaler is None:
            return None
        c = self.autoscaler.config
        return {"bounds": {"prefill": [c.min_prefill, c.max_prefill], "decode": [c.min_decode, c.max_decode]},
                "last": self._last, "routers_reporting": len(self._fresh_reports()),
                "decisions": [{"role": r, "direction": d, "count": n} for (r, d), n in sorted(self._decisions.items())]}

    def _stale_s(self) -> float:
        return 5 * self.autoscaler.config.interval_s + 5.0

    def _fresh_reports(self) -> list[RouterReport]:
        now = time.monotonic()
        return [r for at, r in self._reports.values() if now - at < self._stale_s()]

    async def _autoscale_loop(self) -> None:
        interval = self.autoscaler.config.interval_s
        while True:
            await asyncio.sleep(interval)
            try:
                loads, starting = self.pool.loads()
                decisions = self.autoscaler.step(time.monotonic(), dict(self.pool.targets), starting, loads,
                                                 self._fresh_reports())
                for d in decisions:
                    log.info("autoscaler: %s %d -> %d: %s", d.role.value, d.before, d.after, d.reason)
                    key = (d.role.value, d.direction)
                    self._decisions[key] = self._decisions.get(key, 0) + 1
                    self._last[d.role.value] = {"at": time.time(), "from": d.before, "to": d.after,
                                                "reason": d.reason}
                    await self.pool.set_pools(d.after if d.role is Role.PREFILL else None,
                                              d.after if d.role is Role.DECODE else None)
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad tick must not end autoscaling
                log.exception("autoscaler: tick failed")

    async def set_pools(self, prefill: int | None, decode: int | None) -> dict:
        try:
            return await self.pool.set_pools(prefill, decode)
        except ValueError as e:  # a plain reply: a Ray task error would carry a remote traceback
            return {"error": str(e)}

    async def suspect(self, worker_id: str) -> None:
        self.pool.suspect(worker_id)

    async def shutdown(self) -> None:
        """Stop every worker; the caller then ends this actor."""
        for t in (self._start, self._autoscale_task):
            if t is not None:
                t.cancel()
        await self.pool.stop()


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
        return ray.get_actor(NAME, namespace=NAMESPACE)
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


def create(config: PoolConfig, info: dict, detached: bool):
    """A new controller on this process's node (the head, under KubeRay). Detached, it
    outlives this process and is ended by `tandem controller --stop`; otherwise it ends
    with this process (and takes its workers with it). ValueError when one exists."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    options = {"name": NAME, "namespace": NAMESPACE, "num_cpus": 0, "max_restarts": 0,
               "scheduling_strategy": here, "max_concurrency": 1000}
    if detached:
        options["lifetime"] = "detached"
    return ray.remote(Controller).options(**options).remote(config, info)


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
