"""Prometheus metrics of one worker, served on its own /metrics port.

Gauges are read from the engine when scraped (plain ints; a scrape never blocks the
engine thread); counters and histograms are fed by the engine thread as steps,
landings and transfers happen. Every series carries `worker_id`, `role` and
`model_name` (the served name, as on the routers' series). Names
are listed in docs/metrics.md.
"""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.build_info import build_info
from worker_runtime.config import Role
from worker_runtime.prom import labelled
from worker_runtime.stats import COUNTERS, WorkerStats

log = logging.getLogger(__name__)

STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class _StatsCollector(Collector):
    """Gauges and counters read off the worker's WorkerStats at scrape time."""

    def __init__(self, labels: list[str], read: Callable[[], WorkerStats]) -> None:
        self.labels = labels
        self.read = read

    def collect(self):
        for name, value in self.read().metric_values().items():
            kind = CounterMetricFamily if name in COUNTERS else GaugeMetricFamily
            fam = kind(name, name.replace("tandem:", "").replace("_", " "), labels=["worker_id", "role"])
            fam.add_metric(self.labels, value)
            yield fam


class _SpecCollector(Collector):
    """Speculative decoding's counters (vLLM's names, in tandem's namespace), read off the
    engine's SpecStats at scrape time."""

    def __init__(self, labels: list[str], read: Callable[[], object]) -> None:
        self.labels = labels
        self.read = read

    def collect(self):
        st = self.read()
        lab = ["worker_id", "role"]
        for name, value, doc in (
            ("num_drafts", st.num_drafts, "Sequence-steps that verified a draft."),
            ("num_draft_tokens", st.num_draft_tokens, "Tokens proposed."),
            ("num_accepted_tokens", st.num_accepted_tokens, "Proposed tokens that verification kept."),
        ):
            fam = CounterMetricFamily(f"tandem:spec_decode_{name}", doc, labels=lab)
            fam.add_metric(self.labels, value)
            yield fam
        fam = CounterMetricFamily("tandem:spec_decode_num_accepted_tokens_per_pos",
                                  "Proposed tokens kept, by their position in the draft (0: the first).",
                                  labels=[*lab, "position"])
        for i, n in enumerate(st.accepted_per_pos or ()):
            fam.add_metric([*self.labels, str(i)], n)
        yield fam
        g = GaugeMetricFamily("tandem:spec_decode_mean_accepted_length",
                              "Tokens a verified draft step emitted on average (kept + the target's own), "
                              "since the worker started.", labels=lab)
        g.add_metric(self.labels, st.mean_accepted_length)
        yield g


class _ReadCounter(Collector):
    """One counter read off the engine at scrape time (a plain int the engine thread
    increments; a scrape reads it without a lock)."""

    def __init__(self, labels: list[str], name: str, doc: str, read: Callable[[], int]) -> None:
        self.labels, self.name, self.doc, self.read = labels, name, doc, read

    def collect(self):
        fam = CounterMetricFamily(self.name, self.doc, labels=["worker_id", "role"])
        fam.add_metric(self.labels, self.read())
        yield fam


class _ExpertCollector(Collector):
    """A mixture of experts' routing, read off its sparse layers (engine/models/moe.py) at
    scrape time: tokens sent to each expert since start (summed over the layers), and how
    uneven the last step was (its busiest expert's tokens over the mean, averaged over
    the layers: 1 is perfectly even, the number of experts is one expert taking all)."""

    def __init__(self, labels: list[str], blocks: list) -> None:
        self.labels, self.blocks = labels, blocks
        self.seen: dict[int, list[int]] = {}  # CUDA: each block's counts at the last scrape

    def collect(self):
        lab = ["worker_id", "role"]
        fam = CounterMetricFamily("tandem:moe_expert_tokens", "Tokens the router sent to each expert, summed over "
                                  "the sparse layers (a token counts once for each of its top-k experts).",
                                  labels=[*lab, "expert"])
        counts, lasts = [], []
        for i, b in enumerate(self.blocks):
            mine = list(b.expert_tokens)
            last = list(b.tokens_per_expert)
            if b.device_tokens is not None:  # the fused CUDA path counts on the device, step by step
                dev = b.device_tokens.tolist()
                before = self.seen.get(i, [0] * len(dev))
                last = [n - m for n, m in zip(dev, before)]  # since the last scrape
                self.seen[i] = dev
                mine = [n + m for n, m in zip(mine, dev)]
            counts.append(mine)
            lasts.append(last)
        for e, n in enumerate(sum(col) for col in zip(*counts)):
            fam.add_metric([*self.labels, str(e)], n)
        yield fam
        ratios = []
        for last in lasts:
            if sum(last):
                ratios.append(max(last) * len(last) / sum(last))
        g = GaugeMetricFamily("tandem:moe_expert_load_imbalance", "The last step's (on CUDA: since the last "
                              "scrape) busiest expert's tokens over the mean tokens an expert, averaged over the "
                              "sparse layers (1: even).", labels=lab)
        g.add_metric(self.labels, sum(ratios) / len(ratios) if ratios else 1.0)
        yield g


