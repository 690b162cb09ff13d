// Linear layers on 8-bit weights: y = x @ (q * scale).T (+ b), for any number of rows.
//
//   x:     [M, K] bf16 or fp32, rows contiguous
//   q:     [N, K] int8 or float8_e4m3fn, row-major (the checkpoint's layout, never copied)
//   scale: [N, G] fp32; the K columns go in G groups of `group` (the last may be short),
//          G = 1 (group >= K) being one scale per output channel
//   b:     [N] in x's dtype, or absent;  out: [M, N] in x's dtype
//
// Two ways, by what x and q are:
// * bf16 x, int8 q, one scale a row: W8A8. Each row of x is quantized to int8 (one scale
//   a row) and the dot products are exact int32 (VNNI, AVX2 byte products, AMX int8
//   tiles), so every path gives the same bits at every batch size (the W8A8 section).
//   On AMX CPUs q is kept in the tile unit's order instead of row-major
//   (quant_pack_int8): the tiles read it as stored above four rows, VNNI with the rows
//   in the lanes at one to four.
// * otherwise (fp32 x: exact against the dequantized weights; fp8 q; group scales): q is
//   widened to fp32 in registers, 16 values at a time (8 with AVX2):
//     int8: sign-extend to int32, convert (two instructions);
//     e4m3: the byte's sign, exponent and mantissa moved into an fp16's places (an AND
//           and a shift each), which is the value / 256 exactly, subnormals included;
//           F16C converts it to fp32, and the 256 is folded into the scale.
//   Within a group the sums run over the group's columns; the group's sum is then
//   multiplied by its scale and added to the output's total, in the same order whatever
//   the rows computed beside it. Up to four rows of x share one pass over q; above that q
//   goes in tiles of rows (about 16 KB, in L1) that each group of four rows passes over,
//   and with AMX and bf16 x (one scale a row) a panel of 32 rows of q is widened into
//   bf16 in the tile unit's layout (int8 and e4m3 values are exact in bf16) in L2 and
//   multiplied on the tiles, the scale applied to the fp32 sums.
// A decode step reads every weight once, so at one to four rows a layer is bound by the
// weight stream: each thread takes a contiguous run of output rows (or panels) and reads
// it front to back, asking for the bytes 8 KB ahead, as linear.cpp's kernels do (the
// hardware prefetcher stops at 4 KB pages). No path keeps a dequantized copy of W.
//
// Which paths run here: `quant_linear_kernel()`.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include "amx.h"
#include "simd.h"
#include "steal.h"
#include "tile_layout.h"

namespace {

using c10::BFloat16;
struct Fp8 {
  uint8_t bits;
};

constexpr int64_t kAhead = 8192;  // bytes a weight stream asks for ahead of its reads
constexpr int64_t kStreamRows = 4;  // up to this many rows of x share one pass over q
constexpr int64_t kMaxTileK = 65536;  // inputs a row the AMX int8 path takes (x_q's row on the stack)

// e4m3 byte -> the bits of the fp16 whose value is the e4m3 value / 256
inline uint16_t fp8_as_half_bits(uint8_t b) { return static_cast<uint16_t>(((b & 0x80u) << 8) | ((b & 0x7fu) << 7)); }
inline float widen1(int8_t q) { return static_cast<float>(q); }
inline float widen1(Fp8 q) { return static_cast<float>(c10::Half(fp8_as_half_bits(q.bits), c10::Half::from_bits())); }
template <typename Q>
constexpr float scale_fold() { return std::is_same_v<Q, Fp8> ? 256.0f : 1.0f; }

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define TANDEM_QVEC 16
using Vec = __m512;
constexpr int64_t kL = 16;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vset1(float s) { return _mm512_set1_ps(s); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
inline Vec widen(const int8_t* q) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
}
inline Vec widen(const Fp8* q) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                    _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7));
  return _mm512_cvtph_ps(h);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TANDEM_QVEC 8
using Vec = __m256;
constexpr int64_t kL = 8;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vset1(float s) { return _mm256_set1_ps(s); }
inline float vsum(Vec v) { return tandem_simd::hsum8(v); }
inline Vec widen(const int8_t* q) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
}
inline Vec widen(const Fp8* q) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                 _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7));
  return _mm256_cvtph_ps(h);
}
#else
#define TANDEM_QVEC 0
#endif


// y[m * N + r] = x[m] . (q[r] * scale[r]) (+ b[r]) for R rows of q (stride K) and MT rows
// of x (fp32, stride K)
template <typename Q, typename T, int R, int MT, bool ONE>
inline void qblock(const float* xa, int64_t K, const Q* W, const float* S, int64_t G, int64_t group, const T* b,
                   T* y, int64_t N) {
  constexpr float fold = scale_fold<Q>();
  float tail[R][MT] = {};
#if TANDEM_QVEC
  // totals over the groups; with one group (ONE) the group's sums are the totals, scaled
  // at the end, which leaves the registers to more rows
  Vec tot[ONE ? 1 : R][ONE ? 1 : MT];
  if constexpr (!ONE)
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) tot[r][m] = vzero();
  Vec acc[R][MT];
#endif
  for (int64_t g = 0; g < G; ++g) {
    const int64_t k0 = g * group, k1 = std::min(K, k0 + group);
    int64_t kv = k0;
#if TANDEM_QVEC
    kv = k0 + (k1 - k0) / kL * kL;
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) acc[r][m] = vzero();
    for (int64_t k = k0; k < kv; k += kL) {
      Vec w[R];
      for (int r = 0; r < R; ++r) {
        if ((k & 63) < kL) _mm_prefetch(reinterpret_cast<const char*>(W + r * K + k) + kAhead, _MM_HINT_T2);
        w[r] = widen(W + r * K + k);
      }
      for (int m = 0; m < MT; ++m) {
        const Vec xv = vload(xa + m * K + k);
        for (int r = 0; r < R; ++r) acc[r][m] = vfma(xv, w[r], acc[r][m]);
      }
    }
    if constexpr (!ONE)
      for (int r = 0; r < R; ++r) {
        const Vec s = vset1(S[r * G + g] * fold);
        for (int m = 0; m < MT; ++m) tot[r][m] = vfma(acc[r][m], s, tot[r][m]);
      }
#endif
    if (kv < k1)
      for (int r = 0; r < R; ++r) {
        const float s = S[r * G + g] * fold;
        for (int m = 0; m < MT; ++m) {
          float part = 0.0f;
          for (int64_t k = kv; k < k1; ++k) part += xa[m * K + k] * widen1(W[r * K + k]);
          tail[r][m] += part * s;
        }
      }
  }
  for (int r = 0; r < R; ++r) {
    const float bias = b == nullptr ? 0.0f : static_cast<float>(b[r]);
    for (int m = 0; m < MT; ++m) {
#if TANDEM_QVEC
      const float sum = ONE ? vsum(acc[r][m]) * (S[r] * fold) + tail[r][m] : vsum(tot[r][m]) + tail[r][m];
#else
      const float sum = tail[r][m];
#endif
      y[m * N + r] = T(sum + bias);
    }
  }
}

