"""`tandem tune` end to end on the built-in model: real servers, real load, a profile
that `tandem serve --config` then serves with (its workload the drift reference)."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
import yaml

from tests.cluster.test_serve import ADMIN, Serve

pytestmark = pytest.mark.cluster


@pytest.mark.timeout(600)
def test_tune_measures_each_configuration_and_writes_a_profile_serve_takes(tmp_path):
    out = tmp_path / "profile.yaml"
    done = subprocess.run(
        [sys.executable, "-m", "cli", "tune", "--bench-args=--input-len 32 --output-len 16 --request-rate 8 "
         "--num-requests 12", "--slo", "ttft:2000", "tpot:200", "--serve-args=--colocated --num-threads 1",
         "--knob", "max-num-seqs=4", "--budget-s", "240", "-o", str(out), "--plot", str(tmp_path),
         "--log-dir", str(tmp_path)], capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[1/2] defaults: goodput" in done.stderr and "[2/2] max-num-seqs=4: goodput" in done.stderr
    assert "about" in done.stderr and "s left" in done.stderr  # progress with the time left
    assert "tandem tune: goodput under ttft <= 2000 ms, tpot <= 200 ms" in done.stdout
    assert "profile written to" in done.stdout and (tmp_path / "tune-goodput.png").stat().st_size > 0
    profile = yaml.safe_load(out.read_text())
    assert profile["profile"]["trials"] == 2 and profile["colocated"] is True and profile["num-threads"] == 1
    assert profile["classes"]["interactive"] == {"slo-ttft-ms": 2000.0, "slo-tpot-ms": 200.0}
    w = profile["workload"]
    assert w["prompt_tokens"]["p50"] == 32 and w["output_tokens"]["p90"] == 16 and 4 < w["arrival_rate"] < 16

    srv = Serve(["--config", str(out)], tmp_path / "serve.log")
    try:
        r = httpx.get(srv.url + "/admin/pools", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10).json()
        assert r["drift"]["reference"] == w and r["drift"]["reference_source"] == "profile"
        text = httpx.get(srv.url + "/metrics", timeout=10).text
        assert 'tandem:slo_ttft_seconds{class="interactive",model_name="tandem-tiny-v2"} 2.0' in text

        # pointed at this running cluster, tune tries the pools' split through the admin API, then puts it back
        again = tmp_path / "running.yaml"
        done = subprocess.run(
            [sys.executable, "-m", "cli", "tune", "--url", srv.url, "--admin-key", ADMIN, "--bench-args="
             "--input-len 32 --output-len 16 --request-rate 8 --num-requests 12", "--slo", "ttft:2000",
             "--knob", "pools=0:2", "--budget-s", "240", "-o", str(again)], capture_output=True, text=True, timeout=400)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "[2/2] pools=0:2: goodput" in done.stderr and "putting the pools at" in done.stderr
        pools = httpx.get(srv.url + "/admin/pools", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10).json()
        assert pools["pools"]["decode"]["target"] == 1
        with pytest.raises(subprocess.CalledProcessError):  # engine knobs need new workers: refused with --url
            subprocess.run([sys.executable, "-m", "cli", "tune", "--url", srv.url, "--bench-args=",
                            "--slo", "ttft:1", "--knob", "max-num-seqs=4"], check=True, capture_output=True, timeout=60)
    finally:
        srv.stop()
