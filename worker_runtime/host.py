"""Host a worker service: its asyncio loop on a thread of its own, so a Ray actor (or
a plain process) can start it, ask for its address and stop it. The service class
comes from the worker package (prefill_worker, decode_worker); this package knows
nothing of either.

`python -m prefill_worker` / `python -m decode_worker` run `main(...)`: one worker in
the foreground, printing `READY <host:port>` once it serves, until SIGINT/SIGTERM. The
first signal drains: the worker refuses new requests (gRPC UNAVAILABLE: the router
tries another worker), lets the running ones finish for at most `--shutdown-grace-s`,
then stops and exits 0 with one log line; a second signal stops at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
import time
from typing import Callable, Protocol

from worker_runtime import eventloop
from worker_runtime.args import add_worker_args, worker_config_from_args
from worker_runtime.config import LOG_FORMAT, Role, WorkerConfig
from worker_runtime.engine_args import add_engine_args, engine_config_from_args
from worker_runtime.gcheap import freeze_startup_heap
from worker_runtime.logs import use_log_format
from worker_runtime.metrics import model_dtypes
from worker_runtime.rpc import use_cluster_tls

log = logging.getLogger(__name__)


class WorkerService(Protocol):
    """What a worker package hands the host: built from its config, started and
    stopped on the host's event loop."""

    epoch: int
    draining: bool

    def stats(self): ...

    async def start(self) -> str: ...

    async def stop(self) -> None: ...


ServiceFactory = Callable[[WorkerConfig], WorkerService]


class WorkerHost:
    def __init__(self, config: WorkerConfig, make_service: ServiceFactory) -> None:
        self.config = config
        use_cluster_tls(config.tls)  # this process's gRPC servers and channels, and its feed socket
        self.worker = make_service(config)
        self.loop = eventloop.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=f"{config.worker_id}-loop", daemon=True)

    def start(self, timeout: float = 600.0) -> str:
        """Build the engine and start serving; returns host:port."""
        self._thread.start()
        return self.run(self.worker.start(), timeout)

    def run(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, timeout: float = 15.0) -> None:
        try:
            self.run(self.worker.stop(), timeout)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)


class WorkerActor:
    """Body of the Ray actor for either role; the actor process owns its cores.
    A worker package subclasses it and names its service class in `service`.

    SIGTERM (a pod being deleted: its preStop hook signals the worker processes) drains
    as a standalone worker does, in place of Ray's handler, which exits at once: new
    requests are refused (routers retry elsewhere), running ones finish for at most
    `shutdown_grace_s`, then the process exits 0 and the controller replaces it. A
    second SIGTERM exits at once."""

    service: ServiceFactory

    def __init__(self, config: WorkerConfig) -> None:
        device = config.engine.device
        setup_process(device.num_threads, device.cpu_affinity)
        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
        use_log_format(config.log_format, LOG_FORMAT)
        if config.engine.parallel.tensor_parallel_size > 1:
            from worker_runtime.tp_ray import use_placement_group

            use_placement_group(f"tandem-worker-{config.worker_id}")  # its other ranks: actors in its group
        self.host = WorkerHost(config, type(self).service)
        self.address = ""
        self._force: asyncio.Event | None = None
        signal.signal(signal.SIGTERM, self._on_sigterm)  # Ray runs actor __init__ on the main thread

    def _on_sigterm(self, signum, frame) -> None:
        if self._force is not None:  # the second one
            self.host.loop.call_soon_threadsafe(self._force.set)
            return
        self._force = asyncio.Event()
        threading.Thread(target=self._drain_then_exit, name="sigterm-drain", daemon=True).start()

    def _drain_then_exit(self) -> None:
        cfg, t0 = self.host.config, time.monotonic()
        start, finished = 0, False
        try:
            if self.address:  # started: drain it
                start, finished = self.host.run(drain(self.host.worker, cfg.shutdown_grace_s, self._force),
                                                cfg.shutdown_grace_s + 10)
            self.host.stop()
        except Exception as e:  # noqa: BLE001 - exiting regardless
            log.warning("%s: drain on SIGTERM: %s", cfg.worker_id, e)
        how = f"all {start} finished" if finished else "cut off"
        log.info("%s %s stopped on SIGTERM after draining for %.1f s (requests live: %d, %s)", cfg.role.value,
                 cfg.worker_id, time.monotonic() - t0, start, how)
        logging.shutdown()
        os._exit(0)

    def __repr__(self) -> str:  # Ray prefixes this actor's log lines with it: "(decode-0 pid=...)"
        return self.host.config.worker_id

    def start(self) -> str:
        self.address = self.host.start()
        freeze_startup_heap(self.host.config.worker_id)  # the actor's process is this worker's alone
        return self.address

    def info(self) -> dict:
        return {
            "worker_id": self.host.config.worker_id,
            "role": self.host.config.role.value,
            "address": self.address,
            "epoch": self.host.worker.epoch,
            "pid": os.getpid(),
            "tensor_parallel_size": self.host.config.engine.parallel.tensor_parallel_size,
            "ranks": self._ranks(),
            **self._model(),
        }

    def _model(self) -> dict:
        """What the weights and the KV cache are stored as (once the engine is made)."""
        runner = getattr(getattr(getattr(self.host, "worker", None), "engine", None), "runner", None)
        return model_dtypes(runner) if runner is not None else {}

    def _ranks(self) -> list[str]:
        runner = getattr(getattr(getattr(self.host, "worker", None), "engine", None), "runner", None)
        return runner.rank_info() if runner is not None else []

    def stop(self) -> bool:
        self.host.stop()
        return True