// q rows [n0, n1) against MT rows of x, R rows of q at a time (fewer at more rows of x,
// whose sums then fill the registers: AVX2 has 16, AVX-512 32)
template <typename Q, typename T, int MT, bool ONE>
void qspan_groups(const float* xa, const Q* W, const float* S, int64_t G, int64_t group, const T* b, T* y,
                  int64_t n0, int64_t n1, int64_t N, int64_t K) {
  // AVX-512 has 32 vector registers, AVX2 16: sums (and totals) R x MT, R weight vectors
  constexpr int R = TANDEM_QVEC == 16 ? (ONE ? 4 : MT == 1 ? 4 : MT == 2 ? 3 : 2)
                                      : (MT == 1 ? 4 : ONE ? (MT == 2 ? 4 : 2) : (MT == 2 ? 2 : 1));
  auto bias = [&](int64_t r) { return b == nullptr ? nullptr : b + r; };
  int64_t n = n0;
  for (; n + R <= n1; n += R) qblock<Q, T, R, MT, ONE>(xa, K, W + n * K, S + n * G, G, group, bias(n), y + n, N);
  for (; n < n1; ++n) qblock<Q, T, 1, MT, ONE>(xa, K, W + n * K, S + n * G, G, group, bias(n), y + n, N);
}

template <typename Q, typename T, int MT>
void qspan(const float* xa, const Q* W, const float* S, int64_t G, int64_t group, const T* b, T* y, int64_t n0,
           int64_t n1, int64_t N, int64_t K) {
  if (G == 1)
    qspan_groups<Q, T, MT, true>(xa, W, S, G, group, b, y, n0, n1, N, K);
  else
    qspan_groups<Q, T, MT, false>(xa, W, S, G, group, b, y, n0, n1, N, K);
}

template <typename Q, typename T>
void qspan_rows(int64_t mt, const float* xa, const Q* W, const float* S, int64_t G, int64_t group, const T* b, T* y,
                int64_t n0, int64_t n1, int64_t N, int64_t K) {
  switch (mt) {
    case 1: qspan<Q, T, 1>(xa, W, S, G, group, b, y, n0, n1, N, K); break;
    case 2: qspan<Q, T, 2>(xa, W, S, G, group, b, y, n0, n1, N, K); break;
    case 3: qspan<Q, T, 3>(xa, W, S, G, group, b, y, n0, n1, N, K); break;
    default: qspan<Q, T, 4>(xa, W, S, G, group, b, y, n0, n1, N, K); break;
  }
}

constexpr int64_t kPanel = 32;  // output rows a panel: two B tiles of 16 (tile order's 32 outputs)

#if TANDEM_AMX

// 16 x 16 32-bit words transposed in registers: r[c] becomes what was column c
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {  // pairs of rows, interleaved by word within each 128-bit lane
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // a lane of r[4i + c]: column 4L + c of rows 4i..4i+3
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i)  // then the 128-bit lanes: columns to their registers
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0x88);
      t[8 * i + j + 4] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

// a panel's 32 rows of q (stride K) -> bf16 in the tile layout: per 32 inputs s, per half
// t of the panel, 16 pairs of inputs x 16 rows x 2 (tile_pack_linear_weight's order).
// Each row's 32 values are one register of 16 bf16 pairs; 16 rows' registers, transposed,
// are the 16 rows of the tile (pair j of every row).
template <typename Q>
void widen_panel(const Q* W, int64_t K, BFloat16* out) {
  __m512i r[16];
  for (int64_t s = 0; s < K / 32; ++s)
    for (int64_t t = 0; t < 2; ++t) {
      for (int64_t n = 0; n < 16; ++n) {
        const Q* row = W + (t * 16 + n) * K + s * 32;
        if ((s & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(row) + kAhead, _MM_HINT_T2);
        r[n] = (__m512i)_mm512_cvtne2ps_pbh(widen(row + 16), widen(row));
      }
      transpose16(r);
      __m512i* dst = reinterpret_cast<__m512i*>(out + (s * 2 + t) * 512);
      for (int j = 0; j < 16; ++j) _mm512_store_si512(dst + j, r[j]);
    }
}

// rows x 16 fp32 sums (row stride 16) x scale (+ bias) -> bf16 y (row stride ldy)
inline void store_scaled(const float* c, const float* s, const BFloat16* b, BFloat16* y, int64_t ldy, int rows,
                         float fold) {
  const __m512 sv = _mm512_mul_ps(_mm512_loadu_ps(s), _mm512_set1_ps(fold));
  const __m512 bias = b == nullptr ? _mm512_setzero_ps()
                                   : _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i*)b));
  for (int r = 0; r < rows; ++r) {
    const __m512 v = _mm512_fmadd_ps(_mm512_load_ps(c + 16 * r), sv, bias);
    _mm256_storeu_si256((__m256i*)(y + r * ldy), (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// panels [p0, p1) of y = x @ (q * scale).T (+ b), one scale a row, on the calling thread
template <typename Q>
void amx_panels(const BFloat16* x, const Q* W, const float* S, const BFloat16* b, BFloat16* y, int64_t M, int64_t N,
                int64_t K, int64_t p0, int64_t p1) {
  thread_local std::vector<BFloat16, tandem_simd::Aligned64<BFloat16>> buf;
  if (static_cast<int64_t>(buf.size()) < K * kPanel) buf.resize(K * kPanel);
  BFloat16* panel = buf.data();
  const int64_t blocks = (M + 31) / 32, lda = K * static_cast<int64_t>(sizeof(BFloat16));
  constexpr float fold = scale_fold<Q>();
  alignas(64) float c[4][256];
  int configured = -1;
  for (int64_t p = p0; p < p1; ++p) {
    widen_panel(W + p * kPanel * K, K, panel);
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int rows = static_cast<int>(std::min<int64_t>(32, M - 32 * blk));
      int r0, r1;
      tandem_amx::configure_2x2_for(rows, r0, r1, configured);
      const char* none = nullptr;  // the panel was just widened: nothing to ask for ahead
      tandem_amx::block_2x2<false>(reinterpret_cast<const char*>(x + 32 * blk * K), lda,
                                   reinterpret_cast<const char*>(panel), K / 32, r1, c, none, none, 0);
      BFloat16* yo = y + 32 * blk * N + p * kPanel;
      const float* so = S + p * kPanel;
      const BFloat16* bo = b == nullptr ? nullptr : b + p * kPanel;
      const BFloat16* bo16 = b == nullptr ? nullptr : bo + 16;
      store_scaled(c[0], so, bo, yo, N, r0, fold);
      store_scaled(c[1], so + 16, bo16, yo + 16, N, r0, fold);
      if (r1) {
        store_scaled(c[2], so, bo, yo + 16 * N, N, r1, fold);
        store_scaled(c[3], so + 16, bo16, yo + 16 * N + 16, N, r1, fold);
      }
    }
  }
  _tile_release();
}
#endif

// ---- int8 weights x bf16 activations: integer dot products (W8A8) ----
// Each row of x is quantized to int8 with one symmetric scale (its largest magnitude /
// 127, round to nearest even), and y = (x_q . q) * (s_x * s_w) + b: the sums are exact
// int32, so every path below (VNNI, AVX2's pairwise products, the AMX int8 tiles, scalar)
// gives the same bits, and a row's result does not depend on the batch. x_q . q is
// what llama.cpp's Q8_0 computes too (its activation scales per 32 values; these per
// row, which the tile unit's whole-K sums need).
//   AVX512-VNNI: vpdpbusd multiplies unsigned by signed bytes: x_q + 128 (as u8) times q,
//     then 128 * sum(q row), kept per row at load, comes off.
//   AVX2 (and AVX-512 without VNNI): |x_q| times q with x_q's sign (pmaddubsw; pairs of
//     products stay below 2^15), pmaddwd with ones into int32.
//   AMX: tdpbssd, signed by signed bytes, 64 inputs a step, on q kept in the tile order
//     (quant_pack_int8, below).

// the unsigned byte operand of this build's integer products, made once with x_q:
// x_q + 128 for VNNI's vpdpbusd (its sums carry 128 * sum(q), taken off after), |x_q|
// otherwise (pmaddubsw, x_q's sign moved onto q)
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kUnsignedX = true;
#else
constexpr bool kUnsignedX = false;
#endif

struct XQ {  // x quantized: rows of K int8, the same as u8 (kUnsignedX), a scale a row
  const int8_t* q;
  const uint8_t* u;
  const float* s;
};

// one row: its scale, and x / scale rounded to nearest even, in [-127, 127]; `u` (the
// unsigned operand, above) written only where a path reads it (null: not)
//
// The quotient: a vector division a value cost more than the rest of the row's work.
// With AVX-512 each value is instead q = x * r, r = 1 / scale (one division a row),
// corrected once with the exact residual: e = fma(-q, scale, x), q' = fma(e, r, q), which
// is the correctly rounded x / scale (Markstein's correction; r correctly rounded). Checked
// over every bf16 x against every bf16 largest magnitude in [1, 2) (4.18 M pairs: scaling
// both by a power of two changes neither quotient, so that covers every row whose largest
// magnitude is a normal number above 2^-60): q' equals the division in all of them, where
// x * r alone rounds 48 of them to the other integer (docs/results/
// peers-small-cpu-2core-amx-r47/quotient_check.cpp). Rows whose largest magnitude is below
// 2^-60 (so that the residual could underflow) divide. tests/unit/test_quant_linear.py
// compares the kernel's x_q with torch's x / scale on such values. On the AMX Xeon of round
// 47 a 2,048 x 1,024 x took 0.50 -> 0.42 ms to quantize, 2,048 x 2,816 1.38 -> 1.12 ms
// (with the unsigned copy left out where the AMX tiles do not read it).
template <typename T>
void quantize_row(const T* row, int64_t K, int8_t* q, uint8_t* u, float* scale) {
  int64_t k = 0;
  float top = 0.0f;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  auto load16 = [&](int64_t i) {
    if constexpr (std::is_same_v<T, float>)
      return _mm512_loadu_ps(row + i);
    else
      return _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(row + i))), 16));
  };
  __m512 vtop = _mm512_setzero_ps();
  for (; k + 16 <= K; k += 16) vtop = _mm512_max_ps(vtop, _mm512_abs_ps(load16(k)));
  top = _mm512_reduce_max_ps(vtop);
