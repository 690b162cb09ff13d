"""`tandem tune`: find the engine configuration with the most goodput under the SLOs
for one workload, within a time budget, and write it as a profile.

    tandem tune --bench-args="--workload mixed --request-rate 6 --num-requests 120" \\
                --slo ttft:1000 tpot:100 --budget-s 600 \\
                --knob max-num-seqs=8,32,128 --knob max-num-batched-tokens=256,1024 \\
                [--serve-args="--colocated --decode 1"] [-o profile.yaml] [--plot DIR]

Each trial starts `tandem serve` (on 127.0.0.1, `--serve-args` plus the trial's knob
values), runs `tandem bench` with `--bench-args` and the SLOs against it, and stops it.
The search is coordinate descent from the defaults: the defaults first, then each knob
in turn over its values with the other knobs at the best found so far (1 + the sum of
(values - 1) trials, never the whole grid). The score is goodput: requests per second
that met every SLO (ties: output tokens per second). A trial that would not end within
the budget is not started; each running trial is bounded by what is left of it.

Knobs are `tandem serve` options given as `--knob NAME=V1,V2,...`; `pools=P:D,...`
sets the prefill:decode split (`--prefill P --decode D`; P = 0 runs colocated).
Pointed at a running cluster (`--url`, with `--admin-key`), tune starts nothing: the
defaults are the cluster as it is, the only knob is `pools` (set through the admin
API; the pools are put back at the end), and the profile holds the split and the
workload.

Output: the profile (YAML) that `tandem serve --config` takes as it is: the winning
options, the SLOs as the interactive class's, and the `workload` the trials measured
(the drift monitor's reference); a table of every trial; with --plot, a chart of
goodput per trial. Progress, and an estimate of the time left, go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.servers import TandemServer

SLO_NAMES = ("ttft", "tpot", "e2e")


@dataclass
class Trial:
    knobs: dict[str, str]
    goodput_rps: float = 0.0
    attainment: float = 0.0
    output_tok_s: float = 0.0
    completed: int = 0
    failed: int = 0
    seconds: float = 0.0
    error: str | None = None
    workload: dict[str, Any] = field(default_factory=dict)

    @property
    def score(self) -> tuple[float, float]:
        return (self.goodput_rps, self.output_tok_s) if self.error is None else (-1.0, -1.0)

    def label(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.knobs.items()) or "defaults"


def parse_knob(text: str) -> tuple[str, list[str]]:
    name, sep, values = text.partition("=")
    vals = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not name or not vals:
        raise argparse.ArgumentTypeError(f"--knob wants NAME=V1,V2,...; got {text!r}")
    if name == "pools" and not all(len(v.split(":")) == 2 and all(x.isdigit() for x in v.split(":")) for v in vals):
        raise argparse.ArgumentTypeError(f"pools values are P:D worker counts; got {text!r}")
    return name.removeprefix("--"), vals


def parse_slos(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        name, _, ms = item.partition(":")
        if name not in SLO_NAMES:
            raise SystemExit(f"tandem tune: unknown SLO {name!r}; use {', '.join(SLO_NAMES)}")
        out[name] = float(ms)
    if not out:
        raise SystemExit("tandem tune: give at least one SLO, e.g. --slo ttft:1000 tpot:100")
    return out


def knob_args(knobs: dict[str, str]) -> list[str]:
    args: list[str] = []
    for name, value in knobs.items():
        if name == "pools":
            p, d = value.split(":")
            args += ["--colocated", "--decode", d] if p == "0" else ["--prefill", p, "--decode", d]
        else:
            args += [f"--{name}", value]
    return args


def _metrics(url: str) -> dict[tuple[str, str], float]:
    """Router samples summed by (name, class)."""
    out: dict[tuple[str, str], float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            key = (s.name, s.labels.get("class", ""))
            out[key] = out.get(key, 0.0) + s.value
    return out


def _workload(run: dict, before: dict, after: dict) -> dict[str, Any]:
    """The traffic this trial sent, in the profile's `workload` shape (router/drift.py)."""
    from router.drift import percentile

    recs = [r for r in run.get("requests") or [] if r.get("error") is None]
    if not recs:
        return {}
    prompts = [r["input_tokens"] for r in recs]
    outputs = [r["output_tokens"] for r in recs]
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    hits, queries = delta.get(("tandem:router_prefix_cache_hits_total", ""), 0), \
        delta.get(("tandem:router_prefix_cache_queries_total", ""), 0)
    done = {c: delta.get(("tandem:e2e_request_latency_seconds_count", c), 0) for c in ("interactive", "batch")}
    sent = sorted(r["scheduled"] for r in run["requests"])
    span = sent[-1] - sent[0] if len(sent) > 1 else 0.0
    return {
        "prompt_tokens": {"p50": percentile(prompts, 50), "p90": percentile(prompts, 90)},
        "output_tokens": {"p50": percentile(outputs, 50), "p90": percentile(outputs, 90)},
        "arrival_rate": round((len(sent) - 1) / span, 3) if span > 0 else 1.0,  # requests/s, as sent
        "prefix_hit_rate": round(hits / queries, 4) if queries else 0.0,
        "batch_share": round(done["batch"] / sum(done.values()), 4) if sum(done.values()) else 0.0,
    }


