// bf16 linear layer for decode steps of one to four tokens: y = x @ W.T (+ b).
//
//   x:   [M, K] bf16, rows contiguous      (M small: 1 to 4 is where it pays)
//   W:   [N, K] bf16, row-major, contiguous (the checkpoint's own layout)
//   b:   [N] bf16 or absent
//   out: [M, N] bf16, rows contiguous
//
// At one token a linear layer is a matrix-vector product: every weight byte is read
// once and used once, so what matters is how fast the weights stream in and how few
// instructions each row costs besides its dot products. Each thread takes a contiguous
// run of rows and walks it front to back, so its reads form one sequential stream
// (several interleaved row streams measured 30-40% slower on an earlier machine). The
// hardware's stream prefetcher stops at every 4 KB page, which a 1,024-wide bf16 row
// crosses every other row, so the loop also asks for the bytes 8 KB ahead of the one it
// reads (into L2): on the Intel AMX machine that took small's 61 linear layers at one
// token from 25.8-29.0 to 18.6-19.6 ms (docs/performance.md, twentieth round). A prefetch
// past the end of the weights is a hint that never faults. AVX512-BF16's dot-product
// instruction multiplies bf16 pairs into fp32 sums. Up to four rows of x share one pass
// over W; a row's sums run in the same order whatever the number of rows, so its result
// does not depend on the rows beside it.
//
// Rows go in groups of 16, one fp32 accumulator each. A group's 16 accumulators are
// then summed across their lanes together (a transpose-and-add tree: 15 shuffles and
// 15 adds for the group, where one row's own horizontal sum takes 8), which gives one
// vector of the 16 rows' results; the bias is added in fp32 and the 16 results are
// rounded to bf16 (nearest even, as c10::BFloat16 does) and stored at once. With 256-
// wide rows (the 11M model) the per-row sum was as costly as the row's 8 dot products:
// grouping made the layers 1.5-1.75x faster on one thread, and the 200M model's 1.1-1.2x
// (docs/performance.md). Rows past the last full group, and widths that are not a
// multiple of 32, take one row at a time with 8 accumulators. Only the order of the fp32
// additions differs from oneDNN's bf16 path.
//
// Built where the compiler targets AVX512-BF16; elsewhere (AVX2) the widening kernel
// below takes bf16 layers, and fp32 ones everywhere. `small_batch_linear_supported()`
// says whether this build takes bf16 layers, `small_batch_linear_kernel()` with which.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include "amx.h"
#include "simd.h"
#include "steal.h"
#include "tile_layout.h"

namespace {

using c10::BFloat16;

#if defined(__AVX512BF16__)
constexpr int64_t kLanes = 32;  // bf16 values per 64-byte load
constexpr int64_t kPrefetchBytes = 8192;  // how far ahead of its reads a weight stream asks for bytes

inline void prefetch_ahead(const BFloat16* w) {
  _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes, _MM_HINT_T2);
}

// y[m * ldy] = x[m] . w (+ bias) for m < MT, one weight row w of length K.
template <int MT, int U>
inline void row_dot(const BFloat16* x, int64_t K, const BFloat16* w, float bias, BFloat16* y, int64_t ldy) {
  __m512 acc[MT][U];
  for (int m = 0; m < MT; ++m)
    for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + kLanes * U <= K; k += kLanes * U) {
    for (int u = 0; u < U; ++u) {
      prefetch_ahead(w + k + kLanes * u);
      __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k + kLanes * u);
      for (int m = 0; m < MT; ++m)
        acc[m][u] = _mm512_dpbf16_ps(acc[m][u], (__m512bh)_mm512_loadu_si512(x + m * K + k + kLanes * u), wv);
    }
  }
  for (; k < K; k += kLanes) {  // the tail, up to U-1 full loads and one partial
    int64_t left = K - k;
    __mmask32 mask = left >= kLanes ? (__mmask32)0xffffffffu : (__mmask32)((1u << left) - 1);
    __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + k);
    for (int m = 0; m < MT; ++m)
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k), wv);
  }
  for (int m = 0; m < MT; ++m) {
    __m512 s = acc[m][0];
    for (int u = 1; u < U; ++u) s = _mm512_add_ps(s, acc[m][u]);
    y[m * ldy] = BFloat16(_mm512_reduce_add_ps(s) + bias);
  }
}

