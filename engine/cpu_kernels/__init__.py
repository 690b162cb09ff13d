"""tandem's CPU kernels in C++, compiled just in time on first use (build.py).

- paged_attention.cpp: paged decode attention (engine/attention/cpu uses it);
- linear.cpp: bf16 linear layers for decode steps: the tile kernel (AMX, up to 256
  tokens) and the row-major kernel (AVX512-BF16, one to four) (engine/models/packed.py
  uses them); amx.h: the tile setup shared with the attention kernels;
- fused.cpp: RMSNorm (with the residual add), rotary in place, the KV store;
- threads.cpp: binds a worker's OpenMP threads one to a core (engine/runner.py).
"""
