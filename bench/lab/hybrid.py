"""KV groups (engine/kv_groups.py) against one block table, served: a random Gemma 2
checkpoint (windowed and global layers interleaved) under a fixed KV memory, long
answers at rate inf, one server with its windowed layers' blocks given back as the
answers grow and one with `--disable-hybrid-kv-cache-manager` (every block kept).

    python -m bench.lab.hybrid [--hidden 512 --layers 8 --window 256] [--kv-gb 0.06]
                           [--input-len 512 --output-len 512 --num-requests 32]
                           [--dtype bfloat16] [--rounds 2] [--json PATH]

The checkpoint is written by transformers (Gemma2Config, seeded random weights, the
built-in model's tokenizer) into a temporary directory. The load is `tandem bench`'s
random workload (fixed lengths, every request sent at once). Per server the report
gives the KV blocks of the cache, the most sequences running at once (the worker's
`tandem:num_requests_running`, sampled while the load runs), output tokens per second,
TTFT p50 and TPOT p50 (throughput and latency separately).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.servers import TandemServer

ADMIN = "bench-hybrid"


def write_gemma2(path: Path, a: argparse.Namespace) -> Path:
    """A random Gemma 2 of the given shape, its layers alternating windowed and global."""
    import torch
    import transformers

    from engine.models.builtin import builtin_model_path
    from engine.models.writer import copy_tokenizer_files

    src = Path(builtin_model_path())
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    cfg = transformers.Gemma2Config(
        vocab_size=vocab, hidden_size=a.hidden, intermediate_size=3 * a.hidden, num_hidden_layers=a.layers,
        num_attention_heads=a.hidden // 64, num_key_value_heads=max(1, a.hidden // 128), head_dim=64,
        sliding_window=a.window, max_position_embeddings=4096, query_pre_attn_scalar=64,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=[1, 4], torch_dtype=a.dtype)
    torch.manual_seed(2026)
    model = transformers.Gemma2ForCausalLM(cfg).to(getattr(torch, a.dtype)).eval()
    model.save_pretrained(path, safe_serialization=True)
    for name, data in copy_tokenizer_files(src).items():
        if name != "generation_config.json":
            (path / name).write_bytes(data)
    return path


class RunningPeak(threading.Thread):
    """The most requests a worker reports running, sampled every `every_s` until stopped."""

    def __init__(self, metrics_url: str, every_s: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.url, self.every_s, self.peak = metrics_url, every_s, 0.0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                text = httpx.get(self.url, timeout=5).text
                for m in re.finditer(r"^tandem:num_requests_running(?:\{[^}]*\})? ([0-9.e+]+)$", text, re.M):
                    self.peak = max(self.peak, float(m.group(1)))
            except httpx.HTTPError:
                pass
            self.done.wait(self.every_s)


def run_variant(name: str, extra: list[str], model: Path, a: argparse.Namespace, tmp: Path) -> dict:
    args = ["--colocated", "--decode", "1", "--model", str(model), "--dtype", a.dtype, "--block-size", "16",
            "--kv-cache-memory-gb", str(a.kv_gb), "--max-model-len", "4096", *shlex.split(a.serve_args), *extra]
    server = TandemServer.launch([*args, "--admin-key", ADMIN], Path(f"{a.log_prefix}-{name.replace(' ', '-')}.log"))
    try:
        pools = httpx.get(server.url + "/admin/pools", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
        pools.raise_for_status()
        [worker] = pools.json()["pools"]["decode"]["workers"]
        peak = RunningPeak(f"http://{worker['metrics']}/metrics")
        peak.start()
        out = tmp / f"{name.replace(' ', '-')}.json"
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-m", "cli", "bench", "--base-url", server.url + "/v1",
                        "--input-len", str(a.input_len), "--output-len", str(a.output_len),
                        "--num-requests", str(a.num_requests), "--request-rate", "inf", "--seed", "5", "--quiet",
                        "-o", str(out)], check=True, timeout=a.timeout_s)
        wall = time.monotonic() - t0
        peak.done.set()
        peak.join(5)
        run = json.loads(out.read_text())["runs"][0]["summary"]
    finally:
        server.stop()
    log = Path(server.log_path).read_text(errors="replace")  # the worker's lines, forwarded by Ray
    blocks = re.search(r"(\d+) KV blocks of (\d+) tokens", log)
    groups = re.search(r"(\d+) KV groups of (\d+) slot", log)
    lat = run["latency_ms"]
    return {"variant": name, "serve_args": shlex.join(args), "kv_blocks": int(blocks.group(1)) if blocks else None,
            "kv_groups": int(groups.group(1)) if groups else 1, "peak_running": peak.peak,
            "done": run["requests"]["completed"], "failed": run["requests"]["failed"],
            "output_tok_s": run["throughput"]["output_tokens_per_s"], "ttft_p50_ms": lat["ttft"].get("p50"),
            "tpot_p50_ms": lat["tpot"].get("p50"), "wall_s": round(wall, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lab.hybrid", description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--kv-gb", type=float, default=0.06, help="the KV cache's size (--kv-cache-memory-gb)")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--serve-args", default="--num-threads 2", help="more `tandem serve` options, quoted")
    p.add_argument("--rounds", type=int, default=1, help="runs of each server, in alternating order")
    p.add_argument("--timeout-s", type=float, default=1200.0, help="bound on each load run")
    p.add_argument("--log-prefix", default="/tmp/tandem-hybrid", help="server logs: PREFIX-VARIANT.log")
    p.add_argument("--json", default=None, help="write the results here too")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = write_gemma2(Path(tmp) / "gemma2", a)
        variants = [("kv groups", []), ("one table", ["--disable-hybrid-kv-cache-manager"])]
        rows = []
        for i in range(a.rounds):  # A B, then B A, ...: neither always runs first
            for name, extra in (variants if i % 2 == 0 else variants[::-1]):
                rows.append({"round": i + 1, **run_variant(name, extra, model, a, Path(tmp))})
    print(f"KV groups against one table: a random Gemma 2 (hidden {a.hidden}, {a.layers} layers alternating a "
          f"{a.window}-token window and global, {a.dtype}), KV cache {a.kv_gb:g} GiB, {a.num_requests} requests of "
          f"{a.input_len} + {a.output_len} tokens at rate inf")
    print("| round | cache | KV blocks (groups) | most running at once | done (failed) | output tok/s | TTFT p50 ms | "
          "TPOT p50 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['round']} | {r['variant']} | {r['kv_blocks']} ({r['kv_groups']}) | {r['peak_running']:g} | "
              f"{r['done']} ({r['failed']}) | {r['output_tok_s']:.1f} | {r['ttft_p50_ms']:.0f} | "
              f"{r['tpot_p50_ms']:.1f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