// fp32 -> bf16 as c10::BFloat16(float) rounds, 16 at once (simd.h)
inline __m256i round_bf16(__m512 v) { return tandem_simd::round_bf16(v, 0x7fc0); }

// The lane sums of 16 vectors as one vector, lane j the sum of v[order[j]]: each level
// adds two halves of every pair of vectors (512 -> 256 -> 128 -> 64 -> 32 bits).
inline __m512 sum_lanes16(const __m512* v) {
  __m512 a8[8], a4[4], a2[2];
  for (int i = 0; i < 8; ++i)
    a8[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)
    a4[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a8[2 * i], a8[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(a8[2 * i], a8[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)
    a2[i] = _mm512_add_ps(_mm512_unpacklo_ps(a4[2 * i], a4[2 * i + 1]), _mm512_unpackhi_ps(a4[2 * i], a4[2 * i + 1]));
  const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(a2[0]), _mm512_castps_pd(a2[1]));
  const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(a2[0]), _mm512_castps_pd(a2[1]));
  return _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
}

// The permutation that puts row r's sum in lane r, found once by running the tree on
// vectors whose only nonzero lane names their row.
__m512i row_order() {
  __m512 v[16];
  for (int r = 0; r < 16; ++r) v[r] = _mm512_mask_mov_ps(_mm512_setzero_ps(), 1, _mm512_set1_ps(float(r + 1)));
  alignas(64) float got[16];
  alignas(64) int32_t idx[16] = {};
  _mm512_store_ps(got, sum_lanes16(v));
  for (int lane = 0; lane < 16; ++lane) {
    const int r = static_cast<int>(got[lane]) - 1;
    TORCH_CHECK(r >= 0 && r < 16 && got[lane] == float(r + 1), "small_batch_linear: lane tree is not a permutation");
    idx[r] = lane;
  }
  return _mm512_load_si512(idx);
}

// y[m * ldy + r] for 16 rows r of W starting at W (K a multiple of 32)
template <int MT>
inline void group16(const BFloat16* x, int64_t K, const BFloat16* W, const BFloat16* b, BFloat16* y, int64_t ldy,
                    __m512i order) {
  __m512 acc[MT][16];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < 16; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int r = 0; r < 16; ++r) {  // row by row: one sequential read of the group's 16 x K
    const BFloat16* w = W + r * K;
    for (int64_t k = 0; k < K; k += kLanes) {
      prefetch_ahead(w + k);
      __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k);
      for (int m = 0; m < MT; ++m)
        acc[m][r] = _mm512_dpbf16_ps(acc[m][r], (__m512bh)_mm512_loadu_si512(x + m * K + k), wv);
    }
  }
  for (int m = 0; m < MT; ++m) {
    __m512 s = _mm512_permutexvar_ps(order, sum_lanes16(acc[m]));
    if (b != nullptr) s = _mm512_add_ps(s, _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i*)b)));
    _mm256_storeu_si256((__m256i*)(y + m * ldy), round_bf16(s));
  }
}

