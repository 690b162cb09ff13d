// Intel AMX (the tile matrix unit) for the kernels that use it: paged_attention.cpp's
// decode and prefill attention, linear.cpp's tile linear layer.
//
// TANDEM_AMX is 1 where the compiler targets AMX-BF16 (and AVX512-BF16 beside it).
// Linux hands a process the 8 KB of tile state only once it asks (arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA, kernel 5.16 and later); oneDNN asks too when its
// matmuls use AMX. `tandem_amx::usable()` asks once and remembers the answer.
// A kernel loads its own tile configuration on every thread it runs on (other kernels
// on the same thread load theirs), and releases the tiles when done, so a context switch
// has no tile data to save.
#pragma once

#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
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

}  // namespace tandem_amx
