"""Start a worker as a child process (`python -m prefill_worker|decode_worker`) and wait,
bounded, for its READY line. Used by cluster tests and benchmarks."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

START_TIMEOUT_S = 180.0


@dataclass
class WorkerProc:
    role: str
    worker_id: str
    proc: subprocess.Popen
    address: str
    log: Path

    def kill(self) -> None:
        """SIGKILL: the worker gets no chance to clean up."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def client(self, token: str | None = None):
        from router.worker_client import WorkerClient

        return WorkerClient(self.worker_id, self.role, self.address, token)


def spawn_worker(role: str, worker_id: str, log_dir: Path, transport: str = "tcp", port: int = 0,
                 faults: str = "", args: tuple[str, ...] = (), num_blocks: int = 256) -> WorkerProc:
    """Start one worker process and wait (bounded) for its READY line."""
    log = Path(log_dir) / f"{worker_id}-{int(time.time() * 1000) % 10**8}.log"
    env = {**os.environ, "TANDEM_FAULTS": faults}
    cmd = [sys.executable, "-m", f"{role}_worker", "--worker-id", worker_id, "--transport", transport,
           "--port", str(port), "--num-threads", "1", "--num-blocks", str(num_blocks), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, env=env)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        if sel.select(timeout=0.5):
            line = proc.stdout.readline()
            if line.startswith("READY "):
                return WorkerProc(role, worker_id, proc, line.split()[1], log)
    proc.kill()
    raise RuntimeError(f"{role} worker {worker_id} did not start: {log.read_text()[-3000:]}")
