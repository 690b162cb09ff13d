"""Decode attention at small's shape (100 sequences of 270 tokens, 16 query heads over 4 kv
heads of 64 dims, blocks of 64) on two builds loaded in one process, alternating call by
call (medians of 20): one layer over and over (its 27 MB of K and V warm in the L3), and
12 layers in turn, each with its own cache of 2,048 blocks, the sequences' blocks
scattered over it (as a served step reads them: each layer's K and V come from memory);
a bf16 cache and an fp8 one.

    PYTHONPATH=. python docs/results/peers-small-cpu-2core-amx-r49/attention_ab.py OLD.so NEW.so
"""

import sys
from pathlib import Path

import torch

from bench.lab.engine import format_table, interleaved_medians
from engine.cpu_kernels.build import _load_binary

torch.set_num_threads(2)
builds = [_load_binary(Path(p), Path(p).stem) for p in sys.argv[1:3]]
B, L, BS, HKV, G, D, LAYERS, POOL = 100, 270, 64, 4, 4, 64, 12, 2048
g = torch.Generator().manual_seed(0)
per_seq = (L + BS - 1) // BS
tables = torch.randperm(POOL, generator=g)[: B * per_seq].view(B, per_seq).to(torch.int32)
lens = torch.full((B,), L, dtype=torch.int32)
q = torch.randn(B, G * HKV, D, generator=g).bfloat16()
out = torch.empty_like(q)
caches = [(torch.randn(POOL, BS, HKV, D, generator=g).bfloat16(), torch.randn(POOL, BS, HKV, D, generator=g).bfloat16())
          for _ in range(LAYERS)]
fp8 = [(k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)) for k, v in caches]


def layers(ops, kv, n):
    def run():
        for k, v in kv[:n]:
            ops.paged_decode_attention(out, q, k, v, tables, lens, 0.125, True, 1.0, 0, 0.0)
    return run


rows = []
for label, kv, n in [("bf16 cache, one layer (warm)", caches, 1), ("bf16 cache, 12 layers in turn", caches, LAYERS),
                     ("fp8 cache, one layer (warm)", fp8, 1), ("fp8 cache, 12 layers in turn", fp8, LAYERS)]:
    old, new = interleaved_medians([(layers(ops, kv, n), None) for ops in builds], reps=20, warmup=3)
    rows.append([label, old / n * 1e3, new / n * 1e3, old / new])
print(format_table(["decode attention", "A ms a layer", "B ms a layer", "A / B"], rows))
