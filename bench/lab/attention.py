"""Benchmark CPU paged decode attention: the torch reference vs the C++ kernel.

    python -m bench.lab.attention [--dtype fp32] [--batches 1 16 64 256] [--contexts 128 512 2048]
        [--window W] [--softcap C]

Shapes: the built-in model (H=4, Hkv=2, D=64) and a Llama-3-8B-like layer (H=32,
Hkv=8, D=128), block size 16. Every call reads a fresh random block table drawn from
a pool larger than the last-level cache, so K/V come from DRAM as in a real step
(one layer's cache is read once per step). Times are medians over repeated calls
(`best` is the fastest call: on a shared machine the median can be inflated by other
processes); GB/s is the K+V bytes of the context divided by the kernel's median time. The reference is
skipped (`-`) where its padded gather would exceed --ref-max-gb. With --window the
kernel reads the blocks the window touches alone (those before it are poisoned, -1, as a
released block's entry is) and GB/s counts the bytes it reads; the reference (what a
windowed layer took on CPU before the kernel had windows) gathers the whole context.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from dataclasses import dataclass

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
POOL_BYTES = 256 << 20  # per K and V: well past a 32 MiB L3
NUM_TABLES = 8


@dataclass(frozen=True)
class Shape:
    name: str
    heads: int
    kv_heads: int
    head_dim: int


SHAPES = [Shape("builtin", 4, 2, 64), Shape("small", 16, 4, 64), Shape("llama8b", 32, 8, 128)]


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.lab.attention",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--shapes", nargs="+", choices=[s.name for s in SHAPES], default=[s.name for s in SHAPES])
    p.add_argument("--ref-max-gb", type=float, default=0.6, help="skip the reference above this much K+V")
    p.add_argument("--min-time", type=float, default=0.5, help="seconds of calls per measurement")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--window", type=int, default=None, help="a sliding window of this many positions")
    p.add_argument("--softcap", type=float, default=None, help="scores soft-capped at this value")
    return p.parse_args(argv)


def time_ms(fn, min_time: float, min_reps: int = 5, max_reps: int = 200) -> tuple[float, float]:
    """(median, best) wall time of fn() in ms, after one warm-up call."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < min_time and len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, min(times) * 1e3


def kv_bytes(shape: Shape, dtype: torch.dtype, batch: int, ctx: int) -> int:
    """K + V bytes of `batch` contexts of `ctx` tokens: what one call must read."""
    return 2 * batch * ctx * shape.kv_heads * shape.head_dim * torch.empty((), dtype=dtype).element_size()


def read_tokens(ctx: int, window: int | None, bs: int) -> int:
    """Positions the kernel reads a context: whole blocks from the one holding the window's start."""
    return ctx if not window or ctx <= window else ctx - (ctx - window) // bs * bs


def bench_case(
    shape: Shape, dtype: torch.dtype, bs: int, batch: int, ctx: int, args
) -> tuple[float | None, float, float]:
    """(reference median ms or None, kernel median ms, kernel best ms) for one (batch, context)."""
    from engine.attention import reference
    from engine.attention.cpu import kernels

    g = torch.Generator().manual_seed(batch * 7919 + ctx)
    elem = torch.empty((), dtype=dtype).element_size()
    m = (ctx + bs - 1) // bs
    block_bytes = bs * shape.kv_heads * shape.head_dim * elem
    pool = max(batch * m, POOL_BYTES // block_bytes)
    k_cache = torch.randn(pool, bs, shape.kv_heads, shape.head_dim, generator=g).to(dtype)
    v_cache = torch.randn(pool, bs, shape.kv_heads, shape.head_dim, generator=g).to(dtype)
    tables = [torch.randperm(pool, generator=g)[: batch * m].view(batch, m).to(torch.int32) for _ in range(NUM_TABLES)]
    before = (ctx - args.window) // bs if args.window and ctx > args.window else 0
    poisoned = [t.clone() for t in tables]
    for t in poisoned:
        t[:, :before] = -1
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
    query = torch.randn(batch, shape.heads, shape.head_dim, generator=g).to(dtype)
    out = torch.empty_like(query)
    scale = shape.head_dim**-0.5
    turn, kturn = itertools.cycle(tables), itertools.cycle(poisoned)  # a fresh table per call: K/V come from DRAM
    w, cap = args.window, args.softcap

    t_cpu, best_cpu = time_ms(
        lambda: kernels.paged_decode_attention(query, k_cache, v_cache, next(kturn), seq_lens, scale, out=out,
                                               window=w, softcap=cap),
        args.min_time,
    )
    t_ref = None
    if kv_bytes(shape, dtype, batch, ctx) <= args.ref_max_gb * 1e9:
        t_ref = time_ms(
            lambda: reference.paged_decode_attention(query, k_cache, v_cache, next(turn), seq_lens, scale, ctx,
                                                     window=w, softcap=cap),
            args.min_time,
            min_reps=3,
        )[0]
    return t_ref, t_cpu, best_cpu


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    from engine.cpu_kernels import build

    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    ops = build.load()
    print(
        f"cpu kernel loaded in {time.perf_counter() - t0:.1f}s (simd lanes: {ops.simd_lanes()}); "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    dtype = DTYPES[args.dtype]
    for shape in (s for s in SHAPES if s.name in args.shapes):
        print(
            f"\npaged decode  {shape.name}: H={shape.heads} Hkv={shape.kv_heads} D={shape.head_dim} "
            f"block={args.block_size} {args.dtype}"
            + (f" window={args.window}" if args.window else "") + (f" softcap={args.softcap}" if args.softcap else "")
        )
        print(f"{'batch':>6} {'ctx':>6} {'torch ms':>10} {'cpu ms':>9} {'best ms':>9} {'speedup':>8} {'cpu GB/s':>9}")
        for ctx in args.contexts:
            for batch in args.batches:
                t_ref, t_cpu, best = bench_case(shape, dtype, args.block_size, batch, ctx, args)
                read = read_tokens(ctx, args.window, args.block_size)
                gbs = kv_bytes(shape, dtype, batch, read) / (t_cpu * 1e-3) / 1e9
                ref = f"{t_ref:>10.3f}" if t_ref is not None else f"{'-':>10}"
                speedup = f"{t_ref / t_cpu:>7.1f}x" if t_ref is not None else f"{'-':>8}"
                print(f"{batch:>6} {ctx:>6} {ref} {t_cpu:>9.3f} {best:>9.3f} {speedup} {gbs:>9.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
