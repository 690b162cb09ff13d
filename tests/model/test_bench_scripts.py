"""bench.lab.engine, bench.lab.decode, bench.lab.profile and bench.lab.spec run end to end
on the built-in model with tiny sizes: the structure of their reports, never their speed. vLLM itself is not started."""

from __future__ import annotations

import json

import pytest

from bench.lab import decode as bench_decode
from bench.lab import engine as bench_engine
from bench.lab import profile as bench_profile

pytestmark = pytest.mark.model


def test_engine_bench_report(tmp_path, capsys):
    out = tmp_path / "engine.json"
    doc = bench_engine.main(
        [
            "--quick",
            "--models",
            "builtin",
            "--batches",
            "3",
            "1",
            "--context",
            "20",
            "--prefill-prompts",
            "2",
            "--prefill-len",
            "24",
            "--reps",
            "1",
            "--prefill-reps",
            "1",
            "--warmup",
            "0",
            "--threads",
            "1",
            "--json",
            str(out),
        ]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert doc["settings"]["threads"] == 1 and doc["settings"]["batches"] == [1, 3]
    (m,) = doc["models"]
    assert m["model"] == "builtin" and m["attention_backend"] and m["context"] == 20
    assert [r["batch"] for r in m["decode"]] == [1, 3]
    for r in m["decode"]:
        assert r["ours_ms"] > 0 and r["hf_ms"] > 0
        assert r["ours_tok_s"] == pytest.approx(r["batch"] / (r["ours_ms"] / 1e3))
        assert r["speedup"] == pytest.approx(r["hf_ms"] / r["ours_ms"])
    p = m["prefill"]
    assert p["tokens"] == 48 and p["ours_tok_s"] > 0 and p["hf_tok_s"] > 0
    printed = capsys.readouterr().out
    assert "ours ms/step" in printed and "HF tok/s" in printed and "speedup" in printed


def test_engine_bench_without_hf():
    doc = bench_engine.main(
        [
            "--models",
            "builtin",
            "--batches",
            "2",
            "--context",
            "8",
            "--prefill-prompts",
            "1",
            "--prefill-len",
            "16",
            "--reps",
            "1",
            "--prefill-reps",
            "1",
            "--warmup",
            "0",
            "--threads",
            "1",
            "--no-hf",
        ]
    )
    (m,) = doc["models"]
    assert m["decode"][0]["hf_ms"] is None and m["decode"][0]["speedup"] is None
    assert m["prefill"]["hf_tok_s"] is None and bench_engine.render(doc)


def test_engine_bench_rejects_unknown_model():
    with pytest.raises(SystemExit):
        bench_engine.parse_args(["--models", "builtin,gpt5"])


def test_batching_report(tmp_path, capsys):
    out = tmp_path / "batching.json"
    doc = bench_decode.main(
        [
            "batching",
            "--quick",
            "--num-requests",
            "6",
            "--prompt-len",
            "8",
            "--median-out",
            "3",
            "--max-out",
            "8",
            "--max-num-seqs",
            "2",
            "--threads",
            "1",
            "--json",
            str(out),
        ]
    )
    assert json.loads(out.read_text())["batching"]["ratio"] == pytest.approx(doc["batching"]["ratio"])
    r = doc["batching"]
    assert [x["scheduler"] for x in r["rows"]] == ["continuous", "static"]
    lengths = bench_decode.lognormal_lengths(6, 3, 1.0, 8, 1)
    assert r["output_tokens"] == sum(lengths) and all(1 <= n <= 8 for n in lengths)
    for x in r["rows"]:
        assert x["wall_s"] > 0 and x["steps"] > 0
        assert x["output_tok_s"] == pytest.approx(r["output_tokens"] / x["wall_s"])
    assert r["ratio"] == pytest.approx(r["rows"][0]["output_tok_s"] / r["rows"][1]["output_tok_s"])
    assert "continuous / static" in capsys.readouterr().out


def test_interference_report():
    doc = bench_decode.main(
        [
            "interference",
            "--quick",
            "--streams",
            "2",
            "--stream-prompt-len",
            "8",
            "--stream-tokens",
            "12",
            "--long-prompt-len",
            "64",
            "--interval",
            "0.001",
            "--chunk",
            "16",
            "--threads",
            "1",
        ]
    )
    r = doc["interference"]
    chunked, whole = r["rows"]
    assert chunked["chunked"] and not whole["chunked"]
    assert chunked["max_num_batched_tokens"] == 16 and whole["max_num_batched_tokens"] >= 64
    for x in r["rows"]:
        assert 0 < x["itl_count"] <= 2 * 11
        assert 0 < x["itl_p50_ms"] <= x["itl_p99_ms"] <= x["itl_max_ms"]
        assert x["long_prompts"] >= 1 and x["long_ttft_p50_ms"] > 0
    assert set(r["ratios_unchunked_over_chunked"]) == {"itl_p50_ms", "itl_p99_ms", "itl_max_ms", "long_ttft_p50_ms"}
    assert "ITL p99 ms" in bench_decode.render_interference(r)


def test_vllm_section_without_vllm(tmp_path):
    """The tandem half of the comparison runs; a missing vLLM install is reported, not fatal."""
    doc = bench_decode.main(
        [
            "vllm",
            "--venv",
            str(tmp_path / "no-venv"),
            "--num-prompts",
            "3",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--dtypes",
            "fp32",
            "--threads",
            "1",
            "--repeats",
            "2",
        ]
    )
    r = doc["vllm"]
    assert r["vllm_skipped"] and [x["engine"] for x in r["rows"]] == ["tandem"]
    row = r["rows"][0]
    assert (
        row["dtype"] == "float32"
        and len(row["walls_s"]) == 2
        and row["output_tok_s"] == pytest.approx(12 / row["wall_s"])
    )
    assert "vLLM skipped" in bench_decode.render_vllm(r)


def test_quick_settings_are_small():
    args = bench_decode.parse_args(["--quick"])
    assert args.batching.num_requests <= 64 and args.interference.streams <= 8
    assert args.vllm.num_prompts <= 32 and args.vllm.enforce_eager
    args = bench_decode.parse_args(["vllm", "--dtypes", "bf16,float32", "--num-prompts", "7"])
    assert args.vllm.dtypes == ("bfloat16", "float32") and args.vllm.num_prompts == 7
    with pytest.raises(SystemExit):
        bench_decode.parse_args(["batching", "--num-requests", "0"])


def test_profile_report(capsys):
    assert bench_profile.main(["--batch", "3", "--prompt-len", "20", "--steps", "2", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "decode step at batch 3, context ~20, float32, 1 threads" in out
    groups = [line.split()[0] for line in out.split("by group")[1].split("top ")[0].splitlines()[3:] if line.strip()]
    assert {"matmul", "attention", "python"} <= set(groups)
    assert "small_batch_linear" in out  # fp32 decode steps of up to 4 tokens: the row-major kernel


def test_isa_report(builtin_dir, tmp_path):
    from bench.lab import isa

    out, md = tmp_path / "isa.json", tmp_path / "isa.md"
    assert isa.main(["--model", str(builtin_dir), "--builds", "native", "--dtypes", "float32", "--prompt-len", "8",
                     "--max-tokens", "4", "--batch", "2", "--threads", "1", "--kv-cache-memory-gb", "0.1",
                     "--json", str(out), "--markdown", str(md)]) == 0
    report = json.loads(out.read_text())
    assert report["meta"]["cpu_flags"] and report["meta"]["read_bandwidth_gbs"] > 0
    (row,) = report["rows"]
    assert row["ms_per_token"] > 0 and row["batch_tok_s"] > 0 and row["weight_bytes"] > 0
    assert "| native | float32 |" in md.read_text()


def test_profile_groups():
    assert bench_profile.group_of("aten::addmm") == "matmul"
    assert bench_profile.group_of("tandem_cpu_0::paged_decode_attention") == "attention"
    assert bench_profile.group_of("tandem_cpu_0::store_kv") == "attention"
    assert bench_profile.group_of("tandem_cpu_0::small_batch_linear") == "matmul"
    assert bench_profile.group_of("mkldnn::_linear_pointwise") == "matmul"
    assert bench_profile.group_of("aten::argmax") == "sampling"
    assert bench_profile.group_of("aten::silu_") == "other"


def test_spec_bench_report(tmp_path):
    from bench.lab import spec as bench_spec

    out, md = tmp_path / "spec.json", tmp_path / "spec.md"
    assert bench_spec.main(["--concurrency", "1,2", "--methods", "off,ngram,adaptive-suffix", "--max-tokens", "12",
                            "--rounds", "2", "--workloads", "code,repeat", "--threads", "1", "--json", str(out),
                            "--markdown", str(md)]) == 0
    doc = json.loads(out.read_text())
    rows = {(r["method"], r["workload"], r["concurrency"]): r for r in doc["rows"]}
    assert len(rows) == 3 * 2 * 2 and doc["rounds"] == 2
    for (method, _, _), r in rows.items():
        assert r["tok_s"] > 0 and r["ms_per_token_p50"] > 0
        assert r["speedup_tok_s"] == 1.0 if method == "off" else r["speedup_tok_s"] > 0
        assert ("acceptance" in r) == (method != "off")
    assert rows[("ngram", "repeat", 1)]["draft_tokens"] > 0  # a repeated function is found in its prompt
    assert "| ngram | 2 |" in md.read_text()


def test_interference_bench_report(tmp_path, capsys):
    """bench.lab.interference runs the engine alone and beside its neighbour processes, stops
    them, and reports both runs."""
    from bench.lab import interference

    out = tmp_path / "interference.json"
    doc = interference.main(["--prompts", "3", "--prompt-len", "16", "--output-len", "4", "--threads", "1",
                             "--period-ms", "20", "--exchanges", "5", "--work-us", "20", "--json", str(out)])
    assert json.loads(out.read_text()) == doc
    for name in ("alone", "beside"):
        r = doc[name]
        assert r["decode_steps"] >= 3 and r["prompt_steps"] >= 1 and r["output_tok_s"] > 0
    text = capsys.readouterr().out
    assert "alone:" in text and "beside:" in text


def test_hostpath_bench_report(capsys):
    from bench.lab import hostpath

    assert hostpath.main(["--batches", "3", "--context", "20", "--steps", "6"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:7] == ["batch", "context", "schedule", "prepare", "finish", "sync", "sum"]
    row = lines[1].split()
    assert row[:2] == ["3", "20"] and all(float(x) > 0 for x in row[2:])
