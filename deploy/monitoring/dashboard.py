"""tandem's Grafana dashboard, built with grafana-foundation-sdk (Grafana's own builder
library) and written to tandem-dashboard.json next to this file (checked in; the Helm
chart ships a copy as a ConfigMap for Grafana's sidecar).

    python deploy/monitoring/dashboard.py          # rewrite the JSON
    python deploy/monitoring/dashboard.py --check  # exit 1 if the JSON is stale

Throughput and latency are separate panels, never one number. Per-worker series come
from the router's /metrics (tandem:worker_*, read from each worker's stats), so the
dashboard works with the routers scraped alone; several routers repeat them, hence
`max by (worker_id)`. Every query keeps to the `namespace` and `model_name` variables
(both "All" by default; "All" also matches series without the label).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard as gdash
from grafana_foundation_sdk.builders import prometheus, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as m

OUT = Path(__file__).with_name("tandem-dashboard.json")
DS = m.DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "[$__rate_interval]"
# every query keeps to the chosen namespaces and models (both variables default to all)
SCOPE = 'namespace=~"$namespace", model_name=~"$model_name"'
MET = 'met="true"'


def s(name: str, match: str = "") -> str:
    """`name` with the dashboard's scope (and `match`, more label matchers)."""
    return f"{name}{{{SCOPE}{', ' + match if match else ''}}}"


def q(expr: str, legend: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend)


def quantiles(hist: str, qs=(0.5, 0.9, 0.99), by: str = "") -> list[prometheus.Dataquery]:
    keys = f"le{', ' + by if by else ''}"
    return [q(f"histogram_quantile({x}, sum by ({keys}) (rate({s(hist + '_bucket')}{RATE})))",
              f"p{round(x * 100)}" + (f" {{{{{by}}}}}" if by else "")) for x in qs]


def panel(title: str, unit: str, queries: list, description: str = "", width: int = 8,
          threshold: float | None = None, max_val: float | None = None) -> timeseries.Panel:
    p = timeseries.Panel().title(title).datasource(DS).unit(unit).height(8).span(width).description(description)
    for i, target in enumerate(queries):
        p = p.with_target(target.ref_id(chr(ord("A") + i)))
    if max_val is not None:
        p = p.min(0).max(max_val)
    if threshold is not None:  # a red line at the alert's threshold
        steps = [m.Threshold(value=None, color="green"), m.Threshold(value=threshold, color="red")]
        p = p.thresholds(gdash.ThresholdsConfig().mode(m.ThresholdsMode.ABSOLUTE).steps(steps))
        p = p.thresholds_style(_line_style())
    return p


def _line_style():
    from grafana_foundation_sdk.builders import common
    from grafana_foundation_sdk.models import common as cm

    return common.GraphThresholdsStyleConfig().mode(cm.GraphTresholdsStyleMode.LINE)


def _label_variable(label: str, title: str, series: str):
    """A multi-value variable over a label's values, "All" (every value, and series
    without the label, such as a static scrape's) by default."""
    return (gdash.QueryVariable(label).label(title).datasource(DS)
            .query(f"label_values({series}, {label})")
            .multi(True).include_all(True).all_value(".*").refresh(m.VariableRefresh.ON_TIME_RANGE_CHANGED))


