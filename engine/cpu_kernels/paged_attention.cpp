// Paged attention on CPU, reading K/V in place from the paged cache (no gather, no
// mask, no padded copies): decode (one query token per sequence) below, prefill chunks
// (bf16, AVX512-BF16, or AMX tiles where the CPU has them) further down.
//
//   query, out:  [B, H, D]            (last dim contiguous)
//   k/v_cache:   [N, bs, Hkv, D]      (last dim contiguous; K and V share strides)
//   block_tables [B, M] int32, seq_lens [B] int32 (context incl. the new token)
//
// Work item = (sequence b, a run of ng kv heads, normally all of them). The G =
// H / Hkv query heads of each kv head are handled together, so each K/V row is read
// from memory once per group, and a block's rows are walked in address order. Two
// passes over the context, fp32 throughout:
//   1. s[h, t] = scale * q[h] . k[t]       (scores in a per-thread scratch)
//   2. p = exp(s - max_t s); out[h] = sum_t p[h, t] v[t] / sum_t p[h, t]
// With a bf16 query and cache (and `bf16_pairs`, the default) pass 2 multiplies p,
// rounded to bf16, into V two tokens an instruction on AVX512-BF16's dot product;
// the sums stay fp32 (in attend, below).
// Where the CPU has AMX (blocks hold a multiple of 32 tokens, D is 64 or 128, 4 to 16
// query heads share a kv head), a bf16 item runs both passes on tiles instead (attend's
// kAmx branches; over an fp8 cache too, its rows widened to bf16 as they are loaded):
// the scores of a kv head's G query heads against 16 tokens are one tile
// product per 32 dims, with no horizontal sums, and p.v takes 32 tokens an instruction.
// On the 2-core Xeon of docs/performance.md (fifteenth round) a layer of small's shape
// (B=100, L=320) went from 1.95 to 1.32 ms with the cache in L3 and 2.46 to 1.75-1.96 ms
// scattered.
// Items are handed out through an atomic counter so ragged lengths balance.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include "amx.h"
#include "simd.h"

namespace {

using c10::BFloat16;
using c10::Float8_e4m3fn;
using c10::Half;

// ---- 16-lane fp32 vector: AVX-512 when compiled for it, else a plain array the
// compiler vectorises for whatever -march allows. One kernel body uses either.
#if defined(__AVX512F__)
struct V16 {
  __m512 v;
};
inline V16 vzero() { return {_mm512_setzero_ps()}; }
inline V16 vset1(float x) { return {_mm512_set1_ps(x)}; }
inline V16 vfma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V16 vadd(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 vmul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 vmax(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline float vsum(V16 a) { return _mm512_reduce_add_ps(a.v); }
inline float vhmax(V16 a) { return _mm512_reduce_max_ps(a.v); }
inline V16 vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V16 vload(const BFloat16* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
}
inline V16 vload(const Half* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
// 16 e4m3 bytes as fp16 (fp8_as_half in simd.h: exact, subnormals included), then
// fp32, times 2^8 (exact): the fp8 KV cache's values, before its scale
inline V16 vload(const Float8_e4m3fn* p) {
  const __m256i h = tandem_simd::fp8_as_half16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f))};
}
inline void vstore(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline void vstore_n(float* p, V16 a, int n) { _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), a.v); }
// Lane t of the result = the sum of a[t]'s 16 lanes: 16 horizontal sums in 45 ops
// (pairwise interleave-and-add within 128-bit lanes, then across them).
inline V16 vsum16(const V16* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i].v, a[2 * i + 1].v),
                         _mm512_unpackhi_ps(a[2 * i].v, a[2 * i + 1].v));
  for (int i = 0; i < 4; ++i) {
    __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // c[i]'s 128-bit lane j holds lane-j partial sums of tokens 4i..4i+3: add over j.
  __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x44), _mm512_shuffle_f32x4(c[0], c[1], 0xEE));
  __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x44), _mm512_shuffle_f32x4(c[2], c[3], 0xEE));
  return {_mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, 0x88), _mm512_shuffle_f32x4(e0, e1, 0xDD))};
}
// exp for x <= 0 (simd.h's reduction and polynomial), scaled by 2^n with vscalefps
// (underflows to 0).
inline V16 vexp(V16 x) {
  using namespace tandem_simd;
  __m512 xv = _mm512_max_ps(x.v, _mm512_set1_ps(-104.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xv, _mm512_set1_ps(kLog2e)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), xv);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return {_mm512_scalef_ps(p, n)};
}
constexpr int kSimdLanes = 16;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// AVX2: two 8-lane halves. 16 registers hold 8 such vectors, so the loops that keep 16
// of them (a tile's 16 dot products) spill some to L1, which costs less than the
// memory they wait on.
struct V16 {
  __m256 lo, hi;
};
inline V16 vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 vfma(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V16 vadd(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 vmul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 vmax(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline float vsum(V16 a) { return tandem_simd::hsum8(_mm256_add_ps(a.lo, a.hi)); }
inline float vhmax(V16 a) {
  __m256 m = _mm256_max_ps(a.lo, a.hi);
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
inline V16 vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 widen_bf16(const BFloat16* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline V16 vload(const BFloat16* p) { return {widen_bf16(p), widen_bf16(p + 8)}; }
inline V16 vload(const Half* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline V16 vload(const Float8_e4m3fn* p) {
  const __m256i h = tandem_simd::fp8_as_half16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 k = _mm256_set1_ps(256.0f);
  return {_mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), k),
          _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), k)};
}
inline void vstore(float* p, V16 a) { _mm256_storeu_ps(p, a.lo), _mm256_storeu_ps(p + 8, a.hi); }
inline void vstore_n(float* p, V16 a, int n) {
  alignas(32) float t[16];
  vstore(t, a);
  for (int i = 0; i < n; ++i) p[i] = t[i];
}
// The lane sums of 8 vectors as one vector (lane i: the sum of v[i]), by pairwise
// horizontal adds and one exchange of 128-bit halves.
inline __m256 sum_lanes8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
inline V16 vsum16(const V16* a) {
  __m256 h[16];
  for (int i = 0; i < 16; ++i) h[i] = _mm256_add_ps(a[i].lo, a[i].hi);
  return {sum_lanes8(h), sum_lanes8(h + 8)};
}
// exp for x <= 0, the same reduction and polynomial as the AVX-512 version; 2^n is built
// in the exponent bits, so inputs below -87 (results under 2^-126) give 0
inline __m256 exp8(__m256 x) {
  using namespace tandem_simd;
  const __m256 xv = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xv, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), xv);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ), y);
}
inline V16 vexp(V16 x) { return {exp8(x.lo), exp8(x.hi)}; }
constexpr int kSimdLanes = 8;
#else
struct V16 {
  float v[16];
};
inline V16 vset1(float x) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = x; return r; }
inline V16 vzero() { return vset1(0.f); }
inline V16 vadd(V16 a, V16 b) { for (int i = 0; i < 16; ++i) a.v[i] += b.v[i]; return a; }
inline V16 vfma(V16 a, V16 b, V16 c) { for (int i = 0; i < 16; ++i) c.v[i] += a.v[i] * b.v[i]; return c; }
inline V16 vmul(V16 a, V16 b) { for (int i = 0; i < 16; ++i) a.v[i] *= b.v[i]; return a; }
inline V16 vmax(V16 a, V16 b) { for (int i = 0; i < 16; ++i) a.v[i] = std::max(a.v[i], b.v[i]); return a; }
inline float vsum(V16 a) { float s = 0.f; for (int i = 0; i < 16; ++i) s += a.v[i]; return s; }
inline float vhmax(V16 a) { float m = a.v[0]; for (int i = 1; i < 16; ++i) m = std::max(m, a.v[i]); return m; }
template <typename T>
inline V16 vload(const T* p) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = static_cast<float>(p[i]); return r; }
inline void vstore(float* p, V16 a) { for (int i = 0; i < 16; ++i) p[i] = a.v[i]; }
inline void vstore_n(float* p, V16 a, int n) { for (int i = 0; i < n; ++i) p[i] = a.v[i]; }
inline V16 vsum16(const V16* a) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = vsum(a[i]); return r; }
inline V16 vexp(V16 x) { for (int i = 0; i < 16; ++i) x.v[i] = std::exp(x.v[i]); return x; }
constexpr int kSimdLanes = 0;
#endif


// ---- AMX (Intel's tile matrix unit, amx.h): bf16 K rows times the query in one
// instruction. The decode kernel uses tiles only where the build targets AMX, the kernel
// granted them and `set_decode_amx` has not turned them off.
std::atomic<bool> g_decode_amx{true};

#if TANDEM_AMX
using tandem_amx::TileConfig;