#endif
  for (; k < K; ++k) top = std::max(top, std::abs(static_cast<float>(row[k])));
  const float s = top > 0.0f ? top / 127.0f : 1.0f;
  *scale = s;
  k = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (top >= 0x1p-60f) {
    const __m512 vs = _mm512_set1_ps(s), vr = _mm512_set1_ps(1.0f / s);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    // 16 values -> 16 int32 in [-127, 127]: the corrected quotient, rounded to nearest even
    auto quotient = [&](int64_t i) {
      const __m512 x = load16(i);
      const __m512 q0 = _mm512_mul_ps(x, vr);
      const __m512 q1 = _mm512_fmadd_ps(_mm512_fnmadd_ps(q0, vs, x), vr, q0);
      return _mm512_min_epi32(hi, _mm512_max_epi32(lo, _mm512_cvt_roundps_epi32(
                                                           q1, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
    };
    // the saturating packs interleave 128-bit lanes; this puts the 64 bytes back in order
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    for (; k + 64 <= K; k += 64) {
      const __m512i ab = _mm512_packs_epi32(quotient(k), quotient(k + 16));
      const __m512i cd = _mm512_packs_epi32(quotient(k + 32), quotient(k + 48));
      const __m512i v = _mm512_permutexvar_epi32(order, _mm512_packs_epi16(ab, cd));
      _mm512_storeu_si512(q + k, v);
      if (u != nullptr)
        _mm512_storeu_si512(u + k, kUnsignedX ? _mm512_xor_si512(v, _mm512_set1_epi8(-128)) : _mm512_abs_epi8(v));
    }
    for (; k + 16 <= K; k += 16) {
      const __m512i i = quotient(k);
      _mm_storeu_si128((__m128i*)(q + k), _mm512_cvtepi32_epi8(i));
      if (u != nullptr) {
        const __m512i ui = kUnsignedX ? _mm512_add_epi32(i, _mm512_set1_epi32(128)) : _mm512_abs_epi32(i);
        _mm_storeu_si128((__m128i*)(u + k), _mm512_cvtepi32_epi8(ui));
      }
    }
  }
#endif
  for (; k < K; ++k) {
    const float v = std::nearbyint(static_cast<float>(row[k]) / s);
    const int8_t qk = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, v)));
    q[k] = qk;
    if (u != nullptr) u[k] = static_cast<uint8_t>(kUnsignedX ? qk + 128 : std::abs(qk));
  }
}

// every row of x quantized, in buffers of the calling thread; `with_u`: the unsigned
// operand too (the VNNI and AVX2 products read it, AMX's tdpbssd does not)
//
// `tiles` (the AMX int8 path, K a multiple of 64, at most kMaxTileK, no unsigned copy):
// q in the tiles' A order instead of row-major, blocks of 16 rows, then steps of 64
// inputs, each step one 1 KB tile of the block's 16 rows x 64 bytes ([ceil(M / 16)][K /
// 64][16][64]; a last block of fewer rows leaves its other rows unwritten, and its tiles
// load only the rows it has). A tile load then reads 1 KB in a run, where rows K bytes
// apart fell on the same few L1 sets. Either way the chunk of rows m0.. starts m0 * K
// bytes in (m0 a multiple of 16).
//
// The buffers start on a 64-byte line (tandem_simd::Aligned64): the AMX tiles load x_q's
// rows 64 bytes at a time, and a row that straddles two lines costs two
template <typename T>
XQ quantize_rows(const T* x, int64_t M, int64_t K, bool with_u = true, bool tiles = false) {
  thread_local std::vector<int8_t, tandem_simd::Aligned64<int8_t>> qbuf;
  thread_local std::vector<uint8_t, tandem_simd::Aligned64<uint8_t>> ubuf;
  thread_local std::vector<float, tandem_simd::Aligned64<float>> sbuf;
  const int64_t q_bytes = (tiles ? (M + 15) / 16 * 16 : M) * K;
  if (static_cast<int64_t>(qbuf.size()) < q_bytes) qbuf.resize(q_bytes);
  if (with_u && static_cast<int64_t>(ubuf.size()) < M * K) ubuf.resize(M * K);
  if (static_cast<int64_t>(sbuf.size()) < M) sbuf.resize(M);
  int8_t* q = qbuf.data();
  uint8_t* u = with_u ? ubuf.data() : nullptr;
  float* s = sbuf.data();
  if (!tiles) {
    at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        quantize_row(x + m * K, K, q + m * K, u == nullptr ? nullptr : u + m * K, s + m);
    });
    return {q, u, s};
  }
  at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
    alignas(64) int8_t row[kMaxTileK];  // (a row on the stack, then its 64-byte steps to their tiles)
    for (int64_t m = m0; m < m1; ++m) {
      quantize_row(x + m * K, K, row, nullptr, s + m);
      int8_t* dst = q + (m / 16) * 16 * K + (m % 16) * 64;
      for (int64_t t = 0; t < K / 64; ++t) std::memcpy(dst + t * 1024, row + t * 64, 64);
    }
  });
  return {q, u, s};
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int64_t kIL = 64;  // bytes an integer step takes
using IVec = __m512i;
inline IVec izero() { return _mm512_setzero_si512(); }
inline IVec idot(IVec acc, const int8_t*, const uint8_t* xu, const int8_t* w) {
  return _mm512_dpbusd_epi32(acc, _mm512_loadu_si512(xu), _mm512_loadu_si512(w));
}
inline int32_t isum(IVec v) { return _mm512_reduce_add_epi32(v); }
#elif defined(__AVX512BW__)
constexpr int64_t kIL = 64;
using IVec = __m512i;
inline IVec izero() { return _mm512_setzero_si512(); }
inline IVec idot(IVec acc, const int8_t* xq, const uint8_t*, const int8_t* w) {
  const __m512i x = _mm512_loadu_si512(xq), wv = _mm512_loadu_si512(w);
  const __m512i wx = _mm512_mask_sub_epi8(wv, _mm512_movepi8_mask(x), _mm512_setzero_si512(), wv);
  const __m512i p = _mm512_maddubs_epi16(_mm512_abs_epi8(x), wx);
  return _mm512_add_epi32(acc, _mm512_madd_epi16(p, _mm512_set1_epi16(1)));
}
inline int32_t isum(IVec v) { return _mm512_reduce_add_epi32(v); }
#elif defined(__AVX2__)
constexpr int64_t kIL = 32;
using IVec = __m256i;
inline IVec izero() { return _mm256_setzero_si256(); }
inline IVec idot(IVec acc, const int8_t* xq, const uint8_t* xu, const int8_t* w) {  // xu: |x_q|
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xu));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, _mm256_sign_epi8(wv, x)),
                                                 _mm256_set1_epi16(1)));
}
inline int32_t isum(IVec v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}
#else
constexpr int64_t kIL = 0;
#endif

