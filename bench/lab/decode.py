"""Decode-worker benchmarks on the built-in model (or --model DIR), engine-side timing.

    python -m bench.lab.decode [batching|interference|vllm|all] [--quick] [--json PATH|-]
                           [--threads N] [--model DIR] [section options]

batching      Offline `LLM.generate` with scheduler="continuous" vs "static" on a
              long-tailed output-length workload: N requests, random prompts of
              --prompt-len tokens, output lengths lognormal (median --median-out, sigma
              --sigma, clipped to [1, --max-out], seeded), ignore_eos so every request
              produces exactly its length; at most --max-num-seqs running. Output tok/s,
              requests/s, wall time, engine steps; ratio = continuous / static.

interference  ITL of running decode streams while long prompts arrive. --streams
              streams (prompt --stream-prompt-len, --stream-tokens output tokens each)
              decode; once all have their first token, a --long-prompt-len-token prompt
              arrives every --interval seconds (wall clock) until they finish. The
              LLMEngine is stepped directly; a token's time is the end of the step that
              produced it. ITL = gap between consecutive tokens of one stream, counted
              from the moment every stream is decoding. A prompt never arrives while
              the previous one still waits for its first token (on a machine too slow
              for --interval, arrivals space out instead of piling up; the count is
              reported). Run twice: chunked prefill
              (max_num_batched_tokens = --chunk) and unchunked (the whole prompt in one
              step). Reports ITL p50/p99/max, the long prompts' TTFT, and the ratios.

vllm          Offline generation throughput, tandem vs vLLM's CPU build, on the same
              checkpoint: --num-prompts random prompts of --input-len token ids,
              --output-len tokens each, greedy, ignore_eos (the side by side's
              workload). tandem runs `LLM.generate` in this process; vLLM runs
              `LLM.generate` in a subprocess of --venv's python with the tuned CPU
              settings of bench/lab/peers.py. Only generate() is timed, after a short
              warm-up generate, never start-up. One row per engine and --dtypes entry;
              ratio = tandem / vLLM output tok/s at the same dtype; `same` = fraction
              of requests whose greedy outputs are identical in both engines.
              --repeats N times each engine's generate on N distinct prompt sets (one
              start-up) and reports the median wall time.

On a shared or busy machine use --threads 1: with torch's default OpenMP runtime (libgomp)
every parallel region waits for a descheduled thread, and 2-thread runs of tandem slowed
down up to 10x under load, while vLLM, which preloads tcmalloc and its libiomp5, did not.
To give tandem the same runtime, start this command with the same LD_PRELOAD (the JSON's
environment records it).

all (default) runs the three in that order. --quick shrinks every section to a smoke
run (the vllm section still pays vLLM's start-up, 20-100 s, with enforce_eager).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from bench import metrics
from bench.lab.engine import (
    DTYPE_ALIASES,
    TOKEN_LOW,
    _log,
    default_threads,
    environment,
    format_table,
    set_threads,
    warn_if_busy,
    write_json,
)
from bench.lab.peers import DEFAULT_VENV

SECTIONS = ("batching", "interference", "vllm")
Log = Callable[..., None]


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """n distinct prompts of ordinary token ids (no prefix-cache hits between them)."""
    rng = np.random.default_rng(seed)
    return rng.integers(TOKEN_LOW, vocab, size=(n, length)).tolist()


def lognormal_lengths(n: int, median: float, sigma: float, max_len: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    x = rng.lognormal(mean=math.log(median), sigma=sigma, size=n)
    return np.clip(np.rint(x), 1, max_len).astype(int).tolist()


def percentile(xs: list[float], q: float) -> float | None:
    return metrics.percentile(xs, q) if xs else None


def _vocab(model: str | None) -> int:
    """Token ids for random prompts: the tokenizer's ordinary ids (and within the model's)."""
    from engine.models.builtin import builtin_model_path
    from engine.models.checkpoint import load_checkpoint

    ckpt = load_checkpoint(model or builtin_model_path())
    return min(ckpt.tokenizer.vocab_size, ckpt.config.vocab_size)


def _greedy(max_tokens: int):
    from engine.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


# ---- 1. continuous vs static batching -------------------------------------------------
@dataclass
class BatchingArgs:
    num_requests: int = 256
    prompt_len: int = 128
    median_out: float = 32
    sigma: float = 1.0
    max_out: int = 512
    max_num_seqs: int = 32
    seed: int = 0


def run_batching(a: BatchingArgs, model: str | None, dtype: str | None, threads: int, log: Log = _log) -> dict:
    from decode_worker.llm import LLM

    vocab = _vocab(model)
    prompts = random_prompts(a.num_requests, a.prompt_len, vocab, a.seed)
    lengths = lognormal_lengths(a.num_requests, a.median_out, a.sigma, a.max_out, a.seed + 1)
    params = [_greedy(n) for n in lengths]
    out_tokens = sum(lengths)
    log(
        f"[batching] {a.num_requests} requests x {a.prompt_len} prompt tokens, output lengths "
        f"median {statistics.median(lengths):g}, mean {statistics.mean(lengths):.1f}, max {max(lengths)}, "
        f"total {out_tokens}; max_num_seqs {a.max_num_seqs}"
    )
    rows = []
    backend = None
    for policy in ("continuous", "static"):
        llm = LLM(model, dtype=dtype, scheduler=policy, max_num_seqs=a.max_num_seqs, num_threads=threads, seed=0)
        backend = llm.engine.runner.backend.name
        llm.generate(random_prompts(2, a.prompt_len, vocab, a.seed + 99), _greedy(4), use_tqdm=False)  # warm-up
        steps0 = llm.engine.stats.num_steps
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        got = [len(o.outputs[0].token_ids) for o in outs]
        if got != lengths:
            raise RuntimeError(f"[batching/{policy}] output lengths differ from the workload's (ignore_eos broken?)")
        steps = llm.engine.stats.num_steps - steps0
        rows.append(
            {
                "scheduler": policy,
                "wall_s": wall,
                "output_tok_s": out_tokens / wall,
                "requests_s": a.num_requests / wall,
                "steps": steps,
                "mean_tokens_per_step": (out_tokens + a.num_requests * a.prompt_len) / steps,
            }
        )
        log(f"[batching] {policy}: {wall:.2f} s, {out_tokens / wall:.0f} output tok/s, {steps} steps")
        del llm, outs
        gc.collect()
    cont, stat = rows
    return {
        "settings": asdict(a),
        "attention_backend": backend,
        "output_tokens": out_tokens,
        "rows": rows,
        "ratio": cont["output_tok_s"] / stat["output_tok_s"],
    }


def render_batching(r: dict) -> str:
    s = r["settings"]
    head = (
        f"== batching: {s['num_requests']} requests, prompt {s['prompt_len']}, output lognormal median "
        f"{s['median_out']:g} sigma {s['sigma']:g} max {s['max_out']} ({r['output_tokens']} tokens), "
        f"max_num_seqs {s['max_num_seqs']}, attention {r['attention_backend']} =="
    )
    table = format_table(
        ["scheduler", "output tok/s", "requests/s", "wall s", "steps"],
        [[x["scheduler"], x["output_tok_s"], x["requests_s"], x["wall_s"], x["steps"]] for x in r["rows"]],
    )
    return f"{head}\n{table}\ncontinuous / static throughput: {r['ratio']:.2f}x"


# ---- 2. ITL under long-prompt arrivals -----------------------------------------------
@dataclass
class InterferenceArgs:
    streams: int = 32
    stream_prompt_len: int = 128
    stream_tokens: int = 256
    long_prompt_len: int = 2048
    long_output: int = 1
    interval: float = 0.5
    chunk: int = 512
    max_model_len: int = 4096
    seed: int = 0


def _interference_once(a: InterferenceArgs, chunked: bool, model: str | None, dtype: str | None, vocab: int) -> dict:
    from decode_worker.llm_engine import LLMEngine
    from engine.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig

    max_len = max(a.max_model_len, a.long_prompt_len + a.long_output + 1, a.stream_prompt_len + a.stream_tokens + 1)
    sched = SchedulerConfig(
        max_num_seqs=a.streams + 64,
        max_model_len=max_len,
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=a.chunk if chunked else max_len,
    )
    # Streams, plus the long prompts that can be alive at once: one waits for its first
    # token at a time, and each decodes --long-output tokens after it.
    longs_alive = min(64, 1 + a.long_output)
    blocks_needed = (
        a.streams * math.ceil((a.stream_prompt_len + a.stream_tokens) / 16)
        + longs_alive * math.ceil((a.long_prompt_len + a.long_output) / 16)
        + 64
    )
    config = EngineConfig(
        model=model,
        dtype=dtype,
        scheduler=sched,
        cache=CacheConfig(num_blocks=blocks_needed, enable_prefix_caching=False),
        device=DeviceConfig(num_threads=None),
        seed=0,
    )
    engine = LLMEngine.from_config(config)
    backend = engine.runner.backend.name

    def drain() -> None:
        while engine.has_work():
            engine.step()

    # Warm-up: one long prompt and one short one, so first-use costs are not measured.
    warm = random_prompts(2, a.long_prompt_len, vocab, a.seed + 1000)
    engine.add_request("warm-long", warm[0], _greedy(2))
    engine.add_request("warm-short", warm[1][: a.stream_prompt_len], _greedy(4))
    drain()

    prompts = random_prompts(a.streams, a.stream_prompt_len, vocab, a.seed)
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, _greedy(a.stream_tokens))
    last: dict[str, float] = {}
    done: set[str] = set()
    itl: list[float] = []
    measure_from: float | None = None
    long_added: dict[str, float] = {}
    ttft: dict[str, float] = {}
    next_arrival = math.inf
    long_rng = np.random.default_rng(a.seed + 2000)
    steps = 0
    t_start = time.perf_counter()
    while engine.has_work():
        now = time.perf_counter()
        in_flight = len(long_added) > len(ttft)
        if measure_from is not None and len(done) < a.streams and now >= next_arrival and not in_flight:
            rid = f"long{len(long_added)}"
            engine.add_request(
                rid, long_rng.integers(TOKEN_LOW, vocab, a.long_prompt_len).tolist(), _greedy(a.long_output)
            )
            long_added[rid] = now
            next_arrival = now + a.interval
        events = engine.step()
        steps += 1
        ts = time.perf_counter()
        for ev in events:
            if ev.error:
                raise RuntimeError(f"[interference] {ev.seq_id}: {ev.error}")
            if ev.seq_id in long_added:
                if ev.token_id is not None and ev.seq_id not in ttft:
                    ttft[ev.seq_id] = ts - long_added[ev.seq_id]
                continue
            if ev.token_id is not None:
                prev = last.get(ev.seq_id)
                if prev is not None and measure_from is not None and prev >= measure_from:
                    itl.append(ts - prev)
                last[ev.seq_id] = ts
            if ev.finished:
                done.add(ev.seq_id)
        if measure_from is None and len(last) == a.streams:
            measure_from = ts  # every stream is decoding: the clock of arrivals starts
            next_arrival = ts  # the first long prompt arrives at once
    wall = time.perf_counter() - t_start
    missing = set(long_added) - set(ttft)
    if missing:
        raise RuntimeError(f"[interference] long prompts without a first token: {sorted(missing)}")
    ttfts = list(ttft.values())
    return {
        "chunked": chunked,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "attention_backend": backend,
        "itl_count": len(itl),
        "itl_p50_ms": percentile(itl, 50) * 1e3,
        "itl_p99_ms": percentile(itl, 99) * 1e3,
        "itl_max_ms": max(itl) * 1e3,
        "itl_mean_ms": statistics.mean(itl) * 1e3,
        "long_prompts": len(ttfts),
        "long_ttft_p50_ms": percentile(ttfts, 50) * 1e3 if ttfts else None,
        "long_ttft_max_ms": max(ttfts) * 1e3 if ttfts else None,
        "steps": steps,
        "wall_s": wall,
    }


def run_interference(a: InterferenceArgs, model: str | None, dtype: str | None, threads: int, log: Log = _log) -> dict:
    set_threads(threads)
    vocab = _vocab(model)
    log(
        f"[interference] {a.streams} streams x {a.stream_tokens} tokens; a {a.long_prompt_len}-token prompt "
        f"every {a.interval:g} s; chunk {a.chunk}"
    )
    rows = []
    for chunked in (True, False):
        r = _interference_once(a, chunked, model, dtype, vocab)
        log(
            f"[interference] {'chunked' if chunked else 'unchunked'}: ITL p50 {r['itl_p50_ms']:.1f} ms, "
            f"p99 {r['itl_p99_ms']:.1f} ms, max {r['itl_max_ms']:.1f} ms; {r['long_prompts']} long prompts, "
            f"TTFT p50 {r['long_ttft_p50_ms'] or 0:.0f} ms"
        )
        rows.append(r)
        gc.collect()
    ch, un = rows

    def ratio(key: str) -> float | None:
        return un[key] / ch[key] if ch[key] and un[key] else None

    return {
        "settings": asdict(a),
        "rows": rows,
        "ratios_unchunked_over_chunked": {
            k: ratio(k) for k in ("itl_p50_ms", "itl_p99_ms", "itl_max_ms", "long_ttft_p50_ms")
        },
    }


def render_interference(r: dict) -> str:
    s = r["settings"]
    head = (
        f"== interference: {s['streams']} streams x {s['stream_tokens']} tokens (prompt {s['stream_prompt_len']}); "
        f"a {s['long_prompt_len']}-token prompt every {s['interval']:g} s; attention "
        f"{r['rows'][0]['attention_backend']} =="
    )
    table = format_table(
        [
            "prefill",
            "budget",
            "ITL p50 ms",
            "ITL p99 ms",
            "ITL max ms",
            "ITLs",
            "long prompts",
            "long TTFT p50 ms",
            "long TTFT max ms",
        ],
        [
            [
                "chunked" if x["chunked"] else "whole",
                x["max_num_batched_tokens"],
                x["itl_p50_ms"],
                x["itl_p99_ms"],
                x["itl_max_ms"],
                x["itl_count"],
                x["long_prompts"],
                x["long_ttft_p50_ms"],
                x["long_ttft_max_ms"],
            ]
            for x in r["rows"]
        ],
    )
    q = r["ratios_unchunked_over_chunked"]
    fmt = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
    return (
        f"{head}\n{table}\nunchunked / chunked: ITL p50 {fmt(q['itl_p50_ms'])}, p99 {fmt(q['itl_p99_ms'])}, "
        f"max {fmt(q['itl_max_ms'])}; long-prompt TTFT p50 {fmt(q['long_ttft_p50_ms'])}"
    )


# ---- 3. tandem vs vLLM CPU, offline -------------------------------------------------
@dataclass
class VllmArgs:
    num_prompts: int = 200
    input_len: int = 256
    output_len: int = 128
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    venv: str = DEFAULT_VENV
    max_model_len: int = 2048
    kv_cache_gib: int = 4
    timeout_s: float = 900.0
    enforce_eager: bool = False
    repeats: int = 1
    seed: int = 0


# Runs under the vLLM venv's python: no tandem imports. Prompts and settings come in a
# JSON file; the result goes to another.
VLLM_CHILD = textwrap.dedent("""
    import json, sys, time

    def main():
        args = json.load(open(sys.argv[1]))
        t0 = time.perf_counter()
        import vllm
        from vllm import LLM, SamplingParams
        llm = LLM(model=args["model"], dtype=args["dtype"], max_model_len=args["max_model_len"], seed=0,
                  enforce_eager=args["enforce_eager"])
        startup = time.perf_counter() - t0
        sp = SamplingParams(temperature=0.0, max_tokens=args["output_len"], ignore_eos=True)
        warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in args["warmup_prompts"]], warm, use_tqdm=False)
        walls, first = [], None
        for prompt_set in args["prompt_sets"]:
            prompts = [{"prompt_token_ids": p} for p in prompt_set]
            t1 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            walls.append(time.perf_counter() - t1)
            first = first or [list(o.outputs[0].token_ids) for o in outs]
        json.dump({"walls_s": walls, "startup_s": startup, "version": vllm.__version__, "outputs": first},
                  open(args["out"], "w"))

    if __name__ == "__main__":
        main()