template <int MT>
void rows(const BFloat16* x, const BFloat16* W, const BFloat16* b, BFloat16* y, int64_t N, int64_t K) {
  // each thread one contiguous run of rows, front to back, in chunks of about 64 KB; a
  // thread done with its run takes chunks from the back of the others' (steal.h), so a
  // preempted thread's rows go to the one still running. (Chunks handed out in turn from
  // one shared counter, so that no thread read one contiguous run, measured no better
  // served and 5% slower offline.)
  static const __m512i order = row_order();
  const int64_t groups = K % kLanes == 0 ? N / 16 : 0;
  tandem_steal::parallel_chunks(groups, tandem_steal::chunk_items(16 * 2 * K), [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      group16<MT>(x, K, W + g * 16 * K, b == nullptr ? nullptr : b + g * 16, y + g * 16, N, order);
  });
  const int64_t n_tail = groups * 16;  // the rest one by one, at least 8 rows a thread
  at::parallel_for(n_tail, N, 8, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      row_dot<MT, 8>(x, K, W + n * K, b == nullptr ? 0.0f : static_cast<float>(b[n]), y + n, N);
  });
}
#endif

// ---- The tile linear layer (AMX): y = x @ W.T (+ b) for steps of up to a few hundred
// tokens, on a copy of W laid out for the tile unit (`tile_pack_linear_weight`).
//
// W [N, K] is cut into panels of 32 output features; a panel is stored as K/32 steps of
// two 1 KB B tiles (16 features each), each tile 16 rows of 16 (k, k + 1) bf16 pairs, the
// layout the tile product reads. A panel is one contiguous run of K x 64 bytes, and the
// panels follow each other, so each thread's share of W (a contiguous run of panels) is
// one sequential stream. For a panel, 32 rows of x at a time (two A tiles, loaded
// straight from x's rows) meet the panel's two B tiles 32 features a step, into four
// fp32 C tiles; the C tiles are rounded to bf16 (the bias added in fp32 first) once the
// panel's K is done. Each output's sum runs over k in order, in fp32, in the tile unit,
// whatever the number of rows: a row's result does not depend on the rows beside it.
// oneDNN's bf16 matmul, also on tiles, ends one bf16 step apart in about 1 in 5,000-10,000
// outputs (the order of its fp32 additions differs).
//
// While a thread works on a panel it prefetches the next one into L2, a few lines per
// step, spread so that the whole next panel is asked for by the end of this one: the
// hardware's stream prefetcher stops at 4 KB pages. At one to 32 rows a step is bound by
// the weight stream, and small's 61 linear layers at 4-16 tokens took 17.4-20.3 ms against
// oneDNN's 31.9-32.9 (and 23.0 for the row-major kernel above at 4 tokens); at 200 rows
// 94.5 against 120.5, at 256 and 384 the same as oneDNN (docs/performance.md, twenty-first
// round).
#if TANDEM_AMX
constexpr int64_t kPanel = 32;  // output features a panel: two B tiles

// rows x 16 fp32 sums (row stride 16) + bias -> bf16 y (row stride ldy)
inline void store_rows(const float* c, const BFloat16* b, BFloat16* y, int64_t ldy, int rows) {
  const __m512 bias = b == nullptr ? _mm512_setzero_ps()
                                   : _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i*)b));
  for (int r = 0; r < rows; ++r) {
    __m512 v = _mm512_load_ps(c + 16 * r);
    if (b != nullptr) v = _mm512_add_ps(v, bias);
    _mm256_storeu_si256((__m256i*)(y + r * ldy), round_bf16(v));
  }
}

