"""Where a decode step's (or a prefill's) time goes: torch.profiler over the engine's steps.

    python -m bench.lab.profile [--batch 200] [--prompt-len 256] [--steps 20] [--dtype float32] [--quantization int8]
        [--kv-cache-dtype fp8] [--phase prefill]

Decode (the default): fills the engine with `batch` requests of random prompts (greedy,
ignore_eos), runs steps until every prompt is prefilled, then profiles `steps` pure
decode steps and prints the step time and the operators by self CPU time per step,
grouped into matmuls, attention, sampling and the rest.
Prefill: the prefill of `batch` random prompts, in steps of the engine's token budget
(`--max-num-batched-tokens`, chunked as the server does), once to warm up, once timed
and once under the profiler, each with prompts of their own (no prefix-cache hits);
the operators per prefill step, grouped the same way.
The same engine `tandem generate` and the decode worker run; built-in model unless
--model is given.
"""

from __future__ import annotations

import argparse
import sys
import time

from bench.lab.decode import _vocab, random_prompts
from bench.lab.engine import DTYPE_ALIASES, default_threads, format_table, set_threads, warn_if_busy

GROUPS = (  # first match wins; names as torch.profiler reports them
    ("matmul", ("aten::addmm", "aten::mm", "aten::linear", "aten::matmul", "aten::bmm",
                "mkldnn::_linear_pointwise", "small_batch_linear", "tile_linear", "quant_linear")),
    # index_copy_ (torch) and store_kv (the cpu kernels): the KV write
    ("attention", ("paged_decode_attention", "paged_prefill_attention", "index_copy_", "store_kv",
                   "scaled_dot_product")),
    ("sampling", ("aten::argmax", "aten::topk", "aten::sort", "aten::softmax", "aten::exponential")),
)


def group_of(name: str) -> str:
    for group, keys in GROUPS:
        if any(k in name for k in keys):
            return group
    return "other"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lab.profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: the built-in model)")
    p.add_argument("--dtype", choices=sorted(DTYPE_ALIASES), default="float32")
    p.add_argument("--quantization", choices=("int8", "fp8"), default=None,
                   help="the linear weights quantized as they load (`tandem serve --quantization`)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto", help="`tandem serve --kv-cache-dtype`")
    p.add_argument("--batch", type=int, default=200)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=12, help="operators listed")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--phase", choices=("decode", "prefill"), default="decode")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens a step (the server's default); prefill chunks to it")
    a = p.parse_args(argv)

    from torch.profiler import ProfilerActivity, profile

    from decode_worker.llm import LLM
    from engine.sampling_params import SamplingParams

    threads = set_threads(a.threads or default_threads())
    warn_if_busy()
    llm = LLM(a.model, dtype=DTYPE_ALIASES[a.dtype], max_num_seqs=a.batch, num_threads=threads,
              max_model_len=a.prompt_len + 2 * a.steps + 64, seed=0, quantization=a.quantization,
              kv_cache_dtype=a.kv_cache_dtype, max_num_batched_tokens=a.max_num_batched_tokens)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=2 * a.steps + 32, ignore_eos=True)

    def fill(seed: int) -> None:
        for i, prompt in enumerate(random_prompts(a.batch, a.prompt_len, _vocab(a.model), seed=seed)):
            engine.add_request(f"s{seed}-{i}", prompt, params)

    def prefill() -> int:
        """Steps until every prompt is prefilled (bounded); how many."""
        for n in range(10_000):
            sched = engine.scheduler
            if not sched.num_waiting and all(s.num_to_compute == 1 for s in sched.running):
                return n
            engine.step()
        raise RuntimeError("prefill did not finish in 10,000 steps")

    fill(0)
    prefill()
    if len(engine.scheduler.running) != a.batch:
        print(f"only {len(engine.scheduler.running)} of {a.batch} requests fit the cache", file=sys.stderr)
        return 1
    weights = (f", weights {a.quantization}" if a.quantization else "") + (
        f", KV {a.kv_cache_dtype}" if a.kv_cache_dtype != "auto" else "")
    if a.phase == "prefill":
        return profile_prefill(a, engine, fill, prefill, threads, weights)
    for _ in range(3):  # warm-up decode steps
        engine.step()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        engine.step()
    plain_ms = (time.perf_counter() - t0) / a.steps * 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(a.steps):
            engine.step()
        wall = time.perf_counter() - t0
    step_ms = wall / a.steps * 1e3
    print(f"decode step at batch {a.batch}, context ~{a.prompt_len}, {DTYPE_ALIASES[a.dtype]}{weights}, "
          f"{threads} threads, attention {engine.runner.backend.name}: {plain_ms:.2f} ms/step "
          f"({a.batch / plain_ms * 1e3:.0f} tok/s); {step_ms:.2f} ms/step under the profiler, {a.steps} steps each")
    print_operators(prof, a.steps, step_ms, a.top)
    return 0


def print_operators(prof, steps: int, step_ms: float, top_n: int) -> None:
    """The profiled operators by group and the largest ones, per step."""
    ops = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total_us = sum(e.self_cpu_time_total for e in ops)
    groups: dict[str, float] = {}
    for e in ops:
        groups[group_of(e.key)] = groups.get(group_of(e.key), 0.0) + e.self_cpu_time_total
    print("\nby group (self CPU time per step; the rest of the step is Python outside torch ops):")
    print(format_table(["group", "ms/step", "share of step"],
                       [[g, us / 1e3 / steps, f"{us / 1e3 / steps / step_ms:.0%}"]
                        for g, us in sorted(groups.items(), key=lambda kv: -kv[1])]
                       + [["python + untracked", step_ms - total_us / 1e3 / steps,
                           f"{1 - total_us / 1e3 / steps / step_ms:.0%}"]]))
    print(f"\ntop {top_n} operators:")
    top = sorted(ops, key=lambda e: -e.self_cpu_time_total)[:top_n]
    print(format_table(["operator", "group", "calls/step", "ms/step"],
                       [[e.key[:60], group_of(e.key), e.count / steps, e.self_cpu_time_total / 1e3 / steps]
                        for e in top]))


def profile_prefill(a, engine, fill, prefill, threads: int, weights: str) -> int:
    """The batch's prefill timed, then profiled, each on prompts of its own after the
    warm-up's requests are done (so no prompt hits the prefix cache)."""
    from torch.profiler import ProfilerActivity, profile

    def finish() -> None:
        for _ in range(100_000):
            if not engine.has_work():
                return
            engine.step()
        raise RuntimeError("requests did not finish in 100,000 steps")

    finish()
    fill(1)
    t0 = time.perf_counter()
    steps = prefill()
    plain_s = time.perf_counter() - t0
    finish()
    fill(2)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        psteps = prefill()
        wall = time.perf_counter() - t0
    finish()
    tokens = a.batch * a.prompt_len
    print(f"prefill of {a.batch} prompts of {a.prompt_len} tokens, {DTYPE_ALIASES[a.dtype]}{weights}, {threads} "
          f"threads, steps of {a.max_num_batched_tokens} tokens: {plain_s:.2f} s in {steps} steps "
          f"({tokens / plain_s:.0f} tok/s); {wall:.2f} s under the profiler")
    print_operators(prof, psteps, wall / psteps * 1e3, a.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
