"""Benchmark the Triton paged-decode and KV-store kernels against the torch reference.

    python -m bench.kernels [--dtype bf16] [--heads 32] [--kv-heads 8] [--head-dim 128]

Needs CUDA; on a CPU-only machine it says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
BATCH_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
CONTEXT_LENS = [512, 2048]
STORE_TOKENS = [1, 64, 512, 4096]


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.kernels", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    return p.parse_args(argv)


def _time_us(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=50) * 1e3  # ms -> us


def bench_decode(args: argparse.Namespace) -> None:
    from engine.attention import reference
    from engine.attention.triton import kernels

    dtype, bs, hkv, d = DTYPES[args.dtype], args.block_size, args.kv_heads, args.head_dim
    elem = torch.empty((), dtype=dtype).element_size()
    print(f"paged decode  H={args.heads} Hkv={hkv} D={d} block={bs} {args.dtype}")
    print(f"{'batch':>6} {'ctx':>6} {'triton us':>10} {'torch us':>10} {'speedup':>8} {'triton GB/s':>12}")
    for ctx in CONTEXT_LENS:
        for b in BATCH_SIZES:
            m = (ctx + bs - 1) // bs
            k_cache = torch.randn(b * m, bs, hkv, d, device="cuda", dtype=dtype)
            v_cache = torch.randn_like(k_cache)
            block_tables = torch.randperm(b * m, device="cuda", dtype=torch.int32).view(b, m)
            seq_lens = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
            query = torch.randn(b, args.heads, d, device="cuda", dtype=dtype)
            call = (query, k_cache, v_cache, block_tables, seq_lens, d**-0.5, ctx)
            t_triton = _time_us(lambda: kernels.paged_decode_attention(*call))
            t_torch = _time_us(lambda: reference.paged_decode_attention(*call))
            gbs = 2 * b * ctx * hkv * d * elem / (t_triton * 1e-6) / 1e9  # K + V bytes read
            print(f"{b:>6} {ctx:>6} {t_triton:>10.1f} {t_torch:>10.1f} {t_torch / t_triton:>7.2f}x {gbs:>12.0f}")
            del k_cache, v_cache
        torch.cuda.empty_cache()


def bench_store_kv(args: argparse.Namespace) -> None:
    from engine.attention import reference
    from engine.attention.triton import kernels

    dtype, bs, hkv, d = DTYPES[args.dtype], args.block_size, args.kv_heads, args.head_dim
    num_blocks = 4096
    k_cache = torch.zeros(num_blocks, bs, hkv, d, device="cuda", dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    print(f"\nstore_kv  Hkv={hkv} D={d} block={bs} {args.dtype}")
    print(f"{'tokens':>6} {'triton us':>10} {'torch us':>10} {'speedup':>8}")
    for t in STORE_TOKENS:
        key = torch.randn(t, hkv, d, device="cuda", dtype=dtype)
        value = torch.randn_like(key)
        slots = torch.randperm(num_blocks * bs, device="cuda")[:t]
        call = (key, value, k_cache, v_cache, slots)
        t_triton = _time_us(lambda: kernels.store_kv(*call))
        t_torch = _time_us(lambda: reference.store_kv(*call))
        print(f"{t:>6} {t_triton:>10.1f} {t_torch:>10.1f} {t_torch / t_triton:>7.2f}x")


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.kernels needs a CUDA GPU; none found, nothing to do.")
        return 0
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}")
    bench_decode(args)
    bench_store_kv(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
