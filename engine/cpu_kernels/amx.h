// Intel AMX (the tile matrix unit) for the kernels that use it: paged_attention.cpp's
// decode and prefill attention, linear.cpp's tile linear layer, quant_linear.cpp's.
//
// TANDEM_AMX is 1 where the compiler targets AMX-BF16 and AMX-INT8 (and AVX512-BF16 beside it).
// Linux hands a process the 8 KB of tile state only once it asks (arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA, kernel 5.16 and later); oneDNN asks too when its
// matmuls use AMX. `tandem_amx::usable()` asks once and remembers the answer.
// A kernel loads its own tile configuration on every thread it runs on (other kernels
// on the same thread load theirs), and releases the tiles when done, so a context switch
// has no tile data to save.
#pragma once

#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define TANDEM_AMX 1
#else
#define TANDEM_AMX 0
#endif

namespace tandem_amx {

inline bool usable() {
#if TANDEM_AMX
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

// Palette 1: up to 8 tiles of at most 16 rows of 64 bytes, each tile's shape set here
// (rows 0 and colsb 0: the tile is not used).
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

#if TANDEM_AMX
// The linear layers' tile blocks (linear.cpp's bf16 tile kernel, quant_linear.cpp's int8
// and widened ones): tiles 0-3 hold the sums of x's rows 0-15 and 16-31 (r0 and r1 of
// them) by a panel's outputs 0-15 and 16-31; 4 and 5 those rows' A tiles, 6 and 7 the
// panel's two B tiles of a step.
inline void configure_2x2(int r0, int r1) {
  TileConfig cfg;
  for (int t : {0, 1, 4}) cfg.rows[t] = static_cast<uint8_t>(r0), cfg.colsb[t] = 64;
  for (int t : {2, 3, 5}) cfg.rows[t] = static_cast<uint8_t>(r1), cfg.colsb[t] = r1 ? 64 : 0;
  for (int t : {6, 7}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// The configuration for a block of `rows` rows (r0 + r1 of them), loaded unless
// `configured` (r0 * 32 + r1 of the loaded one, -1 for none) says it already is.
inline void configure_2x2_for(int rows, int& r0, int& r1, int& configured) {
  r0 = rows < 16 ? rows : 16;
  r1 = rows - r0;
  if (r0 * 32 + r1 != configured) {
    configure_2x2(r0, r1);
    configured = r0 * 32 + r1;
  }
}

// One block of up to 32 rows of x against a panel, configured by configure_2x2(r0, r1):
// A rows `lda` bytes apart, 64 bytes a step (32 bf16 or 64 int8 inputs); the panel two
// 1 KB B tiles a step, 2 KB apart. The four 16 x 16 sums (fp32, or int32 for INT8:
// tdpbssd on int8 instead of tdpbf16ps on bf16) go to c[4][256]. Each step also asks for
// `ahead` 64-byte lines of [next, next_end), the next panel, into L2.
template <bool INT8>
inline void block_2x2(const char* a, int64_t lda, const char* b, int64_t steps, int r1, void* c, const char*& next,
                      const char* next_end, int64_t ahead) {
  _tile_zero(0);
  _tile_zero(1);
  if (r1) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t s = 0; s < steps; ++s) {
    const char* bt = b + s * 2048;
    for (int64_t l = 0; l < ahead && next < next_end; ++l, next += 64) _mm_prefetch(next, _MM_HINT_T2);
    _tile_loadd(4, a + 64 * s, lda);
    _tile_loadd(6, bt, 64);
    _tile_loadd(7, bt + 1024, 64);
    if constexpr (INT8) {
      _tile_dpbssd(0, 4, 6);
      _tile_dpbssd(1, 4, 7);
    } else {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (r1) {
      _tile_loadd(5, a + 16 * lda + 64 * s, lda);
      if constexpr (INT8) {
        _tile_dpbssd(2, 5, 6);
        _tile_dpbssd(3, 5, 7);
      } else {
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
  }
  char* out = static_cast<char*>(c);
  _tile_stored(0, out, 64);
  _tile_stored(1, out + 1024, 64);
  if (r1) {
    _tile_stored(2, out + 2048, 64);
    _tile_stored(3, out + 3072, 64);
  }
}
#endif

}  // namespace tandem_amx
