"""`tandem tune`'s parts that need no cluster: knobs, the coordinate search's order,
the profile it writes (loadable by `tandem serve --config`)."""

from __future__ import annotations

import argparse

import pytest
import yaml

from bench import tune
from router.drift import check_reference

pytestmark = pytest.mark.unit


def test_knobs_parse_and_become_serve_flags():
    assert tune.parse_knob("max-num-seqs=8, 32") == ("max-num-seqs", ["8", "32"])
    assert tune.parse_knob("--local-prefill-threshold=0") == ("local-prefill-threshold", ["0"])
    for bad in ("max-num-seqs", "=1", "pools=1,2", "pools=a:b"):
        with pytest.raises(argparse.ArgumentTypeError):
            tune.parse_knob(bad)
    assert tune.knob_args({"pools": "1:2", "max-num-seqs": "8"}) == [
        "--prefill", "1", "--decode", "2", "--max-num-seqs", "8"]
    assert tune.knob_args({"pools": "0:2"}) == ["--colocated", "--decode", "2"]


def test_serve_options_keep_only_what_differs_from_the_defaults():
    opts = tune._serve_options(["--colocated", "--num-threads", "1"], {"max-num-seqs": "8", "pools": "0:2"})
    assert opts == {"colocated": True, "num-threads": 1, "max-num-seqs": 8, "decode": 2}
    with pytest.raises(SystemExit):  # not a tandem serve option
        tune._serve_options([], {"max-num-sequences": "8"})


def _fake_runs(monkeypatch, goodput: dict[str, float]):
    """run_trial that scores each configuration from `goodput` (keyed by its label)."""
    seen: list[str] = []

    def fake(trial, a, slos, tmp, timeout_s, n):
        seen.append(trial.label())
        trial.goodput_rps = goodput[trial.label()]
        trial.output_tok_s = 100.0
        trial.seconds = 1.0
        trial.workload = {"prompt_tokens": {"p50": 10, "p90": 12}, "output_tokens": {"p50": 8, "p90": 8},
                          "arrival_rate": 2.0, "prefix_hit_rate": 0.0, "batch_share": 0.0}

    monkeypatch.setattr(tune, "run_trial", fake)
    return seen


def test_the_search_varies_one_knob_at_a_time_around_the_best(monkeypatch, tmp_path):
    scores = {"defaults": 1.0, "max-num-seqs=8": 0.5, "max-num-seqs=64": 2.0,
              "max-num-seqs=64, max-num-batched-tokens=256": 1.5, "max-num-seqs=64, max-num-batched-tokens=4096": 3.0}
    seen = _fake_runs(monkeypatch, scores)
    out = tmp_path / "p.yaml"
    assert tune.main(["--bench-args", "--num-requests 4", "--slo", "ttft:500", "tpot:50", "--serve-args=--colocated",
                      "--knob", "max-num-seqs=8,64", "--knob", "max-num-batched-tokens=256,4096",
                      "-o", str(out), "--budget-s", "60"]) == 0
    assert seen == ["defaults", "max-num-seqs=8", "max-num-seqs=64", "max-num-seqs=64, max-num-batched-tokens=256",
                    "max-num-seqs=64, max-num-batched-tokens=4096"]
    doc = yaml.safe_load(out.read_text())
    assert doc["max-num-seqs"] == 64 and doc["max-num-batched-tokens"] == 4096 and doc["colocated"] is True
    assert doc["classes"] == {"interactive": {"slo-ttft-ms": 500.0, "slo-tpot-ms": 50.0}}
    assert doc["profile"]["goodput_req_s"] == 3.0 and doc["profile"]["defaults_goodput_req_s"] == 1.0
    check_reference(doc["workload"])
    # and `tandem serve --config` takes it as it is
    from cli.main import apply_config_file, build_parser

    parser = build_parser()
    args = parser.parse_args(["serve", "--config", str(out)])
    apply_config_file(args, next(a for a in parser._actions if a.dest == "command").choices["serve"],
                      ["serve", "--config", str(out)])
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.slo_ttft_ms, args.colocated) == (64, 4096, 500.0,
                                                                                                  True)
    assert args.workload == doc["workload"]


def test_the_budget_stops_the_search(monkeypatch, tmp_path):
    seen = _fake_runs(monkeypatch, {"defaults": 1.0, "max-num-seqs=8": 2.0, "max-num-seqs=16": 3.0})
    clock = iter(range(0, 10_000, 5))
    monkeypatch.setattr(tune.time, "monotonic", lambda: float(next(clock)))
    tune.main(["--bench-args", "", "--slo", "ttft:500", "--knob", "max-num-seqs=8,16", "-o",
               str(tmp_path / "p.yaml"), "--budget-s", "12"])
    assert len(seen) < 3  # the clock runs out before every trial could start
