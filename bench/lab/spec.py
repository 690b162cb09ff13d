"""Speculative decoding: output tokens a second and ms a token, with each proposer, fixed
and adaptive, at concurrency 1, 4, 16 and 64, on two workloads.

    python -m bench.lab.spec [--concurrency 1,4,16,64] [--methods off,ngram,...] [--max-tokens 128]
                         [--rounds 3] [--threads N] [--json PATH|-] [--markdown PATH]

The LLMEngine is stepped directly (no HTTP, no router), greedy, ignore_eos, on the
built-in pair (tandem-tiny-v2 and its draft). Each run keeps `c` requests in flight
(closed loop: a finished request is replaced at once) until max(2c, 8) have finished.
Within a run the requests' prompts are distinct (64 of each workload, reused only at
c=64's second wave), and suffix decoding's shared history is emptied before each run.
Workloads, from the stdlib files held out of the built-in model's training:
- `code`: a file's first ~200 tokens, cut at a line's end; the model continues it.
- `repeat`: "edit or repeat this code": a held-out function, then a comment asking for
  it again and its first line with a new name; the model repeats the body.
Figures: output tok/s over the run (all tokens / wall time), ms a token for a request
(its decode time / its tokens after the first, median over requests), acceptance
(accepted / drafted tokens) and mean accepted length (tokens a verified draft step
emits). Methods: off; ngram, suffix and draft with K fixed (4); and each with the
adaptive policy (engine/spec_policy.py): `adaptive-<method>`.

The shared machine's speed drifts by 10-20% between runs seconds apart, more than the
differences measured, so every engine is built once and the runs interleave: each round
runs every method at one (workload, concurrency) in turn, the order rotating each round,
and the table gives each figure's median over --rounds rounds with the ratio to `off`
taken within each round (then the median of those ratios).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time

from bench.lab.sweep import machine_info

METHODS = ("off", "ngram", "suffix", "draft", "adaptive-ngram", "adaptive-suffix", "adaptive-draft")


def workloads(tokenizer, n: int = 64) -> dict[str, list[list[int]]]:
    """Prompts from the held-out stdlib files (bench/lab/train_builtin.py)."""
    from bench.lab.train_builtin import stdlib_files

    held = [(rel, text) for rel, text, h in stdlib_files() if h]
    code, repeat = [], []
    for rel, text in held:
        ids = tokenizer.encode(text)
        if len(ids) > 260:
            cut = tokenizer.decode(ids[1:200])
            cut = cut[: cut.rfind("\n") + 1] or cut
            code.append(tokenizer.encode(cut))
        for m in re.finditer(r"^def (\w+)\(.*?(?=^\S|\Z)", text, re.M | re.S):
            body = m.group(0).rstrip()
            if 80 <= len(tokenizer.encode(body)) <= 400:
                first = body.splitlines()[0].replace(m.group(1), m.group(1) + "_copy", 1)
                repeat.append(tokenizer.encode(f"{body}\n\n\n# the same function again, renamed:\n{first}\n"))
                break
    return {"code": (code * n)[:n], "repeat": (repeat * n)[:n]}


def run(engine, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    total = max(2 * concurrency, 8)
    queue = [prompts[i % len(prompts)] for i in range(total)]
    started: dict[str, float] = {}
    first: dict[str, float] = {}
    per_token_ms: list[float] = []
    tokens = 0
    spec = engine.spec
    before = (spec.stats.num_draft_tokens, spec.stats.num_accepted_tokens, spec.stats.num_drafts) if spec else None
    if spec is not None and hasattr(spec.proposer, "forget_history"):
        spec.proposer.forget_history()  # suffix: learn within this run only, not from earlier runs' outputs
    t0 = time.perf_counter()
    nxt = 0
    while nxt < total or engine.has_work():
        while nxt < total and len(engine.seqs) < concurrency:
            rid = f"r{nxt}"
            engine.add_request(rid, queue[nxt], params)
            started[rid] = time.perf_counter()
            nxt += 1
        for ev in engine.step():
            now = time.perf_counter()
            if ev.token_id is not None:
                tokens += 1
                first.setdefault(ev.seq_id, now)
            if ev.finished:
                n = ev.completion_tokens
                if n > 1:
                    per_token_ms.append((now - first[ev.seq_id]) * 1e3 / (n - 1))
    wall = time.perf_counter() - t0
    out = {"concurrency": concurrency, "requests": total, "output_tokens": tokens,
           "tok_s": round(tokens / wall, 1), "ms_per_token_p50": round(statistics.median(per_token_ms), 3)}
    if spec:
        drafted = spec.stats.num_draft_tokens - before[0]
        kept = spec.stats.num_accepted_tokens - before[1]
        drafts = spec.stats.num_drafts - before[2]
        out |= {"draft_tokens": drafted, "acceptance": round(kept / drafted, 3) if drafted else None,
                "mean_accepted_length": round(1 + kept / drafts, 2) if drafts else None}
    engine.check_integrity()
    return out


def make_engine(method: str, k: int, threads: int):
    import torch

    from decode_worker.llm_engine import LLMEngine
    from engine.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig, SpeculativeConfig

    torch.set_num_threads(threads)
    adaptive = method.startswith("adaptive-")
    base = method.removeprefix("adaptive-")
    spec = SpeculativeConfig() if base == "off" else SpeculativeConfig(method=base, num_speculative_tokens=k,
                                                                       adaptive=adaptive)
    cfg = EngineConfig(cache=CacheConfig(kv_cache_memory_gb=0.25),
                       scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=2048),
                       device=DeviceConfig(num_threads=threads), speculative=spec)
    return LLMEngine.from_config(cfg)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--workloads", default="code,repeat")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the results here (- for stdout)")
    ap.add_argument("--markdown", default=None, help="write a table here")
    args = ap.parse_args(argv)
    conc = [int(c) for c in args.concurrency.split(",")]
    methods = args.methods.split(",")
    engines = {m: make_engine(m, args.k, args.threads) for m in methods}
    prompts = workloads(next(iter(engines.values())).checkpoint.tokenizer)
    for e in engines.values():
        run(e, prompts["code"][:4], 4, 16)  # warm-up (and the adaptive policy's first steps)
    rows = []
    for wl in args.workloads.split(","):
        for c in conc:
            runs: dict[str, list[dict]] = {m: [] for m in methods}
            for r in range(args.rounds):
                order = methods[r % len(methods):] + methods[: r % len(methods)]
                for m in order:
                    runs[m].append(run(engines[m], prompts[wl], c, args.max_tokens))
            for m in methods:
                rows.append(_summary(m, wl, c, runs[m], runs.get("off")))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    out = {"bench": "spec", "machine": machine_info(), "threads": args.threads, "k": args.k,
           "max_tokens": args.max_tokens, "rounds": args.rounds, "rows": rows}
    if args.json == "-":
        json.dump(out, sys.stdout, indent=2)
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(out))
    return 0


def _summary(method: str, wl: str, c: int, runs: list[dict], off: list[dict] | None) -> dict:
    med = statistics.median
    row = {"method": method, "workload": wl, "concurrency": c, "rounds": len(runs),
           "tok_s": round(med(r["tok_s"] for r in runs), 1),
           "tok_s_range": [min(r["tok_s"] for r in runs), max(r["tok_s"] for r in runs)],
           "ms_per_token_p50": round(med(r["ms_per_token_p50"] for r in runs), 3)}
    if off:
        row["speedup_tok_s"] = round(med(r["tok_s"] / o["tok_s"] for r, o in zip(runs, off)), 3)
        row["speedup_ms_per_token"] = round(med(o["ms_per_token_p50"] / r["ms_per_token_p50"]
                                                for r, o in zip(runs, off)), 3)
    if "draft_tokens" in runs[0]:
        drafted = sum(r["draft_tokens"] for r in runs)
        row["draft_tokens"] = drafted
        acc = [r["acceptance"] for r in runs if r["acceptance"] is not None]
        mal = [r["mean_accepted_length"] for r in runs if r["mean_accepted_length"] is not None]
        row["acceptance"] = round(med(acc), 3) if acc else None
        row["mean_accepted_length"] = round(med(mal), 2) if mal else None
    return row


def markdown(out: dict) -> str:
    rows = out["rows"]
    lines = [f"# Speculative decoding, {out['machine']['cpu_model']}, {out['threads']} threads, K={out['k']}, "
             f"{out['max_tokens']} tokens a request, greedy; medians of {out.get('rounds', 1)} interleaved rounds\n",
             "`vs off`: the median over rounds of the ratio to `off` in the same round (tok/s: higher is better; "
             "ms/token: off's over this one's, so higher is better too).\n"]
    for wl in sorted({r["workload"] for r in rows}):
        lines += [f"\n## {wl}\n", "| method | c | out tok/s (range) | vs off | ms/token p50 | vs off | acceptance | "
                  "mean accepted length |", "|---|---|---|---|---|---|---|---|"]
        for r in (r for r in rows if r["workload"] == wl):
            lo, hi = r["tok_s_range"]
            acc = "" if r.get("acceptance") is None else r["acceptance"]
            mal = "" if r.get("mean_accepted_length") is None else r["mean_accepted_length"]
            lines.append(f"| {r['method']} | {r['concurrency']} | {r['tok_s']} ({lo:.0f}-{hi:.0f}) | "
                         f"{r.get('speedup_tok_s', 1.0):.2f}x | {r['ms_per_token_p50']} | "
                         f"{r.get('speedup_ms_per_token', 1.0):.2f}x | {acc} | {mal} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
