// bf16 linear layer for decode steps of one or two tokens: y = x @ W.T (+ b).
//
//   x:   [M, K] bf16, rows contiguous      (M small: 1 or 2 is where it pays)
//   W:   [N, K] bf16, row-major, contiguous (the checkpoint's own layout)
//   b:   [N] bf16 or absent
//   out: [M, N] bf16, rows contiguous
//
// At one token a linear layer is a matrix-vector product: every weight byte is read
// once and used once, so the only thing that matters is how fast the weights stream
// in. Each thread takes a contiguous run of rows and walks it front to back, 512 bytes
// (8 x 64) per iteration into 8 independent fp32 accumulators, so its reads form one
// sequential stream the prefetchers follow (several interleaved row streams measured
// 30-40% slower on the development machine). AVX512-BF16's dot-product instruction
// multiplies bf16 pairs into fp32 sums; the row's 8 partial sums are added, the bias
// added in fp32, and the result rounded to bf16 once (round to nearest even), as
// oneDNN's bf16 path does. Only the order of the fp32 additions differs from it.
//
// Built only where the compiler targets AVX512-BF16; `small_batch_linear_supported()`
// says whether this build has it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using c10::BFloat16;

#if defined(__AVX512BF16__)
constexpr int64_t kLanes = 32;  // bf16 values per 64-byte load

// y[m * ldy] = x[m] . w (+ bias) for m < MT, one weight row w of length K.
template <int MT, int U>
inline void row_dot(const BFloat16* x, int64_t K, const BFloat16* w, float bias, BFloat16* y, int64_t ldy) {
  __m512 acc[MT][U];
  for (int m = 0; m < MT; ++m)
    for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + kLanes * U <= K; k += kLanes * U) {
    for (int u = 0; u < U; ++u) {
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

template <int MT>
void rows(const BFloat16* x, const BFloat16* W, const BFloat16* b, BFloat16* y, int64_t N, int64_t K) {
  // each thread one contiguous run of rows, at least 8 (16 KB of weights for K = 1024).
  // (Rows handed out in chunks from a shared counter, so that a preempted thread's share
  // goes to the others, measured no better served and 5% slower offline.)
  at::parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) {
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
  int64_t m = 0;
  for (; M - m >= 2; m += 2) rows<2>(xp + m * K, wp, bp, yp + m * N, N, K);  // each pass streams W once
  if (m < M) rows<1>(xp + m * K, wp, bp, yp + m * N, N, K);
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(TORCH_EXTENSION_NAME, m) {
  m.def("small_batch_linear(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias) -> ()", &small_batch_linear);
  m.def("small_batch_linear_supported() -> bool", &supported);
}