// Scores of one kv head's G query heads against 16 tokens:
//   tmm0  C  [16 tokens][G]        fp32 scores
//   tmm1, tmm6  A [16 tokens][32]  bf16 K rows, 32 dims a tile (two, to overlap loads)
//   tmm2..5  B [16][G][2]          the G query rows, dims 32c..32c+31 in pairs (VNNI)
inline void configure_score_tiles(int64_t G) {
  TileConfig cfg;
  const uint16_t narrow = static_cast<uint16_t>(4 * G);
  cfg.rows[0] = 16, cfg.colsb[0] = narrow;
  for (int t : {1, 6}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  for (int t = 2; t <= 5; ++t) cfg.rows[t] = 16, cfg.colsb[t] = narrow;
  _tile_loadconfig(&cfg);
}

// Output of one kv head's G query heads, 64 dims at a time, 32 tokens an instruction:
//   tmm0..3  C  [G][16]       fp32 sums, 16 dims each (in the interleaved order below)
//   tmm4     A  [G][32]       bf16 probabilities of 32 consecutive tokens
//   tmm5, 6  B  [16][16][2]   V rows of those tokens in pairs (t, t + 1) per dim
inline void configure_output_tiles(int64_t G) {
  TileConfig cfg;
  for (int t = 0; t <= 4; ++t) cfg.rows[t] = static_cast<uint8_t>(G), cfg.colsb[t] = 64;
  for (int t : {5, 6}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}
#endif

// Everything one call needs, in elements (not bytes). K and V share strides.
struct Problem {
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int64_t q_seq, q_head, o_seq, o_head;        // query / out strides
  int64_t kv_block, kv_token, kv_head;          // cache strides
  int64_t bt_row, num_cache_blocks;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  float scale;
  bool bf16_pairs;  // bf16 query and cache: p.v on the dot-product instruction (see attend)
  float v_scale;    // the V cache's scale (an fp8 cache's; 1 otherwise): multiplies the output
  int64_t window;   // a sliding window: the query sees the last `window` positions (0: all)
  float softcap;    // scores soft-capped as cap * tanh(s / cap) before the softmax (0: none)
};

// The part of sequence b's context a windowed query sees: its block table from the first
// block the window touches, the context's length counted from that block, and how many
// of that block's leading positions lie before the window (masked). Blocks wholly before
// the window are never read: they may be freed and reused.
struct Span {
  const int32_t* table;
  int64_t len, skip;
};
inline Span window_span(const int32_t* row, int64_t L, int64_t window, int64_t bs) {
  const int64_t start = window > 0 && L > window ? L - window : 0, first = start / bs;
  return {row + first, L - first * bs, start - first * bs};
}

// Soft-capping of n scores (n a multiple of 16): cap * tanh(s / cap), with tanh(|x|)
// = (1 - e) / (1 + e), e = exp(-2|x|) in (0, 1] (the kernels' exp takes x <= 0).
inline void softcap_scores(float* s, int64_t n, float cap) {
  alignas(64) float e[16];
  for (int64_t t = 0; t < n; t += 16) {
    for (int i = 0; i < 16; ++i) e[i] = -2.f * std::fabs(s[t + i]) / cap;
    vstore(e, vexp(vload(e)));
    for (int i = 0; i < 16; ++i) s[t + i] = std::copysign(cap * (1.f - e[i]) / (1.f + e[i]), s[t + i]);
  }
}

// Per-thread scratch, grown on demand and reused across calls (no per-call malloc),
// starting on a cache line (the AMX paths load and store their tiles in it)
float* thread_scratch(size_t n) {
  thread_local std::vector<float, tandem_simd::Aligned64<float>> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// Blocks loaded ahead of each pass's compute: 16 tokens x 8 kv heads x 128 dims of bf16
// is 32 KB a block, so a segment stays well inside a 1-2 MB L2.
constexpr int64_t kSegBlocks = 16;

inline int64_t round16(int64_t n) { return (n + 15) & ~int64_t(15); }

// Software prefetch into L2, spread over a compute loop. The decode kernel is bound by
// memory: an item's K and V (320 KB at small's shape, L = 320) take longer to arrive
// than the item takes to compute on them. Loading a segment before computing on it
// (load_blocks, in attend) leaves memory idle while the core computes; so, besides,
// while pass 1 computes on K the item's V is fetched, and while pass 2 computes on V
// the next item's K is, a few lines at every step of the loop. Measured on Zen 4
// (B = 200, H = 16, Hkv = 4, D = 64, blocks of 64, cache on huge pages and scattered,
// L = 256 / 320 / 384, four interleaved pairs): 2.6-3.0 / 3.3-3.7 / 4.1-4.4 ms without,
// 2.0-2.5 / 2.7-3.2 / 3.5-3.8 ms with (docs/performance.md, twenty-fourth round).
struct Prefetcher {
  const char* runs[kSegBlocks];
  int64_t run_bytes[kSegBlocks];
  int nruns = 0, r = 0;
  int64_t off = 0, per = 0;
  // The first segment (up to kSegBlocks blocks) of a context of L tokens: in each block
  // of `table`, `row_bytes` a token from `head_off` bytes in (whole token rows, so one
  // contiguous run a block), spread over about `calls` calls of step(). Block ids
  // outside the cache are skipped (attend checks them when that item runs).
  void plan(const Problem& P, const char* cache, const int32_t* table, int64_t L, int64_t head_off,
            int64_t row_bytes, int64_t elem, int64_t calls) {
    nruns = r = 0;
    off = 0;
    int64_t lines = 0;
    for (int64_t i = 0; i < kSegBlocks && i < P.max_blocks && i * P.block_size < L; ++i) {
      if (table[i] < 0 || table[i] >= P.num_cache_blocks) continue;
      runs[nruns] = cache + (table[i] * P.kv_block) * elem + head_off;
      run_bytes[nruns] = std::min(P.block_size, L - i * P.block_size) * row_bytes;
      lines += (run_bytes[nruns] + 63) / 64;
      ++nruns;
    }
    per = (lines + std::max<int64_t>(calls, 1) - 1) / std::max<int64_t>(calls, 1);
  }
  void clear() { nruns = r = 0; }
  inline void step() {
#if defined(__AVX512F__) || defined(__AVX2__)
    for (int64_t left = per; left > 0 && r < nruns;) {
      const char* p = runs[r] + off;
      const int64_t n = std::min(left, (run_bytes[r] - off + 63) / 64);
      for (int64_t k = 0; k < n; ++k) _mm_prefetch(p + 64 * k, _MM_HINT_T1);
      left -= n;
      off += 64 * n;
      if (off >= run_bytes[r]) ++r, off = 0;
    }
#endif
  }
};

#if TANDEM_AMX
// 32 of the cache's values as bf16 (one 512-bit vector), the tiles' operand: a bf16 cache
// as stored; an fp8 cache widened, exactly (every e4m3 value is a bf16 value), in 16-bit
// lanes by integer instructions: a normal e4m3 byte's exponent and mantissa shifted into
// bf16's places with its exponent bias raised by 120; the eight magnitudes whose exponent
// field is zero (zero and the subnormals m * 2^-9) from a table; the sign moved to bit 15.
// Eight instructions for 32 values (through fp16 and fp32 it took about twice as many, and
// the tiles did not pay for it). One layer at small's shape, 100 sequences of 270 tokens:
// 2.38 ms on the vector path, 1.09 on the tiles, a bf16 cache 0.91 (the AMX Xeon of round
// 47, docs/results/peers-small-cpu-2core-amx-r47/fp8_kv_ab.py).
inline __m512i load32_bf16(const BFloat16* p) { return _mm512_loadu_si512(p); }
inline __m512i load32_bf16(const Float8_e4m3fn* p) {
  const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  // bf16 bits of m * 2^-9 for m = 0..7, repeated: vpermw reads the low 5 bits of the byte
  const __m512i sub = _mm512_set_epi16(0x3C60, 0x3C40, 0x3C20, 0x3C00, 0x3BC0, 0x3B80, 0x3B00, 0,
                                       0x3C60, 0x3C40, 0x3C20, 0x3C00, 0x3BC0, 0x3B80, 0x3B00, 0,
                                       0x3C60, 0x3C40, 0x3C20, 0x3C00, 0x3BC0, 0x3B80, 0x3B00, 0,
                                       0x3C60, 0x3C40, 0x3C20, 0x3C00, 0x3BC0, 0x3B80, 0x3B00, 0);
  __m512i mag = _mm512_add_epi16(_mm512_and_si512(_mm512_slli_epi16(w, 4), _mm512_set1_epi16(0x7F0)),
                                 _mm512_set1_epi16(0x3C00));
  mag = _mm512_mask_permutexvar_epi16(mag, _mm512_testn_epi16_mask(w, _mm512_set1_epi16(0x78)), w, sub);
  // (w << 8) & 0x8000 | mag: the sign bit from the first, the rest from the third
  return _mm512_ternarylogic_epi32(_mm512_slli_epi16(w, 8), _mm512_set1_epi16(static_cast<int16_t>(0x8000)), mag,
                                   0xEA);
}
#endif

// One work item: sequence b, kv heads [g0, g0 + ng) and their ng * G query heads.
// Blocks are walked in order and, inside a block, a token's ng head slices are
// adjacent, so a block is read as one contiguous run. C = D / 16 when known at
// compile time (a K row lives in registers), else 0 (run-time head_dim).
template <int C, typename KV, typename Q, bool kPairs, bool kAmx = false>
void attend(const Problem& P, const KV* kc, const KV* vc, const Q* query, Q* out,
            int64_t b, int64_t g0, int64_t ng, int64_t next_b = -1) {
  const int64_t D = P.head_dim, G = P.num_heads / P.num_kv_heads, GT = ng * G, bs = P.block_size;
  const int nc = C ? C : static_cast<int>(D / 16);
#if defined(__AVX512BF16__)
  // pass 2 on bf16 pairs: a bf16 cache, or on tiles an fp8 one (widened to bf16 as loaded)
  constexpr bool kPairPass = kPairs && (std::is_same_v<KV, BFloat16> || kAmx) && std::is_same_v<Q, BFloat16> &&
                             C > 0 && C % 2 == 0;
#else
  constexpr bool kPairPass = false;
#endif
  const int64_t L_all = P.seq_lens[b];
  Q* o = out + b * P.o_seq + g0 * G * P.o_head;
  if (L_all <= 0) {  // nothing to attend to: the output is defined as zeros
    for (int64_t h = 0; h < GT; ++h)
      for (int64_t d = 0; d < D; ++d) o[h * P.o_head + d] = Q(0.f);
    return;
  }
  TORCH_CHECK(L_all <= P.max_blocks * bs, "seq_len ", L_all, " of sequence ", b,
              " exceeds its block table (", P.max_blocks, " blocks of ", bs, ")");
  // Below, the context is the window's span: positions count from its first block, and
  // the `skip` leading ones (before the window) get no weight.
  const Span span = window_span(P.block_tables + b * P.bt_row, L_all, P.window, bs);
  const int32_t* table = span.table;
  const int64_t L = span.len, skip = span.skip;
  const int64_t Lp = kAmx ? (L + 31) & ~int64_t(31) : round16(L), nblk = (L + bs - 1) / bs;
  for (int64_t i = 0; i < nblk; ++i)
    TORCH_CHECK(table[i] >= 0 && table[i] < P.num_cache_blocks, "block id ", table[i],
                " of sequence ", b, " is outside the cache (", P.num_cache_blocks, " blocks)");
  // With AMX the scores and probabilities are token-major, 16 heads a row (SW = 16):
  // a tile of scores is 16 tokens by the G heads of one kv head, and the softmax then
  // runs across tokens with one head per vector lane.
  const int64_t SW = kAmx ? 16 : GT;
  // AMX only: the query tiles [ng][D / 32][16][16] words, the probabilities head-major
  // [16][Lp / 2] words, four V tiles [4][16][16] words.
  const int64_t qt_words = kAmx ? ng * (D / 32) * 256 : 0;
  const int64_t pt_words = kAmx ? 8 * Lp : 0, vt_words = kAmx ? 1024 : 0;
  float* q = thread_scratch(2 * GT * D + SW * Lp + SW + SW * Lp / 2 + qt_words + pt_words + vt_words);
  // q: [GT, D] query * scale (not used on tiles)
  float* acc = q + GT * D;                                 // [GT, D] unnormalised output
  float* s = acc + GT * D;                                 // [GT, Lp] scores, then exp(s - max); AMX: [Lp, 16]
  float* inv_sum = s + SW * Lp;                            // [GT]
  uint32_t* pp = reinterpret_cast<uint32_t*>(inv_sum + SW);  // [GT, Lp / 2] bf16 pairs (bf16 pass 2); AMX: [Lp / 2, 16]
  uint32_t* qt = pp + SW * Lp / 2;
  uint32_t* pT = qt + qt_words;
  uint32_t* vt = pT + pt_words;
  const Q* qb = query + b * P.q_seq + g0 * G * P.q_head;
#if defined(__AVX512BF16__)
  // the bf16 score loop (below) reads the query as it is: no fp32 copy to make
  constexpr bool kBf16Scores = std::is_same_v<KV, BFloat16> && std::is_same_v<Q, BFloat16> && C > 0 && C % 2 == 0;
#else
  constexpr bool kBf16Scores = false;
#endif
  if constexpr (!kAmx && !kBf16Scores)
    for (int64_t h = 0; h < GT; ++h)
      for (int64_t d = 0; d < D; ++d) q[h * D + d] = static_cast<float>(qb[h * P.q_head + d]) * P.scale;
  auto block_of = [&](const KV* cache, int64_t i) { return cache + table[i] * P.kv_block + g0 * P.kv_head; };
  // Reading K and V in the loops that compute on them leaves few loads in flight: the
  // compute fills the out-of-order window, and a thread got 9 GB/s out of a memory
  // system that gives it 36 GB/s on a stream (AMD Zen 5, 2 cores; software prefetches
  // a block ahead changed nothing there). So each pass first loads a segment of up to
  // kSegBlocks blocks with nothing but loads, which the core issues back to back, and
  // then computes on the segment from L2. Measured on B=200, L=320, H=16, Hkv=4, D=64:
  // 3.3 -> 1.9 ms with each sequence's blocks in address order, 4.2 -> 2.6 ms scattered.
  // The AMX branches below do not do this: on the AMX Xeon of docs/performance.md
  // (nineteenth round) the tile loads stream from memory at the rate a pure load loop
  // gets, and the separate loads only added their own time (12 layers of small's shape,
  // B=192, L=314, cache scattered: 43.9-54.0 ms with them, 33.0-45.8 without).
  const int64_t row_bytes = ng * P.kv_head * static_cast<int64_t>(sizeof(KV));
  const bool whole_rows = ng == P.num_kv_heads && P.kv_token == P.num_kv_heads * P.kv_head;
  auto load_blocks = [&](const KV* cache, int64_t i0, int64_t i1) {
#if defined(__AVX512F__)
    __m512i sink = _mm512_setzero_si512();
    for (int64_t i = i0; i < i1; ++i) {
      const char* base = reinterpret_cast<const char*>(block_of(cache, i));
      const int64_t n = std::min(bs, L - i * bs);
      if (whole_rows) {  // one contiguous run
        for (int64_t off = 0; off + 64 <= n * row_bytes; off += 64)
          sink = _mm512_or_si512(sink, _mm512_loadu_si512(base + off));
      } else {
        for (int64_t t = 0; t < n; ++t)
          for (int64_t off = 0; off + 64 <= row_bytes; off += 64)
            sink = _mm512_or_si512(sink, _mm512_loadu_si512(base + t * P.kv_token * int64_t(sizeof(KV)) + off));
      }
    }
    asm volatile("" : : "v"(sink));  // the loads are the point: keep them
#elif defined(__AVX2__)
    __m256i sink = _mm256_setzero_si256();
    for (int64_t i = i0; i < i1; ++i) {
      const char* base = reinterpret_cast<const char*>(block_of(cache, i));
      const int64_t n = std::min(bs, L - i * bs);
      if (whole_rows) {
        for (int64_t off = 0; off + 64 <= n * row_bytes; off += 64)
          sink = _mm256_or_si256(sink, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + off)));
      } else {
        for (int64_t t = 0; t < n; ++t)
          for (int64_t off = 0; off + 64 <= row_bytes; off += 64)
            sink = _mm256_or_si256(sink, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                             base + t * P.kv_token * int64_t(sizeof(KV)) + off)));
      }
    }
    asm volatile("" : : "x"(sink));
#else
    (void)cache, (void)i0, (void)i1;
#endif
  };

  // While pass 1 computes on K, V's first segment comes into L2; while pass 2 computes on
  // V, the next item's K does (an item is about its context's K and V, 320 KB at small's
  // shape and L = 320, and the current and next segments fit a 1 MB L2 together).
  Prefetcher pf;
  const int64_t elem = static_cast<int64_t>(sizeof(KV)), head_off = g0 * P.kv_head * elem;
  // The tile path steps it too: once a 16-token tile of pass 1, once every 32 tokens of pass
  // 2. With each layer's K and V coming from memory (12 layers in turn, blocks scattered,
  // small's shape) it took a bf16 cache's layer from 1.70 to 1.61 ms and an fp8 cache's
  // from 1.88 to 1.22 (the AMX Xeon, docs/results/peers-small-cpu-2core-amx-r49/
  // attention_ab.py); one layer over and over, its cache warm, within noise. Prefetching
  // to L1 instead, every other line, or only the next item's K measured slower.
  if (whole_rows)
    pf.plan(P, reinterpret_cast<const char*>(vc), table, L, head_off, row_bytes, elem, ng * ((L + 15) / 16));
  // pass 2's plan: the next item's K, spread over `calls` steps
  auto plan_next_k = [&](int64_t calls) {
    pf.clear();
    if (whole_rows && next_b >= 0) {
      const Span nx = window_span(P.block_tables + next_b * P.bt_row, P.seq_lens[next_b], P.window, bs);
      pf.plan(P, reinterpret_cast<const char*>(kc), nx.table, nx.len, head_off, row_bytes, elem, calls);
    }
  };
  // Pass 1: scores, 16 tokens at a time: one query head's row stays in registers
  // while the tile's K rows stream past (from L2, loaded by load_blocks, then L1),
  // and the 16 dot products are reduced together. `tile(rows, h, nt)` returns the
  // scores of query head h against the nt (<= 16) K rows at `rows`, in lanes 0..nt-1.
  auto score_tiles = [&](auto&& tile) {
    for (int64_t i = 0; i < nblk; ++i) {
      if (i % kSegBlocks == 0) load_blocks(kc, i, std::min(nblk, i + kSegBlocks));
      const KV* kb = block_of(kc, i);
      const int64_t n = std::min(bs, L - i * bs);
      for (int64_t t0 = 0; t0 < n; t0 += 16) {
        const int nt = static_cast<int>(std::min<int64_t>(16, n - t0));
        for (int64_t gg = 0; gg < ng; ++gg) {
          const KV* rows = kb + t0 * P.kv_token + gg * P.kv_head;
          for (int64_t h = gg * G; h < (gg + 1) * G; ++h) vstore_n(s + h * Lp + i * bs + t0, tile(rows, h, nt), nt);
          pf.step();
        }
      }
    }
  };
