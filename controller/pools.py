"""PoolManager: the prefill and decode pools as Ray actors, inside the controller.

It creates worker actors (resources from config), keeps the registry, watches each
worker (gRPC health; stats for `tandem status`, drains and the autoscaler), replaces a
worker that dies, and resizes a pool on command. Scaling down drains first: the
worker stops taking new requests, its running requests finish (bounded by
`drain_timeout_s`, read from the worker's own stats), then it is stopped and removed.
The states are worker_runtime/membership.py's.

Workers are named actors (`tandem-worker-<role>-<n>` in tandem's namespace) and, with
`detached_workers`, detached: they outlive the controller. A controller that starts
(Ray restarting it, or `tandem controller` run again) first adopts the live workers it
finds by name, checked by their own epoch over gRPC, and only then starts what the
targets still lack; an adopted worker is never drained to meet a target, so a
controller's restart drops no stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import logging
import os
import time
from dataclasses import dataclass, field

import grpc

from controller.autoscale import AutoscaleConfig, WorkerLoad
from engine.config import ConfigError, kv_cache_dtype_of
from engine.cores import create_core_table
from worker_runtime import envs
from worker_runtime.client import RPC_ERRORS, WorkerClient, wait_ready
from worker_runtime.config import Role, WorkerConfig
from worker_runtime.membership import NAMESPACE, ROLES, Member, Membership, WorkerState
from worker_runtime.rpc import epoch_str
from worker_runtime.stats import WorkerStats

log = logging.getLogger(__name__)

# The worker actors' classes, by path: the controller creates them but runs none of
# their code (their services import torch in the workers' own processes).
WORKER_ACTORS = {Role.PREFILL: "prefill_worker.actor:PrefillWorkerActor",
                 Role.DECODE: "decode_worker.actor:DecodeWorkerActor"}
WORKER_NAME_PREFIX = "tandem-worker-"  # + worker id: the actor's name, by which a new controller finds it


def worker_actor_name(worker_id: str) -> str:
    return WORKER_NAME_PREFIX + worker_id


def _model_of(info: dict) -> dict:
    """The model dtypes in a worker's `info()` (worker_runtime/metrics.py model_dtypes)."""
    return {k: info[k] for k in ("dtype", "weights", "weight_scales", "quantization", "kv_cache_dtype", "experts")
            if k in info}


def kv_disagreement(worker_id: str, model: dict, others: dict[str, dict]) -> str | None:
    """Why a worker whose model dtypes are `model` cannot serve beside `others` (worker id
    to theirs): its KV cache holds another dtype than theirs, so blocks could not move
    between them (a prefill worker's KV is a decode worker's cache, byte for byte); None
    when they agree or say nothing."""
    mine = model.get("kv_cache_dtype")
    for other, theirs in others.items():
        if mine and theirs.get("kv_cache_dtype") and theirs["kv_cache_dtype"] != mine:
            return (f"{worker_id} keeps its KV cache in {mine} and {other} in {theirs['kv_cache_dtype']}: prefill and "
                    "decode workers must agree on --kv-cache-dtype (and the model's --dtype)")
    return None


def placement_group_name(worker_id: str) -> str:
    """The placement group holding a tensor-parallel worker's ranks (found by name on adoption)."""
    return worker_actor_name(worker_id) + "-ranks"


def parse_worker_id(worker_id: str) -> tuple[Role, int] | None:
    """(role, number) of a worker id such as decode-3; None for anything else."""
    role, _, n = worker_id.rpartition("-")
    try:
        return Role(role), int(n)
    except ValueError:
        return None


# Local CPU runs: a worker step of at most this much work (tokens x weight parameters) uses
# one torch thread, leaving the other cores to the router and clients. About 4 tokens of
# an 8M-parameter model; never one token of a 100M+ one, whose step is bandwidth-bound
# and gains from every core (measured: docs/performance.md).
LOCAL_SERIAL_STEP_WORK = 32_000_000


