// Pieces the kernels' vector code shares across files: the exp polynomial's constants
// (paged_attention.cpp's AVX-512 and AVX2 exp) and an 8-lane horizontal sum (the AVX2
// attention vector and linear.cpp's widening kernel).
#pragma once

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace tandem_simd {

// exp(x) for x <= 0: x = n ln2 + r, |r| <= ln2/2, ln2 split in two for the reduction;
// e^r = 1 + r + r^2 p(r), p of degree 5 (Cephes expf's coefficients, highest first, ~1 ulp)
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

#if defined(__AVX2__)
inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
#endif

}  // namespace tandem_simd
