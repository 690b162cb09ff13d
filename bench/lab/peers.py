"""Start and stop peer servers (vLLM's CPU build) on loopback, to compare with one client.

    python -m bench.lab.peers vllm --model DIR [--port 8100] [--venv /work/venvs/vllm]
        starts `vllm serve DIR` on 127.0.0.1 with the tuned CPU settings (shared/PEERS.md),
        waits for /health (bounded), sends one streamed request, stops it.
    python -m bench.lab.peers vllm --model DIR -- --request-rate 4 -o vllm.json
        the same, but runs `tandem bench` (the arguments after --, with --base-url set)
        against it before stopping.

vLLM lives in a virtual environment of its own (see docs/bench.md for the install).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.servers import http_status, log_tail
from worker_runtime.process import stop_process_group

DEFAULT_VENV = "/work/venvs/vllm"
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


@dataclass(frozen=True)
class VllmConfig:
    model: str
    port: int = 8100
    venv: str = DEFAULT_VENV
    dtype: str = "bfloat16"
    max_model_len: int = 2048
    kv_cache_gib: int = 4
    startup_timeout_s: float = 300.0
    log_path: str = "vllm-server.log"
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"--model {self.model}: not a local HF checkpoint (no config.json)")
        if not (Path(self.venv) / "bin" / "vllm").is_file():
            raise ValueError(f"no vllm in {self.venv}/bin: install it (docs/bench.md) "
                             "or pass --venv")
        if not 1024 <= self.port <= 65535:
            raise ValueError("--port must be in 1024..65535")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class VllmServer:
    """`vllm serve` as a child process in its own process group, bound to 127.0.0.1."""

    def __init__(self, cfg: VllmConfig) -> None:
        self.cfg = cfg
        self.proc: subprocess.Popen | None = None
        self._log = None

    def command(self) -> list[str]:
        c = self.cfg
        return [f"{c.venv}/bin/vllm", "serve", c.model, "--host", "127.0.0.1",
                "--port", str(c.port), "--dtype", c.dtype,
                "--max-model-len", str(c.max_model_len), *c.extra_args]

    def env(self) -> dict[str, str]:
        """The tuned CPU settings: no core reserved for the front end, tcmalloc and the
        bundled libiomp5 preloaded, the internal queue on loopback, 4 GiB of KV cache."""
        env = dict(os.environ)
        preload = [p for p in (TCMALLOC, f"{self.cfg.venv}/lib/libiomp5.so") if Path(p).is_file()]
        env.update(VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_HOST_IP="127.0.0.1",
                   VLLM_CPU_KVCACHE_SPACE=str(self.cfg.kv_cache_gib),
                   LD_PRELOAD=":".join(preload), PATH=f"{self.cfg.venv}/bin:{env['PATH']}")
        env.pop("VIRTUAL_ENV", None)
        return env

    def start(self) -> None:
        self._log = open(self.cfg.log_path, "ab")
        self.proc = subprocess.Popen(self.command(), env=self.env(), stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)

    def wait_ready(self) -> float:
        """Poll /health until it answers 200; seconds it took. Raises on exit or timeout."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.cfg.startup_timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm exited with {self.proc.returncode} while starting; "
                                   f"last log lines:\n{self.log_tail()}")
            if http_status(self.cfg.base_url + "/health") == 200:
                return time.monotonic() - t0
            time.sleep(1.0)
        raise TimeoutError(f"vllm not healthy after {self.cfg.startup_timeout_s:g}s; "
                           f"last log lines:\n{self.log_tail()}")

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to the server's own process group, SIGKILL after `grace_s`."""
        if self.proc is None:
            return
        stop_process_group(self.proc, grace_s)  # the group we created with start_new_session: only vllm's
        if self._log is not None:
            self._log.close()
        self.proc = None

    def log_tail(self, n: int = 20) -> str:
        return log_tail(Path(self.cfg.log_path), n)

    def __enter__(self) -> VllmServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def smoke_request(base_url: str, output_len: int = 16) -> str:
    """One streamed completion with the bench client; a one-line verdict."""
    from bench.client import ClientConfig, StreamClient
    from bench.records import RequestRecord
    from bench.workloads import RequestSpec

    async with StreamClient(ClientConfig(base_url, request_timeout_s=120)) as client:
        model = await client.resolve_model()
        spec = RequestSpec(list(range(1000, 1032)), 32, output_len)
        rec = await client.send(spec, RequestRecord(index=0), time.perf_counter())
    if not rec.ok:
        return f"FAILED: {rec.error}"
    return (f"ok: model {model}, {rec.output_tokens} tokens ({rec.output_tokens_source}), "
            f"TTFT {rec.ttft * 1000:.1f} ms, E2E {rec.e2e * 1000:.1f} ms")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, bench_args = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="python -m bench.lab.peers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("server", choices=["vllm"])
    p.add_argument("--model", required=True, help="local HF checkpoint directory")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--venv", default=DEFAULT_VENV)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--log", default="vllm-server.log")
    p.add_argument("--hold", type=float, default=0.0, help="keep serving S seconds more")
    args = p.parse_args(argv)
    server = VllmServer(VllmConfig(model=args.model, port=args.port, venv=args.venv,
                                   startup_timeout_s=args.startup_timeout,
                                   log_path=args.log))
    print(f"starting: {' '.join(server.command())} (log: {args.log})", flush=True)
    with server:
        print(f"healthy at {server.cfg.base_url}", flush=True)
        print(asyncio.run(smoke_request(server.cfg.base_url)), flush=True)
        code = 0
        if bench_args:
            from bench.cli import main as bench_main

            code = bench_main(["--base-url", server.cfg.base_url, *bench_args])
        if args.hold > 0:
            time.sleep(args.hold)
    print("stopped", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
