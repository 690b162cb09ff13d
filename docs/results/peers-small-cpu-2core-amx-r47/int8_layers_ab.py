"""small's five int8 layers of one decoder layer (qkv 1536x1024, o 1024x1024, gate and up
2816x1024, down 1024x2816) on the AMX path (`quant_linear_tiles`, weights in tile order,
bf16 x quantized per row), on two builds of the kernels loaded in one process, the
builds alternating call by call (medians of 15): at 2,048 rows (a prefill step of the
server's default token budget), at 100 rows (a decode step of 100 sequences) and the
quantization of x alone (N = 32: one panel).

    PYTHONPATH=. python docs/results/peers-small-cpu-2core-amx-r47/int8_layers_ab.py OLD.so NEW.so

OLD.so: the amx build of the commit before (`git worktree add /tmp/old COMMIT`, then in it
`python -m cli kernels build --variants amx --into /tmp/kold`).
"""

import sys
from pathlib import Path

import torch

from bench.lab.engine import format_table, interleaved_medians
from engine.cpu_kernels.build import _load_binary

torch.set_num_threads(2)
torch.manual_seed(0)
builds = [_load_binary(Path(p), Path(p).stem) for p in sys.argv[1:3]]
LAYERS = [(1536, 1024), (1024, 1024), (2816, 1024), (2816, 1024), (1024, 2816)]


def case(ops, m: int, layers):
    calls = []
    for n, k in layers:
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        tiles, s, sums = ops.quant_pack_int8(q), torch.rand(n, 1) * 1e-3, q.sum(1, dtype=torch.int32)
        x, y = torch.randn(m, k).bfloat16(), torch.empty(m, n, dtype=torch.bfloat16)
        calls.append((y, x, tiles, s, sums))

    def run() -> None:
        for y, x, tiles, s, sums in calls:
            ops.quant_linear_tiles(y, x, tiles, s, None, sums)

    return run


rows = []
for label, m, layers in [("5 layers, 2048 rows", 2048, LAYERS), ("5 layers, 100 rows", 100, LAYERS),
                         ("quantize x: 2048 x 1024 (N = 32)", 2048, [(32, 1024)]),
                         ("quantize x: 2048 x 2816 (N = 32)", 2048, [(32, 2816)])]:
    old, new = interleaved_medians([(case(ops, m, layers), None) for ops in builds], reps=15, warmup=2)
    rows.append([label, old * 1e3, new * 1e3, old / new])
print(format_table(["case", "A ms", "B ms", "A / B"], rows))