#if TANDEM_AMX
  if constexpr (kAmx) {
    // Pass 1 on tiles: for each kv head, C[16 tokens][G] = K rows [16][D] times the G
    // query rows, D / 32 tile products of 32 dims each, no horizontal sums. The query
    // goes in as the B operand, which AMX wants in pairs: row r of tile c holds, for
    // each head, the 32-bit pair (q[32c + 2r], q[32c + 2r + 1]), so B is the query's
    // pair words transposed. Unscaled bf16 products summed in fp32, as in the AVX512-BF16
    // path below (only the order of the additions differs); the scale multiplies the
    // fp32 score in the softmax.
    static_assert(C == 4 || C == 8, "the AMX path handles head_dim 64 and 128");
    constexpr int CB = C / 2;
    std::memset(qt, 0, qt_words * sizeof(uint32_t));
    for (int64_t gg = 0; gg < ng; ++gg)
      for (int64_t j = 0; j < G; ++j)
        for (int c = 0; c < CB; ++c)
          for (int r = 0; r < 16; ++r)
            std::memcpy(qt + (gg * CB + c) * 256 + r * 16 + j, qb + (gg * G + j) * P.q_head + 32 * c + 2 * r,
                        sizeof(uint32_t));
    configure_score_tiles(G);
    constexpr bool kWiden = !std::is_same_v<KV, BFloat16>;  // an fp8 cache: 16 K rows widened to bf16 first
    alignas(64) BFloat16 kw[kWiden ? 16 * 128 : 1];
    const int64_t kstride = kWiden ? D * static_cast<int64_t>(sizeof(BFloat16))
                                   : P.kv_token * static_cast<int64_t>(sizeof(KV));
    for (int64_t i0 = 0; i0 < nblk; i0 += kSegBlocks) {
      const int64_t i1 = std::min(nblk, i0 + kSegBlocks);
      for (int64_t gg = 0; gg < ng; ++gg) {
        const uint32_t* qg = qt + gg * CB * 256;
        _tile_loadd(2, qg, 64);
        _tile_loadd(3, qg + 256, 64);
        if constexpr (CB > 2) {
          _tile_loadd(4, qg + 512, 64);
          _tile_loadd(5, qg + 768, 64);
        }
        for (int64_t i = i0; i < i1; ++i) {
          const KV* kb = block_of(kc, i) + gg * P.kv_head;
          const int64_t n = std::min(bs, L - i * bs);
          // The context's last tile may be partial: its rows past L are still inside
          // the block (blocks hold a multiple of 32 tokens), so the tile reads them
          // whatever they hold, and their scores, never read below, are discarded.
          for (int64_t t0 = 0; t0 < n; t0 += 16) {
            const BFloat16* rows;
            if constexpr (kWiden) {
              for (int r = 0; r < 16; ++r)
                for (int c = 0; c < CB; ++c)
                  _mm512_store_si512(kw + r * D + 32 * c, load32_bf16(kb + (t0 + r) * P.kv_token + 32 * c));
              rows = kw;
            } else {
              rows = kb + t0 * P.kv_token;
            }
            pf.step();
            _tile_zero(0);
            _tile_loadd(1, rows, kstride);
            _tile_dpbf16ps(0, 1, 2);
            _tile_loadd(6, rows + 32, kstride);
            _tile_dpbf16ps(0, 6, 3);
            if constexpr (CB > 2) {
              _tile_loadd(1, rows + 64, kstride);
              _tile_dpbf16ps(0, 1, 4);
              _tile_loadd(6, rows + 96, kstride);
              _tile_dpbf16ps(0, 6, 5);
            }
            _tile_stored(0, s + (i * bs + t0) * 16 + gg * G, 64);
          }
        }
      }
    }
    // Softmax across tokens, one head per lane (lanes past GT are never read). The
    // numerators go to pass 2 as bf16 pairs of consecutive tokens; past L they are 0.
    const __m512 vscale = _mm512_set1_ps(P.scale);
    __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < L; ++t) {
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + t * 16), vscale);
      _mm512_storeu_ps(s + t * 16, x);
      mx = _mm512_max_ps(mx, x);
    }
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < Lp; t += 2) {
      const __m512 e0 = t < L ? vexp(V16{_mm512_sub_ps(_mm512_loadu_ps(s + t * 16), mx)}).v : _mm512_setzero_ps();
      const __m512 e1 = t + 1 < L ? vexp(V16{_mm512_sub_ps(_mm512_loadu_ps(s + (t + 1) * 16), mx)}).v
                                  : _mm512_setzero_ps();
      sum = _mm512_add_ps(_mm512_add_ps(sum, e0), e1);
      const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e0));
      const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e1));
      _mm512_storeu_si512(pp + (t / 2) * 16, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
    _mm512_storeu_ps(inv_sum, _mm512_div_ps(_mm512_set1_ps(P.v_scale), sum));  // 1 but for an fp8 cache
  } else
