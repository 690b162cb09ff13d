"""A worker's /metrics keeps its `tandem:` names whatever format the scraper asks for
(Prometheus asks for OpenMetrics first; prometheus-client 0.26's OpenMetrics output
renamed `tandem:x` samples to `tandem_x`, so rules and dashboards missed them)."""

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from worker_runtime.config import Role
from worker_runtime.metrics import WorkerMetrics
from worker_runtime.stats import WorkerStats

pytestmark = pytest.mark.unit

PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;"
                     "q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2")


def test_worker_metrics_keep_their_names_for_a_prometheus_scrape():
    stats = WorkerStats(role=Role.DECODE, worker_id="decode-0", epoch=1, num_blocks=96, num_free_blocks=10)
    m = WorkerMetrics("decode-0", Role.DECODE, lambda: stats)
    address = m.serve("127.0.0.1", 0)
    r = httpx.get(f"http://{address}/metrics", headers={"Accept": PROMETHEUS_ACCEPT}, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {s.name: s for f in text_string_to_metric_families(r.text) for s in f.samples}
    usage = samples["tandem:kv_cache_usage_perc"]
    assert usage.labels == {"worker_id": "decode-0", "role": "decode"} and abs(usage.value - 86 / 96) < 1e-9
    assert "tandem_kv_cache_usage_perc" not in r.text


def test_a_counter_the_engine_keeps_is_read_at_scrape_time():
    stats = WorkerStats(role=Role.DECODE, worker_id="decode-0", epoch=1, num_blocks=96, num_free_blocks=96)
    m = WorkerMetrics("decode-0", Role.DECODE, lambda: stats)
    steps = [0]
    m.add_counter("tandem:worker_steps_planned_ahead", "steps ahead", lambda: steps[0])
    address = m.serve("127.0.0.1", 0)

    def value():
        text = httpx.get(f"http://{address}/metrics", headers={"Accept": PROMETHEUS_ACCEPT}, timeout=10).text
        got = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
        sample = got["tandem:worker_steps_planned_ahead_total"]
        assert sample.labels == {"worker_id": "decode-0", "role": "decode"}
        return sample.value

    assert value() == 0
    steps[0] = 41
    assert value() == 41


def test_a_worker_says_which_transport_and_kernel_build_it_runs():
    stats = WorkerStats(role=Role.PREFILL, worker_id="prefill-0", epoch=1, num_blocks=96, num_free_blocks=96)
    m = WorkerMetrics("prefill-0", Role.PREFILL, lambda: stats)
    m.runtime_info("auto", "tcp", "avx2")
    address = m.serve("127.0.0.1", 0)
    text = httpx.get(f"http://{address}/metrics", headers={"Accept": PROMETHEUS_ACCEPT}, timeout=10).text
    got = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    backend = got["tandem:kv_transfer_backend"]
    assert backend.value == 1 and backend.labels == {"worker_id": "prefill-0", "role": "prefill",
                                                     "requested": "auto", "backend": "tcp"}
    assert got["tandem:worker_cpu_kernels"].labels["build"] == "avx2"
