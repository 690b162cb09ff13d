// A parallel loop over chunks of a range where a thread that finishes its share takes
// chunks from another's: for the decode steps' weight streams on cores the serving path
// shares.
//
// at::parallel_for hands each thread a fixed share. When one thread of a decode step's
// team is preempted (the router, the client, the worker's event loop run on the same two
// cores), the other finishes its share and waits at the region's end for the rest of
// the preempted one's: the step takes the preemption plus that thread's remaining work.
// Here each thread still streams its own contiguous share front to back, one chunk at a
// time (the same reads in the same order as a fixed share while nobody is preempted),
// and a thread done with its own takes chunks from the back of the others' shares, so a
// preempted thread's remaining work is done by the one still running, and the step waits
// for at most the chunk the preempted thread is in. Each chunk's outputs are computed
// the same way whichever thread takes it, so the bits do not change.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace tandem_steal {

// on unless `set_work_stealing(false)` (TANDEM_CPU_STEAL=0, engine/envs.py): fixed
// shares, at::parallel_for's, for an A/B. One flag for the whole extension (an inline
// function's static is one object across the files that include this)
inline std::atomic<bool>& enabled() {
  static std::atomic<bool> on{true};
  return on;
}

// items of `item_bytes` each in a chunk of about 64 KB of weights: at least `multiple`, and a
// multiple of it
inline int64_t chunk_items(int64_t item_bytes, int64_t multiple = 1) {
  return std::max<int64_t>(multiple, 65536 / std::max<int64_t>(item_bytes, 1) / multiple * multiple);
}

// a share of chunks [lo, hi), both in one word so that the owner taking from the front
// and a thief taking from the back never take the same chunk
struct alignas(64) Share {
  std::atomic<uint64_t> span{0};
};

inline uint64_t pack(uint64_t lo, uint64_t hi) { return lo | (hi << 32); }

// take a chunk from the front (the owner) or the back (another thread); -1 when empty
inline int64_t take(Share& s, bool front) {
  uint64_t cur = s.span.load(std::memory_order_acquire);
  for (;;) {
    const uint64_t lo = cur & 0xffffffffu, hi = cur >> 32;
    if (lo >= hi) return -1;
    const uint64_t next = front ? pack(lo + 1, hi) : pack(lo, hi - 1);
    if (s.span.compare_exchange_weak(cur, next, std::memory_order_acq_rel, std::memory_order_acquire))
      return static_cast<int64_t>(front ? lo : hi - 1);
  }
}

// fn(begin, end) over [0, n) in chunks of `chunk` items, on torch's threads
template <typename Fn>
void parallel_chunks(int64_t n, int64_t chunk, const Fn& fn) {
  if (n <= 0) return;
  if (!enabled().load(std::memory_order_relaxed)) {
    at::parallel_for(0, n, 1, fn);
    return;
  }
  chunk = std::max<int64_t>(chunk, 1);
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t team = std::min<int64_t>(at::in_parallel_region() ? 1 : at::get_num_threads(), chunks);
  if (team <= 1) {
    fn(0, n);
    return;
  }
  std::vector<Share> shares(static_cast<size_t>(team));
  for (int64_t t = 0; t < team; ++t)
    shares[t].span.store(pack(chunks * t / team, chunks * (t + 1) / team), std::memory_order_relaxed);
  auto run = [&](int64_t c) { fn(c * chunk, std::min(n, (c + 1) * chunk)); };
  at::parallel_for(0, team, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t c; (c = take(shares[t], true)) >= 0;) run(c);
      for (int64_t k = 1; k < team; ++k)
        for (int64_t c; (c = take(shares[(t + k) % team], false)) >= 0;) run(c);
    }
  });
}

}  // namespace tandem_steal