#endif
#if defined(__AVX512BF16__)
  // bf16 query and cache: the query row stays bf16 (unscaled, so exactly the model's
  // values) and each K row is multiplied in its own format by the dot-product
  // instruction, 32 pairs per instruction into fp32 sums, with no conversion of K to
  // fp32 first; the scale is applied to the fp32 score. Products of two bf16 values
  // are exact in fp32, so only the order of the fp32 additions differs from the
  // general path below.
  if constexpr (std::is_same_v<KV, BFloat16> && std::is_same_v<Q, BFloat16> && C > 0 && C % 2 == 0) {
    constexpr int CB = C / 2;  // 32-value bf16 vectors per row
    const __m512 vscale = _mm512_set1_ps(P.scale);
    score_tiles([&](const KV* rows, int64_t h, int nt) -> V16 {
      const Q* qh = qb + h * P.q_head;
      __m512bh qr[CB];
      for (int c = 0; c < CB; ++c) qr[c] = (__m512bh)_mm512_loadu_si512(qh + 32 * c);
      V16 a[16];
      for (int t = 0; t < 16; ++t) {
        if (t >= nt) { a[t] = vzero(); continue; }
        const KV* row = rows + t * P.kv_token;
        __m512 x = _mm512_dpbf16_ps(_mm512_setzero_ps(), qr[0], (__m512bh)_mm512_loadu_si512(row));
        for (int c = 1; c < CB; ++c) x = _mm512_dpbf16_ps(x, qr[c], (__m512bh)_mm512_loadu_si512(row + 32 * c));
        a[t] = {x};
      }
      return {_mm512_mul_ps(vsum16(a).v, vscale)};
    });
  } else
#endif
  score_tiles([&](const KV* rows, int64_t h, int nt) -> V16 {
    const float* qh = q + h * D;
    V16 a[16];
    if constexpr (C > 0) {
      V16 qr[C];
      for (int c = 0; c < C; ++c) qr[c] = vload(qh + 16 * c);
      for (int t = 0; t < 16; ++t) {
        if (t >= nt) { a[t] = vzero(); continue; }
        const KV* row = rows + t * P.kv_token;
        V16 x = vmul(qr[0], vload(row)), y = C > 1 ? vmul(qr[1], vload(row + 16)) : vzero();
        for (int c = 2; c < C; c += 2) {  // two chains: half the FMA latency per token
          x = vfma(qr[c], vload(row + 16 * c), x);
          if (c + 1 < C) y = vfma(qr[c + 1], vload(row + 16 * c + 16), y);
        }
        a[t] = vadd(x, y);
      }
    } else {
      for (int t = 0; t < 16; ++t) {
        a[t] = vzero();
        for (int c = 0; t < nt && c < nc; ++c)
          a[t] = vfma(vload(qh + 16 * c), vload(rows + t * P.kv_token + 16 * c), a[t]);
      }
    }
    return vsum16(a);
  });

  // Softmax numerators per head, stable (minus the max). Padding up to Lp is set to
  // -inf (exp -> 0) so the vector loops need no tails.
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t h = 0; h < GT && !kAmx; ++h) {
    float* sh = s + h * Lp;
    if (P.softcap > 0.f) softcap_scores(sh, round16(L), P.softcap);
    for (int64_t t = 0; t < skip; ++t) sh[t] = ninf;
    for (int64_t t = L; t < Lp; ++t) sh[t] = ninf;
    V16 m = vset1(ninf);
    for (int64_t t = 0; t < Lp; t += 16) m = vmax(m, vload(sh + t));
    const V16 neg_max = vset1(-vhmax(m));
    V16 sum = vzero();
    for (int64_t t = 0; t < Lp; t += 16) {
      const V16 e = vexp(vadd(vload(sh + t), neg_max));
      if constexpr (kPairPass) {  // 16 probabilities as 8 (t, t + 1) bf16 pairs
#if defined(__AVX512BF16__)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pp + h * (Lp / 2) + t / 2), (__m256i)_mm512_cvtneps_pbh(e.v));
#endif
      } else {
        vstore(sh + t, e);
      }
      sum = vadd(sum, e);
    }
    inv_sum[h] = P.v_scale / vsum(sum);
  }
#if defined(__AVX512BF16__)
  if constexpr (kPairPass) {
    // Pass 2 on the dot-product instruction: two tokens per instruction. V rows t and
    // t + 1 are interleaved 16 bits at a time (unpacklo/hi within each 128-bit lane),
    // so each 32-bit lane holds (v[t][d], v[t + 1][d]) for one d, and the broadcast
    // pair (p[t], p[t + 1]) multiplies both at once into an fp32 sum. The probabilities
    // are rounded to bf16 for this product (as transformers' eager attention and
    // torch's flash kernel do for bf16) and the sum that normalises stays fp32. The
    // accumulators hold d in the interleaved order; it is undone once at the end.
    // Blocks hold an even number of tokens (checked by the caller); a block's last,
    // odd token pairs with a zero row, never with what lies past it in the cache.
    constexpr int C2 = C / 2, NHB = std::max(1, 16 / C);
    for (int64_t x = 0; x < GT * D; ++x) acc[x] = 0.f;
#if TANDEM_AMX
    if constexpr (kAmx) {
      // Pass 2 on tiles: for each kv head, C[G][16 dims] += P[G][32 tokens] V[32][16],
      // four C tiles a 64-dim half. The A operand wants the probabilities head-major
      // (the softmax made them token-major), B wants V in the same pairs of tokens the
      // AVX512-BF16 loop below builds, so each 32 tokens' V rows are interleaved once
      // into four B tiles; tokens past L enter as zero rows. The C tiles hold the dims
      // in that interleaved order, which the common ending undoes.
      for (int64_t h = 0; h < GT; ++h)
        for (int64_t w = 0; w < Lp / 2; ++w) pT[h * (Lp / 2) + w] = pp[w * 16 + h];
      configure_output_tiles(G);
      // the next item's K, spread over this pass (a step every 32 tokens)
      plan_next_k(ng * (D / 64) * ((L + 31) / 32));
      const int64_t pstride = (Lp / 2) * static_cast<int64_t>(sizeof(uint32_t));
      const int64_t cstride = D * static_cast<int64_t>(sizeof(float));
      for (int64_t i0 = 0; i0 < nblk; i0 += kSegBlocks) {
        const int64_t i1 = std::min(nblk, i0 + kSegBlocks);
        for (int64_t gg = 0; gg < ng; ++gg) {
          for (int64_t half = 0; half < D / 64; ++half) {
            float* ag = acc + gg * G * D + 64 * half;
            _tile_loadd(0, ag, cstride);
            _tile_loadd(1, ag + 16, cstride);
            _tile_loadd(2, ag + 32, cstride);
            _tile_loadd(3, ag + 48, cstride);
            for (int64_t t0 = i0 * bs; t0 < std::min(L, i1 * bs); t0 += 32) {
              pf.step();
              const KV* v0 = block_of(vc, t0 / bs) + gg * P.kv_head + (t0 % bs) * P.kv_token + 64 * half;
              for (int r = 0; r < 16; ++r) {
                const int64_t t = t0 + 2 * r;
                const KV* ra = v0 + 2 * r * P.kv_token;
                const __m512i z = _mm512_setzero_si512();
                const __m512i a0 = t < L ? load32_bf16(ra) : z, a1 = t < L ? load32_bf16(ra + 32) : z;
                const __m512i b0 = t + 1 < L ? load32_bf16(ra + P.kv_token) : z;
                const __m512i b1 = t + 1 < L ? load32_bf16(ra + P.kv_token + 32) : z;
                _mm512_storeu_si512(vt + r * 16, _mm512_unpacklo_epi16(a0, b0));
                _mm512_storeu_si512(vt + 256 + r * 16, _mm512_unpackhi_epi16(a0, b0));
                _mm512_storeu_si512(vt + 512 + r * 16, _mm512_unpacklo_epi16(a1, b1));
                _mm512_storeu_si512(vt + 768 + r * 16, _mm512_unpackhi_epi16(a1, b1));
              }
              _tile_loadd(4, pT + gg * G * (Lp / 2) + t0 / 2, pstride);
              _tile_loadd(5, vt, 64);
              _tile_dpbf16ps(0, 4, 5);
              _tile_loadd(6, vt + 256, 64);
              _tile_dpbf16ps(1, 4, 6);
              _tile_loadd(5, vt + 512, 64);
              _tile_dpbf16ps(2, 4, 5);
              _tile_loadd(6, vt + 768, 64);
              _tile_dpbf16ps(3, 4, 6);
            }
            _tile_stored(0, ag, cstride);
            _tile_stored(1, ag + 16, cstride);
            _tile_stored(2, ag + 32, cstride);
            _tile_stored(3, ag + 48, cstride);
          }
        }
      }
    } else
#endif
    for (int64_t i0 = 0; i0 < nblk; i0 += kSegBlocks) {
      const int64_t i1 = std::min(nblk, i0 + kSegBlocks);
      if (i0 == 0) {  // the next item's K, spread over this pass
        plan_next_k(ng * ((G + NHB - 1) / NHB) * ((L + 1) / 2));
      }
      load_blocks(vc, i0, i1);
      for (int64_t gg = 0; gg < ng; ++gg) {
        for (int64_t h0 = gg * G; h0 < (gg + 1) * G; h0 += NHB) {
          const int nh = static_cast<int>(std::min<int64_t>(NHB, (gg + 1) * G - h0));
          __m512 a[NHB][C];
          for (int h = 0; h < NHB; ++h)
            for (int c = 0; c < C; ++c) a[h][c] = h < nh ? _mm512_loadu_ps(acc + (h0 + h) * D + 16 * c) : _mm512_setzero_ps();
          for (int64_t i = i0; i < i1; ++i) {
            const KV* vb = block_of(vc, i) + gg * P.kv_head;
            const int64_t n = std::min(bs, L - i * bs);
            const uint32_t* pt = pp + h0 * (Lp / 2) + i * bs / 2;
            for (int64_t t = 0; t < n; t += 2) {
              pf.step();
              const KV* r0 = vb + t * P.kv_token;
              __m512bh w[C];
              for (int c2 = 0; c2 < C2; ++c2) {
                const __m512i x0 = _mm512_loadu_si512(r0 + 32 * c2);
                const __m512i x1 = t + 1 < n ? _mm512_loadu_si512(r0 + P.kv_token + 32 * c2) : _mm512_setzero_si512();
                w[2 * c2] = (__m512bh)_mm512_unpacklo_epi16(x0, x1);
                w[2 * c2 + 1] = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
              }
              for (int h = 0; h < NHB; ++h) {
                if (h >= nh) break;
                const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pt[h * (Lp / 2) + t / 2]));
                for (int c = 0; c < C; ++c) a[h][c] = _mm512_dpbf16_ps(a[h][c], w[c], pb);
              }
            }
          }
          for (int h = 0; h < nh; ++h)
            for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + (h0 + h) * D + 16 * c, a[h][c]);
        }
      }
    }
    // Lane 4j + k of the (lo, hi) accumulators of 32 dims holds d = 8j + k (lo) and
    // 8j + 4 + k (hi): two two-source permutes put each 16 back in order.
    const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i second = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    for (int64_t h = 0; h < GT; ++h) {
      const __m512 inv = _mm512_set1_ps(inv_sum[h]);
      for (int c2 = 0; c2 < C2; ++c2) {
        const __m512 lo = _mm512_loadu_ps(acc + h * D + 32 * c2), hi = _mm512_loadu_ps(acc + h * D + 32 * c2 + 16);
        const __m512 r[2] = {_mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), inv),
                             _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), inv)};
        for (int u = 0; u < 2; ++u) {
          Q* dst = o + h * P.o_head + 32 * c2 + 16 * u;
          // bf16: 16 values an instruction (round to nearest even, as c10::BFloat16);
          // that instruction flushes denormals and keeps NaN payloads, so a vector
          // holding either takes the scalar conversion instead
#if defined(__AVX512DQ__)
          if constexpr (std::is_same_v<Q, BFloat16>) {
            if (_mm512_fpclass_ps_mask(r[u], 0x20 | 0x01 | 0x80) == 0) {
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(r[u]));
              continue;
            }
          }
