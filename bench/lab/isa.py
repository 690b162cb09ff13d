"""Decode speed per build of the CPU kernels and per dtype: one stream and a full batch,
offline (the engine `tandem generate` and the decode worker run), each case in its own
process.

    python -m bench.lab.isa --model DIR [--builds native,avx2] [--dtypes float32,bfloat16]
                            [--prompt-len 256] [--max-tokens 128] [--batch 64] [--threads 2]
                            [--json PATH] [--markdown PATH]

`native` is the build this CPU loads by default; any other name (avx2, avx512, ...) is
forced with TANDEM_CPU_KERNELS; `NAME:torch-linear` runs the linear layers on torch alone
(the baseline of the kernels' own); and `avx2` also caps torch's own kernels at AVX2
(ATEN_CPU_CAPABILITY=avx2, MKL_ENABLE_INSTRUCTIONS=AVX2, ONEDNN_MAX_CPU_ISA=AVX2), so on
an AVX-512 machine the row stands for an AVX2-only CPU's code paths (not its memory
system: the bandwidth is this machine's, and is measured and printed beside it).

One stream: a `--prompt-len` prompt, greedy, `--max-tokens` tokens; ms/token is the
decode time (the whole generate minus a 1-token generate of the same prompt) over the
tokens after the first, median of 3. Full batch: `--batch` such prompts at once,
`--max-tokens` each; output tok/s over the whole generate (prefill included), median of
2. The weights' bytes a token reads and this machine's read bandwidth give the one
stream's floor (bytes / bandwidth, as bench/lab/bandwidth.py measures them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

AVX2_CAPS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def case_env(build: str) -> dict[str, str]:
    """The environment of a case: `native`, a build's name, either with `:torch-linear`
    (the linear layers on torch alone, TANDEM_CPU_SMALL_BATCH_LINEAR=0: the baseline the
    kernels' linear layers are measured against)."""
    env = dict(os.environ)
    name, _, modifier = build.partition(":")
    if name != "native":
        env["TANDEM_CPU_KERNELS"] = name
    if name == "avx2":
        env.update(AVX2_CAPS)
    if modifier == "torch-linear":
        env["TANDEM_CPU_SMALL_BATCH_LINEAR"] = "0"
    elif modifier:
        raise SystemExit(f"unknown modifier {modifier!r} in {build!r} (torch-linear)")
    return env


def run_case(args: argparse.Namespace) -> dict:
    """In the child: time one stream and one full batch."""
    import torch

    from decode_worker.llm import LLM
    from engine.cpu_kernels import build
    from engine.sampling_params import SamplingParams

    llm = LLM(args.model, dtype=args.dtype, num_threads=args.threads, kv_cache_memory_gb=args.kv_cache_memory_gb,
              max_num_seqs=max(args.batch, 1))
    vocab = llm.engine.runner.model.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, vocab - 1, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
    full = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    llm.generate(prompts[:1], full, use_tqdm=False)  # warm-up
    one = []
    for _ in range(3):
        t0 = time.perf_counter()
        llm.generate(prompts[:1], first, use_tqdm=False)
        t1 = time.perf_counter()
        llm.generate(prompts[:1], full, use_tqdm=False)
        t2 = time.perf_counter()
        one.append(((t2 - t1) - (t1 - t0)) / (args.max_tokens - 1) * 1e3)
    batch = []
    for _ in range(2):
        t0 = time.perf_counter()
        llm.generate(prompts, full, use_tqdm=False)
        batch.append(args.batch * args.max_tokens / (time.perf_counter() - t0))
    from bench.lab.bandwidth import weight_bytes_per_token

    weight_bytes = weight_bytes_per_token(args.model, {"float32": 4}.get(args.dtype, 2))
    return {"ms_per_token": statistics.median(one), "ms_per_token_all": one, "batch_tok_s": statistics.median(batch),
            "weight_bytes": weight_bytes, "kernels": build.chosen()[0].name,
            "torch_isa": torch.backends.cpu.get_cpu_capability()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lab.isa", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--builds", default="native,avx2")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache-memory-gb", type=float, default=4.0)
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    p.add_argument("--case", action="store_true", help=argparse.SUPPRESS)  # the child's role
    p.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case:
        print("RESULT " + json.dumps(run_case(args)), flush=True)
        return 0

    from bench.lab.bandwidth import read_bandwidth_gbs
    from engine.cpu_kernels import build

    bandwidth = read_bandwidth_gbs(threads=args.threads)
    rows = []
    for b in [x.strip() for x in args.builds.split(",") if x.strip()]:
        for dtype in [x.strip() for x in args.dtypes.split(",") if x.strip()]:
            cmd = [sys.executable, "-m", "bench.lab.isa", "--case", "--model", args.model, "--dtype", dtype,
                   "--prompt-len", str(args.prompt_len), "--max-tokens", str(args.max_tokens),
                   "--batch", str(args.batch), "--threads", str(args.threads),
                   "--kv-cache-memory-gb", str(args.kv_cache_memory_gb)]
            out = subprocess.run(cmd, env=case_env(b), capture_output=True, text=True, timeout=3600)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if out.returncode != 0 or line is None:
                print(f"{b} {dtype}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
                return 1
            r = {"build": b, "dtype": dtype, **json.loads(line[7:])}
            r["floor_ms"] = r["weight_bytes"] / (bandwidth * 1e9) * 1e3
            rows.append(r)
            print(f"{b:18s} {dtype:9s} kernels {r['kernels']:12s} torch {r['torch_isa']:7s} one stream "
                  f"{r['ms_per_token']:6.2f} ms/token ({r['ms_per_token'] / r['floor_ms']:.2f}x the floor "
                  f"{r['floor_ms']:.1f}); batch {args.batch}: {r['batch_tok_s']:7.1f} tok/s", flush=True)
    meta = {"cpu": build.cpu_model(), "cpu_flags": build.cpu_flags(), "threads": args.threads,
            "read_bandwidth_gbs": bandwidth, "model": args.model, "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens, "batch": args.batch}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(f"CPU: {meta['cpu']}, {args.threads} threads, read bandwidth {bandwidth:.1f} GB/s; "
                    f"{os.path.basename(args.model.rstrip('/'))}, prompt {args.prompt_len}, "
                    f"{args.max_tokens} tokens\n\n")
            f.write("| build | dtype | kernels | torch | one stream ms/token | vs floor | "
                    f"batch {args.batch} tok/s |\n")
            f.write("|---|---|---|---|---|---|---|\n")
            for r in rows:
                f.write(f"| {r['build']} | {r['dtype']} | {r['kernels']} | {r['torch_isa']} | "
                        f"{r['ms_per_token']:.2f} | {r['ms_per_token'] / r['floor_ms']:.2f}x of "
                        f"{r['floor_ms']:.1f} | {r['batch_tok_s']:.1f} |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
