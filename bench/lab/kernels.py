"""Benchmark the Triton kernels (paged decode, varlen paged prefill, KV store) against
the torch reference, and the decode kernel's achieved bandwidth as a fraction of the
device's own copy bandwidth (a device-to-device copy of 1 GiB: bytes read + written).

    python -m bench.lab.kernels [--dtype bf16] [--heads 32] [--kv-heads 8] [--head-dim 128]

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
        prog="python -m bench.lab.kernels", description=__doc__,
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


def copy_bandwidth_gbs() -> float:
    """The device's memory bandwidth as a large copy achieves it: (read + write) / time."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = _time_us(lambda: dst.copy_(src))
    return 2 * (1 << 30) / (t * 1e-6) / 1e9


def bench_decode(args: argparse.Namespace, copy_gbs: float) -> None:
    from engine.attention import reference
    from engine.attention.triton import kernels

    dtype, bs, hkv, d = DTYPES[args.dtype], args.block_size, args.kv_heads, args.head_dim
    elem = torch.empty((), dtype=dtype).element_size()
    print(f"paged decode  H={args.heads} Hkv={hkv} D={d} block={bs} {args.dtype}")
    print(f"{'batch':>6} {'ctx':>6} {'triton us':>10} {'torch us':>10} {'speedup':>8} {'triton GB/s':>12} "
          f"{'of copy':>8}")
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
            print(f"{b:>6} {ctx:>6} {t_triton:>10.1f} {t_torch:>10.1f} {t_torch / t_triton:>7.2f}x {gbs:>12.0f} "
                  f"{gbs / copy_gbs:>7.0%}")
            del k_cache, v_cache
        torch.cuda.empty_cache()


def bench_prefill(args: argparse.Namespace) -> None:
    """Ragged prefill of 8 prompts of `length` new tokens after `cached` cached ones."""
    from engine.attention import reference
    from engine.attention.triton import kernels

    dtype, bs, hkv, d, h = DTYPES[args.dtype], args.block_size, args.kv_heads, args.head_dim, args.heads
    print(f"\nvarlen paged prefill  H={h} Hkv={hkv} D={d} block={bs} {args.dtype}, 8 sequences")
    print(f"{'new':>6} {'cached':>6} {'triton us':>10} {'torch us':>10} {'speedup':>8} {'Mtok/s':>8} {'TFLOP/s':>8}")
    for length, cached in [(128, 0), (512, 0), (2048, 0), (512, 2048)]:
        b, ctx = 8, length + cached
        m = -(-ctx // bs)
        k_cache = torch.randn(b * m, bs, hkv, d, device="cuda", dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        tables = torch.randperm(b * m, device="cuda", dtype=torch.int32).view(b, m)
        query = torch.randn(b * length, h, d, device="cuda", dtype=dtype)
        key = torch.randn(b * length, hkv, d, device="cuda", dtype=dtype)
        value = torch.randn_like(key)
        starts = torch.arange(0, (b + 1) * length, length, device="cuda", dtype=torch.int32)
        seq_lens = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
        t_triton = _time_us(lambda: kernels.varlen_prefill_attention(
            query, k_cache, v_cache, tables, starts, seq_lens, d**-0.5, length))
        t_torch = _time_us(lambda: reference.varlen_attention(
            query, key, value, k_cache, v_cache, tables, [length] * b, [ctx] * b, d**-0.5))
        flops = 4 * b * h * d * length * (cached + (length + 1) / 2)  # QK^T and PV over the causal keys
        print(f"{length:>6} {cached:>6} {t_triton:>10.1f} {t_torch:>10.1f} {t_torch / t_triton:>7.2f}x "
              f"{b * length / t_triton:>8.2f} {flops / (t_triton * 1e-6) / 1e12:>8.1f}")
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
        print("bench.lab.kernels needs a CUDA GPU; none found, nothing to do.")
        return 0
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth_gbs()
    print(f"device: {torch.cuda.get_device_name()}; copy bandwidth {copy_gbs:.0f} GB/s (read + write)")
    bench_decode(args, copy_gbs)
    bench_prefill(args)
    bench_store_kv(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
