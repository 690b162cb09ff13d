"""`tandem serve` as a child process on 127.0.0.1, for benchmarks and tests."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from bench.sweep import free_port


class ServeProcess:
    """`tandem serve ARGS` on a free port of 127.0.0.1, in a session of its own; the
    constructor returns once it announces itself (bounded by `timeout_s`)."""

    def __init__(self, args: list[str], log_path, timeout_s: float = 300.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        cmd = [sys.executable, "-m", "router.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith("tandem: serving"):
                return
            if not line and self.proc.poll() is not None:
                break
        self.stop()
        raise RuntimeError(f"tandem serve did not come up; see {log_path}")

    def stop(self, grace_s: float = 90.0) -> None:
        """SIGTERM (it drains, then exits), then SIGKILL to its group if it lingers."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
