"""bench.lab.peers without starting vLLM: config checks, command line and environment."""
from __future__ import annotations

import json

import pytest

from bench.lab.peers import VllmConfig, VllmServer

pytestmark = pytest.mark.unit


@pytest.fixture
def fake_install(tmp_path):
    model, venv = tmp_path / "model", tmp_path / "venv"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "vllm").write_text("#!/bin/sh\n")
    return str(model), str(venv)


def test_command_binds_loopback_with_tuned_settings(fake_install):
    model, venv = fake_install
    server = VllmServer(VllmConfig(model=model, venv=venv, port=8123))
    cmd = server.command()
    assert cmd[:3] == [f"{venv}/bin/vllm", "serve", model]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and "8123" in cmd
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
    env = server.env()
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and env["VLLM_HOST_IP"] == "127.0.0.1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert server.cfg.base_url == "http://127.0.0.1:8123"
    server.stop()  # never started: a no-op


def test_config_names_the_fix(fake_install, tmp_path):
    model, venv = fake_install
    with pytest.raises(ValueError, match="config.json"):
        VllmConfig(model=str(tmp_path), venv=venv)
    with pytest.raises(ValueError, match="install it"):
        VllmConfig(model=model, venv=str(tmp_path))
    with pytest.raises(ValueError, match="--port"):
        VllmConfig(model=model, venv=venv, port=80)


def _point(server: str, rnd: int, tput: float | None = None, tpot: float | None = None,
           step: float | None = None, engine: dict | None = None, duration: float | None = None) -> dict:
    """A saved sweep point as bench.lab.sweep writes it: rate inf (throughput, the run's
    duration, for tandem the pools' forward seconds) or single stream (TPOT p50, a mean
    0.5 ms above it, and for tandem the decode workers' mean step)."""
    conc = 1 if tpot is not None else None
    summary = {"throughput": {"output_tokens_per_s": tput}, "duration_s": duration,
               "latency_ms": {"tpot": {"p50": tpot, "mean": None if tpot is None else tpot + 0.5}}}
    return {"server": server, "workload": "random", "rate": "inf", "concurrency": conc,
            "round": rnd, "summary": summary, "decode_step_ms": step, "engine_s": engine}


def test_sweep_rounds_order_and_side_by_side_medians():
    """--rounds: every server once, then the repeated ones again with the order reversed
    every other round; the side-by-side takes each ratio within its round (llama.cpp, run
    once, through its only figure) and reports the medians and ranges over the rounds."""
    from bench.lab.sweep import Sweep, _side_by_side, build_parser, main

    args = build_parser().parse_args(["--preset", "peers", "--rounds", "3", "--out", "/nonexistent"])
    args.servers, args.repeat_servers = "vllm,llamacpp,tandem-colocated", "vllm,tandem-colocated"
    assert Sweep(args).turns() == [(1, "vllm"), (1, "llamacpp"), (1, "tandem-colocated"),
                                   (2, "tandem-colocated"), (2, "vllm"),
                                   (3, "vllm"), (3, "tandem-colocated")]
    args.repeat_servers = "vllm,tandem-disagg"  # not among --servers: refused
    with pytest.raises(ValueError, match="repeat-servers"):
        Sweep(args)
    assert main(["--rounds", "2", "--servers", "vllm", "--repeat-servers", "llamacpp",
                 "--out", "/nonexistent"]) == 2

    vllm = {1: (500.0, 30.0), 2: (600.0, 32.0), 3: (400.0, 31.0)}
    tandem = {1: (550.0, 29.0), 2: (600.0, 30.0), 3: (520.0, 33.0)}
    pts = [_point("llamacpp", 1, tpot=25.0)]
    for rnd in (1, 2, 3):
        for name, figs in (("vllm", vllm), ("tandem-colocated", tandem)):
            step = figs[rnd][1] - 0.25 * rnd if name.startswith("tandem") else None
            pts += [_point(name, rnd, tput=figs[rnd][0]), _point(name, rnd, tpot=figs[rnd][1], step=step)]
    meta = {"workloads": {"random": []}, "num_requests": 200, "model": "m"}
    text = "\n".join(_side_by_side(meta, pts))
    # per round: 550/500, 600/600, 520/400; one stream 29/30, 30/32, 33/31; vs llama.cpp x/25
    # engine step: TPOT p50 - 0.25 x round; overhead: the mean (p50 + 0.5) minus the step
    assert "| tandem-colocated (round 3) | 520 | 1.30x | 33.00 | 1.06x | 1.32x | - | 32.250 | 1.250 |" in text
    assert "| vllm (round 2) | 600 | 1.00x | 32.00 | 1.00x | 1.28x | - | - | - |" in text
    assert "| tandem-colocated | 3 | 550 (520-600) | 1.10x (1.00x-1.30x) | 30.00 (29.00-33.00) | " \
           "0.97x (0.94x-1.06x) | 1.20x (1.16x-1.32x) | 1.000 (0.750-1.250) |" in text
    assert "| llamacpp | 1 | - | - | 25.00 | 0.83x | 1.00x | - |" in text  # round 1: 25/30


