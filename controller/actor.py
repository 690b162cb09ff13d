"""The control plane: one named Ray actor per cluster that owns the worker pools.

The controller runs a PoolManager (controller/pools.py): it creates the worker actors (so
they live as long as it does, not as long as any router), checks their health,
replaces the dead, and resizes the pools on command. Routers (router/view.py) find it
by name, follow its membership (a long poll, worker_runtime/membership.py), and talk to
the workers themselves: requests, stats and KV events never pass through it. This
package is the controller's process alone: no router imports it.

    tandem serve                  starts a local Ray, the controller and one router;
                                  stopping it stops all three
    tandem controller --address   starts a detached controller in a running cluster
    tandem router --address       one more router for the controller found there
    tandem controller --address ADDR --stop
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time

from controller.autoscale import Autoscaler
from controller.pools import PoolConfig, PoolManager
from worker_runtime.config import LOG_FORMAT, Role
from worker_runtime.logs import use_log_format
from worker_runtime.membership import CONTROLLER_NAME, NAMESPACE, Membership, RouterReport
from worker_runtime.rpc import use_cluster_tls

log = logging.getLogger(__name__)

ADOPTION_WAIT_S = 60.0  # a call that needs the members waits this long for the adoption at start


class Controller:
    """The actor's class (made remote in `create`). Every method is async: one event
    loop in the actor runs the pool's loops and answers the routers."""

    def __init__(self, config: PoolConfig, info: dict) -> None:
        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
        use_log_format(config.template.log_format, LOG_FORMAT)
        use_cluster_tls(config.template.tls)  # its health and stats channels to the workers
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
        """Adopt the running workers, then bring the pools to their targets; once (a
        second caller waits for the first)."""
        await asyncio.shield(self._started())

    def _started(self) -> asyncio.Task:
        """The start task, begun by the first call of any kind: after Ray restarts this
        actor (max_restarts) nobody calls `start`, and the routers' next membership poll
        begins it, so the running workers are adopted within a poll."""
        if self._start is None:
            self._start = asyncio.create_task(self.pool.start())
            self._start.add_done_callback(self._on_started)
        return self._start

    def _on_started(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        if task.exception() is not None:
            log.error("the pools did not come up: %s", task.exception())
        elif self.autoscaler is not None and self._autoscale_task is None:
            self._autoscale_task = asyncio.create_task(self._autoscale_loop())

    async def _adopted(self) -> None:
        """Wait (bounded) until the running workers are adopted: a membership without
        them would make the routers drop workers that serve their streams."""
        self._started()
        await asyncio.wait_for(self.pool.adoption.wait(), ADOPTION_WAIT_S)

    async def membership(self, since: int = -1, wait_s: float = 0.0) -> Membership:
        await self._adopted()
        return await self.pool.membership(since, min(wait_s, 30.0), self.autoscale_status())

    async def get_pools(self) -> dict:
        await self._adopted()
        return {**await self.pool.get_pools(), "autoscaler": self.autoscale_status(),
                "controller": {"pid": os.getpid(), "adopted": self.pool.adopted}}

    # ---- the autoscaler (controller/autoscale.py) ----------------------------------------
    async def report(self, router_id: str, report: RouterReport) -> None:
        """A router's own side of the load (its queue, its recent SLO attainment)."""
        now = time.monotonic()
        self._reports = {k: v for k, v in self._reports.items() if now - v[0] < self._stale_s()}  # routers gone
        self._reports[router_id] = (now, report)

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


def create(config: PoolConfig, info: dict, detached: bool):
    """A new controller on this process's node (the head, under KubeRay). Detached, it
    outlives this process and is ended by `tandem controller --stop`; otherwise it ends
    with this process (and takes its workers with it, unless they are detached: those are
    ended by `shutdown`). ValueError when one exists."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # on this node (the head, under KubeRay) while it lives; soft, so that a controller
    # Ray restarts after the head itself was lost (GCS fault tolerance) runs on another
    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=True)
    # max_restarts: a controller whose process dies is started again by Ray with the same
    # arguments, and adopts the workers (they are detached where it is, PoolConfig)
    options = {"name": CONTROLLER_NAME, "namespace": NAMESPACE, "num_cpus": 0, "max_restarts": -1,
               "scheduling_strategy": here, "max_concurrency": 1000}
    if detached:
        options["lifetime"] = "detached"
    return ray.remote(Controller).options(**options).remote(config, info)