// y = (x_q . q) * (s_x * s_w) + b, the bits every path gives
template <typename T>
inline T w8a8_out(int32_t dot, float sx, float sw, const T* b, int64_t n) {
  const float v = static_cast<float>(dot) * (sx * sw);
  return T(b == nullptr ? v : v + static_cast<float>(b[n]));
}

// rows [n0, n1) of q against MT rows of x_q, R rows of q at a time
template <typename T, int R, int MT>
inline void iblock(const XQ& xq, int64_t K, const int8_t* W, const float* S, const int32_t* wsum, const T* b, T* y,
                   int64_t N, int64_t n) {
  int32_t dot[R][MT] = {};
  int64_t k = 0;
#if defined(__AVX2__) || defined(__AVX512BW__)
  IVec acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = izero();
  for (; k + kIL <= K; k += kIL) {
    for (int r = 0; r < R; ++r) {
      const int8_t* w = W + (n + r) * K + k;
      if ((k & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(w) + kAhead, _MM_HINT_T2);
      for (int m = 0; m < MT; ++m) acc[r][m] = idot(acc[r][m], xq.q + m * K + k, xq.u + m * K + k, w);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) dot[r][m] = isum(acc[r][m]) - (kUnsignedX ? 128 * wsum[n + r] : 0);
#endif
  for (; k < K; ++k)  // (with VNNI's correction taken off the whole row, its tail's share back on)
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m)
        dot[r][m] += (int32_t(xq.q[m * K + k]) + (kUnsignedX ? 128 : 0)) * int32_t(W[(n + r) * K + k]);
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) y[m * N + n + r] = w8a8_out<T>(dot[r][m], xq.s[m], S[n + r], b, n + r);
}

#if defined(__AVX2__) && !defined(__AVX512BW__)
// AVX2 and one row of x (a decode step of one sequence): q's rows one after another, each
// front to back, so that a thread's share is one stream. Four rows a pass (iblock) read
// four streams a row's length apart, which the prefetchers of a 2-core AVX2 EPYC (Zen 3)
// follow worse: the step's 168 MB of small's int8 layers went at 10-14 GB/s that way
// against 12.6-16.5 GB/s one row at a time (docs/results/peers-small-cpu-2core-zen3-avx2-r45/).
// The products are idot's (|x_q| made with x_q, xq.u): the same int32 sums, so the same
// bits as every other path's.
template <typename T>
void ispan_one_row(const XQ& xq, int64_t K, const int8_t* W, const float* S, const T* b, T* y, int64_t n0,
                   int64_t n1) {
  auto part = [&](__m256i acc, const int8_t* w, int64_t at) { return idot(acc, xq.q + at, xq.u + at, w + at); };
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* w = W + n * K;
    __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(w + k) + kAhead, _MM_HINT_T2);
      a0 = part(a0, w, k);
      a1 = part(a1, w, k + 32);
    }
    if (k + 32 <= K) a0 = part(a0, w, k), k += 32;
    int32_t dot = isum(_mm256_add_epi32(a0, a1));
    for (; k < K; ++k) dot += int32_t(xq.q[k]) * int32_t(w[k]);
    y[n] = w8a8_out<T>(dot, xq.s[0], S[n], b, n);
  }
}
#endif

template <typename T, int MT>
void ispan(const XQ& xq, int64_t K, const int8_t* W, const float* S, const int32_t* wsum, const T* b, T* y,
           int64_t N, int64_t n0, int64_t n1) {
#if defined(__AVX2__) && !defined(__AVX512BW__)
  if constexpr (MT == 1) {
    ispan_one_row<T>(xq, K, W, S, b, y, n0, n1);
    return;
  }
#endif
  constexpr int R = MT == 1 ? 4 : MT == 2 ? 3 : 2;
  int64_t n = n0;
  for (; n + R <= n1; n += R) iblock<T, R, MT>(xq, K, W, S, wsum, b, y, N, n);
  for (; n < n1; ++n) iblock<T, 1, MT>(xq, K, W, S, wsum, b, y, N, n);
}

template <typename T>
void ispan_rows(int64_t mt, const XQ& xq, int64_t K, const int8_t* W, const float* S, const int32_t* wsum,
                const T* b, T* y, int64_t N, int64_t n0, int64_t n1) {
  switch (mt) {
    case 1: ispan<T, 1>(xq, K, W, S, wsum, b, y, N, n0, n1); break;
    case 2: ispan<T, 2>(xq, K, W, S, wsum, b, y, N, n0, n1); break;
    case 3: ispan<T, 3>(xq, K, W, S, wsum, b, y, N, n0, n1); break;
    default: ispan<T, 4>(xq, K, W, S, wsum, b, y, N, n0, n1); break;
  }
}

// int8 weights in tile order (quant_pack_int8) on VNNI: where the build has AVX512-VNNI and
// AVX512-BF16 (the amx and avx512_bf16 builds)
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define TANDEM_VNNI_TILES 1
#else
#define TANDEM_VNNI_TILES 0
#endif

#if TANDEM_VNNI_TILES
// 16 outputs of a row before the bias: the int32 sums times x's row scale and the weights'
inline __m512 w8a8_value(const int32_t* c, float sx, __m512 sw) {
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c)), _mm512_mul_ps(_mm512_set1_ps(sx), sw));
}

