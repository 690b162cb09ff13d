"""PNG plots with matplotlib's Agg backend: latency CDFs, and throughput vs latency."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.metrics import latency_series
from bench.records import RequestRecord
from bench.report import LATENCIES, records_of


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("tandem: plots need matplotlib, an extra: pip install 'tandem-serve[plot]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_cdfs(curves: list[tuple[str, list[RequestRecord]]], path: str | Path,
              title: str = "") -> Path:
    """One panel per latency metric, one empirical CDF per (label, records)."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    series = [(label, latency_series(records)) for label, records in curves]
    for ax, (key, name) in zip(axes.flat, LATENCIES):
        for label, by_metric in series:
            xs = sorted(x * 1000 for x in by_metric[key])
            if xs:
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", label=label)
        ax.set_title(f"{name} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize="small")
            if _spans_decades(ax):
                ax.set_xscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, plt, path)


def _spans_decades(ax: Any) -> bool:
    lo, hi = float("inf"), 0.0
    for line in ax.get_lines():
        xs = [x for x in line.get_xdata() if x > 0]
        if xs:
            lo, hi = min(lo, min(xs)), max(hi, max(xs))
    return hi > 0 and lo < float("inf") and hi / lo > 100


def plot_sweep(docs: list[tuple[str, dict[str, Any]]], path: str | Path) -> Path:
    """Output tokens/s (x) against p50 and p99 of TTFT, TPOT, ITL and E2E (y), one line
    per result document, each point one request rate of its --sweep."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (key, name) in zip(axes.flat, LATENCIES):
        for label, doc in docs:
            pts = _sweep_points(doc, key)
            if not pts:
                continue
            xs = [p[0] for p in pts]
            line, = ax.plot(xs, [p[1] for p in pts], marker="o", label=f"{label} p50")
            ax.plot(xs, [p[2] for p in pts], marker="^", linestyle="--",
                    color=line.get_color(), label=f"{label} p99")
            for x, y, rate in zip(xs, [p[2] for p in pts], [p[3] for p in pts]):
                ax.annotate(str(rate), (x, y), fontsize="x-small", alpha=0.7)
        ax.set_title(f"{name} vs throughput (labels: request rate)")
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(f"{name} (ms)")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize="small")
    fig.tight_layout()
    return _save(fig, plt, path)


def _sweep_points(doc: dict[str, Any], key: str) -> list[tuple[float, float, float, Any]]:
    pts = []
    for run in doc["runs"]:
        s = run["summary"]
        d = s["latency_ms"][key]
        if d.get("p50") is not None and d.get("p99") is not None:
            pts.append((s["throughput"]["output_tokens_per_s"], d["p50"], d["p99"],
                        run["request_rate"]))
    return sorted(pts, key=lambda p: float(p[3]))  # offered load order; "inf" is last


def _save(fig: Any, plt: Any, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_docs(docs: list[tuple[str, dict[str, Any]]], out_dir: str | Path) -> list[Path]:
    """All plots for one or more result documents. One document: latency_cdf.png with a
    curve per run (request rate). Several: latency_cdf_runI.png per run index with a
    curve per document. And throughput_vs_latency.png when any document swept rates.
    CDFs need the per-request records (not written with --no-save-requests)."""
    out_dir = Path(out_dir)
    written = []
    if len(docs) == 1:
        curves = [(f"rate {run['request_rate']}", records_of(run))
                  for run in docs[0][1]["runs"] if run.get("requests")]
        if curves:
            written.append(plot_cdfs(curves, out_dir / "latency_cdf.png", title=docs[0][0]))
    else:
        for i in range(max(len(doc["runs"]) for _, doc in docs)):
            curves = [(label, records_of(doc["runs"][i])) for label, doc in docs
                      if i < len(doc["runs"]) and doc["runs"][i].get("requests")]
            if curves:
                written.append(plot_cdfs(curves, out_dir / f"latency_cdf_run{i}.png",
                                         title=f"run {i}"))
    if any(len(doc["runs"]) > 1 for _, doc in docs):
        written.append(plot_sweep(docs, out_dir / "throughput_vs_latency.png"))
    return written