@dataclass(frozen=True)
class PoolConfig:
    template: WorkerConfig  # worker_id / role are filled in per worker
    sizes: dict[Role, int] = field(default_factory=lambda: {Role.PREFILL: 1, Role.DECODE: 1})
    resources: dict[Role, dict] = field(
        default_factory=lambda: {Role.PREFILL: {"num_cpus": 1}, Role.DECODE: {"num_cpus": 1}}
    )
    cores: tuple[int, ...] | None = None  # pin workers round-robin to these cores (CPU hosts)
    health_interval_s: float = 1.0
    health_failures: int = 3  # consecutive failed checks before a worker may be declared dead
    # a worker whose connection stands but which answers nothing (paused, or stalled in a
    # step) is dead only after this long without an answer: a busy worker answers late
    dead_after_s: float = 30.0
    stats_interval_s: float = 0.25
    start_timeout_s: float = 600.0
    join_timeout_s: float = 60.0  # joining a running Ray cluster (--address)
    drain_timeout_s: float = 120.0
    max_workers: int = 64
    autoscale: AutoscaleConfig | None = None  # the controller's autoscaler (router/autoscale.py); None: off
    # ranks per worker, by pool (default: the template's --tensor-parallel-size); a pool's
    # resources are per rank: a worker of N ranks holds N such bundles (a placement group)
    tensor_parallel: dict[Role, int] = field(default_factory=dict)
    # KV cache size by pool, over the template's (CacheConfig fields: num_blocks,
    # kv_cache_memory_gb): decode workers hold every running sequence's context, prefill
    # workers a prefix cache, and the two are sized apart
    cache: dict[Role, dict] = field(default_factory=dict)
    # workers outlive the controller (a detached controller's, or a local runtime's); else
    # they share its fate, and a restarted controller starts new ones
    detached_workers: bool = False

    def __post_init__(self) -> None:  # accept role names as keys; hold Role members
        object.__setattr__(self, "sizes", {Role(r): n for r, n in self.sizes.items()})
        object.__setattr__(self, "resources", {Role(r): v for r, v in self.resources.items()})
        object.__setattr__(self, "tensor_parallel", {Role(r): n for r, n in self.tensor_parallel.items()})
        object.__setattr__(self, "cache", {Role(r): dict(v) for r, v in self.cache.items()})


@dataclass
class PoolWorker:
    """The controller's record of one worker actor it owns."""

    worker_id: str
    role: Role
    actor: object
    client: WorkerClient | None = None
    state: WorkerState = WorkerState.STARTING
    epoch: int = 0
    metrics_address: str = ""
    pid: int = 0
    pg: object = None  # a tensor-parallel worker's placement group (its ranks' bundles), removed with it
    tp_size: int = 1
    ranks: list = field(default_factory=list)  # where each tensor-parallel rank runs (the worker's own account)
    model: dict = field(default_factory=dict)  # what its weights and KV cache are stored as (metrics.model_dtypes)
    stats: WorkerStats | None = None  # the worker's own account, read every stats_interval_s
    failures: int = 0  # consecutive failed health checks
    last_answer: float = field(default_factory=time.monotonic)  # when it last answered a check
    slowest_answer_s: float = 0.0  # the slowest of its recent answers (the health check's deadline follows it)

    def member(self) -> Member:
        return Member(self.worker_id, self.role, self.state, self.client.address if self.client else "",
                      self.epoch, self.metrics_address, self.pid)

    def as_dict(self) -> dict:
        s = self.stats
        d = {
            "worker_id": self.worker_id,
            "role": self.role.value,
            "state": self.state.value,
            "address": self.client.address if self.client else "",
            "epoch": epoch_str(self.epoch),
            "metrics": self.metrics_address,
            "pid": self.pid,
            "tensor_parallel_size": self.tp_size,
            "ranks": self.ranks,
            **self.model,
        }
        if s is not None:
            d |= {
                "running": s.num_running,
                "waiting": s.num_waiting,
                "awaiting_kv": s.num_awaiting_kv,
                "kv_usage": round(s.kv_usage, 4),
                "queued_prefill_tokens": s.queued_prefill_tokens,
                "transport": s.transport,
            }
            if s.tier_host_blocks:  # KV tiers below the device (engine/kv_tiers.py), in blocks
                d["tiers"] = {"host_blocks": s.tier_host_blocks, "host_used": s.tier_host_used,
                              "disk_blocks": s.tier_disk_blocks, "disk_used": s.tier_disk_used,
                              "hits": s.tier_hits, "swap_outs": s.tier_swap_outs}
        return d