#endif
          for (int k = 0; k < 16; ++k) dst[k] = Q(r[u][k]);
        }
      }
    }
    return;
  }
#endif

  // Pass 2: acc[h] += p[h, t] v[t], block by block. Query heads go NH at a time so
  // their accumulators sit in registers over a block's tokens.
  constexpr int NH = C > 0 ? std::max(1, 16 / C) : 1;
  constexpr int CR = C > 0 ? C : 1;
  for (int64_t x = 0; x < GT * D; ++x) acc[x] = 0.f;
  for (int64_t i = 0; i < nblk; ++i) {
    if (i % kSegBlocks == 0) load_blocks(vc, i, std::min(nblk, i + kSegBlocks));
    const KV* vb = block_of(vc, i);
    const int64_t n = std::min(bs, L - i * bs);
    for (int64_t gg = 0; gg < ng; ++gg) {
      for (int64_t h0 = gg * G; h0 < (gg + 1) * G; h0 += NH) {
        const int nh = static_cast<int>(std::min<int64_t>(NH, (gg + 1) * G - h0));
        const float* pt = s + h0 * Lp + i * bs;
        float* ah = acc + h0 * D;
        if constexpr (C > 0) {
          V16 a[NH][CR];
          for (int h = 0; h < NH; ++h)
            for (int c = 0; c < C; ++c) a[h][c] = h < nh ? vload(ah + h * D + 16 * c) : vzero();
          for (int64_t t = 0; t < n; ++t) {
            const KV* row = vb + t * P.kv_token + gg * P.kv_head;
            V16 p[NH];
            for (int h = 0; h < NH; ++h) p[h] = vset1(h < nh ? pt[h * Lp + t] : 0.f);
            for (int c = 0; c < C; ++c) {
              const V16 v = vload(row + 16 * c);
              for (int h = 0; h < NH; ++h)
                if (h < nh) a[h][c] = vfma(p[h], v, a[h][c]);
            }
          }
          for (int h = 0; h < nh; ++h)
            for (int c = 0; c < C; ++c) vstore(ah + h * D + 16 * c, a[h][c]);
        } else {
          for (int64_t t = 0; t < n; ++t) {
            const KV* row = vb + t * P.kv_token + gg * P.kv_head;
            const V16 p = vset1(pt[t]);
            for (int c = 0; c < nc; ++c) vstore(ah + 16 * c, vfma(p, vload(row + 16 * c), vload(ah + 16 * c)));
          }
        }
      }
    }
  }
  for (int64_t h = 0; h < GT; ++h)
    for (int64_t d = 0; d < D; ++d) o[h * P.o_head + d] = Q(acc[h * D + d] * inv_sum[h]);
}

// Work items are (sequence, run of ng kv heads): whole token rows (ng = Hkv) when
// there are enough sequences to keep every thread busy, narrower runs otherwise.
template <int C, typename KV, typename Q>
void run_all(const Problem& P, const at::Tensor& k_cache, const at::Tensor& v_cache,
             const at::Tensor& query, const at::Tensor& out, int64_t num_seqs) {
  const KV* kc = reinterpret_cast<const KV*>(k_cache.data_ptr());
  const KV* vc = reinterpret_cast<const KV*>(v_cache.data_ptr());
  const Q* q = reinterpret_cast<const Q*>(query.data_ptr());
  Q* o = reinterpret_cast<Q*>(out.data_ptr());
  const int64_t threads = at::get_num_threads(), hkv = P.num_kv_heads;
  const int64_t G = P.num_heads / hkv;
  int64_t ng = hkv;
  while (ng > 1 && num_seqs * (hkv / ng) < 4 * threads) ng = ng % 2 == 0 ? ng / 2 : 1;
  const bool pairs = P.bf16_pairs && P.block_size % 2 == 0;
  // Tiles where they apply: a bf16 query over a bf16 or fp8 cache (an fp8 one widened to
  // bf16 as the tiles load it), head_dim 64 or 128, blocks of a multiple of 32 tokens,
  // at least 4 and at most 16 query heads per kv head (one vector lane each in the
  // softmax). Below 4 the tiles' fixed costs per token (a softmax vector, the V
  // interleave) outweigh what they save: at G = 2 (H=4, Hkv=2, D=64, B=200, L=320) the
  // tile path took 3.2-3.7 ms against 2.75 with blocks scattered; at G = 4 and 8 it is
  // the faster one (docs/performance.md, fifteenth round).
  constexpr bool kAmxShape = TANDEM_AMX && (std::is_same_v<KV, BFloat16> || std::is_same_v<KV, Float8_e4m3fn>) &&
                             std::is_same_v<Q, BFloat16> && (C == 4 || C == 8);
  // A window or a soft cap takes the AVX512-BF16 loops (the tile path has neither)
  const bool amx = kAmxShape && pairs && P.block_size % 32 == 0 && G >= 4 && G <= 16 && P.window == 0 &&
                   P.softcap == 0.f && g_decode_amx.load(std::memory_order_relaxed) && tandem_amx::usable();
  if (amx)
    while (ng > 1 && ng * G > 16) ng = ng % 2 == 0 ? ng / 2 : 1;
  const int64_t runs = hkv / ng, items = num_seqs * runs;
  std::atomic<int64_t> next{0};
  // With many items of whole rows, each thread claims its next item before it starts
  // the current one, so that the current one can fetch the next one's K ahead
  // (Prefetcher). With few, claiming ahead could leave one thread idle at the end
  // while the other holds two items, so they are taken one at a time.
  const bool ahead = ng == hkv && items >= 32 * threads;
  auto each_item = [&](auto&& run) {  // run(item, the next item's sequence or -1)
    int64_t it = next.fetch_add(1);
    while (it < items) {
      const int64_t nx = ahead ? next.fetch_add(1) : -1;
      run(it, nx >= 0 && nx < items ? nx / runs : -1);
      it = ahead ? nx : next.fetch_add(1);
    }
  };
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
#if TANDEM_AMX
    if constexpr (kAmxShape) {
      if (amx) {
        each_item([&](int64_t it, int64_t nb) {
          attend<C, KV, Q, true, true>(P, kc, vc, q, o, it / runs, (it % runs) * ng, ng, nb);
        });
        _tile_release();  // back to the initial state: nothing extra to save on a switch
        return;
      }
    }
#endif
    each_item([&](int64_t it, int64_t nb) {
      if (pairs) attend<C, KV, Q, true>(P, kc, vc, q, o, it / runs, (it % runs) * ng, ng, nb);
      else attend<C, KV, Q, false>(P, kc, vc, q, o, it / runs, (it % runs) * ng, ng, nb);
    });
  });
}