// rows x 16 int32 sums (row stride 16) -> y, as w8a8_out
inline void store_w8a8(const int32_t* c, const float* sx, const float* sw, const BFloat16* b, BFloat16* y,
                       int64_t ldy, int rows) {
  const __m512 w = _mm512_loadu_ps(sw);
  const __m512 bias = b == nullptr ? _mm512_setzero_ps()
                                   : _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i*)b));
  for (int r = 0; r < rows; ++r) {
    __m512 v = w8a8_value(c + 16 * r, sx[r], w);
    if (b != nullptr) v = _mm512_add_ps(v, bias);
    _mm256_storeu_si256((__m256i*)(y + r * ldy), (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// ---- SwiGLU in the epilogue: h = silu(x Wg^T) * (x Wu^T), the MLP's gate and up layers
// in one call (quant_linear_tiles_swiglu). Gate and up share x's quantization, and
// neither of their outputs is written: 16 gate and 16 up sums of a row become 16 values
// of h. The bits are the unfused layers' followed by torch's silu_ and mul_ (what
// engine/models/llama.py's MLP runs): gate and up rounded to bf16 as store_w8a8 rounds
// them, silu as torch's vectorized CPU kernel computes it for bf16 (x / (1 + exp(-x)) in
// fp32, exp being Sleef's expf16_u10, which libtorch_cpu exports because its own headers'
// inline Vectorized<float>::exp calls it), rounded as torch rounds fp32 to bf16, then the
// product of the two bf16 values in fp32, rounded the same way.
extern "C" __m512 Sleef_expf16_u10(__m512);

// fp32 -> bf16 as torch's AVX-512 vectors round it (simd.h)
inline __m256i bf16_as_torch_vectors(__m512 v) { return tandem_simd::round_bf16(v, 0xffff); }

inline __m512 bf16_widen(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// rows x 16 outputs of h from the gate's sums `cg` and the up's `cu` (each row stride 16),
// their weight scales swg and swu, x's row scales sx. In three passes over the rows, so
// that the calls to Sleef (which may clobber every vector register) have nothing live
// around them: gate and up as bf16 values, exp(-gate), then the rest.
inline void store_swiglu(const int32_t* cg, const int32_t* cu, const float* sx, const float* swg, const float* swu,
                         BFloat16* y, int64_t ldy, int rows) {
  alignas(64) float g[16][16], u[16][16], e[16][16];
  const __m512 wg = _mm512_loadu_ps(swg), wu = _mm512_loadu_ps(swu), neg = _mm512_set1_ps(-0.0f);
  for (int r = 0; r < rows; ++r) {
    const __m512 gr = bf16_widen((__m256i)_mm512_cvtneps_pbh(w8a8_value(cg + 16 * r, sx[r], wg)));
    _mm512_store_ps(g[r], gr);
    _mm512_store_ps(e[r], _mm512_xor_ps(gr, neg));
    _mm512_store_ps(u[r], bf16_widen((__m256i)_mm512_cvtneps_pbh(w8a8_value(cu + 16 * r, sx[r], wu))));
  }
  for (int r = 0; r < rows; ++r) _mm512_store_ps(e[r], Sleef_expf16_u10(_mm512_load_ps(e[r])));  // exp(-g)
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int r = 0; r < rows; ++r) {
    const __m512 silu = _mm512_div_ps(_mm512_load_ps(g[r]), _mm512_add_ps(one, _mm512_load_ps(e[r])));
    const __m512 act = bf16_widen(bf16_as_torch_vectors(silu));
    _mm256_storeu_si256((__m256i*)(y + r * ldy), bf16_as_torch_vectors(_mm512_mul_ps(act, _mm512_load_ps(u[r]))));
  }
}

#endif

// the W8A8 layer on row-major q: x quantized once, then the integer dot products,
// streaming q once for up to four rows at a time, and above that q tiled through L1 (on
// AMX CPUs a bf16 model's int8 layers take the tile order below instead)
template <typename T>
void w8a8_linear(const T* x, const int8_t* W, const float* S, const int32_t* wsum, const T* b, T* y, int64_t M,
                 int64_t N, int64_t K) {
  const XQ xq = quantize_rows(x, M, K);
  if (M <= kStreamRows) {  // a weight stream: shares a free thread takes over (steal.h)
    tandem_steal::parallel_chunks(N, tandem_steal::chunk_items(K, 16), [&](int64_t n0, int64_t n1) {
      ispan_rows<T>(M, xq, K, W, S, wsum, b, y, N, n0, n1);
    });
    return;
  }
  const int64_t tile = std::max<int64_t>(12, 16384 / std::max<int64_t>(K, 1) / 12 * 12);
  at::parallel_for(0, (N + tile - 1) / tile, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t m = 0; m < M; m += kStreamRows) {
        const XQ part{xq.q + m * K, xq.u + m * K, xq.s + m};
        ispan_rows<T>(std::min<int64_t>(M - m, kStreamRows), part, K, W, S, wsum, b, y + m * N, N, t * tile,
                      std::min(N, (t + 1) * tile));
      }
  });
}

template <typename Q, typename T>
void qlinear(const T* x, const Q* W, const float* S, int64_t G, int64_t group, const T* b, T* y, int64_t M, int64_t N,
             int64_t K) {
#if TANDEM_AMX
  if constexpr (std::is_same_v<T, BFloat16>) {
    if (M > kStreamRows && G == 1 && N % kPanel == 0 && K % 32 == 0 && tandem_amx::usable()) {
      at::parallel_for(0, N / kPanel, 1, [&](int64_t p0, int64_t p1) { amx_panels(x, W, S, b, y, M, N, K, p0, p1); });
      return;
    }
  }
#endif
  thread_local std::vector<float> xbuf;  // x in fp32 (bf16 widened once per call)
  const float* xa = nullptr;
  if constexpr (std::is_same_v<T, float>) {
    xa = x;
  } else {
    if (static_cast<int64_t>(xbuf.size()) < M * K) xbuf.resize(M * K);
    float* xw = xbuf.data();
    for (int64_t i = 0; i < M * K; ++i) xw[i] = static_cast<float>(x[i]);
    xa = xw;
  }
  if (M <= kStreamRows) {  // a weight stream: shares a free thread takes over (steal.h)
    tandem_steal::parallel_chunks(N, tandem_steal::chunk_items(K, 16), [&](int64_t n0, int64_t n1) {
      qspan_rows<Q, T>(M, xa, W, S, G, group, b, y, n0, n1, N, K);
    });
    return;
  }
  // rows of q a tile: about 16 KB of them, a multiple of 12 (every R divides it)
  const int64_t tile = std::max<int64_t>(12, 16384 / std::max<int64_t>(K, 1) / 12 * 12);
  const int64_t tiles = (N + tile - 1) / tile;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * tile, n1 = std::min(N, n0 + tile);
      for (int64_t m = 0; m < M; m += kStreamRows)
        qspan_rows<Q, T>(std::min<int64_t>(M - m, kStreamRows), xa + m * K, W, S, G, group, b, y + m * N, n0, n1, N,
                         K);
    }
  });
}

