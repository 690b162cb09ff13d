"""A worker process's own config: its role, where it serves, its transport, and the
handoff timeouts. The engine inside it has its own EngineConfig (engine/config.py).

Handoff timeouts: `HandoffTimeouts`; docs/architecture.md ("Every handoff timeout")
gives the order they fire in and why `quarantine_s > transfer_timeout_s` is required
(checked here).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.config import ConfigError, EngineConfig
from kv_transfer.tls import ClusterTLS

# Every tandem process's log line: time, level, logger, message
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


# How a worker's requests end when one of its tensor-parallel ranks is gone (the engine
# raised engine.parallel.comm.RankLost; worker_runtime/loop.py): a fault of the worker,
# not of any request, so routers move such requests to another worker as they do when a
# worker process dies (router/cluster.py). Other engine failures stay errors: a request
# that broke one engine must not go on to break the next.
WORKER_LOST = "worker lost a tensor-parallel rank: "


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


TRANSPORTS = ("auto", "nixl", "tcp")


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(frozen=True)
class HandoffTimeouts:
    """Every deadline of a KV handoff, in seconds; the module docstring orders them."""

    reservation_lease_s: float = 30.0  # decode: how long reserved blocks wait for their KV
    # decode: blocks of a reservation that ended before its KV landed stay out of use
    # this long (or until the writer's notification arrives), so a late write cannot
    # corrupt a request that reused them
    quarantine_s: float = 30.0
    # prefill: how long one handoff's write may take; None: half the quarantine
    transfer_timeout_s: float | None = None

    @property
    def transfer_s(self) -> float:
        return self.quarantine_s / 2 if self.transfer_timeout_s is None else self.transfer_timeout_s

    def __post_init__(self) -> None:
        _require(self.reservation_lease_s > 0, "reservation_lease_s must be > 0")
        _require(self.quarantine_s > 0, "quarantine_s must be > 0")
        _require(self.transfer_s > 0, "transfer_timeout_s must be > 0")
        _require(self.quarantine_s > self.transfer_s,
                 f"quarantine_s ({self.quarantine_s:g}) must exceed transfer_timeout_s "
                 f"({self.transfer_s:g}): a late write must be over before its blocks are reused; "
                 "raise --reservation-quarantine-s or lower --transfer-timeout-s")


@dataclass(frozen=True)
class WorkerConfig:
    """One prefill or decode worker process."""

    role: Role
    worker_id: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    # where the worker listens for gRPC, /metrics and KV transfer, resolved on its own node
    # (worker_runtime/addresses.py): an IP, "node", 0.0.0.0, an interface or a network
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port, reported after start
    transport: str = "auto"  # auto | nixl | tcp
    cluster_token: str | None = None  # required in every gRPC call's metadata when set
    layerwise_transfer: bool = True  # prefill: push each layer's KV as soon as it is computed
    handoff: HandoffTimeouts = field(default_factory=HandoffTimeouts)
    metrics_port: int | None = None  # serve Prometheus /metrics here (0: any free port)
    shutdown_grace_s: float = 30.0  # on SIGTERM: how long running requests may finish (worker_runtime/host.py)
    tls: ClusterTLS | None = None  # mutual TLS for its gRPC, KV transfer and token feed (kv_transfer/tls.py)
    # the name clients use for the model: the `model_name` label of this worker's series
    # (None: the checkpoint directory's name, the routers' default too)
    served_model_name: str | None = None
    otlp_traces_endpoint: str | None = None  # OTLP/HTTP collector for this worker's spans (worker_runtime/tracing.py)
    log_format: str = "text"  # text | json: its log lines (worker_runtime/logs.py)

    def engine_config(self) -> EngineConfig:
        """The engine this worker runs: `engine`, with the disk tier (if any) in a directory
        of the worker's own under the path given (workers of a host may share the path)."""
        cache = self.engine.cache
        if cache.offload_disk_path is None:
            return self.engine
        import dataclasses
        import os

        path = os.path.join(cache.offload_disk_path, self.worker_id)
        return dataclasses.replace(self.engine, cache=dataclasses.replace(cache, offload_disk_path=path))

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        import os

        from engine.models.builtin import BUILTIN_VERSION

        return os.path.basename(str(self.engine.model).rstrip("/")) if self.engine.model else BUILTIN_VERSION

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "role", Role(self.role))
        except ValueError:
            raise ConfigError(f"role {self.role!r}: use 'prefill' or 'decode'") from None
        _require(bool(self.worker_id), "worker_id must be non-empty")
        _require(self.transport in TRANSPORTS, f"transport {self.transport!r}: use auto, nixl or tcp")
        _require(self.log_format in ("text", "json"), f"log_format {self.log_format!r}: use text or json")
