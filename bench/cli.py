"""`tandem bench`: load generator for any OpenAI-compatible server (docs/bench.md).

    tandem bench --base-url URL [run options]      one run, or --sweep 1,2,inf
    tandem bench compare A.json B.json [--plot D]  side-by-side table with ratios
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

from rich.console import Console

from bench.arrivals import parse_rate, parse_rates
from bench.client import ENDPOINTS, BenchError, ClientConfig, StreamClient
from bench.metrics import DEFAULT_PERCENTILES, SLO_METRICS
from bench.progress import LiveProgress
from bench.prompts import PromptMaker, load_tokenizer
from bench.report import compare_tables, load_json, print_run, result_doc, run_json, sweep_table, write_json
from bench.runner import RunConfig, timed_run, warm_up
from bench.workloads import WORKLOADS, LengthDist, WorkloadConfig, iter_specs

WARMUP_SEED_OFFSET = 7_777_777  # warm-up prompts share nothing with the timed ones


def _slo(items: list[str]) -> dict[str, float]:
    slo = {}
    for item in items:
        name, _, ms = item.partition(":")
        if name not in SLO_METRICS or not ms:
            raise ValueError(
                f"bad --slo {item!r}: use NAME:MS with NAME in {SLO_METRICS}, e.g. ttft:500")
        slo[name] = float(ms)
    return slo


def build_run_parser(prog: str = "tandem bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("server")
    g.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    g.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="completions")
    g.add_argument("--model", help="model name to send (default: first of /v1/models)")
    g.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--header", action="append", default=[], metavar="NAME:VALUE")
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="don't send ignore_eos (output lengths are then measured only)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--continuous-usage", action="store_true",
                   help="ask for usage in every chunk (vLLM) to count tokens per chunk")
    g.add_argument("--extra-body", type=json.loads, default={}, metavar="JSON")
    g.add_argument("--request-timeout", type=float, default=600.0, metavar="S")
    g.add_argument("--no-keepalive", action="store_true", help="a new connection per request")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default="random")
    w.add_argument("--dataset", help="ShareGPT JSON (sharegpt) or JSONL trace (trace)")
    w.add_argument("--input-len", type=LengthDist.parse, default=LengthDist("fixed", 256),
                   help="N | uniform:LO:HI | normal:MEAN:STD | lognormal:MEDIAN:SIGMA")
    w.add_argument("--output-len", type=LengthDist.parse, default=None,
                   help="same forms; default 128 (sharegpt: the dataset's reply length)")
    w.add_argument("--num-prefixes", type=int, default=4, help="prefix: shared prompts")
    w.add_argument("--prefix-len", type=int, default=512, help="prefix: their length")
    w.add_argument("--long-input-len", type=LengthDist.parse, default=LengthDist("fixed", 2048))
    w.add_argument("--long-output-len", type=LengthDist.parse, default=LengthDist("fixed", 32))
    w.add_argument("--long-fraction", type=float, default=0.1, help="mixed: share of long")
    w.add_argument("--long-priority", type=int, default=None,
                   help="mixed: send long documents with this `priority` (> 0: batch work) and chats with 0")
    w.add_argument("--trace-time-unit", choices=("s", "ms"), default="s")
    w.add_argument("--trace-speed", type=float, default=1.0)
    w.add_argument("--trace-block-size", type=int, default=512)
    w.add_argument("--tokenizer", help="local HF dir or tokenizer.json, for exact text")
    w.add_argument("--prompt-format", choices=("auto", "ids", "text"), default="auto",
                   help="auto: token ids on completions, text on chat")
    w.add_argument("--token-id-range", default=None, metavar="LO:HI",
                   help="ids sampled from [LO, HI) (default 1000:8000, or the tokenizer's)")
    w.add_argument("--seed", type=int, default=0)
    r = p.add_argument_group("load")
    r.add_argument("--request-rate", type=parse_rate, default=math.inf, help="req/s or inf")
    r.add_argument("--sweep", type=parse_rates, help="several rates in one go: 1,2,4,inf")
    r.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape: 1 Poisson, <1 burstier, inf constant gaps")
    r.add_argument("--max-concurrency", type=int)
    r.add_argument("--num-requests", type=int, help="default 200 unless --duration")
    r.add_argument("--duration", type=float, metavar="S")
    r.add_argument("--warmup", type=int, default=0, help="requests sent first, not counted")
    o = p.add_argument_group("report")
    o.add_argument("--slo", nargs="+", default=[], metavar="NAME:MS",
                   help="goodput SLOs, e.g. --slo ttft:500 tpot:50 (also e2e:MS)")
    o.add_argument("--percentiles", default=",".join(f"{x:g}" for x in DEFAULT_PERCENTILES))
    o.add_argument("--label", help="name of this result (default: host and model)")
    o.add_argument("-o", "--output", help="write the JSON result here")
    o.add_argument("--no-save-requests", dest="save_requests", action="store_false",
                   help="leave per-request timelines out of the JSON")
    o.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR")
    o.add_argument("--quiet", action="store_true",
                   help="no progress bar or tables; without -o the JSON result goes to stdout")
    return p


def build_compare_parser(prog: str = "tandem bench compare") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="compare tandem bench JSON results "
                                "side by side; ratios are against the first file")
    p.add_argument("results", nargs="+", help="result JSON files")
    p.add_argument("--names", help="comma-separated column names (default: labels)")
    p.add_argument("--plot", metavar="DIR", help="write comparison PNGs into DIR")
    return p


def _configs(args: argparse.Namespace) -> tuple[WorkloadConfig, PromptMaker, ClientConfig,
                                                 RunConfig]:
    output_len = args.output_len or LengthDist("fixed", 128)
    wcfg = WorkloadConfig(
        name=args.workload, input_len=args.input_len, output_len=output_len,
        dataset=args.dataset, output_len_from_dataset=args.output_len is None,
        num_prefixes=args.num_prefixes, prefix_len=args.prefix_len,
        long_input_len=args.long_input_len, long_output_len=args.long_output_len,
        long_fraction=args.long_fraction,
        long_priority=args.long_priority,
        trace_time_scale=0.001 if args.trace_time_unit == "ms" else 1.0,
        trace_speed=args.trace_speed, trace_block_size=args.trace_block_size)
    fmt = args.prompt_format
    if fmt == "auto":
        fmt = "text" if args.endpoint == "chat" else "ids"
    id_range = None
    if args.token_id_range:
        lo, _, hi = args.token_id_range.partition(":")
        id_range = (int(lo), int(hi))
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    maker = PromptMaker(fmt, tokenizer, id_range)
    if any(":" not in h for h in args.header):
        raise ValueError("--header takes NAME:VALUE")
    headers = dict(h.split(":", 1) for h in args.header)
    ccfg = ClientConfig(
        base_url=args.base_url, endpoint=args.endpoint, model=args.model,
        api_key=args.api_key, headers={k.strip(): v.strip() for k, v in headers.items()},
        ignore_eos=args.ignore_eos, temperature=args.temperature,
        continuous_usage=args.continuous_usage, extra_body=args.extra_body,
        request_timeout_s=args.request_timeout, keepalive=not args.no_keepalive)
    num = args.num_requests if args.num_requests or args.duration else 200
    rcfg = RunConfig(request_rate=args.request_rate, burstiness=args.burstiness,
                     max_concurrency=args.max_concurrency, num_requests=num,
                     duration_s=args.duration, warmup=args.warmup, seed=args.seed)
    return wcfg, maker, ccfg, rcfg


def _config_json(args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for key, value in vars(args).items():
        if key in ("api_key", "header", "func"):
            value = "(redacted)" if value else value
        if isinstance(value, float) and math.isinf(value):
            value = "inf"
        elif isinstance(value, list):
            value = ["inf" if isinstance(v, float) and math.isinf(v) else v for v in value]
        elif not isinstance(value, (str, int, float, bool, dict, type(None))):
            value = str(value)
        out[key] = value
    return out


async def _bench(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    wcfg, maker, ccfg, rcfg = _configs(args)
    slo = _slo(args.slo)
    pcts = [float(x) for x in args.percentiles.split(",")]
    rates = args.sweep or [args.request_rate]
    created = datetime.now(timezone.utc).isoformat(timespec="seconds")
    runs: list[dict[str, Any]] = []
    async with StreamClient(ccfg, max_connections=rcfg.max_concurrency or 0) as client:
        model = await client.resolve_model()
        label = args.label or f"{ccfg.root.split('//')[-1]} {model}"
        warm_specs = iter_specs(wcfg, maker, args.seed + WARMUP_SEED_OFFSET)
        warm = await warm_up(client, warm_specs, rcfg.warmup, rcfg.max_concurrency)
        for i, rate in enumerate(rates):
            cfg = replace(rcfg, request_rate=rate, seed=args.seed + i)
            with LiveProgress(console, f"rate {rate:g}", cfg.num_requests, cfg.duration_s,
                              disable=args.quiet) as bar:
                result = await timed_run(client, cfg, iter_specs(wcfg, maker, cfg.seed),
                                         on_done=bar.update)
            result.warmup_failed = sum(1 for r in warm if not r.ok) if i == 0 else 0
            runs.append(run_json(result, slo, pcts, args.save_requests))
            if not args.quiet:
                print_run(console, runs[-1], f"{label}, rate {rate:g}")
    server = {"base_url": ccfg.root, "endpoint": ccfg.url, "model": model}
    return result_doc(label, server, _config_json(args), runs, created)


def _console(stderr: bool = False) -> Console:
    """Tables keep their width when the output is a file or a pipe."""
    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=140)


def run_main(argv: list[str]) -> int:
    args = build_run_parser().parse_args(argv)
    console = _console(stderr=True)
    try:
        if args.workload == "trace" and args.sweep:
            raise ValueError("--sweep does not apply to a trace (it has its own clock)")
        doc = asyncio.run(_bench(args, console))
    except (BenchError, ValueError, OSError) as exc:
        console.print(f"[red]tandem bench: {exc}[/red]")
        return 2
    if len(doc["runs"]) > 1 and not args.quiet:
        console.print(sweep_table(doc))
    if args.output:
        write_json(args.output, doc)
        console.print(f"wrote {args.output}")
    elif args.quiet:  # nothing shown and nothing saved would lose the run: the result goes to stdout
        sys.stdout.write(json.dumps(doc, indent=1) + "\n")
    if args.plot:
        from bench.plots import plot_docs

        for path in plot_docs([(doc["label"], doc)], args.plot):
            console.print(f"wrote {path}")
    return 0 if all(r["summary"]["requests"]["completed"] for r in doc["runs"]) else 1


def compare_main(argv: list[str]) -> int:
    args = build_compare_parser().parse_args(argv)
    console = _console()
    try:
        docs = [load_json(p) for p in args.results]
    except (OSError, ValueError) as exc:
        console.print(f"[red]tandem bench compare: {exc}[/red]")
        return 2
    names = args.names.split(",") if args.names else [d["label"] for d in docs]
    if len(names) != len(docs):
        console.print("[red]--names needs one name per result file[/red]")
        return 2
    named = list(zip(names, docs))
    for table in compare_tables(named):
        console.print(table)
    if args.plot:
        from bench.plots import plot_docs

        for path in plot_docs(named, args.plot):
            console.print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "compare":
        return compare_main(argv[1:])
    return run_main(argv)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Mount as `tandem bench`: every argument after `bench` goes to main()."""
    p = subparsers.add_parser("bench", help="benchmark an OpenAI-compatible server",
                              add_help=False, prefix_chars="\0")
    p.add_argument("bench_argv", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda args: main(args.bench_argv))
    return p