// panels [p0, p1) of y = x @ W.T (+ b), on the calling thread
void tile_panels(const BFloat16* x, const BFloat16* Wt, const BFloat16* b, BFloat16* y, int64_t M, int64_t N,
                 int64_t K, int64_t p0, int64_t p1) {
  const int64_t steps = K / 32, panel = K * kPanel;  // bf16 values a panel
  const int64_t blocks = (M + 31) / 32;
  const int64_t lda = K * static_cast<int64_t>(sizeof(BFloat16));
  // lines of the next panel to ask for each step: K x 64 bytes over blocks x steps steps
  const int64_t ahead = (32 + blocks - 1) / blocks;
  alignas(64) float c[4][256];
  int configured = -1;  // r0 * 32 + r1 of the loaded configuration
  for (int64_t p = p0; p < p1; ++p) {
    const BFloat16* wp = Wt + p * panel;
    const char* next = reinterpret_cast<const char*>(wp + panel);
    const char* next_end = p + 1 < p1 ? next + panel * sizeof(BFloat16) : next;
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int rows = static_cast<int>(std::min<int64_t>(32, M - 32 * blk));
      int r0, r1;
      tandem_amx::configure_2x2_for(rows, r0, r1, configured);
      tandem_amx::block_2x2<false>(reinterpret_cast<const char*>(x + 32 * blk * K), lda,
                                   reinterpret_cast<const char*>(wp), steps, r1, c, next, next_end, ahead);
      BFloat16* yo = y + 32 * blk * N + p * kPanel;
      const BFloat16* bo = b == nullptr ? nullptr : b + p * kPanel;
      store_rows(c[0], bo, yo, N, r0);
      store_rows(c[1], bo == nullptr ? nullptr : bo + 16, yo + 16, N, r0);
      if (r1) {
        store_rows(c[2], bo, yo + 16 * N, N, r1);
        store_rows(c[3], bo == nullptr ? nullptr : bo + 16, yo + 16 * N + 16, N, r1);
      }
    }
  }
  _tile_release();  // back to the initial state: nothing extra to save on a switch
}
#endif

// ---- The widening kernel (AVX2 with FMA, so every x86-64 build but the generic one):
// the same layer for bf16 weights on CPUs without AVX512-BF16's dot product, and for
// fp32 weights everywhere. A bf16 weight is made fp32 in registers, where it costs two
// integer instructions per 16 values: a 32-byte load holds 16 values as 8 (even, odd)
// pairs, a shift left by 16 makes the 8 even ones fp32 and a mask of the high halves
// the 8 odd ones. x is widened once per call, each 16 values stored as their 8 even
// ones then their 8 odd ones, so each half meets the weights it multiplies. A row is
// read from memory once (bf16: 2 bytes a weight, half of fp32's); each output is one
// fp32 sum in an order that does not depend on the rows beside it (widen_block); rows of
// a width that is not a multiple of 16 finish one value at a time. The bytes 8 KB ahead
// are asked for as above.
#if defined(__AVX2__) && defined(__FMA__)
#define TANDEM_WIDEN 1
constexpr int64_t kWidenAhead = 8192;  // bytes

inline void split16(const BFloat16* w, __m256& even, __m256& odd) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline void split16(const float* w, __m256& first, __m256& second) {
  first = _mm256_loadu_ps(w);
  second = _mm256_loadu_ps(w + 8);
}

// x's row laid out as split16 splits the weights: per 16 values, the halves it makes
template <typename T>
void arrange(const T* x, int64_t K, float* out) {
  const int64_t K16 = K & ~int64_t(15);
  for (int64_t k = 0; k < K16; k += 16)
    for (int j = 0; j < 8; ++j) {
      if constexpr (std::is_same_v<T, BFloat16>) {
        out[k + j] = static_cast<float>(x[k + 2 * j]);
        out[k + 8 + j] = static_cast<float>(x[k + 2 * j + 1]);
      } else {
        out[k + j] = x[k + j];
        out[k + 8 + j] = x[k + 8 + j];
      }
    }
  for (int64_t k = K16; k < K; ++k) out[k] = static_cast<float>(x[k]);
}

