"""Results: the JSON document (schema in docs/bench.md), end-of-run tables, compare."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.metrics import by_category, summarize
from bench.records import RequestRecord
from bench.runner import RunResult

SCHEMA_VERSION = 1
LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E"))


def rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def run_json(result: RunResult, slo_ms: dict[str, float] | None, percentiles: list[float],
             save_requests: bool = True) -> dict[str, Any]:
    """One run's entry in the result document."""
    summary = summarize(result.records, slo_ms, percentiles, result.duration_s)
    groups = by_category(result.records)
    entry: dict[str, Any] = {
        "request_rate": rate_json(result.request_rate),
        "started_at": result.started_at,
        "warmup_failed": result.warmup_failed,
        "summary": summary,
        "categories": {},
    }
    if len(groups) > 1:
        entry["categories"] = {name: summarize(recs, slo_ms, percentiles, result.duration_s)
                               for name, recs in sorted(groups.items())}
    if save_requests:
        entry["requests"] = [r.to_dict() for r in result.records]
    return entry


def result_doc(label: str, server: dict[str, Any], config: dict[str, Any],
               runs: list[dict[str, Any]], created: str) -> dict[str, Any]:
    return {"schema_version": SCHEMA_VERSION, "tool": "tandem-bench", "label": label,
            "created": created, "server": server, "config": config, "runs": runs}


def write_json(path: str | Path, doc: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, allow_nan=False)
        f.write("\n")


