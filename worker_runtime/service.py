"""Pieces both worker services build the same way: the transport, and the RPCs they
answer alike (Health, CheckIntegrity, Drain, KVEvents, Stats, PushBlocks)."""

from __future__ import annotations

import abc
import logging
import time

from kv_transfer.base import Transport, TransportConfig
from kv_transfer.registry import create_transport
from protos import tandem_pb2 as pb
from worker_runtime import envs, tracing
from worker_runtime.addresses import Endpoint
from worker_runtime.config import WorkerConfig
from worker_runtime.kv_pull import PullMixin, PullStats
from worker_runtime.metrics import WorkerMetrics, model_dtypes
from worker_runtime.rpc import epoch_str
from worker_runtime.stats import WorkerStats

log = logging.getLogger(__name__)


def process_age_s() -> float:
    """Seconds since this process started (its imports included), for start-up lines."""
    import psutil

    return time.time() - psutil.Process().create_time()


def tls_note(cfg: WorkerConfig) -> str:
    """For the worker's serving line: whether its connections are mutual TLS."""
    return " with mutual TLS" if cfg.tls is not None else ""


def transport_config(cfg: WorkerConfig, epoch: int, endpoint: Endpoint) -> TransportConfig:
    return TransportConfig(worker_name=cfg.worker_id, epoch=epoch_str(epoch), bind_host=endpoint.bind,
                           advertise_host=endpoint.advertise, token=cfg.cluster_token, tls=cfg.tls)


def make_worker_kv(cfg: WorkerConfig, epoch: int, endpoint: Endpoint, runner, num_kv_heads: int):
    """The worker's KV transports (worker_runtime/tp_kv.py WorkerKV): rank 0's, registered
    on its cache, and, under tensor parallelism, one on each other rank like it."""
    from worker_runtime.tp_kv import WorkerKV

    transport = make_transport(cfg, epoch, endpoint)
    transport.register(runner.kv_cache.kv)
    kv = WorkerKV(transport, num_kv_heads, runner.tp)
    kv.start(transport_config(cfg, epoch, endpoint))
    return kv


def make_transport(cfg: WorkerConfig, epoch: int, endpoint: Endpoint) -> Transport:
    """The configured KV transport, named by worker id and this incarnation's epoch,
    on the worker's endpoint; wrapped with injected faults when TANDEM_FAULTS asks."""
    transport = create_transport(cfg.transport, transport_config(cfg, epoch, endpoint))
    if cfg.tls is not None and transport.name != "tcp":
        log.warning("%s: cluster TLS covers gRPC, token feeds and the TCP transport; the %s transport's KV "
                    "transfers are not encrypted (use --transport tcp to encrypt them)", cfg.worker_id, transport.name)
    faults = envs.faults()
    if faults.transfer_delay_s or faults.fail_transfers:
        from kv_transfer.faults import FaultyTransport

        transport = FaultyTransport(transport, faults.transfer_delay_s, faults.fail_transfers)
    return transport


class WorkerRpcs(PullMixin, abc.ABC):
    """The RPCs both worker services answer the same way. A service sets `role`,
    `config`, `epoch`, `draining`, `metrics`, `kv_events`, `kv` and `transport` (its
    KV transports), `engine` and `engine_loop` (its EngineLoop), and defines `stats()`
    (its WorkerStats, built in one place) and `check_integrity()` (run on the engine
    thread). PushBlocks and a prefill worker's pulls: worker_runtime/kv_pull.py."""

    def add_parallel_metrics(self, runner) -> None:
        """Tensor parallel (rank 0): its time in all-reduces, against its step time; a
        mixture of experts: the tokens its router sent to each expert."""
        blocks = [layer.mlp for layer in getattr(runner.model, "layers", ()) if hasattr(layer.mlp, "expert_tokens")]
        if blocks:
            self.metrics.add_experts(blocks)
        comm = runner.comm
        if comm is None:
            return
        self.metrics.add_counter(
            "tandem:worker_allreduce_seconds",
            "Seconds rank 0 of this tensor-parallel worker spent in all-reduces, waits for the other ranks "
            "included; against tandem:worker_step_seconds_sum, their share of the steps.",
            lambda: comm.seconds)

    @abc.abstractmethod
    def stats(self) -> WorkerStats:
        """This worker's load now; any thread (a lock-free snapshot)."""

    @abc.abstractmethod
    def check_integrity(self) -> None:
        """Engine thread: raise AssertionError if blocks, ledger or scheduler disagree."""

    def make_metrics(self) -> WorkerMetrics:
        """The worker's Prometheus registry; its gauges read `stats()` at scrape time.
        Called once the transport and the engine are made: it names both."""
        tracing.configure(f"tandem-{self.role.value}", self.config.otlp_traces_endpoint)
        metrics = WorkerMetrics(self.config.worker_id, self.role, self.stats, self.config.model_name)
        self.pull_stats = PullStats()
        metrics.add_pulls(self.pull_stats)
        kernels = None
        if self.config.engine.device.device == "cpu":
            from engine.cpu_kernels import build

            kernels = build.loaded_build() or "none"
        metrics.runtime_info(self.config.transport, self.transport.name, kernels, model_dtypes(self.engine.runner))
        tiers = self.engine.scheduler.pool.lower
        if tiers is not None:
            metrics.add_tiers(tiers)
        return metrics

    async def Stats(self, request, context):
        return self.stats().to_pb()

    async def Health(self, request, context):
        return self._health()

    async def CheckIntegrity(self, request, context):
        reply = self._health()
        try:
            await self.engine_loop.call(self.check_integrity)
        except AssertionError as e:
            reply.healthy, reply.error = False, f"integrity check failed: {e}"
        return reply

    def _health(self) -> pb.HealthReply:
        loop = self.engine_loop
        return pb.HealthReply(
            healthy=loop.healthy,
            worker_id=self.config.worker_id,
            epoch=self.epoch,
            role=self.role.value,
            error=loop.error or "",
            draining=self.draining,
            metrics_address=self.metrics.address,
        )

    async def Drain(self, request, context):
        self.draining = request.drain
        return self._health()

    async def KVEvents(self, request, context):
        q = await self.engine_loop.call(self.kv_events.subscribe)
        try:
            while True:
                yield await q.get()
        finally:
            self.engine_loop.post(self.kv_events.unsubscribe, q)