""")


def _vllm_env(model: str, a: VllmArgs, threads: int) -> dict[str, str]:
    from bench.lab.peers import VllmConfig, VllmServer

    env = VllmServer(VllmConfig(model=model, venv=a.venv, kv_cache_gib=a.kv_cache_gib)).env()
    if threads < default_threads():  # the same core count as tandem
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


def run_vllm_child(
    model: str,
    dtype: str,
    prompt_sets: list[list[list[int]]],
    warmup_prompts: list[list[int]],
    a: VllmArgs,
    threads: int,
    log: Log = _log,
) -> dict:
    """vLLM's offline generate of each prompt set in a subprocess: wall seconds of each
    (`walls_s`), start-up seconds, version, and the outputs of the first set."""
    with tempfile.TemporaryDirectory(prefix="tandem-bench-vllm-") as tmp:
        tmp_p = Path(tmp)
        (tmp_p / "child.py").write_text(VLLM_CHILD)
        out = tmp_p / "result.json"
        (tmp_p / "args.json").write_text(
            json.dumps(
                {
                    "model": model,
                    "dtype": dtype,
                    "max_model_len": a.max_model_len,
                    "output_len": a.output_len,
                    "enforce_eager": a.enforce_eager,
                    "prompt_sets": prompt_sets,
                    "warmup_prompts": warmup_prompts,
                    "out": str(out),
                }
            )
        )
        logf = tmp_p / "vllm.log"
        with open(logf, "wb") as lf:
            proc = subprocess.Popen(
                [f"{a.venv}/bin/python", str(tmp_p / "child.py"), str(tmp_p / "args.json")],
                env=_vllm_env(model, a, threads),
                cwd=tmp,
                stdout=lf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            try:
                rc = proc.wait(timeout=a.timeout_s)
            except subprocess.TimeoutExpired:
                rc = None
            finally:
                if proc.poll() is None or rc is None:
                    _kill_group(proc)
        if rc != 0 or not out.is_file():
            tail = "\n".join(logf.read_text(errors="replace").splitlines()[-25:])
            why = "timed out" if rc is None else f"exited with {rc}"
            raise RuntimeError(f"vLLM ({dtype}) {why}; last log lines:\n{tail}")
        return json.loads(out.read_text())


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, to the child's own session (vLLM's engine-core processes too)."""
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_tandem_offline(
    model: str | None,
    dtype: str,
    prompt_sets: list[list[list[int]]],
    warmup_prompts: list[list[int]],
    output_len: int,
    threads: int,
) -> dict:
    """tandem's offline generate of each prompt set, in this process; like run_vllm_child."""
    from decode_worker.llm import LLM

    llm = LLM(model, dtype=dtype, num_threads=threads, seed=0)
    backend = llm.engine.runner.backend.name
    llm.generate(warmup_prompts, _greedy(8), use_tqdm=False)
    walls, first = [], None
    for prompts in prompt_sets:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, _greedy(output_len), use_tqdm=False)
        walls.append(time.perf_counter() - t0)
        first = first or [o.outputs[0].token_ids for o in outs]
    result = {"walls_s": walls, "attention_backend": backend, "outputs": first}
    del llm
    gc.collect()
    return result