template <typename KV, typename Q>
void dispatch_dim(const Problem& P, const at::Tensor& kc, const at::Tensor& vc,
                  const at::Tensor& q, const at::Tensor& o, int64_t num_seqs) {
  switch (P.head_dim) {
    case 64: return run_all<4, KV, Q>(P, kc, vc, q, o, num_seqs);
    case 128: return run_all<8, KV, Q>(P, kc, vc, q, o, num_seqs);
    case 256: return run_all<16, KV, Q>(P, kc, vc, q, o, num_seqs);
    default: return run_all<0, KV, Q>(P, kc, vc, q, o, num_seqs);
  }
}

// The cache holds the query's dtype, or float8 e4m3 (an fp8 KV cache: --kv-cache-dtype fp8)
// for a query of any of the three; no other pairs are built (each is a kernel to compile).
void dispatch(const Problem& P, const at::Tensor& kc, const at::Tensor& vc,
              const at::Tensor& q, const at::Tensor& o, int64_t num_seqs) {
  const bool fp8 = kc.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(fp8 || kc.scalar_type() == q.scalar_type(), "cache dtype ", kc.scalar_type(),
              " is neither the query's (", q.scalar_type(), ") nor float8_e4m3fn");
  TORCH_CHECK(fp8 || P.v_scale == 1.f, "a V scale other than 1 needs an fp8 cache");
  switch (q.scalar_type()) {
    case at::kFloat:
      return fp8 ? dispatch_dim<Float8_e4m3fn, float>(P, kc, vc, q, o, num_seqs)
                 : dispatch_dim<float, float>(P, kc, vc, q, o, num_seqs);
    case at::kBFloat16:
      return fp8 ? dispatch_dim<Float8_e4m3fn, BFloat16>(P, kc, vc, q, o, num_seqs)
                 : dispatch_dim<BFloat16, BFloat16>(P, kc, vc, q, o, num_seqs);
    case at::kHalf:
      return fp8 ? dispatch_dim<Float8_e4m3fn, Half>(P, kc, vc, q, o, num_seqs)
                 : dispatch_dim<Half, Half>(P, kc, vc, q, o, num_seqs);
    default: TORCH_CHECK(false, "query dtype ", q.scalar_type(), " is not fp32/bf16/fp16");
  }
}

void paged_decode_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale, bool bf16_pairs, double v_scale,
                            int64_t window, double softcap) {
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must not be negative");
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query/out must be [B, H, D] alike");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
              v_cache.strides() == k_cache.strides(), "k/v cache must be [N, bs, Hkv, D] with equal strides");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k/v cache dtypes differ");
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), "out dtype must match query dtype");
  TORCH_CHECK(query.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
              out.device().is_cpu() && block_tables.device().is_cpu() && seq_lens.device().is_cpu(),
              "all tensors must be on the CPU");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1,
              "query, out and caches need a contiguous last (head_dim) dimension");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
              block_tables.stride(1) == 1, "block_tables must be [B, M] int32, rows contiguous");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 && seq_lens.is_contiguous(),
              "seq_lens must be a contiguous [B] int32 tensor");
  const int64_t B = query.size(0), H = query.size(1), D = query.size(2), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && D % 16 == 0, "head_dim ", D, " must match the cache and be a multiple of 16");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "num_heads ", H, " is not a multiple of num_kv_heads ", Hkv);
  TORCH_CHECK(block_tables.size(0) == B && seq_lens.size(0) == B, "block_tables/seq_lens need B rows");
  if (B == 0) return;
  Problem P{H, Hkv, D, k_cache.size(1), block_tables.size(1),
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_tables.stride(0), k_cache.size(0),
            block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), static_cast<float>(scale), bf16_pairs,
            static_cast<float>(v_scale), window, static_cast<float>(softcap)};
  dispatch(P, k_cache, v_cache, query, out, B);
}

// ---- Prefill (and chunked prefill) attention over the paged cache, bf16 only.
//
//   query, out:   [T, H, D]        the step's prefill rows, sequence after sequence
//   query_start:  [Bp + 1] int32   rows of sequence i: query_start[i] .. query_start[i+1]
//   seq_lens:     [Bp] int32       context length of sequence i, this chunk included
//   block_tables: [Bp, M] int32    the chunk's K/V are already stored in the cache
//
// Row j of sequence i sits at position seq_len - q_len + j and sees keys 0 .. that
// position. Work item = (sequence, kv head): its context's K and V are copied once
// from the cache blocks into per-thread scratch in the layouts AVX512-BF16's
// dot-product instruction wants, and reused by every query row of the G heads:
//   kt[tile][c] = 16 tokens' pairs (k[t][2c], k[t][2c+1]): q . k for 16 tokens is 32
//                 dot-product instructions with a broadcast query pair, no horizontal sums;
//   vp[s][d]    = the pair (v[2s][d], v[2s+1][d]): p . v over two tokens per instruction.
// Per row: exact softmax over the scores in fp32 (max, exp, sum), the probabilities
// rounded to bf16 for the product with V (as torch's flash kernel does for bf16), the
// output divided by the fp32 sum. Where the CPU has AMX, prefill_item_amx does the same
// with both products on tiles (kt and vp are already the tiles' B layouts).
#if defined(__AVX512BF16__)
struct PrefillProblem {
  int64_t num_heads, num_kv_heads, block_size, max_blocks, num_cache_blocks;
  int64_t q_tok, q_head, o_tok, o_head, kv_block, kv_token, kv_head, bt_row;
  const int32_t* query_start;
  const int32_t* seq_lens;
  const int32_t* block_tables;
  float scale;
  bool fp8;       // the cache holds float8 e4m3 (widened to bf16 as it is copied: exact)
  float v_scale;  // an fp8 cache's V scale (1 otherwise): multiplies the output
  int64_t window; // a sliding window: the row at position p sees keys p - window + 1 .. p (0: all)
  float softcap;  // scores soft-capped as cap * tanh(s / cap) (0: none)
};

// softcap_scores on one vector, the same operations in the same order
inline __m512 softcap16(__m512 x, float cap) {
  const __m512 e = vexp(V16{_mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(-2.f / cap))}).v;
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 t = _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(cap), _mm512_sub_ps(one, e)), _mm512_add_ps(one, e));
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign));
}

// Item b's block table row, after checking that its lengths fit it and its block ids
// from block `first` on (those its rows read) lie inside the cache.
const int32_t* checked_table(const PrefillProblem& P, int64_t b, int64_t q_len, int64_t L, int64_t first) {
  const int64_t bs = P.block_size;
  TORCH_CHECK(L >= q_len && L <= P.max_blocks * bs, "sequence ", b, ": seq_len ", L, " with ", q_len,
              " new tokens does not fit its block table (", P.max_blocks, " blocks of ", bs, ")");
  const int32_t* table = P.block_tables + b * P.bt_row;
  const int64_t nblk = (L + bs - 1) / bs;
  for (int64_t i = first; i < nblk; ++i)
    TORCH_CHECK(table[i] >= 0 && table[i] < P.num_cache_blocks, "block id ", table[i], " of sequence ", b,
                " is outside the cache (", P.num_cache_blocks, " blocks)");
  return table;
}

// The context of kv head g (L tokens, padded with zeros to Lp) copied from the cache
// into kt and vp: token t's K row as D / 2 uint32 pairs goes to column t % 16 of its
// tile; V rows t and t + 1 are interleaved element by element.
// bf16 bits of each e4m3 byte: every e4m3 value (subnormals too) is a bf16 value
const uint16_t* fp8_to_bf16_bits() {
  static const auto table = [] {
    std::array<uint16_t, 256> t{};
    for (int i = 0; i < 256; ++i) {
      const BFloat16 x(static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits())));
      t[i] = x.x;
    }
    return t;
  }();
  return table.data();
}

template <int D>
void copy_context(const PrefillProblem& P, const void* kc, const void* vc, const int32_t* table,
                  int64_t L, int64_t Lp, int64_t g, uint32_t* kt, uint32_t* vp) {
  constexpr int NP = D / 2;
  const int64_t bs = P.block_size;
  const int64_t elem = P.fp8 ? 1 : 2;
  const uint16_t* widen = fp8_to_bf16_bits();
  auto row_of = [&](const void* cache, int64_t t) {
    return static_cast<const char*>(cache) + (table[t / bs] * P.kv_block + (t % bs) * P.kv_token + g * P.kv_head) * elem;
  };
  for (int64_t t = 0; t < Lp; ++t) {
    uint32_t* kdst = kt + (t / 16) * NP * 16 + (t % 16);
    if (t >= L) {
      for (int c = 0; c < NP; ++c) kdst[c * 16] = 0;
    } else if (P.fp8) {
      const uint8_t* krow = reinterpret_cast<const uint8_t*>(row_of(kc, t));
      for (int c = 0; c < NP; ++c)
        kdst[c * 16] = widen[krow[2 * c]] | (static_cast<uint32_t>(widen[krow[2 * c + 1]]) << 16);
    } else {
      const uint32_t* krow = reinterpret_cast<const uint32_t*>(row_of(kc, t));
      for (int c = 0; c < NP; ++c) kdst[c * 16] = krow[c];
    }
  }
  for (int64_t s = 0; s < Lp / 2; ++s) {
    uint16_t* dst = reinterpret_cast<uint16_t*>(vp + s * D);
    for (int u = 0; u < 2; ++u) {
      const int64_t t = 2 * s + u;
      if (t >= L) {
        for (int d = 0; d < D; ++d) dst[2 * d + u] = 0;
      } else if (P.fp8) {
        const uint8_t* vrow = reinterpret_cast<const uint8_t*>(row_of(vc, t));
        for (int d = 0; d < D; ++d) dst[2 * d + u] = widen[vrow[d]];
      } else {
        const uint16_t* vrow = reinterpret_cast<const uint16_t*>(row_of(vc, t));
        for (int d = 0; d < D; ++d) dst[2 * d + u] = vrow[d];
      }
    }
  }
}

