"""deploy/monitoring: the alert rules pass Prometheus's own promtool (`check rules`, and
`test rules`: each alert fires on a bad series and stays silent on a healthy one), the
dashboard JSON is what its generator builds, and every metric the rules and the
dashboard name exists in docs/metrics.md and in the code."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests import needs

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
MON = ROOT / "deploy" / "monitoring"
RULES = MON / "tandem-rules.yaml"
ALERTS = {"TandemKVCacheHigh", "TandemTTFTHigh", "TandemTPOTHigh", "TandemQueueGrowing", "TandemKVTransferFailures",
          "TandemKVTransportFallback", "TandemWorkerDown", "TandemPoolEmpty", "TandemPreemptionsHigh",
          "TandemSLOAttainmentLow", "TandemProfileDrift"}


def promtool() -> str:
    return needs.tool("promtool", "Debian's prometheus package; .ci/run installs it")


def test_promtool_checks_the_rules():
    done = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 11 rules found" in done.stdout


def test_every_alert_fires_on_a_bad_series_and_not_on_a_healthy_one():
    done = subprocess.run([promtool(), "test", "rules", "tandem-rules.test.yaml"], cwd=MON, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    tests = yaml.safe_load((MON / "tandem-rules.test.yaml").read_text())["tests"]
    fired = {a["alertname"] for t in tests for a in t["alert_rule_test"] if a["exp_alerts"]}
    assert fired == ALERTS  # every alert has a firing case (and its healthy neighbours stay out of exp_alerts)


def test_the_rules_are_the_alerts_operators_rely_on():
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    assert {r["alert"] for r in rules} == ALERTS
    assert all(r["labels"]["severity"] in ("warning", "critical") and r["annotations"]["summary"] for r in rules)


def test_the_dashboard_json_is_what_its_generator_builds():
    pytest.importorskip("grafana_foundation_sdk")
    done = subprocess.run([sys.executable, str(MON / "dashboard.py"), "--check"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


def _names(expr: str) -> set[str]:
    return set(re.findall(r"tandem:[a-z_]+", expr))


def metric_names() -> set[str]:
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    names = set().union(*(_names(r["expr"]) for r in rules))
    dashboard = json.loads((MON / "tandem-dashboard.json").read_text())
    for p in dashboard["panels"]:
        for t in p.get("targets", []):
            names |= _names(t["expr"])
    return names


def test_every_metric_of_the_rules_and_the_dashboard_is_documented_and_exported():
    docs = (ROOT / "docs" / "metrics.md").read_text()
    code = "\n".join(p.read_text() for d in ("router", "worker_runtime") for p in (ROOT / d).glob("*.py"))
    names = metric_names()
    assert len(names) >= 20, names
    for name in sorted(names):
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert base in docs, f"{base} is not in docs/metrics.md"
        registered = re.sub(r"_total$", "", base)  # prometheus-client adds _total to counters
        assert f'"{registered}' in code, f"{registered} is not exported by router/ or worker_runtime/"
