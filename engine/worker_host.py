"""Host a prefill or decode worker: its asyncio loop on a thread of its own, so a Ray
actor (or a plain process) can start it, ask for its address and stop it.

`python -m prefill_worker` / `python -m decode_worker` run `main(role)`: one worker
in the foreground, printing `READY <host:port>` once it serves, until SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading

from engine.cli_args import add_engine_args, engine_config_from_args
from engine.config import WorkerConfig
from engine.rpc import setup_process

log = logging.getLogger(__name__)


def make_worker(config: WorkerConfig):
    if config.role == "prefill":
        from prefill_worker.service import PrefillWorker

        return PrefillWorker(config)
    from decode_worker.service import DecodeWorker

    return DecodeWorker(config)


class WorkerHost:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.worker = make_worker(config)
        self.loop = asyncio.new_event_loop()
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
    """Body of the Ray actor for either role; the actor process owns its cores."""

    def __init__(self, config: WorkerConfig) -> None:
        device = config.engine.device
        setup_process(device.num_threads, device.cpu_affinity)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.host = WorkerHost(config)
        self.address = ""

    def start(self) -> str:
        self.address = self.host.start()
        return self.address

    def info(self) -> dict:
        return {"worker_id": self.host.config.worker_id, "role": self.host.config.role, "address": self.address,
                "epoch": getattr(self.host.worker, "epoch", 0), "pid": os.getpid()}

    def stop(self) -> bool:
        self.host.stop()
        return True


def parse_args(role: str, argv: list[str] | None) -> WorkerConfig:
    p = argparse.ArgumentParser(prog=f"python -m {role}_worker", description=f"Run one tandem {role} worker.")
    p.add_argument("--worker-id", default=f"{role}-0")
    p.add_argument("--host", default="127.0.0.1", help="gRPC bind address")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
    p.add_argument("--transport", default="auto", choices=("auto", "nixl", "tcp"))
    p.add_argument("--cluster-token", default=None, help="shared secret every gRPC call must carry")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics here (0: any free port)")
    p.add_argument("--no-layerwise-transfer", action="store_true", help="prefill: push KV after the whole forward")
    p.add_argument("--reservation-lease-s", type=float, default=30.0)
    p.add_argument("--reservation-quarantine-s", type=float, default=30.0,
                   help="decode: hold blocks of an unlanded, ended reservation this long")
    add_engine_args(p)
    a = p.parse_args(argv)
    return WorkerConfig(role=role, worker_id=a.worker_id, engine=engine_config_from_args(a), host=a.host,
                        port=a.port, transport=a.transport, cluster_token=a.cluster_token,
                        layerwise_transfer=not a.no_layerwise_transfer, reservation_lease_s=a.reservation_lease_s,
                        reservation_quarantine_s=a.reservation_quarantine_s, metrics_port=a.metrics_port)


def main(role: str, argv: list[str] | None = None) -> int:
    config = parse_args(role, argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    setup_process(config.engine.device.num_threads, config.engine.device.cpu_affinity)

    async def serve() -> None:
        worker = make_worker(config)
        address = await worker.start()
        print(f"READY {address}", flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        await worker.stop()

    asyncio.run(serve())
    return 0
