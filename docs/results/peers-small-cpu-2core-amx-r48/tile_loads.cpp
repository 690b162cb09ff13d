// How fast the AMX int8 tiles multiply, by where a 2x2 block's A and B tiles come from and
// whether their 64-byte rows start on a cache line. One thread; each step loads two A and
// two B tiles (4 KB) and issues four tdpbssd (65,536 multiply-adds), as quant_linear.cpp's
// tile_amx does. A "span" of S steps cycles over S * 2 KB of A (or B): 8 steps (16 KB)
// stay in L1, 64 steps (128 KB) come from L2.
//
//   g++ -O2 -march=sapphirerapids -I engine/cpu_kernels -o tile_loads \
//       docs/results/peers-small-cpu-2core-amx-r48/tile_loads.cpp && taskset -c 1 ./tile_loads
//
// (from the repository's root: amx.h's TileConfig and usable(), the kernels' own)
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <tuple>

#include "amx.h"

#if !TANDEM_AMX
#error "compile with AMX-INT8, AMX-BF16 and AVX512-BF16 (-march=sapphirerapids)"
#endif

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

alignas(64) int32_t sums[4][256];

// tiles 0-3 the sums, 4 and 5 A, 6 and 7 B; spans are powers of two
__attribute__((noinline)) void steps_2x2(const int8_t* a, const int8_t* b, int64_t steps, int64_t aspan, int64_t bspan) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    const int8_t* as = a + (s & (aspan - 1)) * 2048;
    const int8_t* bs = b + (s & (bspan - 1)) * 2048;
    _tile_loadd(4, as, 64);
    _tile_loadd(6, bs, 64);
    _tile_dpbssd(0, 4, 6);
    _tile_loadd(7, bs + 1024, 64);
    _tile_dpbssd(1, 4, 7);
    _tile_loadd(5, as + 1024, 64);
    _tile_dpbssd(2, 5, 6);
    _tile_dpbssd(3, 5, 7);
  }
  _tile_stored(0, sums[0], 64);
  _tile_stored(1, sums[1], 64);
  _tile_stored(2, sums[2], 64);
  _tile_stored(3, sums[3], 64);
}

__attribute__((noinline)) void multiplies_only(int64_t steps) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t s = 0; s < steps; ++s) {
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
    _tile_dpbssd(2, 5, 6);
    _tile_dpbssd(3, 5, 7);
  }
  _tile_stored(0, sums[0], 64);
}

}  // namespace

int main() {
  if (!tandem_amx::usable()) {
    std::puts("no AMX tiles for this process");
    return 1;
  }
  tandem_amx::TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  const int64_t bytes = 2048 * 64 + 64;
  int8_t* abuf = static_cast<int8_t*>(std::aligned_alloc(4096, bytes));
  int8_t* bbuf = static_cast<int8_t*>(std::aligned_alloc(4096, bytes));
  for (int64_t i = 0; i < bytes; ++i) abuf[i] = static_cast<int8_t>(std::rand() % 255 - 127), bbuf[i] = abuf[i] ^ 0x55;
  const int64_t steps = 300000;
  const double macs = steps * 65536.0;
  multiplies_only(10000);
  double t = now();
  multiplies_only(steps);
  t = now() - t;
  std::printf("tdpbssd alone, no loads:                  %.2f TMAC/s\n", macs / t / 1e12);
  for (int offset : {0, 16}) {
    for (auto [aspan, bspan, what] : {std::tuple<int64_t, int64_t, const char*>{8, 8, "A and B in L1"},
                                      {8, 64, "A in L1, B from L2"},
                                      {64, 64, "A and B from L2"}}) {
      steps_2x2(abuf + offset, bbuf + offset, 10000, aspan, bspan);
      t = now();
      steps_2x2(abuf + offset, bbuf + offset, steps, aspan, bspan);
      t = now() - t;
      std::printf("rows %s, %-20s %.2f TMAC/s\n", offset ? "16 bytes into a line" : "on a cache line     ", what,
                  macs / t / 1e12);
    }
  }
  _tile_release();
}
