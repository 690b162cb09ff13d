"""The int8 linear layers of one decode step of small-llama (61 layers in tile order, 168 MB)
at M rows of bf16 x (W8A8 on AMX tiles), two builds of the kernels loaded in one process,
in turn pass by pass: an A/B that the host's moving speed does not decide.

    cp -r engine/cpu_kernels/_prebuilt /tmp/before
    git apply docs/results/peers-small-cpu-2core-amx-r46/chunked-tiles.patch
    python -m cli kernels build --variants amx --into /tmp/after
    PYTHONPATH=. python docs/results/peers-small-cpu-2core-amx-r46/tiles_ab.py /tmp/before/NAME/NAME.so \
        /tmp/after/NAME2/NAME2.so 32 64 100 128 256
"""

import statistics
import sys
import time
from pathlib import Path

import torch

from engine.cpu_kernels.build import _load_binary

torch.set_num_threads(2)
builds = {tag: _load_binary(Path(p), Path(p).stem) for tag, p in zip(("A", "B"), sys.argv[1:3])}
rows = [int(m) for m in sys.argv[3:]] or [32, 64, 100, 128, 256]
SHAPES = [(1536, 1024), (1024, 1024), (5632, 1024), (1024, 2816)] * 12 + [(32000, 1024)]
ops0 = builds["A"]
mats = []
for n, k in SHAPES:
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    mats.append((n, k, ops0.quant_pack_int8(q), torch.rand(n, 1) * 1e-3, q.sum(1, dtype=torch.int32)))
total = sum(n * k for n, k, *_ in mats)
for M in rows:
    xs = {k: torch.randn(M, k).bfloat16() for k in (1024, 2816)}
    ys = {n: {t: torch.empty(M, n, dtype=torch.bfloat16) for t in "AB"} for n in (1024, 1536, 5632, 32000)}

    def step(tag) -> None:
        ops = builds[tag]
        for n, k, t, s, sums in mats:
            ops.quant_linear_tiles(ys[n][tag], xs[k], t, s, None, sums)

    def once(f) -> float:
        t = time.perf_counter()
        f()
        return time.perf_counter() - t

    step("A"), step("B")
    same = all(torch.equal(ys[n]["A"], ys[n]["B"]) for n in ys)
    runs = {"A": [], "B": []}
    for _ in range(12):
        runs["A"].append(once(lambda: step("A")))
        runs["B"].append(once(lambda: step("B")))
    ma, mb = statistics.median(runs["A"]), statistics.median(runs["B"])
    ratio = statistics.median(a / b for a, b in zip(runs["A"], runs["B"]))
    print(f"M={M}: A {ma * 1e3:.2f} ms ({2 * M * total / ma / 1e12:.2f} TOPS), B {mb * 1e3:.2f} ms "
          f"({2 * M * total / mb / 1e12:.2f} TOPS); A/B pass by pass {ratio:.3f}; same bits: {same}", flush=True)
