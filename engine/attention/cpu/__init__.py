"""CPU attention kernels in C++, compiled just-in-time on first use (see build.py).

Cache layout (one layer, see engine/attention/reference.py):
    k_cache, v_cache: [N, bs, Hkv, D]; token p of a sequence lives in row p % bs of
    block block_table[p // bs].

Paged decode (paged_attention.cpp): one work item per (sequence b, run of kv heads,
normally all Hkv of them, narrower only when there are too few sequences to keep every
thread busy) handles all G = H // Hkv query heads of each kv head, so each K/V row is
read from memory once per group, straight from its block, in address order:

    pass 1:  s[h, t] = scale * q[h] . K[t]           t < seq_len, fp32 scores in a
                                                       per-thread scratch [G, seq_len]
    softmax: p[h, t] = exp(s[h, t] - max_t s[h, t])
    pass 2:  out[h]  = sum_t p[h, t] V[t] / sum_t p[h, t]

Items are pulled from a shared counter by at::parallel_for's threads, so ragged
lengths balance. bf16/fp16 caches and queries are widened to fp32 on load.
"""
