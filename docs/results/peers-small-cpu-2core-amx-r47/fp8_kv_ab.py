"""An fp8 KV cache's two kernels on two builds loaded in one process, the builds
alternating call by call (medians of 30): one layer's decode attention at small's shape
(100 sequences of 270 tokens, 16 query heads over 4 kv heads of 64 dims, blocks of 64,
the cache just written; a bf16 cache beside it), and the store of a step's new K and V
rows into an fp8 cache (100 tokens: a decode step; 2,048: a prefill step).

    PYTHONPATH=.:tests/unit python docs/results/peers-small-cpu-2core-amx-r47/fp8_kv_ab.py OLD.so NEW.so
"""

import sys
from pathlib import Path

import torch
from test_cpu_attention import make_case, quantize_kv

from bench.lab.engine import format_table, interleaved_medians
from engine.cpu_kernels.build import _load_binary

torch.set_num_threads(2)
builds = [_load_binary(Path(p), Path(p).stem) for p in sys.argv[1:3]]
query, k, v, tables, lens = make_case(4, 64, 64, torch.float32, [270] * 100, seed=1, num_kv_heads=4)
k8, v8 = quantize_kv(k, 1.0), quantize_kv(v, 1.0)
kb, vb, q = k.bfloat16(), v.bfloat16(), query.bfloat16()
out = torch.empty_like(q)


def attend(ops, kc, vc):
    return lambda: ops.paged_decode_attention(out, q, kc, vc, tables, lens, 0.125, True, 1.0, 0, 0.0)


def store(ops, t: int):
    g = torch.Generator().manual_seed(t)
    key, value = torch.randn(t, 4, 64, generator=g).bfloat16(), torch.randn(t, 4, 64, generator=g).bfloat16()
    kc, vc = (torch.zeros(64, 64, 4, 64, dtype=torch.float8_e4m3fn) for _ in range(2))
    slots = torch.randperm(64 * 64)[:t]
    return lambda: ops.store_kv_fp8(kc, vc, key, value, slots, 0.5, 0.25)


rows = []
for label, make in [("decode attention, fp8 cache", lambda ops: attend(ops, k8, v8)),
                    ("decode attention, bf16 cache", lambda ops: attend(ops, kb, vb)),
                    ("store_kv_fp8, 100 tokens", lambda ops: store(ops, 100)),
                    ("store_kv_fp8, 2048 tokens", lambda ops: store(ops, 2048))]:
    old, new = interleaved_medians([(make(ops), None) for ops in builds], reps=30, warmup=3)
    rows.append([label, old * 1e3, new * 1e3, old / new])
print(format_table(["case (one layer)", "A ms", "B ms", "A / B"], rows))