template <typename T>
void run_typed(const at::Tensor& out, const at::Tensor& x, const at::Tensor& q, const float* S, int64_t G,
               int64_t group, const std::optional<at::Tensor>& bias, const int32_t* wsum, int64_t M, int64_t N,
               int64_t K) {
  const T* b = bias.has_value() && bias->defined() ? bias->data_ptr<T>() : nullptr;
  if (wsum != nullptr)
    w8a8_linear<T>(x.data_ptr<T>(), q.data_ptr<int8_t>(), S, wsum, b, out.data_ptr<T>(), M, N, K);
  else if (q.scalar_type() == at::kChar)
    qlinear<int8_t, T>(x.data_ptr<T>(), q.data_ptr<int8_t>(), S, G, group, b, out.data_ptr<T>(), M, N, K);
  else
    qlinear<Fp8, T>(x.data_ptr<T>(), reinterpret_cast<const Fp8*>(q.data_ptr()), S, G, group, b, out.data_ptr<T>(),
                    M, N, K);
}

// `weight_sums` (int8 weights, one scale a row, bf16 x): the sum of each row of q, int32,
// and the layer runs W8A8 (above); absent: x stays in its dtype
void quant_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                  int64_t group, const std::optional<at::Tensor>& bias,
                  const std::optional<at::Tensor>& weight_sums) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && out.dim() == 2 && scale.dim() == 2,
              "quant_linear: x, weight, scale and out must be 2-d");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "quant_linear: x has ", K, " features, weight ", weight.size(1));
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "quant_linear: out must be [", M, ", ", N, "]");
  TORCH_CHECK(weight.scalar_type() == at::kChar || weight.scalar_type() == at::kFloat8_e4m3fn,
              "quant_linear: weight must be int8 or float8_e4m3fn");
  TORCH_CHECK(group >= 1, "quant_linear: group must be >= 1");
  const int64_t G = (K + group - 1) / group;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.size(0) == N && scale.size(1) == G,
              "quant_linear: scale must be fp32 [", N, ", ", G, "]");
  const at::ScalarType type = x.scalar_type();
  TORCH_CHECK(type == at::kBFloat16 || type == at::kFloat, "quant_linear: x must be bf16 or fp32");
  TORCH_CHECK(out.scalar_type() == type, "quant_linear: out must be of x's dtype");
  for (const at::Tensor* t : {&out, &x, &weight, &scale})
    TORCH_CHECK(t->is_contiguous() && t->device().is_cpu(), "quant_linear: tensors must be contiguous, on CPU");
  if (bias.has_value() && bias->defined())
    TORCH_CHECK(bias->scalar_type() == type && bias->is_contiguous() && bias->numel() == N,
                "quant_linear: bias must be a contiguous [", N, "] of x's dtype");
  const int32_t* wsum = nullptr;
  if (weight_sums.has_value() && weight_sums->defined()) {
    TORCH_CHECK(weight.scalar_type() == at::kChar && G == 1 && type == at::kBFloat16,
                "quant_linear: weight_sums (W8A8) go with int8 weights, one scale a row, and bf16 x");
    TORCH_CHECK(weight_sums->scalar_type() == at::kInt && weight_sums->numel() == N && weight_sums->is_contiguous(),
                "quant_linear: weight_sums must be a contiguous int32 [", N, "]");
    wsum = weight_sums->data_ptr<int32_t>();
  }
  if (M == 0 || N == 0) return;
  if (type == at::kFloat)
    run_typed<float>(out, x, weight, scale.data_ptr<float>(), G, group, bias, wsum, M, N, K);
  else
    run_typed<BFloat16>(out, x, weight, scale.data_ptr<float>(), G, group, bias, wsum, M, N, K);
}

// ---- int8 weights kept in the tile unit's order (AMX CPUs, bf16 models) ----
// [N/32 panels][K/64 steps][2 halves][16 groups of 4 inputs][16 rows][4]: each 1 KB is
// an AMX int8 B tile (tdpbssd reads it as stored; no copy or transposition per call),
// and the same bytes serve one to four rows of x on AVX512-VNNI with the rows in the
// vector lanes: each 64-byte tile row holds 4 inputs of 16 output rows, which one
// vpdpbusd multiplies by those 4 inputs of x broadcast, so a lane's sum is one output's
// and no horizontal sums are needed. The sums are exact int32 as on every other path,
// so the bits are those of the row-major kernel.
at::Tensor quant_pack_int8(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.device().is_cpu(),
              "quant_pack_int8: weight must be a 2-d int8 CPU tensor");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % 32 == 0 && K % 64 == 0 && N > 0, "quant_pack_int8: [N, K] must be multiples of [32, 64], not [",
              N, ", ", K, "]");
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty({N / 32, K / 64, 2, 16, 64}, w.options());
  tandem_tiles::pack<4>(w.data_ptr<int8_t>(), out.data_ptr<int8_t>(), N, K);
  return out;
}

#if TANDEM_VNNI_TILES
// MT rows of x against panels [p0, p1) of tiles on VNNI, the rows' sums in the vector
// lanes: one to four rows stream the weights (a decode step); without AMX, more rows go
// MT = 8 at a time over each panel (tile_vnni), the panel staying in L2 between them
//
// kSwiglu: the weights are a gate and an up layer interleaved (QuantSwiGLU: each panel's
// first 16 rows the gate's, the other 16 the up's, of the same 16 outputs), and y [rows,
// N / 2] takes h = silu(gate) * up (store_swiglu); no bias
template <int MT, bool kSwiglu = false>
void tile_stream(const XQ& xq, const int8_t* tiles, const float* S, const int32_t* wsum, const BFloat16* b,
                 BFloat16* y, int64_t N, int64_t K, int64_t p0, int64_t p1) {
  const int64_t steps = K / 64;
  for (int64_t p = p0; p < p1; ++p) {
    __m512i acc[2][MT];
    for (int t = 0; t < 2; ++t)
      for (int m = 0; m < MT; ++m) acc[t][m] = _mm512_setzero_si512();
    const int8_t* wp = tiles + p * steps * 2048;
    for (int64_t s = 0; s < steps; ++s) {
      const int8_t* w0 = wp + s * 2048;
      for (int j = 0; j < 16; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(w0 + j * 64) + kAhead, _MM_HINT_T2);
        _mm_prefetch(reinterpret_cast<const char*>(w0 + 1024 + j * 64) + kAhead, _MM_HINT_T2);
        const __m512i lo = _mm512_load_si512(w0 + j * 64), hi = _mm512_load_si512(w0 + 1024 + j * 64);
        for (int m = 0; m < MT; ++m) {
          int32_t four;
          std::memcpy(&four, xq.u + m * K + s * 64 + j * 4, 4);
          const __m512i xb = _mm512_set1_epi32(four);
          acc[0][m] = _mm512_dpbusd_epi32(acc[0][m], xb, lo);
          acc[1][m] = _mm512_dpbusd_epi32(acc[1][m], xb, hi);
        }
      }
    }
    alignas(64) int32_t dot[2][MT][16];
    for (int t = 0; t < 2; ++t) {
      const int64_t n = p * 32 + t * 16;
      const __m512i corr = _mm512_slli_epi32(_mm512_loadu_si512(wsum + n), 7);  // 128 * sum(q row)
      for (int m = 0; m < MT; ++m) _mm512_store_si512(dot[t][m], _mm512_sub_epi32(acc[t][m], corr));
      if constexpr (!kSwiglu)
        for (int m = 0; m < MT; ++m)
          store_w8a8(dot[t][m], xq.s + m, S + n, b == nullptr ? nullptr : b + n, y + m * N + n, N, 1);
    }
    if constexpr (kSwiglu)
      for (int m = 0; m < MT; ++m)
        store_swiglu(dot[0][m], dot[1][m], xq.s + m, S + p * 32, S + p * 32 + 16, y + m * (N / 2) + p * 16, N / 2, 1);
  }
}