class _TierCollector(Collector):
    """The KV tiers below the device (engine/kv_tiers.py), read off the worker's index at
    scrape time (plain numbers the engine thread updates). Blocks are the worker's (every
    rank's share); bytes are blocks x the worker's bytes a block."""

    def __init__(self, labels: list[str], tiers) -> None:
        self.labels, self.tiers = labels, tiers

    def collect(self):
        t, st = self.tiers, self.tiers.stats
        lab = ["worker_id", "role"]
        used = GaugeMetricFamily("tandem:kv_offload_usage_perc", "Share of each tier's blocks in use (host: the "
                                 "LRU budget; swap: preempted requests' budget; disk).", labels=[*lab, "tier"])
        for tier, n, cap in (("host", t.num_host_used - t.num_pinned, t.host_blocks), ("swap", t.num_pinned,
                             t.swap_blocks), ("disk", t.num_disk_used, t.disk_blocks)):
            if cap:
                used.add_metric([*self.labels, tier], n / cap)
        yield used
        hits = CounterMetricFamily("tandem:kv_offload_hits", "Blocks restored to the device from a tier below it, "
                                   "by where they were found (disk: came up from disk for the request).",
                                   labels=[*lab, "tier"])
        hits.add_metric([*self.labels, "host"], st.host_hits - st.disk_hits)
        hits.add_metric([*self.labels, "disk"], st.disk_hits)
        yield hits
        q = CounterMetricFamily("tandem:kv_offload_queries", "Blocks of admitted prompts looked up below the device "
                                "(the device's prefix cache missed them).", labels=lab)
        q.add_metric(self.labels, st.queries)
        yield q
        moved = CounterMetricFamily("tandem:kv_offload_bytes", "KV bytes moved between the tiers.",
                                    labels=[*lab, "direction"])
        for direction, n in (("device_to_host", st.host_saves), ("host_to_device", st.host_hits),
                             ("host_to_disk", st.disk_spills), ("disk_to_host", st.disk_fetches)):
            moved.add_metric([*self.labels, direction], n * t.block_bytes)
        yield moved
        err = CounterMetricFamily("tandem:kv_offload_disk_errors", "Disk tier files that failed their check (or "
                                  "could not be read): misses, recomputed.", labels=lab)
        err.add_metric(self.labels, st.disk_errors)
        yield err
        seconds = CounterMetricFamily("tandem:kv_offload_seconds", "Time spent moving blocks up: restore, the host "
                                      "to device copies (on CUDA, their launch); fetch, disk reads (in the "
                                      "background).", labels=[*lab, "stage"])
        seconds.add_metric([*self.labels, "restore"], st.restore_s)
        seconds.add_metric([*self.labels, "fetch"], st.fetch_s)
        yield seconds
        swap = CounterMetricFamily("tandem:kv_preemptions_by_decision", "Preempted requests swapped to host memory "
                                   "or left to recompute (the measured cost model's choice, with --swap-space).",
                                   labels=[*lab, "decision"])
        swap.add_metric([*self.labels, "swap"], st.swap_outs)
        swap.add_metric([*self.labels, "recompute"], st.recomputes)
        yield swap