def setup_process(num_threads: int | None, cpu_affinity: tuple[int, ...] | None) -> None:
    """Pin this worker to its cores. When its thread count or cores are given, the
    process's main thread (model loading, weight packing) runs torch on one thread, and
    the engine sizes each step's team on its own thread from the same settings
    (engine/runner.py). libgomp keeps a pool of helper threads for every thread that ran
    a parallel region, and with more threads than cores it stops spin-waiting at once
    (its "throttled" spin count), so every parallel region of a step then starts with a
    wake-up. A main-thread pool left from loading cost a served one-stream step of the
    small model 17-20 ms against 11.9-15 ms without it (docs/performance.md)."""
    import torch  # this is a worker process: it has loaded torch already

    if cpu_affinity:
        try:
            os.sched_setaffinity(0, set(cpu_affinity))
        except (AttributeError, OSError) as e:
            log.warning("could not pin to cores %s: %s", cpu_affinity, e)
    if num_threads or cpu_affinity:
        torch.set_num_threads(1)


def parse_args(role: Role, argv: list[str] | None) -> WorkerConfig:
    p = argparse.ArgumentParser(
        prog=f"python -m {role.value}_worker", description=f"Run one tandem {role.value} worker."
    )
    p.add_argument("--worker-id", default=f"{role.value}-0")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics here (0: any free port)")
    p.add_argument("--shutdown-grace-s", type=float, default=30.0,
                   help="on SIGTERM/SIGINT: how long running requests may finish while new ones are refused")
    add_worker_args(p)
    add_engine_args(p)
    a = p.parse_args(argv)
    return worker_config_from_args(a, role, a.worker_id, engine_config_from_args(a), port=a.port,
                                   metrics_port=a.metrics_port, shutdown_grace_s=a.shutdown_grace_s)


async def drain(worker: WorkerService, grace_s: float, force: asyncio.Event) -> tuple[int, bool]:
    """Refuse new requests and wait for the running ones (at most `grace_s`, or until
    `force` is set). A worker whose engine has failed (a tensor-parallel rank lost, a
    step that raised) has nothing left that could finish: it stops at once. Returns
    (requests live at the start, whether all finished)."""
    worker.draining = True
    start = worker.stats().live_requests
    deadline = asyncio.get_running_loop().time() + grace_s
    while not worker.stats().idle:
        if force.is_set() or asyncio.get_running_loop().time() >= deadline or not worker.engine_loop.healthy:
            return start, False
        await asyncio.sleep(0.05)
    return start, True


def main(role: Role, make_service: ServiceFactory, argv: list[str] | None = None) -> int:
    config = parse_args(role, argv)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    setup_process(config.engine.device.num_threads, config.engine.device.cpu_affinity)

    use_cluster_tls(config.tls)

    async def serve() -> None:
        worker = make_service(config)
        address = await worker.start()
        freeze_startup_heap(config.worker_id)
        print(f"READY {address}", flush=True)
        stop, force = asyncio.Event(), asyncio.Event()
        got: list[str] = []

        def on_signal(sig: signal.Signals) -> None:
            got.append(sig.name)
            (force if stop.is_set() else stop).set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, on_signal, sig)
        await stop.wait()
        t0 = asyncio.get_running_loop().time()
        start, finished = await drain(worker, config.shutdown_grace_s, force)
        await worker.stop()
        cut = ("by a second signal" if force.is_set() else "by the grace period" if worker.engine_loop.healthy
               else f"at once: the engine had failed ({worker.engine_loop.error})")
        how = f"all {start} finished" if finished else f"cut off {cut}"
        log.info("%s %s stopped on %s after draining for %.1f s (requests live: %d, %s)", role.value,
                 config.worker_id, got[0], asyncio.get_running_loop().time() - t0, start, how)

    eventloop.run(serve())
    return 0
