"""Servers as child processes on 127.0.0.1, for `tandem tune`, the lab and the tests:
one launcher. A server runs in a session of its own, is waited for on its readiness URL
(bounded), and is stopped with a signal to it alone, then SIGKILL to whatever of its
session is left; `Shutdown` records how it went. `TandemServer` is `tandem serve`; the
lab adds its peers (vLLM, llama.cpp: bench/lab/peers.py) as subclasses.
"""

from __future__ import annotations

import abc
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    pid: int
    name: str
    cmdline: str

    def __str__(self) -> str:
        return f"{self.pid} {self.name} ({self.cmdline[:100]})"


def session_processes(sid: int) -> list[Proc]:
    """Live (non-zombie) processes of session `sid`: everything a server started with
    start_new_session=True spawned, however deep (Ray workers change their process
    group but keep the session)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        state, session = fields[0], int(fields[3])
        if session == sid and state != "Z":
            out.append(Proc(int(entry.name), name, cmd.strip()))
    return sorted(out, key=lambda p: p.pid)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class Shutdown:
    """How a server went away: the signal it got, its exit status, seconds to exit,
    and what of its session was still alive after it exited (and had to be killed)."""

    signal: str
    exit_code: int | None = None
    exit_s: float | None = None
    killed_leader: bool = False
    leftovers: list[str] = field(default_factory=list)
    leftovers_gone_after_s: float | None = None
    killed_leftovers: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        """Exited by itself (status 0, or the signal re-raised after its own shutdown,
        as uvicorn does), and its whole session was gone within the wait."""
        sig = -signal.Signals[self.signal].value
        return (self.exit_code in (0, sig) and not self.killed_leader
                and not self.killed_leftovers)

    def describe(self) -> str:
        if self.exit_code is None:
            return "not started"
        code = self.exit_code
        how = f"exit {code}" if code >= 0 else f"ended by {signal.Signals(-code).name}"
        parts = [f"{self.signal} -> {how} after {self.exit_s:.1f}s"]
        if self.killed_leader:
            parts.append("did not exit in time: SIGKILL")
        if self.leftovers:
            names = sorted({p.split(" ", 2)[1] for p in self.leftovers})
            if self.killed_leftovers:
                parts.append(f"{len(self.leftovers)} process(es) of its session outlived it "
                             f"({', '.join(names)}); killed {len(self.killed_leftovers)} "
                             "still there after the wait")
            else:
                parts.append(f"{len(self.leftovers)} process(es) of its session outlived it "
                             f"({', '.join(names)}), gone after "
                             f"{self.leftovers_gone_after_s:.0f}s")
        else:
            parts.append("no process of its session left")
        return "; ".join(parts)


class ManagedServer(abc.ABC):
    """A server process in its own session, on 127.0.0.1:port, with its log in a file."""

    name = "server"
    ready_path = "/health"
    metrics_prefix: str | None = None  # counters checked against the bench's totals
    startup_timeout_s = 420.0

    def __init__(self, port: int, log_path: Path) -> None:
        self.port = port
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self._log = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @abc.abstractmethod
    def command(self) -> list[str]:
        """The server's command line."""

    def env_overrides(self) -> dict[str, str]:
        return {}

    def display_command(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env_overrides().items())
        return (env + " " if env else "") + shlex.join(self.command())

    def env(self) -> dict[str, str]:
        """The whole environment it runs in."""
        return {**os.environ, **self.env_overrides()}

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command(), env=self.env(), stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, cwd=str(REPO))

    def wait_ready(self, timeout_s: float | None = None) -> float:
        """Poll the readiness URL until 200; seconds since start. Raises on exit/timeout."""
        timeout_s = timeout_s or self.startup_timeout_s
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} while "
                                   f"starting; last log lines:\n{self.log_tail()}")
            if http_status(self.base_url + self.ready_path) == 200:
                self.startup_s = time.monotonic() - t0
                return self.startup_s
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready after {timeout_s:g}s; "
                           f"last log lines:\n{self.log_tail()}")

    def stop(self, sig: int = signal.SIGTERM, grace_s: float = 60.0,
             linger_s: float = 10.0) -> Shutdown:
        """`sig` to the server process alone (so that it can shut its children down in
        order), SIGKILL to its whole session after `grace_s`. Then whatever of its
        session is still alive is recorded, given `linger_s` to go, and killed."""
        info = Shutdown(signal.Signals(sig).name)
        if self.proc is None:
            return info
        sid = self.proc.pid
        t0 = time.monotonic()
        if self.proc.poll() is None:
            _kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                info.killed_leader = True
                for p in session_processes(sid):
                    _kill(p.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        info.exit_code = self.proc.returncode
        info.exit_s = time.monotonic() - t0
        t1 = time.monotonic()
        left = session_processes(sid)
        info.leftovers = [str(p) for p in left]
        while left and time.monotonic() - t1 < linger_s:
            time.sleep(0.5)
            left = session_processes(sid)
        if left:
            for p in left:
                _kill(p.pid, signal.SIGTERM)
            time.sleep(3.0)
            left = session_processes(sid)
            for p in left:
                _kill(p.pid, signal.SIGKILL)
            info.killed_leftovers = [str(p) for p in left] or ["(exited on SIGTERM)"]
        elif info.leftovers:
            info.leftovers_gone_after_s = time.monotonic() - t1
        if self._log is not None:
            self._log.close()
            self._log = None
        self.proc = None
        return info

    def log_tail(self, n: int = 25) -> str:
        return log_tail(self.log_path, n)


class TandemServer(ManagedServer):
    """`tandem serve ARGS` (its host and port are this object's)."""

    name = "tandem"
    ready_path = "/ready"
    metrics_prefix = "tandem:"

    def __init__(self, args: list[str] | tuple[str, ...], log_path: Path, port: int | None = None) -> None:
        super().__init__(port or free_port(), Path(log_path))
        self.args = list(args)

    @classmethod
    def launch(cls, args: list[str] | tuple[str, ...], log_path: Path, timeout_s: float = 300.0) -> "TandemServer":
        """Started and ready (or stopped and raised)."""
        server = cls(args, log_path)
        server.start()
        try:
            server.wait_ready(timeout_s)
        except BaseException:
            server.stop()
            raise
        return server

    @property
    def url(self) -> str:
        return self.base_url

    def command(self) -> list[str]:
        return [sys.executable, "-m", "cli", "serve", "--host", "127.0.0.1", "--port", str(self.port), *self.args]

    def display_command(self) -> str:
        return "tandem " + shlex.join(self.command()[3:])

    extra_env: dict[str, str] = {}  # more variables for this server (the side by side's --tandem-env)

    def env_overrides(self) -> dict[str, str]:
        cache = {"TANDEM_CACHE_DIR": os.environ["TANDEM_CACHE_DIR"]} if "TANDEM_CACHE_DIR" in os.environ else {}
        return {**cache, **self.extra_env}


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """The HTTP status of GET `url`; None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return None


def log_tail(path: Path, n: int) -> str:
    """The last `n` lines of a server's log file."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:])
