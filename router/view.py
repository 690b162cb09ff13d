"""One router's view of the pools the controller (controller/) runs.

A router keeps no state another router needs: it learns the members from the
controller (a long poll, so a change reaches it at once), and keeps what it needs to
route by itself: a gRPC client per worker, each worker's stats (polled), the prefix
index (from each worker's KV event stream, which starts with a full snapshot, so a
new router rebuilds it), and the load it has sent each worker and not yet seen in
the worker's stats (`Load`, router/workers.py). Admin calls go to the controller, so
every router acts on the same pools.

A worker is routable here once the controller calls it ready and this router has
read its stats once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable

from protos import tandem_pb2 as pb
from router import controller_client as ctl
from router.admin import AdminInterface
from router.errors import ApiError
from router.prefix_index import PrefixIndex
from router.workers import Worker
from worker_runtime.client import RPC_ERRORS, WorkerClient
from worker_runtime.config import Role
from worker_runtime.membership import ROLES, Membership, RouterReport, WorkerState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ViewConfig:
    ray_address: str | None  # None: start a local Ray (tandem serve on a laptop)
    # given: called (no arguments) to create the controller when none runs, returning its
    # handle (the command line passes controller.actor.create); None: attach only
    create_controller: Callable[[], Any] | None = None
    detached: bool = False  # a controller created here outlives this process
    join_timeout_s: float = 60.0
    controller_wait_s: float = 60.0
    start_timeout_s: float = 900.0
    stats_interval_s: float = 0.25
    poll_wait_s: float = 5.0  # the membership long poll


class ClusterView(AdminInterface):
    def __init__(self, config: ViewConfig) -> None:
        self.config = config
        self.workers: dict[str, Worker] = {}
        self.targets: dict[Role, int] = {r: 0 for r in ROLES}
        self.index = PrefixIndex()
        self.info: dict = {}
        self.controller = None
        self.created = False  # this router created the controller (and stops it, unless detached)
        self._owns_ray = False
        self._version = -1
        self._said: dict[str, WorkerState] = {}  # each worker's state as the controller last gave it
        self._roles: dict[str, Role] = {}  # and its role
        self._bg: list[asyncio.Task] = []
        self.autoscaler: dict | None = None  # the controller's autoscaler status, when it runs one
        # this router's side of the load, for the autoscaler (set by the app: cli/serve.py)
        self.report_source: Callable[[], RouterReport] | None = None
        self.router_id = f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        c = self.config
        t0 = time.monotonic()
        if c.ray_address is None:
            log.info("starting a local Ray cluster")
        else:
            log.info("joining Ray at %s", c.ray_address)
        self._owns_ray = await ctl.connect(c.ray_address, c.join_timeout_s)
        log.info("Ray up in %.1f s", time.monotonic() - t0)
        handle = await asyncio.to_thread(ctl.find)
        if handle is None and c.create_controller is not None:
            try:
                handle = c.create_controller()
                self.created = True
            except ValueError:  # another process created it first (the name is taken): use that one
                handle = await asyncio.to_thread(ctl.find)
        elif handle is None:
            handle = await ctl.wait_for(c.controller_wait_s)
        elif c.create_controller is not None:
            log.warning("a tandem controller already runs in this cluster: attached to it (its pool sizes stand; "
                        "resize with `tandem scale`)")
        self.controller = handle
        deadline = time.monotonic() + c.controller_wait_s
        while True:
            try:
                self.info = await asyncio.wait_for(ctl.result(self.controller.info.remote()), 60)
                # the pools come up once, whoever asks first; everyone else waits for it
                await asyncio.wait_for(ctl.result(self.controller.start.remote()), c.start_timeout_s)
                break
            except Exception as e:
                # one that Ray is restarting (its node lost) answers again soon: wait for it
                if not ctl.unavailable(e) or time.monotonic() >= deadline:
                    raise RuntimeError(f"the controller did not start its pools: {ctl.remote_cause(e)}") from None
                log.info("the controller is not reachable yet (%s); waiting for it", type(ctl.remote_cause(e)).__name__)
                await asyncio.sleep(1.0)
                await self._refind_controller()
        await self._sync(await ctl.result(self.controller.membership.remote(-1, 0)))
        self._bg = [asyncio.create_task(self._follow_membership()), asyncio.create_task(self._stats_loop())]
        if self.info.get("autoscale"):
            self._bg.append(asyncio.create_task(self._report_loop()))
        log.info("pools up %.1f s after the start", time.monotonic() - t0)

    async def stop(self) -> None:
        for t in self._bg:
            t.cancel()
        await asyncio.gather(*self._bg, return_exceptions=True)
        for w in list(self.workers.values()):
            await self._forget(w)
        if self.controller is not None and self.created and not self.config.detached:
            await ctl.stop(self.controller)
        if self._owns_ray:
            await asyncio.to_thread(ctl.shutdown_local_ray)

    # ---- what routing reads -------------------------------------------------------------
    def ready(self, role: Role) -> list[Worker]:
        """Routable: ready by the controller, stats read, and not draining by its own
        account (a worker sent SIGTERM says so in its stats before the controller knows)."""
        return [w for w in self.workers.values()
                if w.role == role and w.state == WorkerState.READY and w.stats and not w.stats.draining]

    def starting(self, role: Role) -> bool:
        """Whether a worker of this role is on its way: the controller is starting it (a
        replacement or a scale-up), or has called it ready and this router has not read
        its stats yet (not routable here for a moment more)."""
        routable = {w.worker_id for w in self.ready(role)}
        draining = {w.worker_id for w in self.workers.values() if w.stats and w.stats.draining}
        return any(self._roles.get(wid) == role and wid not in routable | draining
                   and st in (WorkerState.STARTING, WorkerState.READY) for wid, st in self._said.items())

    def get(self, worker_id: str) -> Worker | None:
        return self.workers.get(worker_id)

    def suspect(self, worker_id: str) -> None:
        """A request saw this worker fail: the controller checks it now."""
        if self.controller is not None:
            self.controller.suspect.remote(worker_id)

    # ---- admin: the controller's ---------------------------------------------------------
    async def get_pools(self) -> dict:
        data = await self._call(self.controller.get_pools.remote())
        return self._with_local_load(data)

    async def set_pools(self, prefill: int | None, decode: int | None) -> dict:
        data = await self._call(self.controller.set_pools.remote(prefill, decode))
        if "error" in data:
            raise ValueError(data["error"])
        return self._with_local_load(data)

    def _with_local_load(self, data: dict) -> dict:
        routable = {w.worker_id for role in ROLES for w in self.ready(role)}
        for pool in data["pools"].values():
            for w in pool["workers"]:
                mine = self.workers.get(w["worker_id"])
                w["in_flight"] = mine.load.in_flight if mine else 0  # this router's requests there
                # whether this router sends requests there now (ready by the controller, its
                # stats read here, not draining): a new router learns of workers a moment late
                w["routable"] = w["worker_id"] in routable
        return data

    async def _call(self, ref, timeout: float = 30.0):
        try:
            return await asyncio.wait_for(ctl.result(ref), timeout)
        except Exception as e:  # gone, restarting (Ray starts it again), or busy: a 503 to retry
            raise ApiError(503, f"the controller did not answer ({type(ctl.remote_cause(e)).__name__}); it may be "
                                "restarting: retry shortly", None, "controller_unavailable", retry_after=2.0) from None

    # ---- following the controller --------------------------------------------------------
    async def _follow_membership(self) -> None:
        while True:
            try:
                m = await asyncio.wait_for(
                    ctl.result(self.controller.membership.remote(self._version, self.config.poll_wait_s)),
                    self.config.poll_wait_s + 30,
                )
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the controller is gone or busy: keep routing to what we know
                log.warning("membership from the controller failed: %s", ctl.remote_cause(e))
                await asyncio.sleep(1.0)
                await self._refind_controller()
                continue
            await self._sync(m)

    async def _refind_controller(self) -> None:
        """A controller started anew under the same name (`tandem controller` again) is
        another actor: follow it. One that Ray restarts keeps its handle."""
        with contextlib.suppress(Exception):
            handle = await asyncio.wait_for(asyncio.to_thread(ctl.find), 10)
            if handle is not None and handle._actor_id != self.controller._actor_id:
                log.info("a new controller runs: following it")
                self.controller = handle

    async def _report_loop(self, interval_s: float = 2.0) -> None:
        """Tell the controller's autoscaler what only a router sees: its queue, its SLOs."""
        while True:
            await asyncio.sleep(interval_s)
            if self.report_source is None:
                continue
            try:
                await asyncio.wait_for(ctl.result(self.controller.report.remote(self.router_id,
                                                                                self.report_source())), 10)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("report to the controller failed: %s", ctl.remote_cause(e))

    async def _sync(self, m: Membership) -> None:
        self._version = m.version
        self.autoscaler = m.autoscaler
        self.targets = dict(m.targets)
        seen = set()
        for entry in m.workers:
            wid = entry.worker_id
            seen.add(wid)
            w = self.workers.get(wid)
            if w is not None and (w.epoch != entry.epoch or w.client.address != entry.address):
                await self._forget(w)  # the same name on a new process (a new controller)
                w = None
            state = self._said[wid] = entry.state
            self._roles[wid] = entry.role
            if w is None:
                if state is not WorkerState.READY or not entry.address:
                    continue  # not reachable yet: picked up when the controller calls it ready
                client = WorkerClient(wid, entry.role, entry.address, self.info["cluster_token"])
                w = Worker(wid, entry.role, client, epoch=entry.epoch, metrics_address=entry.metrics_address,
                           pid=entry.pid)
                self.workers[wid] = w
                w.tasks.append(asyncio.create_task(self._follow_kv_events(w)))
            if state is WorkerState.READY and w.stats is None:
                with contextlib.suppress(*RPC_ERRORS):
                    w.stats = await w.client.stats(timeout=2.0)
            w.state = state if (state is not WorkerState.READY or w.stats) else WorkerState.STARTING
        for wid in set(self.workers) - seen:
            await self._forget(self.workers[wid])
        self._said = {wid: st for wid, st in self._said.items() if wid in seen}
        self._roles = {wid: r for wid, r in self._roles.items() if wid in seen}

    async def _forget(self, w: Worker) -> None:
        w.state = WorkerState.STOPPED
        for t in w.tasks:
            t.cancel()
        self.index.drop(w.worker_id)
        self.workers.pop(w.worker_id, None)
        await w.client.close()

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.stats_interval_s)
            await asyncio.gather(*(self._read_stats(w) for w in list(self.workers.values())))

    async def _read_stats(self, w: Worker) -> None:
        try:
            w.stats = await w.client.stats(timeout=1.0)
        except RPC_ERRORS:
            return
        if w.state is WorkerState.STARTING and self._said.get(w.worker_id) is WorkerState.READY:
            w.state = WorkerState.READY

    async def _follow_kv_events(self, w: Worker) -> None:
        while self.workers.get(w.worker_id) is w:
            try:
                async for batch in w.client.stub.KVEvents(pb.KVEventsRequest(), metadata=w.client.metadata):
                    self.index.apply(w.worker_id, batch)
            except RPC_ERRORS:
                self.index.drop(w.worker_id)
            await asyncio.sleep(0.5)