class PoolManager:
    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.targets = dict(config.sizes)
        self.workers: dict[str, PoolWorker] = {}
        # bumped on every change of membership or state (routers follow it); from the
        # clock in ms, so a restarted controller's versions are past its predecessor's
        self.version = int(time.time() * 1000)
        self.adopted = 0  # workers this controller found running at its start
        self.start_error = ""  # the last worker's failure to start, for the one line that reports it
        self.adoption = asyncio.Event()  # set once they are: until then the membership is not told
        self.polls_waiting = 0  # routers inside a membership long poll now
        self._changed = asyncio.Event()
        self._counter = {r: 0 for r in ROLES}
        self._remote_cls: dict[str, object] = {}
        self._bg: list[asyncio.Task] = []
        self._reconcile_lock = asyncio.Lock()
        self.events: list[tuple[float, str]] = []  # (time, what happened), for status and tests
        self.replaced = 0
        # workers pinned to shares of `cores` lend each other their idle ones (engine/cores.py)
        lend = bool(config.cores) and len(config.cores) > 1 and config.template.engine.device.device == "cpu"
        self.core_table = create_core_table() if lend and envs.cpu_lend_cores() else None

    # ---- lifecycle -----------------------------------------------------------------
    async def start(self) -> None:
        """Inside the controller actor (controller/actor.py): Ray is up."""
        import ray

        self._remote_cls = {role: ray.remote(_resolve(WORKER_ACTORS[role])) for role in ROLES}
        try:
            await self.adopt()
        finally:
            self.adoption.set()
        await self.reconcile()
        missing = [r.value for r in ROLES if len(self.ready(r)) < self.targets[r]]
        if missing:
            why = f"; the last failure: {self.start_error}" if self.start_error else "; see the worker logs"
            raise RuntimeError(f"pools did not come up: {', '.join(missing)}{why}")
        self._bg += [asyncio.create_task(self._health_loop()), asyncio.create_task(self._stats_loop())]

    async def adopt(self) -> None:
        """Take over the live workers a previous controller started (their actors are
        named, see the module doc): each answers its own info and a gRPC health check
        with the same epoch, or is ended. A pool that has more than its target keeps
        them all (its target rises to match); the numbering goes on above theirs."""
        import ray

        ids = [a["name"][len(WORKER_NAME_PREFIX):] for a in await asyncio.to_thread(ray.util.list_named_actors, True)
               if a.get("namespace") == NAMESPACE and a["name"].startswith(WORKER_NAME_PREFIX)]
        ids = sorted(i for i in ids if parse_worker_id(i) is not None)
        found = await asyncio.gather(*(self._adopt_one(i) for i in ids), return_exceptions=True)
        adopted = [w for w in found if isinstance(w, PoolWorker)]
        for w in adopted:
            role, n = parse_worker_id(w.worker_id)
            self._counter[role] = max(self._counter[role], n + 1)
        for role in ROLES:
            mine = sum(w.role is role and not w.stats.draining for w in adopted)
            if mine > self.targets[role]:
                log.info("%s pool: %d workers adopted, over its target of %d: the target is now %d",
                         role.value, mine, self.targets[role], mine)
                self.targets[role] = mine
        self.adopted = len(adopted)
        if ids:
            log.info("adopted %d running worker(s) of %d found: %s", len(adopted), len(ids),
                     ", ".join(w.worker_id for w in adopted) or "none")

    async def _adopt_one(self, worker_id: str) -> PoolWorker | None:
        import ray

        role, _ = parse_worker_id(worker_id)
        try:
            actor = await asyncio.to_thread(ray.get_actor, worker_actor_name(worker_id), NAMESPACE)
            info = await asyncio.wait_for(actor.info.remote(), 10)
        except Exception as e:  # noqa: BLE001 - gone, or not answering: not adopted
            log.warning("%s: found by name but not adopted (%s)", worker_id, e)
            return None
        w = PoolWorker(worker_id, role, actor, pid=info["pid"], tp_size=info.get("tensor_parallel_size", 1),
                       ranks=info.get("ranks", []), model=_model_of(info))
        if w.tp_size > 1:
            try:
                w.pg = await asyncio.to_thread(ray.util.get_placement_group, placement_group_name(worker_id))
            except ValueError:
                log.warning("%s: its placement group is gone", worker_id)
        if not info["address"]:  # it was starting when its controller ended: start afresh
            log.info("%s: was still starting; ending it", worker_id)
            await self._remove(w, drain=False)
            return None
        w.client = WorkerClient(worker_id, role, info["address"], self.config.template.cluster_token)
        try:
            if why := kv_disagreement(worker_id, w.model, {"this controller's workers": self._expected_model()}):
                raise ConfigError(why)
            health = await w.client.health(timeout=5.0)
            if not health.healthy or health.epoch != info["epoch"]:
                raise RuntimeError("unhealthy" if not health.healthy else "its epoch differs from its actor's")
            w.epoch, w.metrics_address = health.epoch, health.metrics_address
            w.stats = await w.client.stats()
        except Exception as e:  # noqa: BLE001
            log.warning("%s: not adopted (%s); ending it", worker_id, e)
            await self._remove(w, drain=False)
            return None
        self.workers[worker_id] = w
        w.state = WorkerState.READY
        if w.stats.draining:  # it was being scaled down: finish that
            self._bg.append(asyncio.create_task(self._remove(w, drain=True)))
        self._note(f"{worker_id} adopted at {w.client.address} (epoch {epoch_str(w.epoch)})")
        return w

    def _models(self, w: PoolWorker) -> dict[str, dict]:
        """The model dtypes of the other workers that have said theirs."""
        return {o.worker_id: o.model for o in self.workers.values() if o is not w and o.model}

    def _expected_model(self) -> dict:
        """What this controller's workers will keep their KV cache in, where its flags fix
        it (--kv-cache-dtype fp8); {} where the checkpoint's dtype decides."""
        flag = self.config.template.engine.cache.kv_cache_dtype
        return {"kv_cache_dtype": kv_cache_dtype_of(flag)} if kv_cache_dtype_of(flag) else {}

    async def stop(self) -> None:
        for t in self._bg:
            t.cancel()
        await asyncio.gather(
            *(self._remove(w, drain=False) for w in list(self.workers.values())), return_exceptions=True
        )
        if self.core_table is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.core_table)

    # ---- queries -------------------------------------------------------------------
    def ready(self, role: Role) -> list[PoolWorker]:
        return [w for w in self.workers.values() if w.role == role and w.state == WorkerState.READY and w.client]

    def get(self, worker_id: str) -> PoolWorker | None:
        return self.workers.get(worker_id)

    async def get_pools(self) -> dict:
        pools = {}
        for role in ROLES:
            ws = [w for w in self.workers.values() if w.role == role]
            pools[role.value] = {
                "target": self.targets[role],
                "ready": sum(w.state is WorkerState.READY for w in ws),
                "workers": [w.as_dict() for w in sorted(ws, key=lambda w: w.worker_id)],
            }
        return {"pools": pools, "replaced": self.replaced}

    async def set_pools(self, prefill: int | None, decode: int | None) -> dict:
        for role, n in ((Role.PREFILL, prefill), (Role.DECODE, decode)):
            if n is None:
                continue
            if not 0 <= n <= self.config.max_workers:
                raise ValueError(f"{role.value} pool size must be between 0 and {self.config.max_workers}, got {n}")
            if role is Role.DECODE and n == 0:
                raise ValueError("the decode pool cannot be empty: it serves every request")
        self.targets.update({r: n for r, n in ((Role.PREFILL, prefill), (Role.DECODE, decode)) if n is not None})
        self._bg.append(asyncio.create_task(self.reconcile()))
        return await self.get_pools()

    # ---- reconciling sizes -------------------------------------------------------------
    async def reconcile(self) -> None:
        """Start or drain workers until every pool matches its target."""
        async with self._reconcile_lock:
            steps = []  # both pools at once: a worker's start is mostly waiting (process, imports, weights)
            for role in ROLES:
                live = [
                    w
                    for w in self.workers.values()
                    if w.role == role and w.state in (WorkerState.STARTING, WorkerState.READY)
                ]
                diff = self.targets[role] - len(live)
                if diff > 0:
                    steps += [self._add(role) for _ in range(diff)]
                elif diff < 0:
                    victims = sorted(live, key=_victim_order)[:-diff]
                    steps += [self._remove(w, drain=True) for w in victims]
            await asyncio.gather(*steps, return_exceptions=True)

    def _worker_config(self, role: Role, worker_id: str, slot: int) -> WorkerConfig:
        t = self.config.template
        device = t.engine.device
        if self.config.cores and device.device == "cpu":
            cores = share_cores(self.config.cores, sum(self.targets.values()), slot)
            # the router and local clients run on these cores too: small steps on one thread
            serial = device.serial_step_work if device.serial_step_work is not None else LOCAL_SERIAL_STEP_WORK
            device = dataclasses.replace(device, cpu_affinity=cores, num_threads=device.num_threads or len(cores),
                                         serial_step_work=serial, core_table=self.core_table,
                                         shared_cores=self.config.cores if self.core_table else None)
        parallel = dataclasses.replace(t.engine.parallel, tensor_parallel_size=self.tp_size(role))
        cache = dataclasses.replace(t.engine.cache, **self.config.cache.get(role, {}))
        engine = dataclasses.replace(t.engine, device=device, parallel=parallel, cache=cache)
        return dataclasses.replace(t, role=role, worker_id=worker_id, engine=engine)

    def tp_size(self, role: Role) -> int:
        return self.config.tensor_parallel.get(role, self.config.template.engine.parallel.tensor_parallel_size)

    async def _placement_group(self, role: Role, worker_id: str):
        """A tensor-parallel worker's ranks in one placement group: one bundle a rank,
        each what a worker of one rank asks for (its CPUs, GPU, custom resources), all on
        one node (STRICT_PACK: one pod under KubeRay, so the ranks share NVLink and a
        host for the CPU all-reduce). Detached with the workers, so it outlives the
        controller with them. None for a worker of one rank."""
        import ray
        from ray.util.placement_group import placement_group

        size = self.tp_size(role)
        if size == 1:
            return None
        res = self.config.resources[role]
        bundle = {"CPU": res.get("num_cpus", 1), **({"GPU": res["num_gpus"]} if res.get("num_gpus") else {}),
                  **res.get("resources", {})}
        pg = placement_group([dict(bundle) for _ in range(size)], strategy="STRICT_PACK",
                             name=placement_group_name(worker_id),
                             lifetime="detached" if self.config.detached_workers else None)
        try:
            await asyncio.wait_for(pg.ready(), self.config.start_timeout_s)
        except asyncio.TimeoutError:
            ray.util.remove_placement_group(pg)
            raise RuntimeError(f"{worker_id}: no node has {size} x {bundle} free for its tensor-parallel ranks "
                               f"within {self.config.start_timeout_s:.0f} s") from None
        return pg

    async def _add(self, role: Role) -> None:
        n = self._counter[role]
        self._counter[role] += 1
        worker_id = f"{role.value}-{n}"
        slot = len(self.workers)
        options = {**self.config.resources[role], "max_restarts": 0, "name": worker_actor_name(worker_id),
                   "namespace": NAMESPACE}
        if self.config.detached_workers:
            options["lifetime"] = "detached"
        w = PoolWorker(worker_id, role, None, tp_size=self.tp_size(role))
        self.workers[worker_id] = w
        t0 = time.monotonic()
        log.info("%s starting%s", worker_id, f" ({w.tp_size} tensor-parallel ranks)" if w.tp_size > 1 else "")
        self._note(f"{worker_id} starting")  # routers learn one is coming (a stream moving waits for it)
        try:
            w.pg = await self._placement_group(role, worker_id)
            if w.pg is not None:  # rank 0 in bundle 0, the other ranks in the others (worker_runtime/tp_ray.py)
                from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(w.pg, placement_group_bundle_index=0)
            actor = w.actor = self._remote_cls[role].options(**options).remote(
                self._worker_config(role, worker_id, slot))
            address = await asyncio.wait_for(actor.start.remote(), self.config.start_timeout_s)
            w.client = WorkerClient(worker_id, role, address, self.config.template.cluster_token)
            health = await wait_ready(w.client, timeout=60)
            w.epoch, w.metrics_address = health.epoch, health.metrics_address
            info = await asyncio.wait_for(actor.info.remote(), 30)
            w.pid, w.ranks, w.model = info["pid"], info.get("ranks", []), _model_of(info)
            if why := kv_disagreement(worker_id, w.model, self._models(w)):
                raise ConfigError(why)
            w.stats = await w.client.stats()
        except Exception as e:
            cause = getattr(e, "cause", None) or e  # a Ray task error carries the worker's own exception
            self.start_error = f"{worker_id}: {type(cause).__name__}: {cause}"
            log.error("%s failed to start: %s", worker_id, self.start_error)
            self._note(f"{worker_id} failed to start: {cause}")
            await self._remove(w, drain=False)
            raise
        w.state = WorkerState.READY
        self._note(f"{worker_id} ready at {address}")
        log.info("%s ready at %s (started in %.1f s)", worker_id, address, time.monotonic() - t0)

    async def _remove(self, w: PoolWorker, drain: bool) -> None:
        if drain and w.client is not None and w.state == WorkerState.READY:
            w.state = WorkerState.DRAINING
            self._note(f"{w.worker_id} draining")
            try:
                await w.client.drain(True)
                await self._wait_idle(w)
            except (*RPC_ERRORS, asyncio.TimeoutError) as e:
                log.warning("%s: drain incomplete (%s); stopping it anyway", w.worker_id, e)
        w.state = WorkerState.STOPPED if w.state != WorkerState.DEAD else WorkerState.DEAD
        self._bump()
        import ray

        if w.actor is not None:
            try:
                await asyncio.wait_for(w.actor.stop.remote(), 15)
            except Exception:
                pass
            try:
                ray.kill(w.actor, no_restart=True)
            except Exception:
                pass
        if w.pg is not None:  # its other ranks' actors go with it
            try:
                ray.util.remove_placement_group(w.pg)
            except Exception:
                pass
        if w.client is not None:
            await w.client.close()
        self.workers.pop(w.worker_id, None)
        self._note(f"{w.worker_id} removed ({w.state})")

    async def _wait_idle(self, w: PoolWorker) -> None:
        deadline = time.monotonic() + self.config.drain_timeout_s
        while time.monotonic() < deadline:
            s = await w.client.stats()
            if s.idle:  # quarantined blocks are not requests: they do not hold a drain
                return
            await asyncio.sleep(0.1)
        raise asyncio.TimeoutError(f"still busy after {self.config.drain_timeout_s}s")

    # ---- watching ------------------------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            await asyncio.gather(*(self.check(w) for w in list(self.workers.values()) if w.state == WorkerState.READY))
            if any(
                len(
                    [
                        w
                        for w in self.workers.values()
                        if w.role == r and w.state in (WorkerState.STARTING, WorkerState.READY)
                    ]
                )
                < self.targets[r]
                for r in ROLES
            ):
                asyncio.create_task(self.reconcile())

    async def check(self, w: PoolWorker) -> bool:
        """One health check, with a deadline that follows the worker's recent answers.
        A worker is declared dead, and replaced, after `health_failures` failed checks in
        a row when it says so (unhealthy, or another process: a new epoch) or refuses
        connections (its process is gone); a worker whose connection stands but which
        answers nothing (paused, stalled in a long step) only once it has not answered
        for `dead_after_s`. The decision is logged with its evidence."""
        t0 = time.monotonic()
        deadline = min(max(2.0, 4 * w.slowest_answer_s), self.config.dead_after_s / 3)
        try:
            reply = await w.client.health(timeout=deadline)
        except RPC_ERRORS as e:
            if isinstance(e, grpc.aio.AioRpcError):  # refused: nothing listens there any more
                gone = e.code() == grpc.StatusCode.UNAVAILABLE and "refused" in (e.details() or "").lower()
                why = f"{e.code().name} ({deadline:.1f} s deadline): {(e.details() or '')[:120]}"
            else:  # UsageError: its channel was closed (the worker is being removed)
                gone, why = True, "its channel is closed"
        else:
            now = time.monotonic()
            w.slowest_answer_s = max(0.9 * w.slowest_answer_s, now - t0)
            w.last_answer = now
            if reply.healthy and reply.epoch == w.epoch:
                w.failures = 0
                return True
            gone, why = True, (f"unhealthy: {reply.error}" if not reply.healthy else "answered with a new epoch")
        w.failures += 1
        silent_s = time.monotonic() - w.last_answer
        dead = w.failures >= self.config.health_failures and (gone or silent_s >= self.config.dead_after_s)
        if dead and w.state == WorkerState.READY:
            w.state = WorkerState.DEAD
            self.replaced += 1
            evidence = f"{w.failures} failed checks in a row, the last {why}; last answer {silent_s:.1f} s ago"
            self._note(f"{w.worker_id} is dead ({evidence}); replacing it")
            log.warning("%s is dead (%s); replacing it", w.worker_id, evidence)
            asyncio.create_task(self._remove(w, drain=False))
        elif w.failures == self.config.health_failures:
            log.warning("%s: %d health checks failed (the last %s) but its connection stands: kept until it has "
                        "not answered for %.0f s", w.worker_id, w.failures, why, self.config.dead_after_s)
        return False

    def suspect(self, worker_id: str) -> None:
        """A request saw this worker fail: check it now rather than at the next tick."""
        w = self.workers.get(worker_id)
        if w is not None and w.state == WorkerState.READY:
            asyncio.create_task(self.check(w))

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.stats_interval_s)
            for w in list(self.workers.values()):
                if w.state in (WorkerState.READY, WorkerState.DRAINING):
                    try:
                        w.stats = await w.client.stats(timeout=1.0)
                    except RPC_ERRORS:
                        pass

    def _note(self, what: str) -> None:
        """Something changed (a worker came, changed state or went): noted, and the
        routers waiting in `membership` wake up."""
        self.events.append((time.time(), what))
        del self.events[:-200]
        self._bump()

    def _bump(self) -> None:
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    def loads(self) -> tuple[dict[Role, list[WorkerLoad]], dict[Role, int]]:
        """What the autoscaler reads: each ready worker's load, and the workers starting."""
        loads: dict[Role, list[WorkerLoad]] = {r: [] for r in ROLES}
        starting = {r: 0 for r in ROLES}
        for w in self.workers.values():
            if w.state is WorkerState.STARTING:
                starting[w.role] += 1
            elif w.state is WorkerState.READY and w.stats is not None:
                s = w.stats
                loads[w.role].append(WorkerLoad(s.kv_usage, s.num_running, s.num_waiting,
                                                s.max_num_seqs, s.queued_prefill_tokens))
        return loads, starting

    async def membership(self, since: int, wait_s: float, autoscaler: dict | None = None) -> Membership:
        """The members and targets once `version` has moved past `since`, or after
        `wait_s` (a long poll: routers learn of a change at once)."""
        if self.version <= since:
            self.polls_waiting += 1
            try:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), wait_s)
            finally:
                self.polls_waiting -= 1
        return Membership(self.version, dict(self.targets), tuple(w.member() for w in self.workers.values()),
                          autoscaler)


def _resolve(path: str) -> type:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _victim_order(w: PoolWorker) -> tuple:
    """Which workers a shrinking pool drains first: those not yet ready, then the ready
    ones with the fewest requests by their own stats (running and queued)."""
    busy = (w.stats.num_running + w.stats.num_waiting) if w.stats else 0
    return (w.state == WorkerState.READY, busy, w.worker_id)


def share_cores(cores: tuple[int, ...], num_workers: int, slot: int) -> tuple[int, ...]:
    """The cores of worker `slot` when `num_workers` share `cores`: an equal contiguous
    share when they fit (1 worker on 8 cores gets all 8), else one core, round-robin."""
    per = max(1, len(cores) // max(num_workers, 1))
    start = (slot * per) % len(cores)
    return tuple(cores[(start + i) % len(cores)] for i in range(per))