// y[m * N + r] = x[m] . W[r] (+ bias[r]) for R weight rows (stride K) and MT rows of x:
// one fp32 sum per output, to which each 16 inputs add their even half and then their
// odd half. That order is the same for every R and MT, so an output does not depend on
// the rows computed beside it, and R x MT sums are independent chains (R = 4 at one row
// of x: enough to keep the FMA units fed while the weights stream in; fewer at more
// rows, which fill the 16 registers with sums instead).
template <typename TW, typename T, int R, int MT>
inline void widen_block(const float* xa, int64_t K, const TW* W, const T* b, T* y, int64_t N) {
  __m256 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_setzero_ps();
  const int64_t K16 = K & ~int64_t(15);
  constexpr int64_t kStep = 64 / (16 * int64_t(sizeof(TW))) > 0 ? 64 / (16 * int64_t(sizeof(TW))) : 1;
  for (int64_t k = 0; k < K16; k += 16) {
    __m256 e[R], o[R];
    for (int r = 0; r < R; ++r) {
      if ((k / 16) % kStep == 0) _mm_prefetch(reinterpret_cast<const char*>(W + r * K + k) + kWidenAhead, _MM_HINT_T2);
      split16(W + r * K + k, e[r], o[r]);
    }
    for (int m = 0; m < MT; ++m) {
      const __m256 xe = _mm256_loadu_ps(xa + m * K + k);
      for (int r = 0; r < R; ++r) acc[r][m] = _mm256_fmadd_ps(xe, e[r], acc[r][m]);
    }
    for (int m = 0; m < MT; ++m) {
      const __m256 xo = _mm256_loadu_ps(xa + m * K + k + 8);
      for (int r = 0; r < R; ++r) acc[r][m] = _mm256_fmadd_ps(xo, o[r], acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const float bias = b == nullptr ? 0.0f : static_cast<float>(b[r]);
    for (int m = 0; m < MT; ++m) {
      float s = tandem_simd::hsum8(acc[r][m]);
      for (int64_t k = K16; k < K; ++k) s += xa[m * K + k] * static_cast<float>(W[r * K + k]);
      y[m * N + r] = T(s + bias);
    }
  }
}

// weight rows [n0, n1) against MT rows of x (arranged), R rows at a time
template <typename TW, typename T, int MT>
void widen_span(const float* xa, const TW* W, const T* b, T* y, int64_t n0, int64_t n1, int64_t N, int64_t K) {
  constexpr int R = MT == 1 ? 4 : MT == 2 ? 3 : 2;
  int64_t n = n0;
  for (; n + R <= n1; n += R)
    widen_block<TW, T, R, MT>(xa, K, W + n * K, b == nullptr ? nullptr : b + n, y + n, N);
  for (; n < n1; ++n) widen_block<TW, T, 1, MT>(xa, K, W + n * K, b == nullptr ? nullptr : b + n, y + n, N);
}

template <typename TW, typename T>
void widen_span_rows(int64_t mt, const float* xa, const TW* W, const T* b, T* y, int64_t n0, int64_t n1, int64_t N,
                     int64_t K) {
  switch (mt) {
    case 1: widen_span<TW, T, 1>(xa, W, b, y, n0, n1, N, K); break;
    case 2: widen_span<TW, T, 2>(xa, W, b, y, n0, n1, N, K); break;
    case 3: widen_span<TW, T, 3>(xa, W, b, y, n0, n1, N, K); break;
    default: widen_span<TW, T, 4>(xa, W, b, y, n0, n1, N, K); break;
  }
}

// Up to 4 rows of x: each thread streams its run of W once for all of them. More rows
// (prefill, big decode batches, on CPUs without native bf16): W goes in tiles of rows
// (about 24 KB of weights, in L1) that every group of 4 rows of x passes over, so W is read
// from memory once. (Widening a bf16 tile once into an fp32 copy, 64 KB, instead of once
// per 4 rows of x measured slower: 86-87 against 110-138 GFLOP/s at 256 rows, the copy
// no longer fitting L1.) At 64-256 rows this gives 0.45-0.7x of MKL's fp32 GEMM on the
// same CPU, against 0.15-0.2x for torch's emulated bf16 matmul.
template <typename T>
void widen_linear(const T* x, const T* W, const T* b, T* y, int64_t M, int64_t N, int64_t K) {
  thread_local std::vector<float> xa;  // x arranged, reused from call to call
  if (static_cast<int64_t>(xa.size()) < M * K) xa.resize(M * K);
  if (M <= 4) {
    for (int64_t r = 0; r < M; ++r) arrange(x + r * K, K, xa.data() + r * K);
    const float* xp = xa.data();
    // a weight stream: shares a free thread takes over (steal.h)
    const int64_t row_bytes = static_cast<int64_t>(sizeof(T)) * K;
    tandem_steal::parallel_chunks(N, tandem_steal::chunk_items(row_bytes, 16), [&](int64_t n0, int64_t n1) {
      widen_span_rows<T, T>(M, xp, W, b, y, n0, n1, N, K);
    });
    return;
  }
  float* xw = xa.data();
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) arrange(x + r * K, K, xw + r * K);
  });
  // rows of W a tile: about 24 KB of them (L1 holds the tile beside x's rows), a multiple of 6
  const int64_t row_bytes = std::max<int64_t>(K, 1) * static_cast<int64_t>(sizeof(T));
  const int64_t tile = std::max<int64_t>(6, 24576 / row_bytes / 6 * 6);
  const int64_t tiles = (N + tile - 1) / tile;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * tile, n1 = std::min(N, n0 + tile);
      for (int64_t m = 0; m < M; m += 4)
        widen_span_rows<T, T>(std::min<int64_t>(M - m, 4), xw + m * K, W, b, y + m * N, n0, n1, N, K);
    }
  });
}
#endif