def run_vllm(a: VllmArgs, model: str | None, threads: int, log: Log = _log, tandem_only: bool = False) -> dict:
    from engine.models.builtin import builtin_model_path

    path = str(model or builtin_model_path())
    vocab = _vocab(model)
    # A fresh prompt set per repeat: neither engine's prefix cache can help.
    prompt_sets = [random_prompts(a.num_prompts, a.input_len, vocab, a.seed + 1000 * r) for r in range(a.repeats)]
    warmup_prompts = random_prompts(4, a.input_len, vocab, a.seed + 1)
    n_out = a.num_prompts * a.output_len
    n_in = a.num_prompts * a.input_len
    log(
        f"[vllm] {a.num_prompts} prompts x {a.input_len} tokens -> {a.output_len} tokens, greedy, ignore_eos; "
        f"{threads} threads; model {path}"
    )
    rows: list[dict] = []
    skipped = None
    if not tandem_only and not Path(a.venv, "bin", "python").is_file():
        skipped = f"no python in {a.venv}/bin: vLLM not installed (docs/bench.md)"
        log(f"[vllm] skipping vLLM: {skipped}")
    for dtype in a.dtypes:
        ours = run_tandem_offline(model, dtype, prompt_sets, warmup_prompts, a.output_len, threads)
        _check_lengths("tandem", ours["outputs"], a.output_len)
        rows.append(_row("tandem", dtype, ours["walls_s"], n_in, n_out, attention_backend=ours["attention_backend"]))
        log(f"[vllm] tandem {dtype}: {_walls(ours)}, {rows[-1]['output_tok_s']:.0f} output tok/s")
        if tandem_only or skipped:
            continue
        try:
            theirs = run_vllm_child(path, dtype, prompt_sets, warmup_prompts, a, threads, log)
        except RuntimeError as e:
            log(f"[vllm] {e}")
            rows.append({"engine": "vllm", "dtype": dtype, "error": str(e).splitlines()[0]})
            continue
        _check_lengths("vllm", theirs["outputs"], a.output_len)
        same = sum(x == y for x, y in zip(ours["outputs"], theirs["outputs"])) / a.num_prompts
        row = _row(
            "vllm",
            dtype,
            theirs["walls_s"],
            n_in,
            n_out,
            version=theirs["version"],
            startup_s=theirs["startup_s"],
            enforce_eager=a.enforce_eager,
        )
        rows.append(row)
        rows[-2]["ratio"] = row["wall_s"] / rows[-2]["wall_s"]
        rows[-2]["same_outputs"] = same
        log(
            f"[vllm] vLLM {theirs['version']} {dtype}: {_walls(theirs)}, {row['output_tok_s']:.0f} "
            f"output tok/s (start-up {theirs['startup_s']:.0f} s); identical greedy outputs {same:.0%}"
        )
    return {"settings": {**asdict(a), "threads": threads, "model": path}, "rows": rows, "vllm_skipped": skipped}


