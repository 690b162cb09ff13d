"""Child processes: start a worker (`python -m prefill_worker|decode_worker`) and wait,
bounded, for its READY line (cluster tests and benchmarks), and the one way every
part of tandem stops a process group."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from worker_runtime.client import WorkerClient

START_TIMEOUT_S = 180.0


def _signal(pid: int, sig: int, group: bool) -> None:
    try:
        (os.killpg if group else os.kill)(pid, sig)
    except ProcessLookupError:
        pass


def stop_process_group(proc: subprocess.Popen, grace_s: float = 30.0, sig: int = signal.SIGTERM,
                       group: bool = True) -> bool:
    """`sig` to the process group `proc` leads (started with start_new_session=True; with
    group=False to `proc` alone), wait up to `grace_s`, then SIGKILL. True when it had
    to be killed."""
    if proc.poll() is not None:
        return False
    _signal(proc.pid, sig, group)
    try:
        proc.wait(grace_s)
        return False
    except subprocess.TimeoutExpired:
        _signal(proc.pid, signal.SIGKILL, group)
        proc.wait(10)
        return True


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
        stop_process_group(self.proc, grace_s=10, group=False)

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def client(self, token: str | None = None) -> WorkerClient:
        return WorkerClient(self.worker_id, self.role, self.address, token)


def spawn_worker(role: str, worker_id: str, log_dir: Path, transport: str = "tcp", port: int = 0,
                 faults: str = "", args: tuple[str, ...] = (), num_blocks: int = 256) -> WorkerProc:
    """Start one worker process and wait (bounded) for its READY line."""
    return start_worker(role, worker_id, log_dir, transport, port, faults, args, num_blocks).ready()


@dataclass
class StartingWorker:
    """A worker process started, its READY line not yet read (`ready` waits for it):
    several workers' starts (imports, weights, ranks) overlap."""

    role: str
    worker_id: str
    proc: subprocess.Popen
    log: Path

    def ready(self) -> WorkerProc:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            if sel.select(timeout=0.5):
                line = self.proc.stdout.readline()
                if line.startswith("READY "):
                    return WorkerProc(self.role, self.worker_id, self.proc, line.split()[1], self.log)
        self.proc.kill()
        raise RuntimeError(f"{self.role} worker {self.worker_id} did not start: {self.log.read_text()[-3000:]}")


def start_worker(role: str, worker_id: str, log_dir: Path, transport: str = "tcp", port: int = 0,
                 faults: str = "", args: tuple[str, ...] = (), num_blocks: int = 256) -> StartingWorker:
    """Start one worker process; its `ready()` waits (bounded) for its READY line."""
    log = Path(log_dir) / f"{worker_id}-{int(time.time() * 1000) % 10**8}.log"
    env = {**os.environ, "TANDEM_FAULTS": faults}
    cmd = [sys.executable, "-m", f"{role}_worker", "--worker-id", worker_id, "--transport", transport,
           "--port", str(port), "--num-threads", "1", "--num-blocks", str(num_blocks), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, env=env)
    return StartingWorker(role, worker_id, proc, log)