def run_trial(trial: Trial, a: argparse.Namespace, slos: dict[str, float], tmp: Path, timeout_s: float,
              n: int) -> None:
    t0 = time.monotonic()
    try:
        if a.url:
            server = RunningCluster(a.url, a.admin_key, trial.knobs, timeout_s)
        else:
            serve = [*shlex.split(a.serve_args), *knob_args(trial.knobs)]
            if a.model:
                serve += ["--model", a.model]
            server = TandemServer.launch(serve, Path(a.log_dir) / f"tune-{n}.log", timeout_s=max(30.0, timeout_s))
    except (RuntimeError, TimeoutError) as e:
        trial.error = str(e)
        trial.seconds = time.monotonic() - t0
        return
    out = tmp / f"trial-{n}.json"
    try:
        before = _metrics(server.url)
        cmd = [sys.executable, "-m", "cli", "bench", "--base-url", server.url + "/v1",
               *shlex.split(a.bench_args), "--slo", *(f"{k}:{v:g}" for k, v in slos.items()), "--quiet", "-o",
               str(out)]
        left = max(10.0, timeout_s - (time.monotonic() - t0))
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
        if done.returncode != 0:
            trial.error = (done.stderr.strip().splitlines() or ["tandem bench failed"])[-1]
            return
        run = json.loads(out.read_text())["runs"][0]
        after = _metrics(server.url)
        s = run["summary"]
        trial.goodput_rps = s["goodput"]["requests_per_s"]
        trial.attainment = s["goodput"]["attainment"]
        trial.output_tok_s = s["throughput"]["output_tokens_per_s"]
        trial.completed, trial.failed = s["requests"]["completed"], s["requests"]["failed"]
        trial.workload = _workload(run, before, after)
    except subprocess.TimeoutExpired:
        trial.error = "ran out of the time budget"
    finally:
        server.stop()
        trial.seconds = time.monotonic() - t0


