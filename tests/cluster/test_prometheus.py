"""A real Prometheus server (Debian's package, as .ci/run installs it) scrapes a live
`tandem serve`: the router's /metrics and the decode worker's own. Load that keeps the
decode worker's KV cache above 85% makes TandemKVCacheHigh fire (the test's copy of the
rules has `for: 3s` in place of minutes), and every query of the Grafana dashboard
returns data from that Prometheus."""

from __future__ import annotations

import asyncio
import json
import random
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from bench.servers import free_port
from tests import needs
from tests.cluster.test_serve import ADMIN, Serve
from tests.oracle import random_prompts

MODEL_NAME = "prom-model"  # the routers' and the workers' model_name label

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
MON = ROOT / "deploy" / "monitoring"


def prometheus_binary() -> str:
    return needs.tool("prometheus", "Debian's prometheus package; .ci/run installs it")


class Prometheus:
    def __init__(self, tmp: Path, targets: dict[str, list[str]]) -> None:
        rules = yaml.safe_load((MON / "tandem-rules.yaml").read_text())
        for rule in rules["groups"][0]["rules"]:
            rule["for"] = "3s"  # minutes in production; seconds here (three evaluations)
        (tmp / "rules.yaml").write_text(yaml.safe_dump(rules))
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(tmp / "rules.yaml")],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": ts}]} for job, ts in targets.items()],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(tmp / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [prometheus_binary(), f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/-/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError("prometheus did not become ready")

    def query(self, expr: str) -> list:
        r = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10)
        r.raise_for_status()
        return r.json()["data"]["result"]

    def targets(self) -> list[tuple[str, str, str]]:
        active = httpx.get(self.url + "/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
        return [(t["scrapeUrl"], t["health"], t["lastError"]) for t in active]

    def firing(self) -> dict[str, dict]:
        alerts = httpx.get(self.url + "/api/v1/alerts", timeout=10).json()["data"]["alerts"]
        return {a["labels"]["alertname"]: a for a in alerts if a["state"] == "firing"}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


async def _users(url: str, prompts: list[list[int]], stop: asyncio.Event, statuses: list[int]) -> None:
    async def one(i: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            while not stop.is_set():
                r = await http.post("/v1/completions", json={
                    "prompt": prompts[(i + len(statuses)) % len(prompts)], "max_tokens": 600, "temperature": 0,
                    "ignore_eos": True})
                statuses.append(r.status_code)

    await asyncio.gather(*(one(i) for i in range(8)))


@pytest.mark.timeout(600)
def test_prometheus_scrapes_tandem_fires_kv_cache_high_and_answers_every_dashboard_query(tmp_path, model_path):
    # a small decode cache (96 blocks of 16 tokens) that 8 users of ~700-token sequences keep full
    srv = Serve(["--prefill", "1", "--decode", "1", "--num-blocks", "96", "--block-size", "16", "--transport", "tcp",
                 "--local-prefill-threshold", "32", "--slo-ttft-ms", "50", "--slo-tpot-ms", "5",
                 "--drift-min-requests", "5", "--served-model-name", MODEL_NAME, "second-name", "--log-format", "json"],
                tmp_path / "serve.log")
    prom = None
    try:
        pools = httpx.get(srv.url + "/admin/pools", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10).json()
        decode = pools["pools"]["decode"]["workers"][0]
        prefill = pools["pools"]["prefill"]["workers"][0]
        prom = Prometheus(tmp_path, {"router": [f"127.0.0.1:{srv.port}"],
                                     "workers": [decode["metrics"], prefill["metrics"]]})
        prompts = random_prompts([random.Random(i).randint(60, 120) for i in range(6)], seed=51)

        async def scenario() -> tuple[list[int], dict]:
            stop, statuses = asyncio.Event(), []
            users = asyncio.create_task(_users(srv.url, prompts, stop, statuses))
            deadline = time.monotonic() + 120
            try:
                while "TandemKVCacheHigh" not in (firing := await asyncio.to_thread(prom.firing)):
                    assert time.monotonic() < deadline, (
                        f"no TandemKVCacheHigh; firing: {list(firing)}; KV usage over 2 minutes: "
                        f"{prom.query('max_over_time(tandem:kv_cache_usage_perc[2m])')}, targets: {prom.targets()}")
                    assert not users.done(), users.exception()
                    await asyncio.sleep(1)
            finally:
                stop.set()
                await asyncio.wait_for(users, 120)
            return statuses, firing["TandemKVCacheHigh"]

        statuses, alert = asyncio.run(scenario())
        assert statuses and set(statuses) == {200}, set(statuses)
        # the alert names the decode worker, from its own /metrics
        assert alert["labels"]["worker_id"] == decode["worker_id"] and float(alert["value"]) > 0.85, alert
        # the SLOs set tight on purpose: the attainment rule sees the misses
        assert prom.query('max(tandem:slo_ttft_seconds{class="interactive"})')[0]["value"][1] == "0.05"

        dashboard = json.loads((MON / "tandem-dashboard.json").read_text())
        exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
        assert len(exprs) >= 25
        empty = []
        for expr in exprs:  # the variables at their default, All (".*")
            got = prom.query(re.sub(r"\$(namespace|model_name)\b", ".*", re.sub(r"\$__rate_interval", "1m", expr)))
            if not got:
                empty.append(expr)
        assert empty == [], f"dashboard queries without data: {empty}"
        # one model chosen: the served name is on the routers' and the workers' series alike
        scoped = [re.sub(r"\$model_name\b", MODEL_NAME, re.sub(r"\$namespace\b", ".*", e)) for e in exprs]
        assert all(prom.query(e.replace("$__rate_interval", "1m")) for e in scoped)
        assert prom.query('max by (worker_id) (tandem:worker_step_seconds_count{model_name="%s"})' % MODEL_NAME)
        # a panel written for vLLM, its prefix swapped, answers as it is
        assert prom.query("sum by (finished_reason) (rate(tandem:request_success_total[1m]))")
        # --log-format json reaches every process: the router's lines and the workers' (Ray's
        # copies, behind its "(decode-0 pid=...)" prefix) are one JSON object each
        lines = open(srv.log_path).read().splitlines()
        for who in (r"\(prefill-0 pid=\d+\) ", r"\(decode-0 pid=\d+\) "):
            ours = [json.loads(m.group(1)) for line in lines if (m := re.match(who + r"(\{.*\})$", line))]
            assert ours and all({"time", "level", "logger", "message"} <= set(o) for o in ours), who
            assert any(o["logger"] == "engine.build" for o in ours), who
        assert any(json.loads(line).get("logger") == "tandem.access" for line in lines if line.startswith("{"))
    finally:
        if prom is not None:
            prom.stop()
        srv.stop()
