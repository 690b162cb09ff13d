"""Traffic classes under a saturating mixed load: the router's queue in `fifo` order
against `priority` order (interactive first, batch aged), one server each, in one run.

    python -m bench.lab.classes [--orders fifo,priority] [--num-requests 240] [--rate 12]
                            [--serve-args "--colocated --decode 1 --max-concurrent-requests 8"]
                            [--slo-ttft-ms 1000] [--json PATH]

The load is `tandem bench`'s mixed workload: short chats sent as interactive work
(`priority` 0) and long documents sent as batch work (`priority` 1), arriving faster
than the cluster serves them, so requests wait in the router's queue. Per order the
report gives, for each class, TTFT p50/p99, the share of requests within the TTFT SLO,
and output tokens per second (latency and throughput separately, as always).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.servers import TandemServer


def _bench(url: str, a: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "cli", "bench", "--base-url", url + "/v1", "--workload", "mixed",
           "--long-priority", "1", "--long-fraction", str(a.long_fraction),
           "--input-len", str(a.input_len), "--output-len", str(a.output_len),
           "--long-input-len", str(a.long_input_len), "--long-output-len", str(a.long_output_len),
           "--num-requests", str(a.num_requests), "--request-rate", str(a.rate), "--seed", "7",
           "--slo", f"ttft:{a.slo_ttft_ms:g}", "--quiet", "-o", str(out)]
    subprocess.run(cmd, check=True, timeout=a.timeout_s)
    return json.loads(out.read_text())["runs"][0]


def run_order(order: str, a: argparse.Namespace, tmp: Path) -> dict:
    args = [*shlex.split(a.serve_args), "--admission-order", order, "--slo-ttft-ms", f"{a.slo_ttft_ms:g}"]
    server = TandemServer.launch(args, f"{a.log_prefix}-{order}.log")
    try:
        run = _bench(server.url, a, tmp / f"{order}.json")
    finally:
        server.stop()
    row = {"order": order, "classes": {}}
    for cat, s in (run.get("categories") or {}).items():
        lat = s["latency_ms"]["ttft"]
        row["classes"][cat] = {
            "done": s["requests"]["completed"], "failed": s["requests"]["failed"],
            "ttft_p50_ms": lat.get("p50"), "ttft_p99_ms": lat.get("p99"),
            "within_ttft_slo": (s.get("goodput") or {}).get("attainment"),
            "output_tok_s": s["throughput"]["output_tokens_per_s"],
        }
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lab.classes", description=__doc__.split("\n\n")[0])
    p.add_argument("--orders", default="fifo,priority", help="router admission orders, in order")
    p.add_argument("--serve-args", default="--colocated --decode 1 --max-concurrent-requests 8",
                   help="more `tandem serve` options, quoted")
    p.add_argument("--num-requests", type=int, default=240)
    p.add_argument("--rate", type=float, default=12.0, help="requests per second (Poisson)")
    p.add_argument("--long-fraction", type=float, default=0.3)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--long-input-len", type=int, default=1024)
    p.add_argument("--long-output-len", type=int, default=64)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="the interactive TTFT SLO")
    p.add_argument("--timeout-s", type=float, default=900.0, help="bound on each load run")
    p.add_argument("--log-prefix", default="/tmp/tandem-classes", help="server logs: PREFIX-ORDER.log")
    p.add_argument("--json", default=None, help="write the results here too")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_order(order, a, Path(tmp)) for order in a.orders.split(",")]
    print(f"traffic classes: {a.num_requests} requests at {a.rate:g}/s, {a.long_fraction:.0%} long documents "
          f"({a.long_input_len}/{a.long_output_len}, priority 1) among chats ({a.input_len}/{a.output_len}, "
          f"priority 0); `tandem serve {a.serve_args}`; TTFT SLO {a.slo_ttft_ms:g} ms")
    print("| router queue | class | done (failed) | TTFT p50 ms | TTFT p99 ms | within TTFT SLO | output tok/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        for cat, c in sorted(r["classes"].items(), key=lambda kv: kv[0] != "interactive"):
            within = "-" if c["within_ttft_slo"] is None else f"{c['within_ttft_slo']:.1%}"
            print(f"| {r['order']} | {cat} | {c['done']} ({c['failed']}) | {c['ttft_p50_ms']:.1f} "
                  f"| {c['ttft_p99_ms']:.1f} | {within} | {c['output_tok_s']:.1f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"config": vars(a), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