def test_side_by_side_reports_engine_time_at_rate_inf():
    """The rate-inf point's engine forward seconds per pool (read from the workers'
    step histograms) against its duration; servers or older results without them get no
    row, and with none at all the table is left out."""
    from bench.lab.sweep import _side_by_side

    meta = {"workloads": {"random": []}, "num_requests": 200, "model": "m"}
    pts = [_point("vllm", 1, tput=500.0, duration=51.0), _point("vllm", 1, tpot=30.0),
           _point("tandem-colocated", 1, tput=480.0, duration=50.0, engine={"decode": 47.5, "prefill": 0.0}),
           _point("tandem-colocated", 1, tpot=29.0, step=28.0),
           _point("tandem-disagg", 1, tput=520.0, duration=40.0, engine={"decode": 30.0, "prefill": 12.0}),
           _point("tandem-disagg", 1, tpot=28.0, step=27.5)]
    text = "\n".join(_side_by_side(meta, pts))
    assert "| tandem-colocated | 50.0 | 47.5 | 95% | - | - |" in text
    assert "| tandem-disagg | 40.0 | 30.0 | 75% | 12.0 | 30% |" in text
    assert "| vllm | 51.0 |" not in text
    for p in pts:
        p["engine_s"] = None
    assert "Engine time at rate inf" not in "\n".join(_side_by_side(meta, pts))


def test_side_by_side_table_takes_ratios_within_the_run(tmp_path):
    from bench.lab.peers import table

    runs = {"vllm": (100.0, 20.0), "llama": (200.0, 10.0), "llama-q8": (150.0, 8.0), "tandem-disagg": (50.0, 12.0)}
    for name, (duration, tpot) in runs.items():
        (tmp_path / f"{name}-inf.json").write_text(json.dumps(
            {"completed": 200, "duration": duration, "median_ttft_ms": 900.0, "failed": 0}))
        (tmp_path / f"{name}-1stream.json").write_text(json.dumps({"median_tpot_ms": tpot, "failed": 1}))
    rows = table(tmp_path, ("vllm", "llama", "llama-q8", "tandem-disagg", "tandem-disagg-int8"))
    assert len(rows) == 2 + 4  # header, rule, and the four servers that ran (tandem-disagg-int8 did not)
    assert rows[2].startswith("| vllm | 256 |  | 900.0 | 20.00 |  | 2.00x | 2.50x | 0+1 |")
    assert rows[5] == "| tandem-disagg | 512 | 2.00x | 900.0 | 12.00 | 0.60x | 1.20x | 1.50x | 0+1 |"


def test_gguf_rotary_order_rotates_as_hugging_face_does():
    """q/k rows reordered for GGML (pairs) give the same rotated vectors as Hugging Face's
    rotate-half layout does with the original rows."""
    import torch

    from bench.lab.peer_models import _interleave_rotary

    heads, d, hidden, pos = 2, 8, 16, 5
    w = torch.randn(heads * d, hidden, dtype=torch.float64)
    x = torch.randn(hidden, dtype=torch.float64)
    theta = pos * 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # [d/2]
    cos, sin = torch.cos(theta), torch.sin(theta)
    hf = (w @ x).view(heads, d)
    first, second = hf[:, : d // 2], hf[:, d // 2:]
    hf_rot = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
    gg = (torch.from_numpy(_interleave_rotary(w.numpy(), heads)) @ x).view(heads, d // 2, 2)
    even, odd = gg[..., 0], gg[..., 1]
    gg_rot = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).view(heads, d)
    # the same rotated features, each pair (i, i + d/2) of HF's now adjacent in GGML's
    assert torch.allclose(gg_rot.view(heads, d // 2, 2).transpose(1, 2).reshape(heads, d), hf_rot)


def test_safetensors_read_without_torch_matches_the_library(tmp_path):
    import torch
    from safetensors.torch import save_file

    from bench.lab.peer_models import read_safetensors

    tensors = {"a": torch.randn(3, 4).to(torch.bfloat16), "b": torch.randn(5), "c": torch.randn(2, 2).half()}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    got = read_safetensors(tmp_path / "m.safetensors")
    assert all(torch.equal(torch.from_numpy(got[k].copy()), t.float()) for k, t in tensors.items())


def test_the_sweep_reads_rates_as_tandem_bench_does():
    from bench.lab.sweep import parse_sweep_rates

    assert parse_sweep_rates("6,3,inf") == ([3.0, 6.0, float("inf")], None)
    assert parse_sweep_rates("auto:0.4,0.8") == ([], (0.4, 0.8))
    with pytest.raises(ValueError, match="request rate must be > 0 or inf"):  # bench/arrivals.py's words
        parse_sweep_rates("3,-1")


def test_llama_cpp_is_built_for_this_cpu_without_its_amx_kernel(monkeypatch):
    """GGML_NATIVE, except on an AMX CPU: its vector extensions named, AMX left out (that
    llama.cpp's AMX Q8_0 kernel stops with SIGILL on the AMX Xeon it was measured on)."""
    from bench.lab import peers
    from engine.cpu_kernels import isa

    monkeypatch.setattr(isa, "cpu_flag_set", lambda: frozenset({"avx2", "fma", "f16c", "avx512f"}))
    assert peers.ggml_isa_options() == ["-DGGML_NATIVE=ON"]
    monkeypatch.setattr(isa, "cpu_flag_set", lambda: frozenset({"avx2", "avx512f", "avx512_vnni", "amx_tile",
                                                                "amx_int8"}))
    opts = peers.ggml_isa_options()
    assert "-DGGML_NATIVE=OFF" in opts and "-DGGML_AMX_INT8=OFF" in opts
    assert "-DGGML_AVX512_VNNI=ON" in opts and "-DGGML_AVX512_BF16=OFF" in opts