class RunningCluster:
    """A cluster tune is pointed at (--url): only the prefill:decode split can change
    there (engine options are fixed when workers start), through the admin API; a
    trial waits until the pools are at their new sizes."""

    def __init__(self, url: str, admin_key: str | None, knobs: dict[str, str], timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        if "pools" not in knobs:
            return
        p, d = (int(x) for x in knobs["pools"].split(":"))
        r = httpx.post(self.url + "/admin/pools", json={"prefill": p, "decode": d}, headers=self.headers, timeout=30)
        if r.status_code != 200:
            raise RuntimeError(f"cannot resize the pools at {self.url}: {r.status_code} {r.text[:200]}")
        deadline = time.monotonic() + timeout_s
        while not self.settled():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the pools at {self.url} did not reach {p}:{d} in time")
            time.sleep(1.0)

    def pools(self) -> dict:
        r = httpx.get(self.url + "/admin/pools", headers=self.headers, timeout=30)
        r.raise_for_status()
        return r.json()["pools"]

    def settled(self) -> bool:
        return all(p["ready"] == p["target"] == len(p["workers"]) for p in self.pools().values())

    def stop(self) -> None:
        pass


def _serve_options(serve_args: list[str], knobs: dict[str, str]) -> dict[str, Any]:
    """The options `--serve-args` plus `knobs` set, as profile keys (only those that
    differ from `tandem serve`'s defaults)."""
    from cli.main import build_parser

    parser = build_parser()
    argv = ["serve", *serve_args, *knob_args(knobs)]
    given, default = vars(parser.parse_args(argv)), vars(parser.parse_args(["serve"]))
    return {k.replace("_", "-"): v for k, v in given.items()
            if k not in ("func", "command", "config") and v != default.get(k)}


def write_profile(path: Path, a: argparse.Namespace, slos: dict[str, float], best: Trial, defaults: Trial,
                  trials: list[Trial]) -> None:
    from router.profile import ClassSLOs, Profile

    meta = {"made_by": "tandem tune", "at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "bench_args": a.bench_args, "slo_ms": slos, "trials": len(trials),
            "goodput_req_s": round(best.goodput_rps, 3), "defaults_goodput_req_s": round(defaults.goodput_rps, 3)}
    classes = {f"slo_{k}_ms": v for k, v in slos.items() if k in ("ttft", "tpot")}
    profile = Profile(profile=meta, classes={"interactive": ClassSLOs(**classes)} if classes else None,
                      workload=best.workload or None, **_serve_options(shlex.split(a.serve_args), best.knobs))
    path.write_text(profile.text())


def print_table(trials: list[Trial], best: Trial, slos: dict[str, float]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="tandem tune: goodput under " + ", ".join(f"{k} <= {v:g} ms" for k, v in slos.items()))
    for col in ("#", "configuration", "goodput req/s", "within SLOs", "output tok/s", "done (failed)", "s"):
        table.add_column(col, justify="left" if col == "configuration" else "right")
    for i, t in enumerate(trials):
        mark = " (best)" if t is best else ""
        if t.error:
            table.add_row(str(i), t.label(), "-", "-", "-", "-", f"{t.seconds:.0f}",
                          style="red", end_section=False)
            table.add_row("", f"  {t.error}", "", "", "", "", "")
            continue
        table.add_row(str(i), t.label() + mark, f"{t.goodput_rps:.3f}", f"{t.attainment:.1%}",
                      f"{t.output_tok_s:.1f}", f"{t.completed} ({t.failed})", f"{t.seconds:.0f}",
                      style="bold" if t is best else None)
    Console(width=None if sys.stdout.isatty() else 160).print(table)


def plot(trials: list[Trial], best: Trial, out_dir: Path) -> Path:
    from bench.plots import _pyplot

    plt = _pyplot()

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(trials)), 4))
    ok = [t for t in trials if t.error is None]
    ax.bar(range(len(ok)), [t.goodput_rps for t in ok], color=["tab:green" if t is best else "tab:blue" for t in ok])
    ax.set_xticks(range(len(ok)), [t.label().replace(", ", "\n") for t in ok], fontsize=7)
    ax.set_ylabel("goodput (requests/s within the SLOs)")
    ax.set_title("tandem tune: goodput per configuration (green: chosen)")
    fig.tight_layout()
    path = out_dir / "tune-goodput.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _candidates(knobs: list[tuple[str, list[str]]], trials: list[Trial]):
    """The coordinate search: the defaults, then each knob's values around the best
    configuration measured by the time that knob's turn comes (the caller runs each
    candidate before asking for the next), skipping configurations already tried."""
    yield {}
    for name, values in knobs:
        base = max(trials, key=lambda t: t.score).knobs
        for v in values:
            cand = {**base, name: v}
            if all(t.knobs != cand for t in trials):
                yield cand


def search(a: argparse.Namespace, slos: dict[str, float]) -> tuple[list[Trial], Trial, Trial]:
    planned = 1 + sum(len(vals) for _, vals in a.knob)
    deadline = time.monotonic() + a.budget_s
    trials: list[Trial] = []
    with tempfile.TemporaryDirectory() as tmp:
        for knobs in _candidates(a.knob, trials):
            left = deadline - time.monotonic()
            mean = sum(t.seconds for t in trials) / len(trials) if trials else None
            if mean is not None and mean > left:
                say(f"stopping: {left:.0f} s of the budget left, a trial takes about {mean:.0f} s")
                break
            trial, n = Trial(knobs), len(trials)
            say(f"[{n + 1}/{planned}] {trial.label()} ...")
            run_trial(trial, a, slos, Path(tmp), left, n)
            trials.append(trial)
            mean = sum(t.seconds for t in trials) / len(trials)
            eta = min(max(0, planned - len(trials)) * mean, max(0.0, deadline - time.monotonic()))
            result = trial.error or (f"goodput {trial.goodput_rps:.3f} req/s ({trial.attainment:.0%} within SLOs), "
                                     f"{trial.output_tok_s:.1f} out tok/s")
            say(f"[{n + 1}/{planned}] {trial.label()}: {result}; {trial.seconds:.0f} s; about {eta:.0f} s left")
    if not trials or trials[0].error:
        raise SystemExit(f"tandem tune: the default configuration failed: {trials[0].error if trials else 'no time'}")
    best = max(trials, key=lambda t: t.score)
    return trials, best, trials[0]