def _row(engine: str, dtype: str, walls: list[float], n_in: int, n_out: int, **extra: Any) -> dict:
    """Throughput from the median wall time over the repeats (all kept in `walls_s`)."""
    wall = statistics.median(walls)
    return {
        "engine": engine,
        "dtype": dtype,
        "wall_s": wall,
        "walls_s": walls,
        "output_tok_s": n_out / wall,
        "total_tok_s": (n_in + n_out) / wall,
        **extra,
    }


def _walls(result: dict) -> str:
    return "wall " + ", ".join(f"{w:.2f}" for w in result["walls_s"]) + " s"


def _check_lengths(engine: str, outputs: list[list[int]], n: int) -> None:
    bad = sum(len(o) != n for o in outputs)
    if bad:
        raise RuntimeError(f"{engine}: {bad} outputs are not {n} tokens long (ignore_eos not honoured?)")


def render_vllm(r: dict) -> str:
    s = r["settings"]
    head = (
        f"== offline generation, tandem vs vLLM CPU: {s['num_prompts']} prompts x {s['input_len']} -> "
        f"{s['output_len']} tokens, greedy, {s['threads']} threads, median of {s['repeats']} =="
    )
    rows = []
    for x in r["rows"]:
        if "error" in x:
            rows.append([x["engine"], x["dtype"], None, None, None, None, None, x["error"][:60]])
            continue
        note = (
            f"attention {x['attention_backend']}"
            if x["engine"] == "tandem"
            else f"v{x['version']}, start-up {x['startup_s']:.0f} s" + (", eager" if x.get("enforce_eager") else "")
        )
        rows.append(
            [
                x["engine"],
                x["dtype"],
                x["output_tok_s"],
                x["total_tok_s"],
                x["wall_s"],
                x.get("ratio"),
                x.get("same_outputs"),
                note,
            ]
        )
    table = format_table(
        ["engine", "dtype", "output tok/s", "total tok/s", "wall s", "tandem/vLLM", "same", "note"], rows
    )
    tail = f"\nvLLM skipped: {r['vllm_skipped']}" if r.get("vllm_skipped") else ""
    return f"{head}\n{table}{tail}"