// bf16 weights: AVX512-BF16's dot product, else the widening kernel
bool supported() {
#if defined(__AVX512BF16__) || defined(TANDEM_WIDEN)
  return true;
#else
  return false;
#endif
}

// Which kernel a bf16 layer takes here: "avx512_bf16", "widen" or "none"
std::string bf16_kernel() {
#if defined(__AVX512BF16__)
  return "avx512_bf16";
#elif defined(TANDEM_WIDEN)
  return "widen";
#else
  return "none";
#endif
}

// The bias's values (nullptr when there is none), checked: a contiguous [N] of `type`
template <typename T = BFloat16>
const T* bias_data(const std::optional<at::Tensor>& bias, int64_t N, const char* op,
                   at::ScalarType type = at::kBFloat16) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == type && bias->is_contiguous() && bias->numel() == N,
              op, ": bias must be a contiguous ", c10::toString(type), " [", N, "]");
  return bias->data_ptr<T>();
}

void small_batch_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && out.dim() == 2, "small_batch_linear: x, weight, out must be 2-d");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "small_batch_linear: x has ", K, " features, weight ", weight.size(1));
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "small_batch_linear: out must be [", M, ", ", N, "]");
  const at::ScalarType type = weight.scalar_type();
  TORCH_CHECK(type == at::kBFloat16 || type == at::kFloat, "small_batch_linear: weight must be bf16 or fp32");
  for (const at::Tensor* t : {&out, &x, &weight})
    TORCH_CHECK(t->scalar_type() == type && t->is_contiguous() && t->device().is_cpu(),
                "small_batch_linear: tensors must be contiguous, on CPU, all of the weight's dtype");
  if (type == at::kFloat) {
#if defined(TANDEM_WIDEN)
    const float* bp = bias_data<float>(bias, N, "small_batch_linear", at::kFloat);
    widen_linear<float>(x.data_ptr<float>(), weight.data_ptr<float>(), bp, out.data_ptr<float>(), M, N, K);
    return;
#else
    TORCH_CHECK(false, "small_batch_linear: this build has no fp32 kernel (needs AVX2 with FMA)");
#endif
  }
  TORCH_CHECK(supported(), "small_batch_linear: this build has no bf16 kernel (needs AVX2 with FMA)");
  const BFloat16* bp = bias_data(bias, N, "small_batch_linear");
