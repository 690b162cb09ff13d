// The W8A8 kernels' quantization of x (engine/cpu_kernels/quant_linear.cpp quantize_row)
// takes round(x / s) as q1 = fma(fma(-q0, s, x), r, q0), q0 = x * r, r = 1 / s, where the
// division took a vector division a value. This checks, for every bf16 largest magnitude
// `top` in [1, 2) (s = top / 127) and every bf16 x with |x| <= top, that q1 is the
// division's quotient (normal x), and that both round to the same integer; and counts how
// often x * r alone rounds to the other integer. Scaling x and top by a power of two
// changes none of these quotients (while no value is subnormal), so this covers every
// row whose largest magnitude is a normal number above 2^-60 (the kernels divide below).
//
//   g++ -O2 -march=native -ffp-contract=off quotient_check.cpp -o quotient_check && ./quotient_check
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>

static float bf16(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

int main() {
  long pairs = 0, differ = 0, plain_differs = 0;
  for (uint16_t tb = 0x3f80; tb < 0x4000; ++tb) {
    const float top = bf16(tb), s = top / 127.0f, r = 1.0f / s;
    for (uint32_t xb = 0; xb < 0x10000; ++xb) {
      const float x = bf16(static_cast<uint16_t>(xb));
      if (!(std::fabs(x) <= top)) continue;
      const float want = x / s, q0 = x * r, q1 = std::fma(std::fma(-q0, s, x), r, q0);
      ++pairs;
      if (std::nearbyint(q1) != std::nearbyint(want) || (q1 != want && std::fabs(x) > 1e-30f)) ++differ;
      if (std::nearbyint(q0) != std::nearbyint(want)) ++plain_differs;
    }
  }
  std::printf("%ld pairs: the corrected quotient differs in %ld, x * r alone rounds differently in %ld\n", pairs,
              differ, plain_differs);
  return differ != 0;
}
