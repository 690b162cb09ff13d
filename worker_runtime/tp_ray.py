"""A tensor-parallel worker's ranks 1..N-1 as Ray actors in the worker's placement group.

The controller puts a worker of N ranks in a placement group of N bundles on one node
(controller/pools.py) and its rank 0, the worker actor, in bundle 0. That actor's
engine starts ranks 1..N-1 here, `RankActor`s in bundles 1..N-1, each asking what
bundle 0 gave rank 0 (its CPUs and GPU), each running `engine.parallel.ranks.run_rank`.
The rank actors belong to rank 0's process: if it dies, Ray ends them; the controller
removes the placement group when it removes the worker. On CUDA each actor sees its
own GPU alone, as cuda:0.
"""

from __future__ import annotations

import dataclasses
import logging
import os

log = logging.getLogger(__name__)


class RankActor:
    """The body of one rank's Ray actor."""

    def run(self, spec, rank: int) -> int:
        logging.basicConfig(level=logging.INFO,
                            format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
        from engine.parallel.ranks import run_rank

        return run_rank(spec, rank)

    def pid(self) -> int:
        return os.getpid()


class RayRanks:
    """A launcher (engine/parallel/ranks.py) for ranks in this actor's placement group."""

    def __init__(self, pg, name: str) -> None:
        import ray

        self.pg, self.name = pg, name
        got = ray.get_runtime_context().get_assigned_resources()
        self.gpus = got.get("GPU", 0)
        self.cpus = got.get("CPU", 0)
        self.actors: list = []
        self.pid_refs: list = []
        self.runs: list = []

    def place(self, devices):
        if self.gpus:  # each rank's actor sees one GPU
            return tuple(dataclasses.replace(d, device="cuda:0") for d in devices)
        return devices

    def start(self, spec) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cls = ray.remote(RankActor)
        for rank in range(1, spec.size):
            actor = cls.options(
                num_cpus=self.cpus, num_gpus=self.gpus, name=f"{self.name}-rank{rank}", max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank),
            ).remote()
            self.actors.append(actor)
            self.pid_refs.append(actor.pid.remote())  # before `run`, which holds the actor for good
            self.runs.append(actor.run.remote(spec, rank))

    def failed(self) -> str | None:
        import ray

        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        for ref in done:
            rank = self.runs.index(ref) + 1
            try:
                status = ray.get(ref, timeout=1)
                return f"rank {rank}'s actor exited with status {status}"
            except Exception as e:  # noqa: BLE001 - the reason is what is reported
                return f"rank {rank}'s actor failed: {e}"
        return None

    def pids(self) -> list[int]:
        import ray

        return ray.get(self.pid_refs, timeout=5)

    def stop(self, timeout_s: float = 5.0) -> None:
        import ray

        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass


def use_placement_group(name: str) -> bool:
    """In a Ray actor placed in a placement group of several bundles: start this
    worker's other ranks as actors in that group. True if it did."""
    import ray

    pg = ray.util.get_current_placement_group()
    if pg is None or len(pg.bundle_specs) < 2:
        return False
    from engine.parallel.ranks import use_launcher

    use_launcher(lambda: RayRanks(pg, name))
    return True