template <int C>  // C = D / 16
void prefill_item(const PrefillProblem& P, const void* kc, const void* vc, const BFloat16* query,
                  BFloat16* out, int64_t b, int64_t g) {
  constexpr int D = 16 * C, NP = D / 2;  // NP: dim pairs per row
  const int64_t G = P.num_heads / P.num_kv_heads;
  const int64_t r0 = P.query_start[b], q_len = P.query_start[b + 1] - r0, L_all = P.seq_lens[b];
  if (q_len <= 0) return;
  // With a window the context starts at the block holding the first row's first key;
  // positions below count from there (origin), and a row's keys before its window are masked.
  auto lowest = [&](int64_t pos) { return P.window > 0 ? std::max<int64_t>(0, pos - P.window + 1) : 0; };
  const int64_t first = lowest(L_all - q_len) / P.block_size, origin = first * P.block_size, L = L_all - origin;
  const int32_t* table = checked_table(P, b, q_len, L_all, first) + first;
  const int64_t ntile = (L + 15) / 16, Lp = ntile * 16;  // keys padded to whole tiles
  // scratch (floats): kt [ntile][NP][16] u32, vp [Lp/2][D] u32, scores [G][Lp], p [G][Lp/2] u32
  float* base = thread_scratch(ntile * NP * 16 + (Lp / 2) * D + G * Lp + G * (Lp / 2) + 16);
  uint32_t* kt = reinterpret_cast<uint32_t*>(base);
  uint32_t* vp = kt + ntile * NP * 16;
  float* sc = reinterpret_cast<float*>(vp + (Lp / 2) * D);
  uint32_t* pp = reinterpret_cast<uint32_t*>(sc + G * Lp);
  copy_context<D>(P, kc, vc, table, L, Lp, g, kt, vp);
  const __m512 vscale = _mm512_set1_ps(P.scale), ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  constexpr int RH = 4;  // query heads whose scores are computed together
  for (int64_t j = 0; j < q_len; ++j) {
    const int64_t pos = L - q_len + j, nk = pos + 1, nt = (nk + 15) / 16;
    const int64_t lo = lowest(pos + origin) - origin, tt0 = lo / 16;  // keys lo .. pos; tiles from tt0
    const BFloat16* qrow = query + (r0 + j) * P.q_tok + g * G * P.q_head;
    // Scores, RH heads x one tile at a time: RH chains of NP dot products.
    for (int64_t h0 = 0; h0 < G; h0 += RH) {
      const int nh = static_cast<int>(std::min<int64_t>(RH, G - h0));
      const uint32_t* qp[RH];
      for (int h = 0; h < RH; ++h)
        qp[h] = reinterpret_cast<const uint32_t*>(qrow + (h0 + std::min(h, nh - 1)) * P.q_head);
      for (int64_t tt = tt0; tt < nt; ++tt) {
        const uint32_t* kb = kt + tt * NP * 16;
        __m512 acc[RH];
        for (int h = 0; h < RH; ++h) acc[h] = _mm512_setzero_ps();
        for (int c = 0; c < NP; ++c) {
          const __m512bh kv = (__m512bh)_mm512_loadu_si512(kb + c * 16);
          for (int h = 0; h < RH; ++h)
            acc[h] = _mm512_dpbf16_ps(acc[h], kv, (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[h][c])));
        }
        const __mmask16 valid = _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(static_cast<int>(nk - tt * 16))) &
                                _mm512_cmpge_epi32_mask(lane, _mm512_set1_epi32(static_cast<int>(lo - tt * 16)));
        for (int h = 0; h < nh; ++h) {
          __m512 x = _mm512_mul_ps(acc[h], vscale);
          if (P.softcap > 0.f) x = softcap16(x, P.softcap);
          _mm512_storeu_ps(sc + (h0 + h) * Lp + tt * 16, _mm512_mask_blend_ps(valid, ninf, x));
        }
      }
    }
    // Softmax numerators per head; p rounded to bf16, packed in token pairs.
    float inv_sum[64];
    for (int64_t h = 0; h < G; ++h) {
      float* sh = sc + h * Lp;
      __m512 m = ninf;
      for (int64_t t = tt0 * 16; t < nt * 16; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(sh + t));
      const V16 neg_max = vset1(-_mm512_reduce_max_ps(m));
      __m512 sum = _mm512_setzero_ps();
      __m256i* ph = reinterpret_cast<__m256i*>(pp + h * (Lp / 2));
      for (int64_t t = tt0 * 16; t < nt * 16; t += 16) {
        const __m512 e = vexp(vadd(V16{_mm512_loadu_ps(sh + t)}, neg_max)).v;
        sum = _mm512_add_ps(sum, e);
        _mm256_storeu_si256(ph + t / 16, (__m256i)_mm512_cvtneps_pbh(e));
      }
      inv_sum[h] = P.v_scale / _mm512_reduce_add_ps(sum);
    }
    // Output: RO heads at a time, C accumulators each, two tokens per instruction.
    constexpr int RO = std::max(1, 16 / C);
    const int64_t npair = (nk + 1) / 2;  // an odd last token pairs with a zero p (and zero V)
    for (int64_t h0 = 0; h0 < G; h0 += RO) {
      const int nh = static_cast<int>(std::min<int64_t>(RO, G - h0));
      __m512 acc[RO][C];
      for (int h = 0; h < RO; ++h)
        for (int c = 0; c < C; ++c) acc[h][c] = _mm512_setzero_ps();
      const uint32_t* ph[RO];
      for (int h = 0; h < RO; ++h) ph[h] = pp + (h0 + std::min(h, nh - 1)) * (Lp / 2);
      for (int64_t s = tt0 * 8; s < npair; ++s) {  // p of the tiles before tt0: not this row's
        const uint32_t* vrow = vp + s * D;
        for (int c = 0; c < C; ++c) {
          const __m512bh v = (__m512bh)_mm512_loadu_si512(vrow + 16 * c);
          for (int h = 0; h < RO; ++h)
            acc[h][c] = _mm512_dpbf16_ps(acc[h][c], v, (__m512bh)_mm512_set1_epi32(static_cast<int>(ph[h][s])));
        }
      }
      for (int h = 0; h < nh; ++h) {
        BFloat16* o = out + (r0 + j) * P.o_tok + (g * G + h0 + h) * P.o_head;
        const __m512 inv = _mm512_set1_ps(inv_sum[h0 + h]);
        for (int c = 0; c < C; ++c)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16 * c),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[h][c], inv)));
      }
    }
  }
}

#if TANDEM_AMX
std::atomic<bool> g_prefill_amx{true};

// prefill_item on AMX tiles: the same K and V layouts, the same fp32 softmax and the
// same roundings (p to bf16 for the product with V, the output from fp32), but the
// products are tile products over 16 query rows of one head at a time:
//   scores  C [16 rows][16 keys] += Q rows [16][32 dims] x kt [16 dim pairs][16 keys]
//   output  C [16 rows][16 dims] += p [16][32 keys]     x vp [16 key pairs][16 dims]
// kt and vp are already the pair layouts a tile's B operand wants. Rows of a whole block
// are read from the query in place; a sequence's last, partial block is copied into a
// zero-padded scratch block first, so no row past the sequence is read.
// Every tile is 16 rows of 64 bytes: tmm0 scores (then tmm0-3 outputs), tmm1-4 query
// (then tmm4 p), tmm5 the B operand.
inline void configure_prefill_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