# ---- command line -----------------------------------------------------------------
QUICK = {
    "batching": BatchingArgs(num_requests=48, prompt_len=32, median_out=8, sigma=1.0, max_out=64, max_num_seqs=8),
    "interference": InterferenceArgs(
        streams=4,
        stream_prompt_len=32,
        stream_tokens=48,
        long_prompt_len=512,
        interval=0.1,
        chunk=128,
        max_model_len=1024,
    ),
    "vllm": VllmArgs(num_prompts=32, input_len=128, output_len=32, dtypes=("bfloat16",), enforce_eager=True),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.lab.decode", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("section", nargs="?", default="all", choices=[*SECTIONS, "all"])
    p.add_argument("--quick", action="store_true", help="smoke-sized runs (explicit flags still win)")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON (- for stdout)")
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: all CPUs); vLLM gets as many cores"
    )
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: the built-in model)")
    p.add_argument(
        "--dtype",
        default=None,
        choices=sorted(DTYPE_ALIASES),
        help="batching/interference dtype (default: the checkpoint's)",
    )
    p.add_argument("--seed", type=int, default=None)
    b = p.add_argument_group("batching")
    b.add_argument("--num-requests", type=int)
    b.add_argument("--prompt-len", type=int)
    b.add_argument("--median-out", type=float)
    b.add_argument("--sigma", type=float)
    b.add_argument("--max-out", type=int)
    b.add_argument("--max-num-seqs", type=int)
    i = p.add_argument_group("interference")
    i.add_argument("--streams", type=int)
    i.add_argument("--stream-prompt-len", type=int)
    i.add_argument("--stream-tokens", type=int)
    i.add_argument("--long-prompt-len", type=int)
    i.add_argument("--long-output", type=int, help="tokens each long prompt generates (default 1)")
    i.add_argument("--interval", type=float, help="seconds between long-prompt arrivals")
    i.add_argument("--chunk", type=int, help="max_num_batched_tokens with chunked prefill")
    v = p.add_argument_group("vllm")
    v.add_argument("--num-prompts", type=int)
    v.add_argument("--input-len", type=int)
    v.add_argument("--output-len", type=int)
    v.add_argument("--dtypes", help="comma-separated, e.g. float32,bfloat16")
    v.add_argument("--venv", help=f"vLLM's virtual environment (default {DEFAULT_VENV})")
    v.add_argument("--vllm-timeout", type=float, dest="timeout_s", help="seconds per vLLM run, start-up included")
    v.add_argument("--enforce-eager", action="store_true", default=None, help="vLLM without compilation")
    v.add_argument("--repeats", type=int, help="timed generate() calls per engine and dtype (median reported)")
    v.add_argument("--tandem-only", action="store_true", help="skip the vLLM subprocess")
    args = p.parse_args(argv)
    args.batching = _fill(BatchingArgs, QUICK["batching"] if args.quick else BatchingArgs(), args)
    args.interference = _fill(InterferenceArgs, QUICK["interference"] if args.quick else InterferenceArgs(), args)
    if args.dtypes:
        args.dtypes = tuple(DTYPE_ALIASES.get(d.strip(), d.strip()) for d in args.dtypes.split(",") if d.strip())
        bad = [d for d in args.dtypes if d not in DTYPE_ALIASES.values()]
        if bad:
            p.error(f"--dtypes: unknown {bad}; use float32, bfloat16")
    args.vllm = _fill(VllmArgs, QUICK["vllm"] if args.quick else VllmArgs(), args)
    args.dtype = DTYPE_ALIASES[args.dtype] if args.dtype else None
    args.threads = args.threads or default_threads()
    if args.interference.stream_tokens < 2:
        p.error("--stream-tokens must be >= 2 (an ITL needs two tokens)")
    for cfg in (args.batching, args.interference, args.vllm):
        for k, val in asdict(cfg).items():
            if isinstance(val, (int, float)) and not isinstance(val, bool) and k != "seed" and val <= 0:
                p.error(f"--{k.replace('_', '-')} must be > 0")
    return args


