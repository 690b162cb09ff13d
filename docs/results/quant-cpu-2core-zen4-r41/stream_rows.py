import torch, time
from engine.cpu_kernels import build
ops = build.load()
torch.manual_seed(0)
# 12 layers of small: qkv 1536x1024, o 1024x1024, gate/up 2816x1024 x2, down 1024x2816
shapes = [(1536,1024),(1024,1024),(2816,1024),(2816,1024),(1024,2816)] * 12
layers = []
for n,k in shapes:
    q = torch.randint(-127,128,(n,k),dtype=torch.int8)
    s = torch.rand(n,1)*0.01
    layers.append((q, ops.quant_pack_int8(q), s, q.sum(dim=1,dtype=torch.int32), n, k))
for M in (1, 4):
    x = {k: torch.randn(M,k).bfloat16() for k in (1024,2816)}
    for name in ("row", "tile"):
        best = 1e9
        for rep in range(15):
            t0 = time.perf_counter()
            for q, t, s, sums, n, k in layers:
                y = torch.empty(M, n, dtype=torch.bfloat16)
                if name == "row": ops.quant_linear(y, x[k], q, s, k, None, sums)
                else: ops.quant_linear_tiles(y, x[k], t, s, None, sums)
            best = min(best, time.perf_counter() - t0)
        print(M, name, round(best*1e3, 2), "ms for 12 layers,", round(sum(q.numel() for q,*_ in layers)/best/1e9,1), "GB/s")
