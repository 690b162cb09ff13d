"""The contract between the controller and the routers: who the workers are.

The controller (controller/) owns the worker actors and publishes their membership; the
routers (router/view.py) follow it with a long poll and keep their own records for
routing. The two processes share these types and nothing else: a router never imports
the controller's code, it finds the actor by name through Ray.

    starting -> ready -> draining -> stopped
                  \\-> dead (health failed) -> replaced
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from worker_runtime.config import Role

CONTROLLER_NAME, NAMESPACE = "tandem-controller", "tandem"
ROLES = (Role.PREFILL, Role.DECODE)


class WorkerState(str, enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    DEAD = "dead"
    STOPPED = "stopped"


@dataclass(frozen=True)
class Member:
    """What a router needs to reach a worker and to know whether to route to it."""

    worker_id: str
    role: Role
    state: WorkerState
    address: str  # gRPC host:port ("" until the worker has started)
    epoch: int  # the worker process's incarnation: a new one is a new worker
    metrics_address: str = ""
    pid: int = 0


@dataclass(frozen=True)
class Membership:
    """One answer of the controller's long poll (`Controller.membership`)."""

    version: int  # moves on every change of members or state
    targets: dict[Role, int]
    workers: tuple[Member, ...]
    autoscaler: dict | None = field(default=None)  # the autoscaler's status, when one runs


@dataclass(frozen=True)
class RouterReport:
    """What only a router sees, sent to the controller's autoscaler: its queue and its
    recent SLO attainment (`Controller.report`)."""

    waiting: int = 0  # engine requests in its admission queue
    oldest_wait_s: float = 0.0
    ttft_met: int = 0
    ttft_total: int = 0
    tpot_met: int = 0
    tpot_total: int = 0