// more than four rows of x on VNNI (no AMX): for each panel, the rows 8 at a time (16
// accumulators, the panel's two weight vectors and a broadcast of x in 19 registers), so
// each weight vector loaded serves 16 products; no horizontal sums, the bits of every
// other path
template <bool kSwiglu = false>
void tile_vnni(const XQ& xq, const int8_t* tiles, const float* S, const int32_t* wsum, const BFloat16* b,
               BFloat16* y, int64_t M, int64_t N, int64_t K, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
      const XQ part{xq.q + m0 * K, xq.u + m0 * K, xq.s + m0};
      BFloat16* yo = y + m0 * (kSwiglu ? N / 2 : N);
      switch (std::min<int64_t>(8, M - m0)) {
        case 1: tile_stream<1, kSwiglu>(part, tiles, S, wsum, b, yo, N, K, p, p + 1); break;
        case 2: tile_stream<2, kSwiglu>(part, tiles, S, wsum, b, yo, N, K, p, p + 1); break;
        case 3: tile_stream<3, kSwiglu>(part, tiles, S, wsum, b, yo, N, K, p, p + 1); break;
        case 4: tile_stream<4, kSwiglu>(part, tiles, S, wsum, b, yo, N, K, p, p + 1); break;
        case 5: tile_stream<5, kSwiglu>(part, tiles, S, wsum, b, yo, N, K, p, p + 1); break;
        case 6: tile_stream<6, kSwiglu>(part, tiles, S, wsum, b, yo, N, K, p, p + 1); break;
        case 7: tile_stream<7, kSwiglu>(part, tiles, S, wsum, b, yo, N, K, p, p + 1); break;
        default: tile_stream<8, kSwiglu>(part, tiles, S, wsum, b, yo, N, K, p, p + 1); break;
      }
    }
  }
}
#endif

// Rows of x a pass over the weights above kStreamRows. Each panel's loop reads the
// whole of its rows of x again (tile_amx: 2 KB of A tiles a step, for 2 KB of B), so those
// rows must stay in L2: 256 rows of int8 x are 256 KB at K = 1,024 and 704 KB at 2,816,
// of a 2 MB L2. At a 2,048-token prefill step, in one pass the 2 MB to 5.8 MB of x came
// from L3 for every panel. With this and the quotient above, small's five int8 layers at
// 2,048 rows went from 28.5 to 23.9 ms on the AMX Xeon of round 47 (docs/results/
// peers-small-cpu-2core-amx-r47/int8_layers_ab.py); passes of 128 rows measured slower
// than 256, of 512 no faster. Decode batches (at most 256 rows) take one pass, as before.
constexpr int64_t kChunkRows = 256;

#if TANDEM_AMX
// Steps of 64 inputs a block's sums stay in tiles before they go to memory (and come back
// for the next steps): 8 steps are 16 KB of the panel's B tiles, which stay in L1 while
// the chunk's blocks of x pass under them (the panel's whole K did not fit beside x's
// tiles at K = 1,024 and above)
constexpr int64_t kTileSteps = 8;

// x's rows (a chunk of at most kChunkRows, in tile order: quantize_rows) against
// panels [p0, p1) on the int8 tiles: for each panel, kTileSteps steps at a time, each
// block of 32 rows' four 16 x 16 sums in tiles 0-3 (configure_2x2), A tiles 4 and 5, the
// panel's B tiles 6 and 7; the sums of a block wait in `acc` between passes
// (kSwiglu: as tile_stream's, h = silu(gate) * up from each block's four sums)
template <bool kSwiglu = false>
void tile_amx(const XQ& xq, const int8_t* tiles, const float* S, const BFloat16* b, BFloat16* y, int64_t M,
              int64_t N, int64_t K, int64_t p0, int64_t p1) {
  const int64_t steps = K / 64, blocks = (M + 31) / 32;
  alignas(64) int32_t acc[kChunkRows / 32][4][256];
  int configured = -1;
  for (int64_t p = p0; p < p1; ++p) {
    const int8_t* wp = tiles + p * steps * 2048;
    // the next panel's lines, asked for into L2 a few at a time over this panel's steps
    const char* next = reinterpret_cast<const char*>(wp + steps * 2048);
    const char* next_end = p + 1 < p1 ? next + steps * 2048 : next;
    const int64_t ahead = (32 * 2 + blocks - 1) / blocks;
    for (int64_t k0 = 0; k0 < steps; k0 += kTileSteps) {
      const int64_t k1 = std::min(steps, k0 + kTileSteps);
      for (int64_t blk = 0; blk < blocks; ++blk) {
        const int rows = static_cast<int>(std::min<int64_t>(32, M - 32 * blk));
        int r0, r1;
        tandem_amx::configure_2x2_for(rows, r0, r1, configured);
        int32_t(*c)[256] = acc[blk];
        if (k0 == 0) {
          _tile_zero(0);
          _tile_zero(1);
          if (r1) {
            _tile_zero(2);
            _tile_zero(3);
          }
        } else {
          _tile_loadd(0, c[0], 64);
          _tile_loadd(1, c[1], 64);
          if (r1) {
            _tile_loadd(2, c[2], 64);
            _tile_loadd(3, c[3], 64);
          }
        }
        const int8_t* a0 = xq.q + 2 * blk * steps * 1024;
        const int8_t* a1 = a0 + steps * 1024;
        for (int64_t s = k0; s < k1; ++s) {
          const int8_t* bt = wp + s * 2048;
          for (int64_t l = 0; l < ahead && next < next_end; ++l, next += 64) _mm_prefetch(next, _MM_HINT_T2);
          _tile_loadd(4, a0 + s * 1024, 64);
          _tile_loadd(6, bt, 64);
          _tile_dpbssd(0, 4, 6);
          _tile_loadd(7, bt + 1024, 64);
          _tile_dpbssd(1, 4, 7);
          if (r1) {
            _tile_loadd(5, a1 + s * 1024, 64);
            _tile_dpbssd(2, 5, 6);
            _tile_dpbssd(3, 5, 7);
          }
        }
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        if (r1) {
          _tile_stored(2, c[2], 64);
          _tile_stored(3, c[3], 64);
        }
        if (k1 < steps) continue;
        if constexpr (kSwiglu) {
          const int64_t ldy = N / 2;
          BFloat16* yo = y + 32 * blk * ldy + p * 16;
          store_swiglu(c[0], c[1], xq.s + 32 * blk, S + p * kPanel, S + p * kPanel + 16, yo, ldy, r0);
          if (r1)
            store_swiglu(c[2], c[3], xq.s + 32 * blk + 16, S + p * kPanel, S + p * kPanel + 16, yo + 16 * ldy, ldy, r1);
          continue;
        }
        BFloat16* yo = y + 32 * blk * N + p * kPanel;
        const float* sx = xq.s + 32 * blk;
        const float* sw = S + p * kPanel;
        const BFloat16* bo = b == nullptr ? nullptr : b + p * kPanel;
        const BFloat16* bo16 = b == nullptr ? nullptr : bo + 16;
        store_w8a8(c[0], sx, sw, bo, yo, N, r0);
        store_w8a8(c[1], sx, sw + 16, bo16, yo + 16, N, r0);
        if (r1) {
          store_w8a8(c[2], sx + 16, sw, bo, yo + 16 * N, N, r1);
          store_w8a8(c[3], sx + 16, sw + 16, bo16, yo + 16 * N + 16, N, r1);
        }
      }
    }
  }
  _tile_release();
}
#endif

