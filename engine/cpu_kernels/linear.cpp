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
// Built only where the compiler targets AVX512-BF16; `small_batch_linear_supported()`
// says whether this build has it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

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

// fp32 -> bf16, round to nearest even, NaN to the quiet NaN: c10::BFloat16(float), 16 at once
inline __m256i round_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
}

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
  // each thread one contiguous run of rows. (Rows handed out in chunks from a shared
  // counter, so that a preempted thread's share goes to the others, measured no better
  // served and 5% slower offline.)
  static const __m512i order = row_order();
  const int64_t groups = K % kLanes == 0 ? N / 16 : 0;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
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

bool supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

void small_batch_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(supported(), "small_batch_linear: this build has no AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && out.dim() == 2, "small_batch_linear: x, weight, out must be 2-d");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "small_batch_linear: x has ", K, " features, weight ", weight.size(1));
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "small_batch_linear: out must be [", M, ", ", N, "]");
  for (const at::Tensor* t : {&out, &x, &weight})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->is_contiguous() && t->device().is_cpu(),
                "small_batch_linear: tensors must be contiguous bf16 on CPU");
  const BFloat16* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N,
                "small_batch_linear: bias must be a contiguous bf16 [", N, "]");
    bp = bias->data_ptr<BFloat16>();
  }
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(TORCH_EXTENSION_NAME, m) {
  m.def("small_batch_linear(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias) -> ()", &small_batch_linear);
  m.def("small_batch_linear_supported() -> bool", &supported);
}
