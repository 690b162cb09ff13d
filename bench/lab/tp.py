"""Tensor parallelism on one host, offline: one engine at TP=1 (N threads) against TP=2
(N/2 threads a rank), the same model and requests, and the all-reduce's share of the
steps (rank 0's time in all-reduces, waits for rank 1 included, over its step time).

    python -m bench.lab.tp MODEL_DIR OUT [--dtype bfloat16] [--cores 0,1] [--batch 64]
                           [--prompt-len 256] [--output-len 128] [--rounds 2]
    python -m bench.lab.tp --allreduce OUT [--cores 0,1]
    python -m bench.lab.tp --experts MODEL_DIR OUT [...]   (a mixture of experts)
    python -m bench.lab.tp --write-moe DIR                 (a random Mixtral-shaped MoE)

`--allreduce`: the collective alone, two processes pinned a core each: tandem's
shared-memory all-reduce against gloo's (torch.distributed), 1, 16 and 256 rows of 768
values in bf16 and fp32, the mean of 2,000 calls (gloo: 500) after a warm-up; OUT/allreduce.md
and OUT/allreduce.json.

Two loads: one stream (a prompt, then its tokens one step at a time: ms a token) and a
batch of `--batch` prompts at once (output tokens a second). The sizes alternate round
by round (`--rounds`), so a noisy host hits both alike. OUT/report.md and OUT/runs.json.
`--experts`: TP=1 against TP=2 with every expert split over both ranks and TP=2 with
--enable-expert-parallel (half the experts whole on each rank), and the routing's share
of the steps (rank 0's router, top-k and grouping by expert over its step time: the
dispatch; the combine is the all-reduce). `--write-moe DIR` writes the model it is run
on: Mixtral's shape scaled down, 8 experts, 2 a token, hidden 1024, 10 layers, about
420M parameters (about 130M a token), random bf16 weights, the built-in tokenizer.
The served figures come from `python -m bench.lab.peers side-by-side ... --tandem-args
"--tensor-parallel-size 2"` (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def write_moe(path: Path) -> Path:
    """A random Mixtral of about 420M parameters (module docstring) at `path`."""
    import torch
    import transformers

    from engine.models.builtin import builtin_model_path
    from engine.models.writer import copy_tokenizer_files

    cfg = transformers.MixtralConfig(vocab_size=8192, hidden_size=1024, intermediate_size=1536, num_hidden_layers=10,
                                     num_attention_heads=16, num_key_value_heads=4, num_local_experts=8,
                                     num_experts_per_tok=2, max_position_embeddings=4096, tie_word_embeddings=False,
                                     bos_token_id=0, eos_token_id=[1, 4])
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg).to(torch.bfloat16).eval()
    model.save_pretrained(path, safe_serialization=True)
    for name, data in copy_tokenizer_files(builtin_model_path()).items():
        if name != "generation_config.json":
            (path / name).write_bytes(data)
    print(f"{path}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")
    return path


def run_once(model: str, tp: int, dtype: str, cores: tuple[int, ...], batch: int, prompt_len: int,
             output_len: int, vocab_parallel: bool = True, ep: bool = False) -> dict:
    import torch

    from decode_worker.llm_engine import LLMEngine
    from engine.config import CacheConfig, DeviceConfig, EngineConfig, ParallelConfig, SchedulerConfig
    from engine.sampling_params import SamplingParams

    os.sched_setaffinity(0, set(cores))
    config = EngineConfig(model=model, dtype=dtype, cache=CacheConfig(block_size=64, kv_cache_memory_gb=2.0),
                          scheduler=SchedulerConfig(max_num_seqs=max(batch, 1), max_num_batched_tokens=2048,
                                                    max_model_len=prompt_len + output_len + 8),
                          device=DeviceConfig(num_threads=len(cores), cpu_affinity=cores),
                          parallel=ParallelConfig(tensor_parallel_size=tp, vocab_parallel_head=vocab_parallel,
                                                  enable_expert_parallel=ep))
    engine = LLMEngine.from_config(config)
    comm = engine.runner.comm
    moe = [layer.mlp for layer in engine.runner.model.layers if hasattr(layer.mlp, "route_seconds")]
    g = torch.Generator().manual_seed(0)
    out = {"tp": tp, "threads_per_rank": len(cores) // tp, "dtype": dtype,
           "experts": "" if not moe else "expert-parallel" if ep and tp > 1 else "split" if tp > 1 else "whole",
           "head": "vocab-parallel" if engine.runner.model.vocab_comm is not None else "whole"}
    try:
        with torch.inference_mode():
            for label, n in (("warmup", 2), ("one_stream", 1), ("batch", batch)):
                params = SamplingParams(max_tokens=output_len if label != "warmup" else 8, temperature=0,
                                        ignore_eos=True)
                for i in range(n):
                    engine.add_request(f"{label}-{i}", torch.randint(5, 8000, (prompt_len,), generator=g).tolist(),
                                       params)
                first_done, decode_s, decode_tokens, ar0, t_start = None, 0.0, 0, None, time.perf_counter()
                route0 = 0.0
                while engine.has_work():
                    t0 = time.perf_counter()
                    before = comm.seconds if comm is not None else 0.0
                    events = engine.step()
                    dt = time.perf_counter() - t0
                    toks = sum(1 for e in events if e.token_id is not None)
                    if first_done is None:  # prefill steps: until every sequence has its first token
                        if all(len(s.output_ids) > 0 for s in engine.seqs.values()):
                            first_done, ar0 = time.perf_counter(), 0.0
                            route0 = sum(b.route_seconds for b in moe)
                        continue
                    decode_s += dt
                    decode_tokens += toks
                    ar0 += (comm.seconds - before) if comm is not None else 0.0
                if label == "warmup":
                    continue
                out[label] = {"decode_s": round(decode_s, 4), "decode_tokens": decode_tokens,
                              "ms_per_step": round(1000 * decode_s / max(1, decode_tokens / n), 3),
                              "tokens_per_s": round(decode_tokens / decode_s, 1) if decode_s else 0.0,
                              "allreduce_s": round(ar0 or 0.0, 4),
                              "allreduce_share": round((ar0 or 0.0) / decode_s, 4) if decode_s else 0.0,
                              "routing_share": round((sum(b.route_seconds for b in moe) - route0) / decode_s, 4)
                              if decode_s and moe else 0.0,
                              "wall_s": round(time.perf_counter() - t_start, 2)}
        out["allreduce_calls"] = comm.calls if comm is not None else 0
    finally:
        engine.runner.close()
    return out


def _allreduce_rank(rank: int, kind: str, core: int, where: str, results) -> None:
    import torch

    from engine.parallel.comm import ShmComm, TorchComm

    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    if kind == "shm":
        comm = ShmComm(where, rank, 2, 4 << 20, create=rank == 0) if rank == 0 else None
        if rank == 1:
            while not os.path.exists(where):
                time.sleep(0.01)
            time.sleep(0.1)
            comm = ShmComm(where, 1, 2, 4 << 20)
    else:
        comm = TorchComm(f"file://{where}", rank, 2, torch.device("cpu"))
    calls = 2000 if kind == "shm" else 500
    for dtype in (torch.bfloat16, torch.float32):
        for rows in (1, 16, 256):
            x = torch.full((rows, 768), rank + 1.0, dtype=dtype)
            for _ in range(50):
                comm.all_reduce(x)
            t0 = time.perf_counter()
            for _ in range(calls):
                comm.all_reduce(x)
            us = (time.perf_counter() - t0) / calls * 1e6
            x.fill_(rank + 1.0)
            comm.all_reduce(x)
            if rank == 0:
                results.put({"comm": kind, "dtype": str(dtype).removeprefix("torch."), "rows": rows,
                             "us_per_call": round(us, 1), "sum_ok": bool((x == 3.0).all())})
    comm.close()


def allreduce(out: Path, cores: tuple[int, ...]) -> int:
    import multiprocessing as mp
    import tempfile

    ctx = mp.get_context("spawn")
    rows = []
    for kind in ("shm", "gloo"):
        results = ctx.Queue()
        where = (f"/dev/shm/tandem-bench-{os.getpid()}" if kind == "shm"
                 else tempfile.mkdtemp(prefix="tandem-bench-") + "/store")
        procs = [ctx.Process(target=_allreduce_rank, args=(r, kind, cores[r % len(cores)], where, results))
                 for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        while not results.empty():
            rows.append(results.get())
        if kind == "shm" and os.path.exists(where):
            os.unlink(where)
    out.mkdir(parents=True, exist_ok=True)
    (out / "allreduce.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = [f"# all-reduce between two ranks, a core each ({cpu_name()}, cores {','.join(map(str, cores[:2]))})", "",
             "| comm | dtype | rows of 768 | us a call | sum right |", "|---|---|---|---|---|"]
    lines += [f"| {r['comm']} | {r['dtype']} | {r['rows']} | {r['us_per_call']} | {r['sum_ok']} |" for r in rows]
    (out / "allreduce.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if rows and all(r["sum_ok"] for r in rows) else 1


def cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lab.tp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?")
    p.add_argument("out", type=Path, nargs="?")
    p.add_argument("--allreduce", type=Path, default=None, metavar="OUT", help="the collective alone (see above)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--cores", default=",".join(map(str, sorted(os.sched_getaffinity(0)))))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)  # a child: one run of this TP size
    p.add_argument("--whole-head", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ep", action="store_true", help=argparse.SUPPRESS)  # a child: with expert parallelism
    p.add_argument("--experts", action="store_true", help="a mixture of experts: its experts split against "
                   "expert parallel (see above)")
    p.add_argument("--write-moe", type=Path, default=None, metavar="DIR", help="write the random MoE (see above)")
    a = p.parse_args(argv)
    cores = tuple(int(c) for c in a.cores.split(","))
    if a.allreduce is not None:
        return allreduce(a.allreduce, cores)
    if a.write_moe is not None:
        write_moe(a.write_moe)
        return 0
    if a.model is None or a.out is None:
        p.error("MODEL_DIR and OUT are needed (or --allreduce OUT)")
    if a.one:
        print(json.dumps(run_once(a.model, a.one, a.dtype, cores, a.batch, a.prompt_len, a.output_len,
                                  not a.whole_head, a.ep)))
        return 0
    import subprocess

    a.out.mkdir(parents=True, exist_ok=True)
    runs = []
    for r in range(a.rounds):
        configs = ((1, False, False), (2, False, False), (2, False, True)) if a.experts else (
            (1, False, False), (2, False, False), (2, True, False))
        for tp, whole, ep in configs:  # each run a process of its own
            cmd = [sys.executable, "-m", "bench.lab.tp", a.model, str(a.out), "--dtype", a.dtype, "--cores", a.cores,
                   "--batch", str(a.batch), "--prompt-len", str(a.prompt_len), "--output-len", str(a.output_len),
                   "--one", str(tp), *(["--whole-head"] if whole else []), *(["--ep"] if ep else [])]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
            if done.returncode != 0:
                print(done.stderr[-3000:], file=sys.stderr)
                return 1
            run = json.loads(done.stdout.strip().splitlines()[-1])
            run["round"] = r
            runs.append(run)
            print(json.dumps(run), flush=True)
    (a.out / "runs.json").write_text(json.dumps(runs, indent=1) + "\n")
    if a.experts:
        return experts_report(a, runs)
    lines = [f"# tensor parallelism offline: {Path(a.model).name}, {a.dtype}", "",
             f"Machine: {cpu_name()}, cores {a.cores}; {a.rounds} rounds, TP=1 and TP=2 in turn, "
             "each a process.",
             f"Loads: one stream of {a.prompt_len} in / {a.output_len} out; a batch of {a.batch} such requests "
             "at once.",
             "Decode steps only (the prefill step excluded). all-reduce share: rank 0's seconds in collectives "
             "(all-reduces; waits for rank 1 included) over its decode seconds. LM head: split by vocabulary "
             "(its logits gathered on rank 0) or whole on every rank (rank 0 alone computes it).", "",
             "| TP | LM head | threads a rank | one stream ms/token | its all-reduce share | batch tok/s "
             "| its all-reduce share |",
             "|---|---|---|---|---|---|---|"]
    for tp, head in ((1, "whole"), (2, "vocab-parallel"), (2, "whole")):
        mine = [x for x in runs if x["tp"] == tp and x["head"] == head]
        ms = [x["one_stream"]["ms_per_step"] for x in mine]
        bt = [x["batch"]["tokens_per_s"] for x in mine]
        s1 = [x["one_stream"]["allreduce_share"] for x in mine]
        sb = [x["batch"]["allreduce_share"] for x in mine]
        lines.append(f"| {tp} | {head} | {mine[0]['threads_per_rank']} | {' / '.join(f'{v:.2f}' for v in ms)} "
                     f"(median {statistics.median(ms):.2f}) | {' / '.join(f'{v:.1%}' for v in s1)} | "
                     f"{' / '.join(f'{v:.0f}' for v in bt)} (median {statistics.median(bt):.0f}) | "
                     f"{' / '.join(f'{v:.1%}' for v in sb)} |")
    return _report(a.out, lines)


def _report(out: Path, lines: list[str]) -> int:
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def experts_report(a, runs: list[dict]) -> int:
    lines = [f"# a mixture of experts, offline: {Path(a.model).name}, {a.dtype}", "",
             f"Machine: {cpu_name()}, cores {a.cores}; {a.rounds} rounds, the three configurations in turn, "
             "each a process.",
             f"Loads: one stream of {a.prompt_len} in / {a.output_len} out; a batch of {a.batch} such requests "
             "at once. Decode steps only.",
             "Experts: whole (one rank), split (TP=2: each rank half of every expert's intermediate size), "
             "expert-parallel (TP=2 with --enable-expert-parallel: half the experts whole on each rank). "
             "routing share: rank 0's router, top-k and grouping by expert over its decode seconds (the dispatch); "
             "all-reduce share: its seconds in collectives, waits for rank 1 included (the combine, and "
             "attention's).", "",
             "| TP | experts | one stream ms/token | routing | all-reduce | batch tok/s | routing | all-reduce |",
             "|---|---|---|---|---|---|---|---|"]
    for tp, kind in ((1, "whole"), (2, "split"), (2, "expert-parallel")):
        mine = [x for x in runs if x["tp"] == tp and x["experts"] == kind]
        ms = [x["one_stream"]["ms_per_step"] for x in mine]
        bt = [x["batch"]["tokens_per_s"] for x in mine]

        def share(load, key, mine=mine):
            return " / ".join(f"{x[load][key]:.1%}" for x in mine)

        lines.append(f"| {tp} | {kind} | {' / '.join(f'{v:.2f}' for v in ms)} (median {statistics.median(ms):.2f}) "
                     f"| {share('one_stream', 'routing_share')} | {share('one_stream', 'allreduce_share')} "
                     f"| {' / '.join(f'{v:.0f}' for v in bt)} (median {statistics.median(bt):.0f}) "
                     f"| {share('batch', 'routing_share')} | {share('batch', 'allreduce_share')} |")
    return _report(a.out, lines)


if __name__ == "__main__":
    sys.exit(main())
