"""small's 60 int8 linear layers (12 decoder layers x qkv 1536x1024, o 1024x1024, gate and up
2816x1024, down 1024x2816: 135 MB of int8 weights, more than this host's caches keep, as a
decode step reads them) on the AMX path (`quant_linear_tiles`), on two builds of the kernels
loaded in one process, alternating call by call (medians of 9), by rows of x (a decode
step of that many sequences). Torch's allocations on transparent huge pages, as the
`tandem` command asks.

    PYTHONPATH=. python docs/results/peers-small-cpu-2core-amx-r48/decode_layers_ab.py OLD.so NEW.so
"""

import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from bench.lab.engine import format_table, interleaved_medians  # noqa: E402
from engine.cpu_kernels.build import _load_binary  # noqa: E402

torch.set_num_threads(2)
torch.manual_seed(0)
builds = [_load_binary(Path(p), Path(p).stem) for p in sys.argv[1:3]]
LAYER = [(1536, 1024), (1024, 1024), (2816, 1024), (2816, 1024), (1024, 2816)]
weights = []
for n, k in LAYER * 12:
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    weights.append((q, torch.rand(n, 1) * 1e-3, q.sum(1, dtype=torch.int32)))
packed = [[(ops.quant_pack_int8(q), s, sums) for q, s, sums in weights] for ops in builds]
gb = sum(q.numel() for q, _, _ in weights) / 1e9


def case(ops, layers, m: int):
    xs = {k: torch.randn(m, k).bfloat16() for k in (1024, 2816)}
    ys = {n: torch.empty(m, n, dtype=torch.bfloat16) for n in (1024, 1536, 2816)}

    def run() -> None:
        for tiles, s, sums in layers:
            n, k = tiles.size(0) * 32, tiles.size(1) * 64
            ops.quant_linear_tiles(ys[n], xs[k], tiles, s, None, sums)

    return run


rows = []
for m in (8, 32, 64, 100, 128, 200, 256):
    old, new = interleaved_medians([(case(ops, layers, m), None) for ops, layers in zip(builds, packed)], reps=9,
                                   warmup=2)
    rows.append([m, old * 1e3, new * 1e3, old / new, gb / new])
print(f"{gb * 1e3:.0f} MB of int8 weights a pass")
print(format_table(["rows", "A ms", "B ms", "A / B", "B GB/s of weights"], rows))
