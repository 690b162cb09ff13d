"""`tandem bench` against a running `tandem serve`: the bench's token counts are the
server's own (usage fields, /metrics counters), and the server goes away when stopped.

One disaggregated server (1 prefill + 1 decode worker, Ray started by `tandem serve`
itself) in its own session on a free port, shared by the tests of this module; the
last test stops it and the fixture kills whatever is left (SIGKILL after a bound).
"""

from __future__ import annotations

import json
import signal

import pytest

from bench.cli import run_main
from bench.lab.sweep import COUNTERS, SweepTandem, bench_totals, counter_deltas, scrape_counters
from bench.report import load_json, records_of
from bench.servers import free_port

pytestmark = pytest.mark.cluster

STARTUP_S = 120.0
PREFIX = "tandem:"


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_path):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    srv = SweepTandem(free_port(), log, colocated=False,
                       extra_args=("--num-blocks", "256", "--max-model-len", "1024"))
    srv.start()
    try:
        srv.wait_ready(STARTUP_S)
        yield srv
    finally:
        srv.stop(grace_s=20.0, linger_s=5.0)  # no-op when a test stopped it already


def _decisions(base_url: str) -> dict[str, float]:
    """tandem:prefill_decisions_total by `where` (local | remote)."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    with urlopen(base_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "tandem:prefill_decisions_total":
                out[s.labels["where"]] = out.get(s.labels["where"], 0.0) + s.value
    return out


def _bench(srv: SweepTandem, out, *args: str) -> dict:
    path = out / "bench.json"
    code = run_main(["--base-url", srv.base_url, "--quiet", "-o", str(path), *args])
    assert code == 0 and path.is_file(), f"tandem bench exited with {code}"
    return load_json(path)


@pytest.mark.parametrize("endpoint,extra", [
    # lengths vary, so prompts go both ways: shorter than --local-prefill-threshold (64)
    # prefills on the decode worker, the others on the prefill worker
    ("completions", ["--num-requests", "12", "--input-len", "uniform:32:96",
                     "--output-len", "uniform:8:24"]),
    ("chat", ["--num-requests", "4", "--input-len", "64", "--output-len", "16"]),
])
def test_bench_counts_equal_server_counts(server, tmp_path, endpoint, extra):
    before = scrape_counters(server.base_url, PREFIX)
    paths_before = _decisions(server.base_url)
    # --continuous-usage: each chunk says how many tokens it carries. A decode worker sends
    # everything queued since its last message as one message (docs/architecture.md), so a
    # chunk may carry two tokens when the router's loop falls behind the engine.
    doc = _bench(server, tmp_path, "--endpoint", endpoint, "--request-rate", "inf",
                 "--seed", "3", "--continuous-usage", *extra)
    run = doc["runs"][0]
    summary, records = run["summary"], records_of(run)
    assert summary["requests"]["failed"] == 0, summary["failures"]
    assert len(records) == summary["requests"]["completed"] > 0

    # per request: the recorded count is the server's usage.completion_tokens, equal to
    # the tokens streamed (counted per chunk) and to max_tokens (ignore_eos)
    for r in records:
        assert r.output_tokens_source == "usage" and r.input_tokens_source == "usage", r
        assert r.output_tokens == sum(r.chunk_tokens), r
        assert len(r.chunk_times) == len(r.chunk_tokens) and all(n >= 1 for n in r.chunk_tokens), r
        assert r.output_tokens == r.expected_output_tokens, r
        assert r.finish_reason == "length", r
    assert summary["tokens"]["output_len_mismatches"] == 0

    # totals: the /metrics counters moved by exactly the bench's totals
    expected = bench_totals(run)
    assert expected["prompt_tokens"] == sum(r.input_tokens for r in records)
    assert expected["generation_tokens"] == sum(r.output_tokens for r in records)
    delta = counter_deltas(server.base_url, PREFIX, before, expected)
    assert delta == expected, json.dumps({"bench": expected, "server_delta": delta})
    assert set(delta) == set(COUNTERS)
    if endpoint == "completions":  # the workload did go both ways
        paths = _decisions(server.base_url)
        assert all(paths.get(w, 0) > paths_before.get(w, 0) for w in ("local", "remote")), paths


def test_sigterm_stops_server_and_its_ray(server):
    info = server.stop(sig=signal.SIGTERM, grace_s=30.0, linger_s=10.0)
    # status 0, or SIGTERM re-raised by uvicorn after its graceful shutdown
    assert info.exit_code in (0, -signal.SIGTERM) and not info.killed_leader, info.describe()
    # everything of its session (Ray's gcs_server, raylet, agents, worker actors) gone
    # within 10 s of its exit
    assert not info.killed_leftovers, info.describe() + "\n" + "\n".join(info.leftovers)