// tile order pays where the CPU multiplies int8 on AMX tiles or VNNI with BF16 beside it
bool tiles_supported() { return TANDEM_VNNI_TILES || tandem_amx::usable(); }

// the W8A8 layer on weights in tile order (quant_pack_int8); bf16 x, one scale a row.
// kSwiglu: the tiles are a gate and an up layer interleaved (engine/quantization/
// linear.py's QuantSwiGLU), out [M, N / 2] takes silu(gate) * up, and there is no bias
template <bool kSwiglu>
void run_tiles(const char* op, const at::Tensor& out, const at::Tensor& x, const at::Tensor& tiles,
               const at::Tensor& scale, const BFloat16* b, const at::Tensor& weight_sums) {
  TORCH_CHECK(tiles_supported(), op, ": this build has neither AMX tiles nor AVX512-VNNI with BF16");
  TORCH_CHECK(tiles.dim() == 5 && tiles.size(2) == 2 && tiles.size(3) == 16 && tiles.size(4) == 64 &&
                  tiles.scalar_type() == at::kChar && tiles.is_contiguous(),
              op, ": tiles must come from quant_pack_int8");
  const int64_t N = tiles.size(0) * 32, K = tiles.size(1) * 64, n_out = kSwiglu ? N / 2 : N;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              op, ": x must be contiguous bf16 [M, ", K, "]");
  const int64_t M = x.size(0);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == n_out && out.scalar_type() == at::kBFloat16 &&
                  out.is_contiguous(), op, ": out must be contiguous bf16 [", M, ", ", n_out, "]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == N && scale.is_contiguous(),
              op, ": scale must be contiguous fp32 [", N, ", 1]");
  TORCH_CHECK(weight_sums.scalar_type() == at::kInt && weight_sums.numel() == N && weight_sums.is_contiguous(),
              op, ": weight_sums must be a contiguous int32 [", N, "]");
  if (M == 0) return;
#if TANDEM_VNNI_TILES
  const bool amx = M > kStreamRows && K <= kMaxTileK && tandem_amx::usable();
  const XQ xq = quantize_rows(x.data_ptr<BFloat16>(), M, K, /*with_u=*/!amx, /*tiles=*/amx);
  const int8_t* tp = tiles.data_ptr<int8_t>();
  const float* S = scale.data_ptr<float>();
  const int32_t* wsum = weight_sums.data_ptr<int32_t>();
  BFloat16* yp = out.data_ptr<BFloat16>();
  if (M <= kStreamRows) {  // a weight stream: each thread its share, taking the others' when done (steal.h)
    tandem_steal::parallel_chunks(N / kPanel, tandem_steal::chunk_items(32 * K), [&](int64_t p0, int64_t p1) {
      switch (M) {
        case 1: tile_stream<1, kSwiglu>(xq, tp, S, wsum, b, yp, N, K, p0, p1); break;
        case 2: tile_stream<2, kSwiglu>(xq, tp, S, wsum, b, yp, N, K, p0, p1); break;
        case 3: tile_stream<3, kSwiglu>(xq, tp, S, wsum, b, yp, N, K, p0, p1); break;
        default: tile_stream<4, kSwiglu>(xq, tp, S, wsum, b, yp, N, K, p0, p1); break;
      }
    });
    return;
  }
  // More rows: the weights pass once per kChunkRows rows of x, whose bytes stay in L2
  // (above)
  for (int64_t m0 = 0; m0 < M; m0 += kChunkRows) {
    const int64_t rows = std::min(kChunkRows, M - m0);
    const XQ part{xq.q + m0 * K, xq.u == nullptr ? nullptr : xq.u + m0 * K, xq.s + m0};
    at::parallel_for(0, N / kPanel, 1, [&](int64_t p0, int64_t p1) {
#if TANDEM_AMX
      if (amx) {
        tile_amx<kSwiglu>(part, tp, S, b, yp + m0 * n_out, rows, N, K, p0, p1);
        return;
      }
#endif
      tile_vnni<kSwiglu>(part, tp, S, wsum, b, yp + m0 * n_out, rows, N, K, p0, p1);
    });
  }
#endif
}

void quant_linear_tiles(const at::Tensor& out, const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scale,
                        const std::optional<at::Tensor>& bias, const at::Tensor& weight_sums) {
  const BFloat16* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == tiles.size(0) * 32,
                "quant_linear_tiles: bias must be a contiguous bf16 [", tiles.size(0) * 32, "]");
    b = bias->data_ptr<BFloat16>();
  }
  run_tiles<false>("quant_linear_tiles", out, x, tiles, scale, b, weight_sums);
}

// the MLP's gate and up layers and SwiGLU between them, in one call: out = silu(x Wg^T) *
// (x Wu^T) on the interleaved tiles of both (store_swiglu: the unfused layers' bits)
void quant_linear_tiles_swiglu(const at::Tensor& out, const at::Tensor& x, const at::Tensor& tiles,
                               const at::Tensor& scale, const at::Tensor& weight_sums) {
  run_tiles<true>("quant_linear_tiles_swiglu", out, x, tiles, scale, nullptr, weight_sums);
}

// which paths run here: bf16 x int8 (integer dot products), the widening one (fp32 x,
// fp8 weights, group scales), and the tile unit's for more than four rows
std::string kernel_name() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  std::string w8a8 = "avx512_vnni";
#elif defined(__AVX512BW__)
  std::string w8a8 = "avx512bw";
#elif defined(__AVX2__)
  std::string w8a8 = "avx2";
#else
  std::string w8a8 = "generic";
#endif
  std::string widen = TANDEM_QVEC == 16 ? "avx512" : TANDEM_QVEC == 8 ? "avx2" : "generic";
  const bool amx = tandem_amx::usable();
  const std::string order = TANDEM_VNNI_TILES ? " (bf16 models: weights in tile order)" : "";
  return "int8 x bf16: " + w8a8 + (amx ? "+amx_int8" : "") + order + "; widening: " + widen + (amx ? "+amx_bf16" : "");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(TORCH_EXTENSION_NAME, m) {
  m.def("quant_linear(Tensor(a!) out, Tensor x, Tensor weight, Tensor scale, int group, Tensor? bias, "
        "Tensor? weight_sums=None) -> ()",
        &quant_linear);
  m.def("quant_linear_kernel() -> str", &kernel_name);
  m.def("quant_pack_int8(Tensor weight) -> Tensor", &quant_pack_int8);
  m.def("quant_tiles_supported() -> bool", &tiles_supported);
  m.def("quant_linear_tiles(Tensor(a!) out, Tensor x, Tensor tiles, Tensor scale, Tensor? bias, Tensor weight_sums) "
        "-> ()", &quant_linear_tiles);
  m.def("quant_linear_tiles_swiglu(Tensor(a!) out, Tensor x, Tensor tiles, Tensor scale, Tensor weight_sums) -> ()",
        &quant_linear_tiles_swiglu);
}
