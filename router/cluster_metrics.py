"""Cluster series on the router's /metrics: routing decisions, the disaggregation path
(transfer seconds / bytes / failures, TTFT split, requests waiting for KV), retries,
and per-worker gauges read from the workers' Stats (blocks reserved for incoming KV,
KV usage, queues). Names are listed in docs/metrics.md."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from worker_runtime.membership import ROLES, WorkerState

TRANSFER_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _WorkerCollector(Collector):
    def __init__(self, view) -> None:
        self.view = view

    def collect(self):
        labels = ["worker_id", "role"]
        gauges = {
            "up": GaugeMetricFamily(
                "tandem:worker_up", "1 when the worker is ready, 0 while starting/draining.", labels=labels
            ),
            "run": GaugeMetricFamily(
                "tandem:worker_num_requests_running", "Sequences in the worker's running batch.", labels=labels
            ),
            "wait": GaugeMetricFamily(
                "tandem:worker_num_requests_waiting", "Sequences queued on the worker.", labels=labels
            ),
            "kv": GaugeMetricFamily(
                "tandem:worker_kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", labels=labels
            ),
            "res": GaugeMetricFamily(
                "tandem:worker_blocks_reserved_for_incoming_kv",
                "Blocks a decode worker holds for KV a prefill worker is writing.",
                labels=labels,
            ),
            "awk": GaugeMetricFamily(
                "tandem:worker_requests_waiting_for_kv",
                "Reservations on a decode worker whose KV has not landed.",
                labels=labels,
            ),
            "qpt": GaugeMetricFamily(
                "tandem:worker_queued_prefill_tokens", "Prompt tokens waiting to be prefilled.", labels=labels
            ),
            "rate": GaugeMetricFamily(
                "tandem:worker_prefill_tokens_per_second",
                "A prefill worker's measured rate: prompt tokens per second of forward time (0 before its first step).",
                labels=labels,
            ),
        }
        counters = {
            "q": CounterMetricFamily(
                "tandem:worker_prefix_cache_queries",
                "Prompt tokens looked up in the worker's prefix cache.",
                labels=labels,
            ),
            "h": CounterMetricFamily(
                "tandem:worker_prefix_cache_hits", "Prompt tokens found in the worker's prefix cache.", labels=labels
            ),
            "p": CounterMetricFamily(
                "tandem:worker_num_preemptions", "Sequences preempted (recomputed) on the worker.", labels=labels
            ),
        }
        for w in list(self.view.workers.values()):
            lv = [w.worker_id, w.role.value]
            gauges["up"].add_metric(lv, 1.0 if w.state is WorkerState.READY else 0.0)
            s = w.stats
            if s is None:
                continue
            for key, val in (
                ("run", s.num_running),
                ("wait", s.num_waiting),
                ("kv", s.kv_usage),
                ("res", s.num_reserved_blocks),
                ("awk", s.num_awaiting_kv),
                ("qpt", s.queued_prefill_tokens),
                ("rate", s.prefill_tokens_per_s),
            ):
                gauges[key].add_metric(lv, val)
            for key, val in (("q", s.prefix_cache_queries), ("h", s.prefix_cache_hits), ("p", s.num_preemptions)):
                counters[key].add_metric(lv, val)
        pools = GaugeMetricFamily("tandem:pool_target_workers", "Target size of each worker pool.", labels=["role"])
        ready = GaugeMetricFamily("tandem:pool_ready_workers", "Ready workers in each pool.", labels=["role"])
        for role, target in self.view.targets.items():
            pools.add_metric([role.value], target)
            ready.add_metric([role.value], len(self.view.ready(role)))
        yield from gauges.values()
        yield from counters.values()
        yield pools
        yield ready
        auto = getattr(self.view, "autoscaler", None)
        if auto:  # the controller's counts (every router shows the same: aggregate with max)
            c = CounterMetricFamily("tandem:autoscaler_decisions", "Pool size changes the autoscaler made, by pool "
                                    "and direction (its reasons are in the controller's log and /admin/pools).",
                                    labels=["role", "direction"])
            counts = {(d["role"], d["direction"]): d["count"] for d in auto.get("decisions", [])}
            for role in ROLES:
                for direction in ("up", "down"):
                    c.add_metric([role.value, direction], counts.get((role.value, direction), 0))
            yield c


class ClusterMetrics:
    def __init__(self, view=None) -> None:
        self.registry = reg = CollectorRegistry()
        self.decisions = Counter(
            "tandem:prefill_decisions",
            "Where prompts were prefilled (local on the decode "
            "worker, or remote on a prefill worker), with the reason.",
            ["where", "reason"],
            registry=reg,
        )
        self.decode_decisions = Counter(
            "tandem:decode_decisions",
            "How the decode worker was chosen: it held part of the prompt (prefix_overlap), "
            "by load alone (load), or it was the only one with room (only_fit).",
            ["reason"],
            registry=reg,
        )
        self.transfer_seconds = Histogram(
            "tandem:router_kv_transfer_seconds",
            "KV write issued to written and notified, per request.",
            buckets=TRANSFER_BUCKETS,
            registry=reg,
        )
        self.transfer_bytes = Counter(
            "tandem:router_kv_transfer_bytes", "KV bytes written from prefill to decode workers.", registry=reg
        )
        self.transfer_failures = Counter(
            "tandem:router_kv_transfer_failures", "Remote prefills (prefill or KV write) that failed.", registry=reg
        )
        self.prefill_queue = Histogram(
            "tandem:prefill_queue_seconds",
            "Time a prompt waited on its prefill worker.",
            buckets=PHASE_BUCKETS,
            registry=reg,
        )
        self.prefill_compute = Histogram(
            "tandem:prefill_compute_seconds",
            "First chunk scheduled to last layer computed.",
            buckets=PHASE_BUCKETS,
            registry=reg,
        )
        self.routed = Counter(
            "tandem:routed_requests", "Request attempts sent to each worker.", ["role", "worker_id"], registry=reg
        )
        self.waiting_for_kv = Gauge(
            "tandem:router_requests_waiting_for_kv",
            "Requests reserved on a decode worker whose KV is being prefilled or written.",
            registry=reg,
        )
        self.retries = Counter(
            "tandem:request_retries", "Request attempts repeated on another worker, by cause.", ["cause"], registry=reg
        )
        self.pull_hints = Counter(
            "tandem:router_pull_hints", "Prefills sent with a worker to pull the prompt's prefix from (it held "
            "more of it than the prefill worker chosen).", registry=reg)
        for where, reason in (
            ("local", "colocated"),
            ("local", "no_prefill_worker"),
            ("local", "short_uncached"),
            ("local", "fallback"),
            ("local", "prompt_logprobs"),
            ("local", "spill"),
            ("local", "lease"),
            ("remote", "remote"),
        ):
            self.decisions.labels(where, reason)
        for reason in ("prefix_overlap", "load", "only_fit"):
            self.decode_decisions.labels(reason)
        for cause in ("decode_failed", "migrated", "no_capacity", "full"):
            self.retries.labels(cause)
        if view is not None:
            reg.register(_WorkerCollector(view))

    def prefill_outcome(self, outcome) -> None:
        """Record one remote prefill's reply (or failure)."""
        if outcome.reply is None:
            self.transfer_failures.inc()
            self.decisions.labels("local", "fallback").inc()
            return
        t = outcome.reply.timings
        self.transfer_seconds.observe(t.transfer_s)
        self.prefill_queue.observe(t.queue_s)
        self.prefill_compute.observe(t.prefill_s)
        self.transfer_bytes.inc(outcome.reply.num_transferred_bytes)
