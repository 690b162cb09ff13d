"""small's MLP gate and up (2,816 x 1,024 each, int8 in tile order, bf16 x) and SwiGLU, on
one build, two ways alternating call by call (medians of 15): the two layers
(`quant_linear_tiles`) then torch's silu_ and mul_, against the one call
(`quant_linear_tiles_swiglu`, engine/quantization/linear.py's QuantSwiGLU); each row
count's two results are checked bit for bit first. Weights L3-warm (one layer).

    PYTHONPATH=. python docs/results/peers-small-cpu-2core-amx-r49/swiglu_ab.py BUILD.so
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.lab.engine import format_table, interleaved_medians
from engine.cpu_kernels.build import _load_binary
from engine.quantization.linear import QuantLinear, QuantSwiGLU

torch.set_num_threads(2)
torch.manual_seed(0)
ops = _load_binary(Path(sys.argv[1]), Path(sys.argv[1]).stem)
INTER, K = 2816, 1024
layers = []
for _ in range(2):
    layer = QuantLinear(K, INTER, False, "int8", K)
    with torch.no_grad():
        layer.weight.copy_(torch.randint(-127, 128, (INTER, K), dtype=torch.int8))
        layer.weight_scale.copy_(torch.rand(INTER, 1) * 2e-3)
    layer.use_kernels(ops, torch.bfloat16)
    layers.append(layer)
gate, up = layers
fused = QuantSwiGLU(gate, up)

rows = []
for m in (1, 8, 100, 256, 2048):
    x = (torch.randn(m, K) * 3).bfloat16()
    assert torch.equal(fused(x).view(torch.int16), F.silu(gate(x)).mul_(up(x)).view(torch.int16)), m
    old, new = interleaved_medians([(lambda: F.silu(gate(x), inplace=True).mul_(up(x)), None),
                                    (lambda: fused(x), None)], reps=15, warmup=2)
    rows.append([f"{m} rows", old * 1e3, new * 1e3, old / new])
print(format_table(["gate + up + SwiGLU", "two layers, silu_, mul_ ms", "one call ms", "ratio"], rows))