def load_json(path: str | Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    if doc.get("tool") != "tandem-bench" or "runs" not in doc:
        raise ValueError(f"{path}: not a tandem bench result (no 'tool': 'tandem-bench')")
    return doc


def records_of(run: dict[str, Any]) -> list[RequestRecord]:
    return [RequestRecord.from_dict(r) for r in run.get("requests", [])]


def _f(x: Any, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    return f"{x:,}" if isinstance(x, int) else str(x)


def run_table(entry: dict[str, Any], title: str) -> Table:
    """Throughput and latency of one run, as two separate blocks of one table."""
    s = entry["summary"]
    pkeys = [k for k in s["latency_ms"]["ttft"] if k.startswith("p")]
    table = Table(title=title, title_justify="left")
    table.add_column("metric")
    for col in ["mean", *pkeys, "max"]:
        table.add_column(col, justify="right")
    req, thr, tok = s["requests"], s["throughput"], s["tokens"]
    blank = [""] * (len(pkeys) + 1)
    table.add_row("requests completed / failed", f"{req['completed']} / {req['failed']}", *blank)
    table.add_row("duration (s)", _f(s["duration_s"]), *blank)
    table.add_row("input / output tokens", f"{tok['input']:,} / {tok['output']:,}", *blank)
    table.add_row("[b]throughput[/b] requests/s", _f(thr["requests_per_s"], 3), *blank)
    table.add_row("input tokens/s", _f(thr["input_tokens_per_s"], 1), *blank)
    table.add_row("output tokens/s", _f(thr["output_tokens_per_s"], 1), *blank)
    table.add_row("total tokens/s", _f(thr["total_tokens_per_s"], 1), *blank, end_section=True)
    for key, name in LATENCIES:
        d = s["latency_ms"][key]
        table.add_row(f"[b]{name}[/b] (ms)" if key == "ttft" else f"{name} (ms)",
                      _f(d["mean"]), *(_f(d[p]) for p in pkeys), _f(d["max"]))
    gp = s.get("goodput")
    if gp:
        slo = " ".join(f"{k}<={v:g}ms" for k, v in gp["slo_ms"].items())
        table.add_row(f"[b]goodput[/b] req/s ({slo})", _f(gp["requests_per_s"], 3),
                      f"{gp['attainment']:.1%} met", *blank[1:], end_section=True)
    return table


def category_table(entry: dict[str, Any], title: str) -> Table:
    """Per-category latency (e.g. interactive vs long in the mixed workload)."""
    table = Table(title=title, title_justify="left")
    cols = ["category", "done", "failed", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50",
            "TPOT p99", "ITL p99", "E2E p99", "goodput"]
    for col in cols:
        table.add_column(col, justify="left" if col == "category" else "right")
    for name, s in entry["categories"].items():
        lat, gp = s["latency_ms"], s.get("goodput")
        table.add_row(name, str(s["requests"]["completed"]), str(s["requests"]["failed"]),
                      _f(s["throughput"]["output_tokens_per_s"], 1),
                      _f(lat["ttft"]["p50"]), _f(lat["ttft"]["p99"]), _f(lat["tpot"]["p50"]),
                      _f(lat["tpot"]["p99"]), _f(lat["itl"]["p99"]), _f(lat["e2e"]["p99"]),
                      f"{gp['attainment']:.1%}" if gp else "-")
    return table


def failures_lines(entry: dict[str, Any]) -> list[str]:
    return [f"  {kind}: {v['count']}  e.g. {v['example'][:160]}"
            for kind, v in entry["summary"]["failures"].items()]


def print_run(console: Console, entry: dict[str, Any], title: str) -> None:
    console.print(run_table(entry, title))
    if entry.get("categories"):
        console.print(category_table(entry, f"{title}, by category"))
    src = entry["summary"]["tokens"]["output_tokens_source"]
    mism = entry["summary"]["tokens"]["output_len_mismatches"]
    console.print(f"output token counts from: {src}; requests whose output length "
                  f"differs from the requested: {mism}")
    lines = failures_lines(entry)
    if lines:
        console.print("[red]failures:[/red]\n" + "\n".join(lines))


def sweep_table(doc: dict[str, Any]) -> Table:
    table = Table(title=f"sweep: {doc['label']}", title_justify="left")
    for col in ("rate", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50",
                "TPOT p99", "ITL p99", "goodput", "failed"):
        table.add_column(col, justify="right")
    for run in doc["runs"]:
        s, lat = run["summary"], run["summary"]["latency_ms"]
        gp = s.get("goodput")
        table.add_row(str(run["request_rate"]), _f(s["throughput"]["requests_per_s"], 3),
                      _f(s["throughput"]["output_tokens_per_s"], 1),
                      _f(lat["ttft"].get("p50")), _f(lat["ttft"].get("p99")),
                      _f(lat["tpot"].get("p50")), _f(lat["tpot"].get("p99")),
                      _f(lat["itl"].get("p99")),
                      _f(gp["requests_per_s"], 3) if gp else "-",
                      str(s["requests"]["failed"]))
    return table


# (label, path into summary, higher is better)
COMPARE_ROWS: list[tuple[str, tuple[str, ...], bool]] = [
    ("requests/s", ("throughput", "requests_per_s"), True),
    ("input tok/s", ("throughput", "input_tokens_per_s"), True),
    ("output tok/s", ("throughput", "output_tokens_per_s"), True),
    *[(f"{name} {stat} (ms)", ("latency_ms", key, stat), False)
      for key, name in LATENCIES for stat in ("mean", "p50", "p90", "p99")],
    ("goodput req/s", ("goodput", "requests_per_s"), True),
    ("failed", ("requests", "failed"), False),
]


def _get(summary: dict[str, Any], path: tuple[str, ...]) -> Any:
    node: Any = summary
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _ratio_cell(base: Any, value: Any, higher_better: bool) -> str:
    if not isinstance(base, (int, float)) or not isinstance(value, (int, float)) or not base:
        return "-"
    ratio = value / base
    if abs(ratio - 1.0) < 0.02:
        return f"{ratio:.2f}x"
    better = (ratio > 1.0) == higher_better
    return f"[{'green' if better else 'red'}]{ratio:.2f}x[/]"


def compare_tables(docs: list[tuple[str, dict[str, Any]]]) -> list[Table]:
    """One table per run index (sweep point): each result's value, and its ratio to the
    first result's (green: better, red: worse)."""
    tables = []
    for i in range(max(len(doc["runs"]) for _, doc in docs)):
        runs = [(name, doc["runs"][i] if i < len(doc["runs"]) else None) for name, doc in docs]
        rates = {str(r["request_rate"]) for _, r in runs if r is not None}
        table = Table(title=f"compare, run {i} (rate {'/'.join(sorted(rates))})",
                      title_justify="left")
        table.add_column("metric")
        for j, (name, _) in enumerate(runs):
            table.add_column(name, justify="right")
            if j:
                table.add_column(f"{name} / {runs[0][0]}", justify="right")
        for label, path, higher in COMPARE_ROWS:
            vals = [_get(r["summary"], path) if r else None for _, r in runs]
            cells = [_f(vals[0])]
            for v in vals[1:]:
                cells += [_f(v), _ratio_cell(vals[0], v, higher)]
            table.add_row(label, *cells)
        tables.append(table)
    return tables