class WorkerMetrics:
    def __init__(self, worker_id: str, role: Role, read_stats: Callable[[], WorkerStats],
                 model_name: str = "") -> None:
        self.registry = reg = CollectorRegistry()
        # what /metrics serves: every series with the served model's name, as vLLM's carry it
        self.exported = labelled(reg, {"model_name": model_name}) if model_name else reg
        self.labels = [worker_id, role.value]
        lab = ["worker_id", "role"]
        reg.register(_StatsCollector(self.labels, read_stats))
        self.step_seconds = Histogram(
            "tandem:worker_step_seconds", "Forward pass time per engine step.", lab, buckets=STEP_BUCKETS, registry=reg
        ).labels(*self.labels)
        self.decode_step_seconds = Histogram(
            "tandem:worker_decode_step_seconds",
            "Forward pass time per engine step that only decodes (no prompt chunk in it): at one stream, the "
            "engine's own share of each token's time.", lab, buckets=STEP_BUCKETS, registry=reg
        ).labels(*self.labels)
        self.step_tokens = Histogram(
            "tandem:worker_step_tokens", "Tokens computed per engine step.", lab, buckets=TOKEN_BUCKETS, registry=reg
        ).labels(*self.labels)
        self.transfer_seconds = Histogram(
            "tandem:kv_transfer_seconds",
            "KV write issued to written and notified.",
            lab,
            buckets=TRANSFER_BUCKETS,
            registry=reg,
        ).labels(*self.labels)
        self.transfer_bytes = Counter(
            "tandem:kv_transfer_bytes", "KV bytes written to decode workers.", lab, registry=reg
        ).labels(*self.labels)
        self.transfer_failures = Counter(
            "tandem:kv_transfer_failures", "KV handoffs that failed.", lab, registry=reg
        ).labels(*self.labels)
        self.kv_landed = Counter("tandem:kv_landed", "Reservations whose KV arrived.", lab, registry=reg).labels(
            *self.labels
        )
        self.kv_expired = Counter(
            "tandem:kv_reservations_expired", "Reservations whose KV never arrived in time.", lab, registry=reg
        ).labels(*self.labels)
        self.address = ""

    def serve(self, host: str, port: int, advertise: str | None = None) -> str:
        """Start the /metrics HTTP endpoint on `host` (port 0: any free port); returns
        the address to scrape, `advertise` (default `host`):port."""
        server = _serve_text_format(self.exported, host, port)
        self.address = f"{advertise or host}:{server.server_port}"
        log.info("metrics at http://%s/metrics", self.address)
        return self.address

    def runtime_info(self, transport_requested: str, transport_backend: str, cpu_kernels: str | None,
                     model: dict | None = None) -> None:
        """What this worker runs on, as 1-valued gauges: the KV transport it asked for
        and the one it got (`tandem:kv_transfer_backend`; requested auto and got tcp is
        NIXL's fallback, which deploy/monitoring alerts on), and on CPU the build of the
        kernels it loaded (`tandem:worker_cpu_kernels`: amx, avx512_bf16, avx512, avx2,
        generic, or none where they did not load); and what the model's weights and KV
        cache are stored as (`tandem:worker_model_info`, from `model_dtypes`)."""
        lab = ["worker_id", "role"]
        info = build_info()
        Gauge("tandem:build_info", "The tandem this process runs (1): its version and commit.",
              lab + ["component", "version", "commit"], registry=self.registry).labels(
                  *self.labels, "worker", info["version"], info["commit"]).set(1)
        if model:
            Gauge("tandem:worker_model_info", "What this worker's model computes in (dtype), stores its linear "
                  "weights as (weights: the dtype, int8 or fp8; weight_scales: how their scales go) and its KV "
                  "cache as (1).", lab + ["dtype", "weights", "weight_scales", "kv_cache_dtype"],
                  registry=self.registry).labels(*self.labels, model["dtype"], model["weights"],
                                                 model["weight_scales"], model["kv_cache_dtype"]).set(1)
        Gauge("tandem:kv_transfer_backend", "The KV transport this worker asked for and the one it runs (1).",
              lab + ["requested", "backend"], registry=self.registry).labels(
                  *self.labels, transport_requested, transport_backend).set(1)
        if cpu_kernels is not None:
            Gauge("tandem:worker_cpu_kernels", "The build of the CPU kernels this worker loaded (1).",
                  lab + ["build"], registry=self.registry).labels(*self.labels, cpu_kernels).set(1)

    def add_spec(self, read: Callable[[], object]) -> None:
        """Export speculative decoding's counters (`read` returns the engine's SpecStats)."""
        self.registry.register(_SpecCollector(self.labels, read))

    def add_tiers(self, tiers) -> None:
        """Export the KV tiers' usage, hits, bytes moved and times (engine/kv_tiers.py)."""
        self.registry.register(_TierCollector(self.labels, tiers))

    def add_pulls(self, stats) -> None:
        """Export peer pulls and pushes (worker_runtime/kv_pull.py PullStats)."""
        reg, lab = self.registry, ["worker_id", "role"]

        class _Pulls(Collector):
            def collect(inner):
                for name, doc, value, kind in (
                    ("tandem:kv_pull_blocks", "Prefix blocks pulled in from another worker instead of computed.",
                     stats.pulled_blocks, CounterMetricFamily),
                    ("tandem:kv_pull_seconds", "Time pulls took (reservation to landed), summed.",
                     stats.pull_s, CounterMetricFamily),
                    ("tandem:kv_push_blocks", "Blocks this worker wrote into another worker's cache for its pulls.",
                     stats.pushed_blocks, CounterMetricFamily)):
                    fam = kind(name, doc, labels=lab)
                    fam.add_metric(self.labels, value)
                    yield fam
                fam = CounterMetricFamily("tandem:kv_pulls", "Pulls of a prefix from another worker, by outcome "
                                          "(failed: the prompt was computed instead).", labels=[*lab, "outcome"])
                fam.add_metric([*self.labels, "ok"], stats.pulls)
                fam.add_metric([*self.labels, "failed"], stats.failed)
                yield fam

        reg.register(_Pulls())

    def add_experts(self, blocks: list) -> None:
        """Export a mixture of experts' routing (`blocks`: its sparse layers)."""
        self.registry.register(_ExpertCollector(self.labels, blocks))

    def add_counter(self, name: str, doc: str, read: Callable[[], int]) -> None:
        """Export a counter the engine keeps (`read` returns its value)."""
        self.registry.register(_ReadCounter(self.labels, name, doc, read))

    def on_step(self, num_tokens: int, forward_s: float, decode_only: bool = False) -> None:
        self.step_tokens.observe(num_tokens)
        self.step_seconds.observe(forward_s)
        if decode_only:
            self.decode_step_seconds.observe(forward_s)