def _fill(cls, base, args: argparse.Namespace):
    """`base` with every field given on the command line replaced."""
    kw = {k: getattr(args, k) for k in cls.__dataclass_fields__ if getattr(args, k, None) is not None}
    return cls(**{**asdict(base), **kw})


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    set_threads(args.threads)
    warn_if_busy(_log)
    sections = SECTIONS if args.section == "all" else (args.section,)
    doc: dict[str, Any] = {
        "tool": "tandem-bench-decode",
        "schema_version": 1,
        "quick": args.quick,
        "model": args.model or "builtin",
        "environment": environment(args.threads),
    }
    text = []
    out = sys.stderr if args.json == "-" else sys.stdout
    for section in sections:
        if section == "batching":
            doc["batching"] = run_batching(args.batching, args.model, args.dtype, args.threads)
            text.append(render_batching(doc["batching"]))
        elif section == "interference":
            doc["interference"] = run_interference(args.interference, args.model, args.dtype, args.threads)
            text.append(render_interference(doc["interference"]))
        else:
            doc["vllm"] = run_vllm(args.vllm, args.model, args.threads, tandem_only=args.tandem_only)
            text.append(render_vllm(doc["vllm"]))
        print("\n" + text[-1], file=out, flush=True)
    write_json(doc, args.json)
    return doc


if __name__ == "__main__":
    main()
