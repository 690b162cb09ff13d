"""The twelve decoder layers' int8 linear layers of small (random weights, 44 M of them:
more than the L3), one and four rows of bf16 x, W8A8 on q row-major (`quant_linear`)
against q in tile order (`quant_linear_tiles`); the best of 15 passes. Run from the
repository root: `python docs/results/quant-cpu-2core-zen4-r41/stream_rows.py`."""

import time

import torch

from engine.cpu_kernels import build

ops = build.load()
torch.manual_seed(0)
# qkv, o, gate, up, down of small (hidden 1024, MLP 2816, 16 / 4 heads of 64)
shapes = [(1536, 1024), (1024, 1024), (2816, 1024), (2816, 1024), (1024, 2816)] * 12
layers = []
for n, k in shapes:
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    s = torch.rand(n, 1) * 0.01
    layers.append((q, ops.quant_pack_int8(q), s, q.sum(dim=1, dtype=torch.int32), n, k))
weight_bytes = sum(q.numel() for q, *_ in layers)
for rows in (1, 4):
    x = {k: torch.randn(rows, k).bfloat16() for k in (1024, 2816)}
    for order in ("row-major", "tile order"):
        best = float("inf")
        for _ in range(15):
            t0 = time.perf_counter()
            for q, tiles, s, sums, n, k in layers:
                y = torch.empty(rows, n, dtype=torch.bfloat16)
                if order == "row-major":
                    ops.quant_linear(y, x[k], q, s, k, None, sums)
                else:
                    ops.quant_linear_tiles(y, x[k], tiles, s, None, sums)
            best = min(best, time.perf_counter() - t0)
        print(f"{rows} rows, {order}: {best * 1e3:.2f} ms for 12 layers, {weight_bytes / best / 1e9:.1f} GB/s")