def build() -> dict:
    d = (
        gdash.Dashboard("tandem")
        .uid("tandem-overview")
        .tags(["tandem", "llm-serving"])
        .description("tandem: throughput, latency against the SLOs, queues, KV cache, disaggregation, pools.")
        .refresh("30s")
        .time("now-1h", "now")
        .with_variable(gdash.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
        .with_variable(_label_variable("namespace", "Namespace", "tandem:build_info"))
        .with_variable(_label_variable("model_name", "Model", 'tandem:build_info{namespace=~"$namespace"}'))
    )
    d = d.with_row(gdash.Row("Throughput"))
    d = d.with_panel(panel("Token throughput", "short", [
        q(f"sum(rate({s('tandem:generation_tokens_total')}{RATE}))", "generated tokens/s"),
        q(f"sum(rate({s('tandem:prompt_tokens_total')}{RATE}))", "prompt tokens/s"),
    ], "Tokens per second over all routers.", width=12))
    d = d.with_panel(panel("Requests", "reqps", [
        q(f"sum by (finished_reason) (rate({s('tandem:request_success_total')}{RATE}))",
          "finished: {{finished_reason}}"),
        q(f"sum by (status) (rate({s('tandem:request_errors_total')}{RATE}))", "error {{status}}"),
    ], "Finished engine requests by finish reason, and HTTP errors by status.", width=6))
    d = d.with_panel(panel("Goodput", "short", [
        q(f"sum by (class) (rate({s('tandem:goodput_tokens_total')}{RATE}))", "{{class}}"),
    ], "Output tokens per second of requests that met their traffic class's TTFT and TPOT SLOs.", width=6))

    d = d.with_row(gdash.Row("Latency"))
    d = d.with_panel(panel("Time to first token", "s", [
        *quantiles('tandem:time_to_first_token_seconds', (0.5, 0.99), by="class"),
        q(f"max by (class) ({s('tandem:slo_ttft_seconds')})", "SLO {{class}}"),
    ], "Per traffic class, from the HTTP request's arrival: router queue, tokenization, prefill, KV transfer."))
    d = d.with_panel(panel("Time per output token", "s", [
        *quantiles('tandem:request_time_per_output_token_seconds', (0.5, 0.99), by="class"),
        q(f"max by (class) ({s('tandem:slo_tpot_seconds')})", "SLO {{class}}"),
    ], "Per traffic class, per request: (last token - first token) / (tokens - 1)."))
    d = d.with_panel(panel("Inter-token latency", "s", quantiles('tandem:inter_token_latency_seconds'),
                           "Gap between consecutive tokens as the client sees them."))
    d = d.with_panel(panel("SLO attainment", "percentunit", [
        q(f"sum by (class) (rate({s('tandem:slo_attainment_total', MET)}{RATE})) "
          f"/ sum by (class) (rate({s('tandem:slo_attainment_total')}{RATE}))", "{{class}}"),
    ], "Per traffic class, the share of successful requests within both its TTFT and TPOT SLOs "
       "(alert under 90% over all classes).",
        threshold=0.9, max_val=1))
    d = d.with_panel(panel("End-to-end latency", "s", quantiles("tandem:e2e_request_latency_seconds", (0.5, 0.99)),
                           "Arrival to last token."))
    d = d.with_panel(panel("Traffic drift from the profile", "short", [
        q(f"max by (dimension) ({s('tandem:profile_drift')})", "{{dimension}}"),
    ], "Distance of live traffic from the workload the profile was tuned for (router/drift.py); above the line "
       "(1.0) a quantile doubled or halved, or a share moved 25 points: TandemProfileDrift.", threshold=1.0))
    d = d.with_panel(panel("Prefix cache hit rate", "percentunit", [
        q(f"sum(rate({s('tandem:router_prefix_cache_hits_total')}{RATE})) "
          f"/ sum(rate({s('tandem:router_prefix_cache_queries_total')}{RATE}))", "prompt tokens found cached"),
    ], "Share of prompt tokens served from a prefix cache.", max_val=1))

    d = d.with_row(gdash.Row("Queues, batches, KV cache"))
    d = d.with_panel(panel("Router queue and running", "short", [
        q(f"sum by (class) ({s('tandem:router_num_requests_waiting')})", "waiting for admission: {{class}}"),
        q(f"sum({s('tandem:router_num_requests_running')})", "running"),
    ], "Engine requests queued in the routers' admission, and admitted ones."))
    d = d.with_panel(panel("Running batch per worker", "short", [
        q(f"max by (worker_id) ({s('tandem:worker_num_requests_running')})", "{{worker_id}}"),
    ], "Sequences in each worker's running batch."))
    d = d.with_panel(panel("KV cache usage per worker", "percentunit", [
        q(f"max by (worker_id) ({s('tandem:worker_kv_cache_usage_perc')})", "{{worker_id}}"),
    ], "Fraction of each worker's KV blocks held by live sequences; the line is the alert's 85%.",
        threshold=0.85, max_val=1))
    d = d.with_panel(panel("Preemptions", "short", [
        q(f"max by (worker_id) (rate({s('tandem:worker_num_preemptions_total')}{RATE}))", "{{worker_id}}"),
    ], "Sequences preempted (recomputed) per second, per worker."))
    d = d.with_panel(panel("Queued prefill tokens", "short", [
        q(f"max by (worker_id) ({s('tandem:worker_queued_prefill_tokens')})", "{{worker_id}}"),
    ], "Prompt tokens admitted or waiting on each worker and not computed yet."))

    d = d.with_row(gdash.Row("Disaggregation and pools"))
    d = d.with_panel(panel("KV transfer rate", "Bps", [
        q(f"sum(rate({s('tandem:router_kv_transfer_bytes_total')}{RATE}))", "prefill -> decode"),
    ], "KV bytes written from prefill to decode workers per second (as the routers count them)."))
    d = d.with_panel(panel("KV transfer latency", "s", quantiles('tandem:router_kv_transfer_seconds', (0.5, 0.99)),
                           "Per remote prefill: last KV write issued to written and notified."))
    d = d.with_panel(panel("Pool sizes", "short", [
        q(f"max by (role) ({s('tandem:pool_ready_workers')})", "{{role}} ready"),
        q(f"max by (role) ({s('tandem:pool_target_workers')})", "{{role}} target"),
    ], "Prefill and decode pools: ready workers against their targets."))
    return json.loads(JSONEncoder(sort_keys=True, indent=2).encode(d.build()))


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def queries(dashboard: dict) -> list[str]:
    """Every PromQL expression of the dashboard."""
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if OUT.read_text() != text:
            print(f"{OUT} is stale: run python {__file__}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT} ({len(queries(json.loads(text)))} queries)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