#if !defined(__AVX512BF16__) && defined(TANDEM_WIDEN)
  widen_linear<BFloat16>(x.data_ptr<BFloat16>(), weight.data_ptr<BFloat16>(), bp, out.data_ptr<BFloat16>(), M, N, K);
#endif
#if defined(__AVX512BF16__)
  const BFloat16* xp = x.data_ptr<BFloat16>();
  const BFloat16* wp = weight.data_ptr<BFloat16>();
  BFloat16* yp = out.data_ptr<BFloat16>();
  for (int64_t m = 0; m < M; m += 4) {  // each pass streams W once for up to four rows of x
    const BFloat16* xm = xp + m * K;
    BFloat16* ym = yp + m * N;
    switch (std::min<int64_t>(M - m, 4)) {
      case 1: rows<1>(xm, wp, bp, ym, N, K); break;
      case 2: rows<2>(xm, wp, bp, ym, N, K); break;
      case 3: rows<3>(xm, wp, bp, ym, N, K); break;
      default: rows<4>(xm, wp, bp, ym, N, K); break;
    }
  }
#endif
}

bool tile_supported() { return tandem_amx::usable(); }  // false where the build has no AMX

// W [N, K] bf16 -> [N/32, K/32, 2, 16, 32]: the tile linear layer's layout (above)
at::Tensor tile_pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu(),
              "tile_pack_linear_weight: weight must be a 2-d bf16 CPU tensor");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % 32 == 0 && K % 32 == 0 && N > 0 && K > 0,
              "tile_pack_linear_weight: both dimensions must be multiples of 32, not [", N, ", ", K, "]");
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty({N / 32, K / 32, 2, 16, 32}, w.options());
  tandem_tiles::pack<2>(w.data_ptr<BFloat16>(), out.data_ptr<BFloat16>(), N, K);
  return out;
}

void tile_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& tiles,
                 const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(tile_supported(), "tile_linear: this build or this CPU has no AMX tiles");
  TORCH_CHECK(tiles.dim() == 5 && tiles.size(2) == 2 && tiles.size(3) == 16 && tiles.size(4) == 32 &&
                  tiles.is_contiguous() && tiles.scalar_type() == at::kBFloat16,
              "tile_linear: tiles must come from tile_pack_linear_weight");
  const int64_t N = tiles.size(0) * 32, K = tiles.size(1) * 32;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "tile_linear: x must be [M, ", K, "]");
  const int64_t M = x.size(0);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == N, "tile_linear: out must be [", M, ", ", N, "]");
  for (const at::Tensor* t : {&out, &x})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->is_contiguous() && t->device().is_cpu(),
                "tile_linear: x and out must be contiguous bf16 on CPU");
  const BFloat16* bp = bias_data(bias, N, "tile_linear");
  if (M == 0) return;
#if TANDEM_AMX
  const BFloat16* xp = x.data_ptr<BFloat16>();
  const BFloat16* wp = tiles.data_ptr<BFloat16>();
  BFloat16* yp = out.data_ptr<BFloat16>();
  // each thread one contiguous run of panels: one sequential stream of W
  at::parallel_for(0, N / kPanel, 1, [&](int64_t p0, int64_t p1) { tile_panels(xp, wp, bp, yp, M, N, K, p0, p1); });
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(TORCH_EXTENSION_NAME, m) {
  m.def("tile_linear(Tensor(a!) out, Tensor x, Tensor tiles, Tensor? bias) -> ()", &tile_linear);
  m.def("tile_pack_linear_weight(Tensor weight) -> Tensor", &tile_pack_linear_weight);
  m.def("tile_linear_supported() -> bool", &tile_supported);
  m.def("small_batch_linear(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias) -> ()", &small_batch_linear);
  m.def("small_batch_linear_supported() -> bool", &supported);
  m.def("small_batch_linear_kernel() -> str", &bf16_kernel);
}
