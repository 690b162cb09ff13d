// Pieces the kernels' vector code shares across files: the exp polynomial's constants
// (paged_attention.cpp's AVX-512 and AVX2 exp), an 8-lane horizontal sum (the AVX2
// attention vector and linear.cpp's widening kernel), fp32 -> bf16 rounding with a chosen
// NaN (linear.cpp as c10 rounds, quant_linear.cpp's SwiGLU as torch's vectors do), and
// scratch vectors that start on a cache line.
#pragma once

#include <cstddef>
#include <new>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace tandem_simd {

// std::vector storage that starts on a 64-byte cache line. The AMX tiles load and store
// rows of 64 bytes: in a buffer that std::vector's allocator starts 16 bytes into a line,
// every row touches two lines (quant_linear.cpp's x_q, paged_attention.cpp's scratch).
template <typename T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <typename U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const Aligned64<U>&) const { return true; }
  template <typename U>
  bool operator!=(const Aligned64<U>&) const { return false; }
};

// exp(x) for x <= 0: x = n ln2 + r, |r| <= ln2/2, ln2 split in two for the reduction;
// e^r = 1 + r + r^2 p(r), p of degree 5 (Cephes expf's coefficients, highest first, ~1 ulp)
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

#if defined(__AVX2__)
// 16 float8 e4m3 values (sign, 4 exponent bits with bias 7, 3 mantissa bits, no
// infinities) as 16 fp16 values 2^-8 times theirs: the 7 magnitude bits moved up 7 place
// the exponent and mantissa in fp16's fields, whose bias of 15 is 8 more than e4m3's, and
// a zero exponent (an e4m3 subnormal, m * 2^-9) lands on the fp16 subnormal m * 2^-17.
// So converting to fp32 and multiplying by 256 gives the exact value. (The NaN byte 0x7f
// would come out finite; the cache is written by rounding finite values, never NaN.)
inline __m256i fp8_as_half16(__m128i bytes) {
  const __m256i x = _mm256_cvtepu8_epi16(bytes);
  const __m256i mag = _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x7f)), 7);
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x80)), 8);
  return _mm256_or_si256(mag, sign);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 16 fp32 values -> bf16 bits, rounded to nearest even with subnormals kept (the bf16
// conversion instruction flushes them), a NaN to `nan`: c10::BFloat16(float) gives
// 0x7fc0, torch's AVX-512 vectors (convert_float_bfloat16, as silu_ and mul_ store) 0xffff
inline __m256i round_bf16(__m512 v, int nan) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(nan));
  return _mm512_cvtepi32_epi16(r);
}
#endif

inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
#endif

}  // namespace tandem_simd