def say(msg: str) -> None:
    print(f"tandem tune: {msg}", file=sys.stderr, flush=True)


def build_parser(prog: str = "tandem tune") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--bench-args", required=True,
                   help="the workload, as `tandem bench` options (quoted): --workload, lengths, rate, --num-requests")
    p.add_argument("--slo", nargs="+", required=True, metavar="NAME:MS", help="ttft:MS, tpot:MS, e2e:MS")
    p.add_argument("--knob", action="append", type=parse_knob, default=[], metavar="NAME=V1,V2",
                   help="a `tandem serve` option and the values to try (repeatable); pools=P:D,... for the split")
    p.add_argument("--serve-args", default="", help="`tandem serve` options every trial shares (quoted)")
    p.add_argument("--url", default=None,
                   help="tune a running cluster at this router instead of starting one per trial: only the "
                   "pools=P:D knob applies there (put back to its sizes at the end)")
    p.add_argument("--admin-key", default=os.environ.get("TANDEM_ADMIN_KEY"),
                   help="with --url: the router's admin key (default: env TANDEM_ADMIN_KEY)")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in model)")
    p.add_argument("--budget-s", type=float, default=600.0, help="stop starting trials past this many seconds")
    p.add_argument("-o", "--output", default="tandem-profile.yaml", help="where the profile goes")
    p.add_argument("--json", default=None, help="every trial's figures, as JSON")
    p.add_argument("--plot", metavar="DIR", default=None, help="write tune-goodput.png here")
    p.add_argument("--log-dir", default=tempfile.gettempdir(), help="the trials' server logs (tune-N.log)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    slos = parse_slos(a.slo)
    if a.budget_s <= 0:
        raise SystemExit("tandem tune: --budget-s must be > 0")
    for name, values in a.knob:  # every knob value must be a `tandem serve` option (argparse says which not)
        if a.url and name != "pools":
            raise SystemExit(f"tandem tune: --knob {name} needs new workers; against a running cluster (--url) only "
                             "pools=P:D can be tuned")
        for v in values:
            _serve_options(shlex.split(a.serve_args), {name: v})
    restore = RunningCluster(a.url, a.admin_key, {}, 0).pools() if a.url else None
    try:
        trials, best, defaults = search(a, slos)
    finally:
        if restore is not None and any(k == "pools" for k, _ in a.knob):
            sizes = f"{restore['prefill']['target']}:{restore['decode']['target']}"
            say(f"putting the pools at {a.url} back to {sizes}")
            RunningCluster(a.url, a.admin_key, {"pools": sizes}, 600)
    print_table(trials, best, slos)
    out = Path(a.output)
    write_profile(out, a, slos, best, defaults, trials)
    gain = f"{best.goodput_rps / defaults.goodput_rps:.2f}x" if defaults.goodput_rps else "the defaults met no SLO"
    print(f"best: {best.label()}: goodput {best.goodput_rps:.3f} req/s against {defaults.goodput_rps:.3f} with the "
          f"defaults ({gain}); profile written to {out}")
    if a.json:
        Path(a.json).write_text(json.dumps([t.__dict__ for t in trials], indent=2, default=str))
    if a.plot:
        print(f"wrote {plot(trials, best, Path(a.plot))}")
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Mount as `tandem tune`: every argument after `tune` goes to main()."""
    p = subparsers.add_parser("tune", help="find the configuration with the most goodput under SLOs, "
                              "and write it as a profile", add_help=False, prefix_chars="\0")
    p.add_argument("tune_argv", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda args: main(args.tune_argv))
    return p


if __name__ == "__main__":
    sys.exit(main())