template <int C>  // C = D / 16
void prefill_item_amx(const PrefillProblem& P, const void* kc, const void* vc, const BFloat16* query,
                      BFloat16* out, int64_t b, int64_t g) {
  constexpr int D = 16 * C, NP = D / 2, KC = D / 32;
  static_assert(KC == 2 || KC == 4, "head_dim 64 or 128");
  const int64_t G = P.num_heads / P.num_kv_heads;
  const int64_t r0 = P.query_start[b], q_len = P.query_start[b + 1] - r0, L = P.seq_lens[b];
  if (q_len <= 0) return;
  const int32_t* table = checked_table(P, b, q_len, L, 0);
  const int64_t Lp = (L + 31) & ~int64_t(31), ntile = Lp / 16;  // keys padded to whole 32-key blocks
  // scratch (4-byte words): kt [ntile][NP][16], vp [Lp/2][D], scores [16][Lp], p [16][Lp/2],
  // output [16][D], a padded query block [16][D/2]
  float* base = thread_scratch(ntile * NP * 16 + (Lp / 2) * D + 16 * Lp + 16 * (Lp / 2) + 16 * D + 8 * D + 16);
  uint32_t* kt = reinterpret_cast<uint32_t*>(base);
  uint32_t* vp = kt + ntile * NP * 16;
  float* sc = reinterpret_cast<float*>(vp + (Lp / 2) * D);
  uint32_t* pp = reinterpret_cast<uint32_t*>(sc + 16 * Lp);
  float* ob = reinterpret_cast<float*>(pp + 16 * (Lp / 2));
  BFloat16* qpad = reinterpret_cast<BFloat16*>(ob + 16 * D);
  copy_context<D>(P, kc, vc, table, L, Lp, g, kt, vp);
  configure_prefill_tiles();
  const __m512 vscale = _mm512_set1_ps(P.scale), ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const int64_t sstride = Lp * static_cast<int64_t>(sizeof(float)), pstride = (Lp / 2) * static_cast<int64_t>(sizeof(uint32_t));
  const int64_t vstride = D * static_cast<int64_t>(sizeof(uint32_t)), ostride = D * static_cast<int64_t>(sizeof(float));
  for (int64_t h = 0; h < G; ++h) {
    for (int64_t j0 = 0; j0 < q_len; j0 += 16) {
      const int64_t nr = std::min<int64_t>(16, q_len - j0);
      const int64_t nk_max = L - q_len + j0 + nr;  // keys the block's last row sees
      const int64_t ntk = (nk_max + 15) / 16, nkb = (nk_max + 31) / 32;
      const BFloat16* qsrc = query + (r0 + j0) * P.q_tok + (g * G + h) * P.q_head;
      int64_t qstride = P.q_tok * static_cast<int64_t>(sizeof(BFloat16));
      if (nr < 16) {
        for (int64_t r = 0; r < 16; ++r)
          for (int d = 0; d < D; ++d) qpad[r * D + d] = r < nr ? qsrc[r * P.q_tok + d] : BFloat16(0.f);
        qsrc = qpad;
        qstride = D * static_cast<int64_t>(sizeof(BFloat16));
      }
      // scores of the block's rows against every key tile up to the last row's position
      _tile_loadd(1, qsrc, qstride);
      _tile_loadd(2, qsrc + 32, qstride);
      if constexpr (KC > 2) {
        _tile_loadd(3, qsrc + 64, qstride);
        _tile_loadd(4, qsrc + 96, qstride);
      }
      for (int64_t tt = 0; tt < ntk; ++tt) {
        const uint32_t* kb = kt + tt * NP * 16;
        _tile_zero(0);
        _tile_loadd(5, kb, 64);
        _tile_dpbf16ps(0, 1, 5);
        _tile_loadd(5, kb + 256, 64);
        _tile_dpbf16ps(0, 2, 5);
        if constexpr (KC > 2) {
          _tile_loadd(5, kb + 512, 64);
          _tile_dpbf16ps(0, 3, 5);
          _tile_loadd(5, kb + 768, 64);
          _tile_dpbf16ps(0, 4, 5);
        }
        _tile_stored(0, sc + tt * 16, sstride);
      }
      // softmax per row over its own keys (0 .. its position), p as bf16 pairs, zero
      // beyond them up to the block's last 32-key block
      float inv_sum[16];
      for (int64_t r = 0; r < 16; ++r) {
        float* sr = sc + r * Lp;
        __m256i* pr = reinterpret_cast<__m256i*>(pp + r * (Lp / 2));
        const int64_t nk = r < nr ? L - q_len + j0 + r + 1 : 0;
        if (nk == 0) {
          for (int64_t t = 0; t < nkb * 32; t += 16) _mm256_storeu_si256(pr + t / 16, _mm256_setzero_si256());
          inv_sum[r] = 0.f;
          continue;
        }
        // max over the row's scores: whole tiles as they are (x * scale is monotonic in x,
        // so the max scales exactly), the last one masked past the row's own keys
        const int64_t nt = (nk + 15) / 16;
        const __mmask16 last = _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(static_cast<int>(nk - (nt - 1) * 16)));
        __m512 m4[4] = {ninf, ninf, ninf, ninf};
        for (int64_t tt = 0; tt + 1 < nt; ++tt) m4[tt & 3] = _mm512_max_ps(m4[tt & 3], _mm512_loadu_ps(sr + tt * 16));
        m4[0] = _mm512_mask_max_ps(m4[0], last, m4[0], _mm512_loadu_ps(sr + (nt - 1) * 16));
        const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m4[0], m4[1]), _mm512_max_ps(m4[2], m4[3])));
        const V16 neg_max = vset1(-(mx * P.scale));
        // exp(score * scale - max), four tiles an iteration (independent polynomials);
        // the sum adds them in tile order
        __m512 sum = _mm512_setzero_ps();
        auto numer = [&](int64_t tt) {
          const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(sr + tt * 16), vscale);
          const __m512 e = vexp(vadd(V16{x}, neg_max)).v;
          return tt == nt - 1 ? _mm512_maskz_mov_ps(last, e) : e;
        };
        int64_t tt = 0;
        for (; tt + 4 <= nt; tt += 4) {
          __m512 e[4];
          for (int u = 0; u < 4; ++u) e[u] = numer(tt + u);
          for (int u = 0; u < 4; ++u) {
            sum = _mm512_add_ps(sum, e[u]);
            _mm256_storeu_si256(pr + tt + u, (__m256i)_mm512_cvtneps_pbh(e[u]));
          }
        }
        for (; tt < nt; ++tt) {
          const __m512 e = numer(tt);
          sum = _mm512_add_ps(sum, e);
          _mm256_storeu_si256(pr + tt, (__m256i)_mm512_cvtneps_pbh(e));
        }
        for (tt = nt; tt < 2 * nkb; ++tt) _mm256_storeu_si256(pr + tt, _mm256_setzero_si256());
        inv_sum[r] = P.v_scale / _mm512_reduce_add_ps(sum);
      }
      // output: p times V, 64 dims (four C tiles) at a time
      for (int half = 0; half < D / 64; ++half) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = 0; kb < nkb; ++kb) {
          const uint32_t* vb = vp + kb * 16 * D + 64 * half;
          _tile_loadd(4, pp + kb * 16, pstride);
          _tile_loadd(5, vb, vstride);
          _tile_dpbf16ps(0, 4, 5);
          _tile_loadd(5, vb + 16, vstride);
          _tile_dpbf16ps(1, 4, 5);
          _tile_loadd(5, vb + 32, vstride);
          _tile_dpbf16ps(2, 4, 5);
          _tile_loadd(5, vb + 48, vstride);
          _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, ob + 64 * half, ostride);
        _tile_stored(1, ob + 64 * half + 16, ostride);
        _tile_stored(2, ob + 64 * half + 32, ostride);
        _tile_stored(3, ob + 64 * half + 48, ostride);
      }
      for (int64_t r = 0; r < nr; ++r) {
        BFloat16* o = out + (r0 + j0 + r) * P.o_tok + (g * G + h) * P.o_head;
        const __m512 inv = _mm512_set1_ps(inv_sum[r]);
        for (int c = 0; c < C; ++c)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16 * c),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(ob + r * D + 16 * c), inv)));
      }
    }
  }
}
#endif
#endif

bool paged_prefill_attention_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

void paged_prefill_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_tables,
                             const at::Tensor& query_start, const at::Tensor& seq_lens, double scale,
                             double v_scale, int64_t window, double softcap) {
  TORCH_CHECK(paged_prefill_attention_supported(), "paged_prefill_attention needs AVX512-BF16");
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must not be negative");
#if defined(__AVX512BF16__)
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query/out must be [T, H, D] alike");
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 &&
              (k_cache.scalar_type() == at::kBFloat16 || fp8) && v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_prefill_attention takes a bf16 query over a bf16 or float8_e4m3fn cache");
  TORCH_CHECK(fp8 || v_scale == 1.0, "a V scale other than 1 needs an fp8 cache");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides(),
              "k/v cache must be [N, bs, Hkv, D] with equal strides");
  TORCH_CHECK(query.device().is_cpu() && out.device().is_cpu() && k_cache.device().is_cpu() &&
              v_cache.device().is_cpu() && block_tables.device().is_cpu() && query_start.device().is_cpu() &&
              seq_lens.device().is_cpu(), "all tensors must be on the CPU");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1,
              "query, out and caches need a contiguous last (head_dim) dimension");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.stride(1) == 1,
              "block_tables must be [B, M] int32, rows contiguous");
  const int64_t Bp = block_tables.size(0);
  TORCH_CHECK(query_start.scalar_type() == at::kInt && query_start.dim() == 1 && query_start.is_contiguous() &&
              query_start.size(0) == Bp + 1, "query_start must be a contiguous [B + 1] int32 tensor");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 && seq_lens.is_contiguous() &&
              seq_lens.size(0) == Bp, "seq_lens must be a contiguous [B] int32 tensor");
  const int64_t H = query.size(1), D = query.size(2), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && (D == 64 || D == 128), "head_dim ", D, " must match the cache and be 64 or 128");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0 && H / Hkv <= 64, "num_heads ", H, " and num_kv_heads ", Hkv, " do not group");
  const int32_t* qs = query_start.data_ptr<int32_t>();
  TORCH_CHECK(qs[0] == 0 && qs[Bp] == query.size(0), "query_start must run from 0 to the number of rows");
  for (int64_t i = 0; i < Bp; ++i) TORCH_CHECK(qs[i + 1] >= qs[i], "query_start must not decrease");
  if (Bp == 0) return;
  PrefillProblem P{H, Hkv, k_cache.size(1), block_tables.size(1), k_cache.size(0),
                   query.stride(0), query.stride(1), out.stride(0), out.stride(1),
                   k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
                   qs, seq_lens.data_ptr<int32_t>(), block_tables.data_ptr<int32_t>(), static_cast<float>(scale),
                   fp8, static_cast<float>(v_scale), window, static_cast<float>(softcap)};
  const void* kc = k_cache.data_ptr();
  const void* vc = v_cache.data_ptr();
  const BFloat16* q = reinterpret_cast<const BFloat16*>(query.data_ptr());
  BFloat16* o = reinterpret_cast<BFloat16*>(out.data_ptr());
  const int64_t items = Bp * Hkv, threads = at::get_num_threads();
  std::atomic<int64_t> next{0};
#if TANDEM_AMX
  // a window or a soft cap takes the AVX512-BF16 rows (the tile path has neither)
  const bool amx = g_prefill_amx.load(std::memory_order_relaxed) && tandem_amx::usable() && window == 0 &&
                   softcap == 0;
#else
  const bool amx = false;
#endif
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
#if TANDEM_AMX
    if (amx) {
      for (int64_t it = next.fetch_add(1); it < items; it = next.fetch_add(1)) {
        if (D == 64) prefill_item_amx<4>(P, kc, vc, q, o, it / Hkv, it % Hkv);
        else prefill_item_amx<8>(P, kc, vc, q, o, it / Hkv, it % Hkv);
      }
      _tile_release();
      return;
    }
#endif
    for (int64_t it = next.fetch_add(1); it < items; it = next.fetch_add(1)) {
      if (D == 64) prefill_item<4>(P, kc, vc, q, o, it / Hkv, it % Hkv);
      else prefill_item<8>(P, kc, vc, q, o, it / Hkv, it % Hkv);
    }
  });
#endif
}

int64_t simd_lanes() { return kSimdLanes; }

// Whether bf16 decode attention can run on AMX tiles here (the build targets
// AMX and the kernel granted the tile state), and the switch for it (TANDEM_CPU_AMX_ATTENTION;
// tests compare both paths). `set_decode_amx` returns the previous setting.
bool decode_amx_supported() { return tandem_amx::usable(); }
bool set_decode_amx(bool on) { return g_decode_amx.exchange(on); }
// The same for bf16 prefill attention (prefill_item_amx); false where there are no tiles.
bool set_prefill_amx(bool on) {
#if TANDEM_AMX && defined(__AVX512BF16__)
  return g_prefill_amx.exchange(on);
#else
  (void)on;
  return false;
#endif
}

}  // namespace

// Ops live in a namespace named after the build (TORCH_EXTENSION_NAME carries a hash),
// so two builds loaded into one process never collide. They show up in torch.profiler.
TORCH_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor seq_lens, float scale, bool bf16_pairs=True, float v_scale=1.0, int window=0, "
        "float softcap=0.0) -> ()",
        &paged_decode_attention);
  m.def("paged_prefill_attention(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor query_start, Tensor seq_lens, float scale, float v_scale=1.0, int window=0, "
        "float softcap=0.0) -> ()",
        &paged_prefill_attention);
  m.def("paged_prefill_attention_supported() -> bool", &paged_prefill_attention_supported);
  m.def("simd_lanes() -> int", &simd_lanes);  // 16 with AVX-512, 8 with AVX2, 0 for the portable build
  m.def("decode_amx_supported() -> bool", &decode_amx_supported);
  m.def("set_decode_amx(bool on) -> bool", &set_decode_amx);
  m.def("set_prefill_amx(bool on) -> bool", &set_prefill_amx);
}
