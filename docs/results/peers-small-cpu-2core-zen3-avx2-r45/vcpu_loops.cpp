// What this host's cores do, apart from memory: the AVX2 W8A8 loop of quant_linear.cpp
// (|x| times q with x's sign, pmaddubsw, pmaddwd with ones, four rows of q a pass) over
// 168 MB of int8 rows (the small model's 61 linear layers and its LM head, 4 KB pages),
// the same loop over rows that stay in L2, a plain read of the 168 MB, and a chain of
// dependent adds (the core's effective clock).
//
//   g++ -O3 -mavx2 -mfma -fopenmp vcpu_loops.cpp -o vcpu_loops
//   OMP_NUM_THREADS=2 OMP_PROC_BIND=close ./vcpu_loops stream 8192   # prefetch distance (0: none)
//   OMP_NUM_THREADS=2 OMP_PROC_BIND=close ./vcpu_loops l2
//   OMP_NUM_THREADS=2 OMP_PROC_BIND=close ./vcpu_loops read
//   ./vcpu_loops adds
// Each prints the median of ten passes.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

static int64_t kAhead = 8192;

static inline int32_t isum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

// four rows of q from row n against one row of x_q, as quant_linear.cpp's iblock<T, 4, 1>
static inline void four_rows(const int8_t* xq, int64_t K, const int8_t* W, int32_t* y, int64_t n) {
  __m256i acc[4];
  for (auto& a : acc) a = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t k = 0; k < K; k += 32) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + k));
    const __m256i ax = _mm256_abs_epi8(x);
    for (int r = 0; r < 4; ++r) {
      const int8_t* w = W + (n + r) * K + k;
      if (kAhead && (k & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(w) + kAhead, _MM_HINT_T2);
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
      acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv, x)), ones));
    }
  }
  for (int r = 0; r < 4; ++r) y[n + r] = isum(acc[r]);
}

int main(int argc, char** argv) {
  const char* what = argc > 1 ? argv[1] : "stream";
  if (argc > 2) kAhead = atoll(argv[2]);
  if (!strcmp(what, "adds")) {
    const long n = 2000000000;
    long a = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < n; ++i) __asm__ volatile("add $1, %0" : "+r"(a));
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    printf("dependent adds: %.2f per ns\n", n / s / 1e9);
    return a == 1;
  }
  std::vector<std::pair<int64_t, int64_t>> shapes;
  for (int l = 0; l < 12; ++l)
    for (auto s : {std::pair<int64_t, int64_t>{1536, 1024}, {1024, 1024}, {2816, 1024}, {2816, 1024}, {1024, 2816}})
      shapes.push_back(s);
  shapes.push_back({32000, 1024});
  std::vector<int8_t*> Ws;
  int64_t total = 0;
  for (auto [N, K] : shapes) {
    auto* w = static_cast<int8_t*>(aligned_alloc(64, (N * K + 63) / 64 * 64));
    for (int64_t i = 0; i < N * K; ++i) w[i] = static_cast<int8_t>(rand() % 255 - 127);
    Ws.push_back(w);
    total += N * K;
  }
  std::vector<int8_t> x(4096);
  for (auto& v : x) v = static_cast<int8_t>(rand() % 255 - 127);
  std::vector<int32_t> y(32000);
  std::vector<double> ms;
  long long sink = 0;
  for (int rep = 0; rep < 12; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    if (!strcmp(what, "l2")) {  // each thread its own 256 rows of the first matrix (256 KB), as many bytes in all
      const int64_t passes = total / (2 * 256 * 1024);
#pragma omp parallel
      {
        const int t = omp_get_thread_num();
        for (int64_t it = 0; it < passes; ++it)
          for (int64_t n = 256 * t; n < 256 * t + 256; n += 4) four_rows(x.data(), 1024, Ws[0], y.data(), n);
      }
    } else if (!strcmp(what, "read")) {
      for (size_t i = 0; i < shapes.size(); ++i) {
        const int64_t B = shapes[i].first * shapes[i].second;
        const int8_t* W = Ws[i];
#pragma omp parallel reduction(+ : sink)
        {
          const int t = omp_get_thread_num(), T = omp_get_num_threads();
          const int64_t j0 = B * t / T / 32 * 32, j1 = t == T - 1 ? B / 32 * 32 : B * (t + 1) / T / 32 * 32;
          __m256i a = _mm256_setzero_si256();
          for (int64_t j = j0; j < j1; j += 32)
            a = _mm256_add_epi64(a, _mm256_sad_epu8(_mm256_load_si256(reinterpret_cast<const __m256i*>(W + j)),
                                                    _mm256_setzero_si256()));
          sink += _mm256_extract_epi64(a, 0);
        }
      }
    } else {
      for (size_t i = 0; i < shapes.size(); ++i) {
        const auto [N, K] = shapes[i];
        const int8_t* W = Ws[i];
#pragma omp parallel
        {
          const int t = omp_get_thread_num(), T = omp_get_num_threads();
          const int64_t n0 = N * t / T / 4 * 4, n1 = t == T - 1 ? N : N * (t + 1) / T / 4 * 4;
          for (int64_t n = n0; n < n1; n += 4) four_rows(x.data(), K, W, y.data(), n);
        }
      }
    }
    if (rep >= 2) ms.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 1e3);
  }
  std::sort(ms.begin(), ms.end());
  printf("%s: %.2f ms for %.0f MB, %.1f GB/s%s\n", what, ms[ms.size() / 2], total / 1e6, total / ms[ms.size() / 2] / 1e6,
         sink == 42 ? " " : "");
}