def _serve_text_format(registry: CollectorRegistry, host: str, port: int) -> ThreadingHTTPServer:
    """/metrics in Prometheus's text format whatever the scraper asks for, as the router's
    is. prometheus-client's own server (start_http_server) answers Prometheus's Accept
    header with OpenMetrics, and version 0.26 then writes `tandem:x` samples as
    `tandem_x` (under a `# TYPE tandem:x`), so every rule and query missed them; a real
    Prometheus found it (tests/cluster/test_prometheus.py)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args) -> None:  # no line per scrape
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server


def model_dtypes(runner) -> dict:
    """What a runner's model is stored as: the dtype it computes in, its linear weights
    (that dtype, or int8 / fp8), how their scales go (channel, tensor, group, block, or
    "" unquantized), the whole quantization in words, and the KV cache's dtype."""
    cfg = runner.model_config
    quant = cfg.quant
    return {"dtype": cfg.dtype, "weights": quant.method if quant else cfg.dtype,
            "weight_scales": quant.strategy if quant else "",
            "quantization": quant.describe() if quant else None,
            "kv_cache_dtype": str(runner.kv_cache.kv.dtype).removeprefix("torch."), "experts": _experts(cfg)}


def _experts(cfg) -> str:
    """A mixture of experts in words ("" for a dense model): how many, how many a token,
    and how a tensor-parallel worker holds them."""
    if not cfg.moe_layers:
        return ""
    held = "" if cfg.local_experts is None else f"; expert parallel, {len(cfg.expert_range)} a rank"
    return f"{cfg.num_experts} experts, {cfg.num_experts_per_tok} a token{held}"
