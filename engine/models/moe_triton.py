"""A mixture of experts' expert matmuls as grouped Triton kernels (CUDA; on CPU only
under the Triton interpreter, for tests).

A step's (token, choice) pairs are laid out grouped by expert, each expert's run padded
to a whole number of BLOCK_M rows (`align`, on the device, no host sync), so that a
program of the grouped GEMM holds BLOCK_M pairs of one expert and one BLOCK_N slice of
its output: it reads that expert's weight tile once for all of them. Two launches make
the experts' SwiGLU MLP:

    h[pair]   = x[token(pair)] @ W13[e]^T          [P, 2I]   (gate rows, then up rows)
    a[pair]   = silu(h[:, :I]) * h[:, I:]           (torch, one elementwise pass)
    y[pair]   = (a[pair] @ W2[e]^T) * weight(pair)  [P, H]
    out[t]    = sum over t's pairs of y              (fp32, then the model's dtype)

The loop over experts (engine/models/moe.py) is the reference: the same products, the
sum over a token's experts taken in another order (so not the same bits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def align(experts: torch.Tensor, num_experts: int,
          block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the flat expert choice of each pair [P] (an id outside 0..E-1: not run here),
    (pair ids grouped by expert, each expert's run padded with -1 to a multiple of
    block_m [R], the expert of each block of block_m rows [R / block_m], -1 past the
    last; the pairs each expert got [E]). R is the bound P + E * (block_m - 1), and no
    operator here reads a size off the device: nothing waits, and a CUDA graph can hold it."""
    device, p = experts.device, experts.numel()
    ids = torch.where((experts >= 0) & (experts < num_experts), experts, num_experts).long()
    order = torch.argsort(ids, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device).scatter_add_(
        0, ids, torch.ones_like(ids))[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    first_padded = torch.cumsum(padded, 0) - padded
    first = torch.cumsum(counts, 0) - counts
    rows = p + num_experts * (block_m - 1)
    rows = (rows + block_m - 1) // block_m * block_m
    sorted_ids = torch.full((rows + 1,), -1, dtype=torch.int32, device=device)  # the last: where skipped pairs go
    sorted_experts = ids[order]
    e = sorted_experts.clamp_max(num_experts - 1)
    dest = first_padded[e] + torch.arange(p, device=device) - first[e]
    dest = torch.where(sorted_experts < num_experts, dest, rows)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    sorted_ids = sorted_ids[:rows]
    starts = torch.arange(0, rows, block_m, device=device)
    ends = torch.cumsum(padded, 0)
    block_expert = torch.searchsorted(ends, starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert, counts


@triton.jit
def _grouped_gemm(
    a_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, weights_ptr,
    N, K, top_k,
    stride_am, stride_we, stride_wn, stride_om,
    A_BY_TOKEN: tl.constexpr,  # row of A: the pair's token (x), or the pair itself (a)
    MUL_WEIGHT: tl.constexpr,  # multiply each row by its pair's routing weight
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    nb = tl.program_id(1)
    e = tl.load(block_expert_ptr + b)
    if e >= 0:
        m = tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ids_ptr + b * BLOCK_M + m)
        valid = pair >= 0
        if A_BY_TOKEN:
            row = tl.where(valid, pair // top_k, 0).to(tl.int64)
        else:
            row = tl.where(valid, pair, 0).to(tl.int64)
        n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        w_base = w_ptr + e.to(tl.int64) * stride_we
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            a = tl.load(a_ptr + row[:, None] * stride_am + k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_base + n[:, None] * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if USE_DOT:
                acc += tl.dot(a, tl.trans(w), input_precision=DOT_PRECISION)
            else:
                acc += tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        if MUL_WEIGHT:
            acc = acc * tl.load(weights_ptr + tl.where(valid, pair, 0), mask=valid, other=0.0)[:, None]
        out = out_ptr + tl.where(valid, pair, 0).to(tl.int64)[:, None] * stride_om + n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


def _launch(a, w, out, sorted_ids, block_expert, weights, top_k, by_token, mul_weight, block_m, use_dot):
    n, k = w.shape[1], w.shape[2]
    block_n = 64 if a.is_cuda else 16
    block_k = 64 if a.is_cuda else 16
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _grouped_gemm[grid](a, w, out, sorted_ids, block_expert, weights, n, k, top_k,
                        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
                        A_BY_TOKEN=by_token, MUL_WEIGHT=mul_weight, BLOCK_M=block_m, BLOCK_N=block_n,
                        BLOCK_K=block_k, USE_DOT=use_dot,
                        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32")  # no tf32 for fp32 models


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, experts: torch.Tensor,
                  weights: torch.Tensor, block_m: int | None = None,
                  use_dot: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the routed experts' output [T, H] in x's dtype, the pairs each expert got [E]).
    x [T, H]; w13 [E, 2I, H] (gate rows then up rows) and w2 [E, H, I], contiguous, of
    the experts held here; experts [T, k] their local ids (outside 0..E-1: another
    rank's, skipped); weights [T, k]."""
    t, h = x.shape
    num_experts, two_i, _ = w13.shape
    top_k = experts.shape[1]
    if block_m is None:
        block_m = 64 if x.is_cuda else 16
    if use_dot is None:
        use_dot = x.is_cuda
    sorted_ids, block_expert, counts = align(experts.reshape(-1), num_experts, block_m)
    pairs = t * top_k
    flat_w = weights.reshape(-1).float().contiguous()
    hidden = torch.empty(pairs, two_i, dtype=x.dtype, device=x.device)
    _launch(x.contiguous(), w13, hidden, sorted_ids, block_expert, flat_w, top_k, True, False, block_m, use_dot)
    inter = two_i // 2
    act = torch.nn.functional.silu(hidden[:, :inter]) * hidden[:, inter:]
    y = torch.zeros(pairs, h, dtype=torch.float32, device=x.device)  # a pair of another rank's expert stays 0
    _launch(act, w2, y, sorted_ids, block_expert, flat_w, top_k, False, True, block_m, use_dot)
    return y.view(t, top_k, h).sum(1).to(x.dtype), counts
