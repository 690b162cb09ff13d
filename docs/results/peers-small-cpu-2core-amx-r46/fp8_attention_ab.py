"""One layer of decode attention, fp8 and bf16 caches, AMX tiles on and off (see README):
100 sequences of 270 tokens, 16 query heads over 4 kv heads of 64 dims, blocks of 64;
medians of 30 calls, 2 threads.

    PYTHONPATH=.:tests/unit python docs/results/peers-small-cpu-2core-amx-r46/fp8_attention_ab.py
"""

import time

import torch
from test_cpu_attention import kernels, make_case, quantize_kv

from engine.cpu_kernels import build

ops = build.load()
torch.set_num_threads(2)
query, k, v, tables, lens = make_case(4, 64, 64, torch.float32, [270] * 100, seed=1, num_kv_heads=4)
k8, v8 = quantize_kv(k, 1.0), quantize_kv(v, 1.0)
kb, vb = k.bfloat16(), v.bfloat16()
q = query.bfloat16()


def median_ms(f, n: int = 30) -> float:
    f()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return sorted(times)[n // 2] * 1e3


for amx in (True, False):
    ops.set_decode_amx(amx)
    fp8 = median_ms(lambda: kernels.paged_decode_attention(q, k8, v8, tables, lens, 0.125))
    bf16 = median_ms(lambda: kernels.paged_decode_attention(q, kb, vb, tables, lens, 0.125))
    print(f"amx {amx}: fp8 cache {fp8:.3f} ms, bf16 cache {bf16:.3f} ms")
