// The tile unit's B-operand order for a linear layer's weight W [N, K], shared by the
// bf16 tile kernel (linear.cpp, E = 2 values a group) and the int8 one (quant_linear.cpp,
// E = 4): panels of 32 output rows, then steps of 16 x E inputs, then the panel's two
// halves of 16 rows, each a tile of 16 groups of E inputs x 16 rows x E. Row n, input k
// of W goes to [n / 32][k / (16 E)][(n % 32) / 16][(k % (16 E)) / E][n % 16][k % E].
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>

namespace tandem_tiles {

template <int E, typename T>
void pack(const T* src, T* dst, int64_t N, int64_t K) {
  constexpr int64_t kStep = 16 * E;
  at::parallel_for(0, N / 32, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t s = 0; s < K / kStep; ++s)
        for (int64_t t = 0; t < 2; ++t)
          for (int64_t j = 0; j < 16; ++j)
            for (int64_t n = 0; n < 16; ++n)
              for (int64_t e = 0; e < E; ++e)
                dst[((((p * (K / kStep) + s) * 2 + t) * 16 + j) * 16 + n) * E + e] =
                    src[(p * 32 + t * 16 + n) * K + s * kStep + j * E + e];
  });
}

}  // namespace tandem_tiles
