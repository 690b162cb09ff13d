"""tandem's CPU kernels in C++, compiled just in time on first use (build.py).

- paged_attention.cpp: paged decode attention (engine/attention/cpu uses it);
- linear.cpp: bf16 linear layers for steps of one to four tokens on AVX512-BF16
  (engine/models/packed.py uses it);
- fused.cpp: RMSNorm (with the residual add), rotary in place, the KV store;
- threads.cpp: binds a worker's OpenMP threads one to a core (engine/runner.py).
"""
