"""The int8 linear layers of one decode step (small's 61 calls, 168 MB, one bf16 row of x:
the W8A8 path) on two builds of the kernels loaded in one process, in turn pass by pass
(60 passes each, torch's sum over as many bytes between them): an A/B that the host's
moving bandwidth does not decide.

    cp -r engine/cpu_kernels/_prebuilt /tmp/before   # before the change; rebuild after it
    PYTHONPATH=. python docs/results/peers-small-cpu-2core-zen3-avx2-r45/stream_ab.py \
        /tmp/before/NAME/NAME.so engine/cpu_kernels/_prebuilt/NAME2/NAME2.so
"""

import statistics
import sys
import time
from pathlib import Path

import torch

from engine.cpu_kernels.build import _load_binary

torch.set_num_threads(2)
builds = {tag: _load_binary(Path(p), Path(p).stem) for tag, p in zip(("A", "B"), sys.argv[1:3])}
SHAPES = [(1536, 1024), (1024, 1024), (2816, 1024), (2816, 1024), (1024, 2816)] * 12 + [(32000, 1024)]
mats = []
for n, k in SHAPES:
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    mats.append((n, k, q, torch.rand(n, 1) * 1e-3, q.sum(1, dtype=torch.int32)))
total = sum(n * k for n, k, *_ in mats)
xs = {k: torch.randn(1, k).bfloat16() for k in (1024, 2816)}
ys = {n: torch.empty(1, n, dtype=torch.bfloat16) for n in (1024, 1536, 2816, 32000)}
flat = torch.ones(total // 4)


def step(ops) -> None:
    for n, k, q, s, sums in mats:
        ops.quant_linear(ys[n], xs[k], q, s, k, None, sums)


def once(f) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


runs: dict[str, list[float]] = {"A": [], "B": [], "torch sum": []}
for ops in builds.values():
    step(ops)
for _ in range(60):
    runs["A"].append(once(lambda: step(builds["A"])))
    runs["B"].append(once(lambda: step(builds["B"])))
    runs["torch sum"].append(once(flat.sum))
for name, v in runs.items():
    v = sorted(v)
    m = statistics.median(v)
    print(f"{name}: median {m * 1e3:.2f} ms ({total / m / 1e9:.1f} GB/s), "
          f"quartiles {v[15] * 1e3:.2f}-{v[45] * 1e3:.2f}")
ratio = [a / b for a, b in zip(runs["A"], runs["B"])]
print(f"A / B pass by pass: median {statistics.median(ratio):.3f}, mean {statistics.mean(ratio):.3f}")
