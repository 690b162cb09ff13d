// Fused elementwise operators of a Llama decoder layer on CPU, each replacing a chain of
// five to ten torch operators (whose per-call cost, about 10 us of Python and dispatch
// each, was 15-25% of a decode step on the development machine):
//
//   rms_norm(out, x, w, eps)                 out = w * norm(x)
//   add_rms_norm(out, residual, delta, w, eps)  residual += delta; out = w * norm(residual)
//   rotary_(x, positions, cos, sin)          x rotated in place (rotate-half RoPE)
//   store_kv(k_cache, v_cache, k, v, slots)  K/V rows into their cache slots (< 0: skip)
//   store_kv_fp8(..., k_scale, v_scale)      the same into an fp8 e4m3 cache: x / scale,
//                                            saturated at +-448, rounded to nearest even
//
// They keep the rounding of the torch code they replace (engine/models/llama.py, after
// Hugging Face transformers): in a bf16 or fp16 model every torch operator rounds its
// result to the model dtype, so these round at the same points; in fp32 they do the same
// fp32 operations in the same order (the build uses -ffp-contract=off, so no product and
// sum are fused into one rounding). Only RMSNorm's sum of squares adds in another order.
//
// Rows (the last dimension) must be contiguous; other strides are free.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <cmath>
#include <type_traits>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kPart = 16;  // partial sums of the sum of squares (vectorises)

template <typename T>
inline float sum_squares(const T* x, int64_t n) {
  float part[kPart] = {0};
  int64_t i = 0;
  for (; i + kPart <= n; i += kPart)
    for (int j = 0; j < kPart; ++j) {
      float v = static_cast<float>(x[i + j]);
      part[j] += v * v;
    }
  for (; i < n; ++i) {
    float v = static_cast<float>(x[i]);
    part[0] += v * v;
  }
  float s = 0.0f;
  for (int j = 0; j < kPart; ++j) s += part[j];
  return s;
}

// out = T(w * T(x * rsqrt(mean(x^2) + eps))): RMSNorm in fp32, cast back, then the weight
template <typename T>
inline void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  float r = 1.0f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i)
    out[i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(static_cast<T>(static_cast<float>(x[i]) * r)));
}

void check_rows(const at::Tensor& t, const char* what, int64_t n) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.size(1) == n && t.stride(1) == 1, what,
              " must be a CPU [rows, ", n, "] tensor with contiguous rows");
}

void rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t n = weight.numel(), rows = x.size(0);
  check_rows(x, "rms_norm: x", n);
  check_rows(out, "rms_norm: out", n);
  TORCH_CHECK(weight.is_contiguous() && out.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type() &&
                  out.size(0) == rows, "rms_norm: out, x and weight must share a dtype; weight contiguous");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t sx = x.stride(0), so = out.stride(0);
    at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * sx, wp, op + r * so, n, static_cast<float>(eps));
    });
  });
}

void add_rms_norm(const at::Tensor& out, const at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight,
                  double eps) {
  const int64_t n = weight.numel(), rows = residual.size(0);
  check_rows(residual, "add_rms_norm: residual", n);
  check_rows(delta, "add_rms_norm: delta", n);
  check_rows(out, "add_rms_norm: out", n);
  TORCH_CHECK(weight.is_contiguous() && delta.size(0) == rows && out.size(0) == rows &&
                  out.scalar_type() == residual.scalar_type() && delta.scalar_type() == residual.scalar_type() &&
                  weight.scalar_type() == residual.scalar_type(),
              "add_rms_norm: out, residual, delta and weight must share a dtype and rows; weight contiguous");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, residual.scalar_type(), "add_rms_norm", [&] {
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* dp = delta.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t sr = residual.stride(0), sd = delta.stride(0), so = out.stride(0);
    at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        scalar_t* row = rp + r * sr;
        const scalar_t* d = dp + r * sd;
        for (int64_t i = 0; i < n; ++i)
          row[i] = static_cast<scalar_t>(static_cast<float>(row[i]) + static_cast<float>(d[i]));
        norm_row(row, wp, op + r * so, n, static_cast<float>(eps));
      }
    });
  });
}

// x[t, h] (head_dim D, halves a | b) becomes (a*c - b*s | b*c + a*s) with c, s the rows
// of the fp32 tables at positions[t], cast to x's dtype first; every product and the sum
// rounded to x's dtype, as `x * cos + rotate_half(x) * sin` does in torch.
void rotary_(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1, "rotary_: x must be a CPU [T, heads, D] "
              "tensor with contiguous rows");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2, P = cos.size(0);
  TORCH_CHECK(D % 2 == 0, "rotary_: odd head_dim ", D);
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == T,
              "rotary_: positions must be a contiguous int64 [", T, "]");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(1) == D &&
                t->size(0) == P, "rotary_: cos and sin must be contiguous fp32 [positions, ", D, "]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "rotary_: position ", pos[t], " outside the table of ", P);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_", [&] {
    using F = float;
    scalar_t* xp = x.data_ptr<scalar_t>();
    const F* cp = cos.data_ptr<F>();
    const F* sp = sin.data_ptr<F>();
    const int64_t st = x.stride(0), sh = x.stride(1);
    auto r = [](F v) { return static_cast<F>(static_cast<scalar_t>(v)); };  // round to the dtype
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const F* c = cp + pos[t] * D;
        const F* s = sp + pos[t] * D;
        for (int64_t h = 0; h < H; ++h) {
          scalar_t* v = xp + t * st + h * sh;
          for (int64_t i = 0; i < half; ++i) {
            F a = static_cast<F>(v[i]), b = static_cast<F>(v[i + half]);
            F ac = r(a * r(c[i])), bs = r(-b * r(s[i]));
            F bc = r(b * r(c[i + half])), as = r(a * r(s[i + half]));
            v[i] = static_cast<scalar_t>(ac + bs);
            v[i + half] = static_cast<scalar_t>(bc + as);
          }
        }
      }
    });
  });
}

void store_kv(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& key, const at::Tensor& value,
              const at::Tensor& slots) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.dim() == 4, "store_kv: caches must be contiguous [N, bs, Hkv, D] of one shape");
  const int64_t row = k_cache.size(2) * k_cache.size(3), nslots = k_cache.size(0) * k_cache.size(1);
  const int64_t T = key.size(0);
  for (const at::Tensor* t : {&key, &value})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == T && t->size(1) * t->size(2) == row && t->stride(2) == 1 &&
                t->stride(1) == t->size(2) && t->scalar_type() == k_cache.scalar_type(),
                "store_kv: key and value must be [T, Hkv, D] with contiguous [Hkv, D] rows in the cache dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == T,
              "store_kv: slots must be a contiguous int64 [", T, "]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] < nslots, "store_kv: slot ", sp[t], " outside the cache");
  const int64_t bytes = row * k_cache.element_size();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  const int64_t sk = key.stride(0) * key.element_size(), sv = value.stride(0) * value.element_size();
  for (int64_t t = 0; t < T; ++t) {
    if (sp[t] < 0) continue;
    std::memcpy(kc + sp[t] * bytes, kp + t * sk, bytes);
    std::memcpy(vc + sp[t] * bytes, vp + t * sv, bytes);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 16 fp32 values, already clamped to [-448, 448], to e4m3 codes, one a 32-bit lane (the
// byte in its low 8 bits): c10's conversion in vector lanes, the same bits. At or above
// 2^-6 (normal e4m3) the mantissa is rounded to 3 bits, to nearest even, and the exponent
// rebiased; below, adding 2^14 rounds the value to a multiple of 2^-9 (the subnormals'
// step), whose count is then the low bits.
inline __m512i fp8_codes16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i sign = _mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int32_t>(0x80000000u)));
  const __m512i a = _mm512_xor_si512(bits, sign);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
  const __m512i normal = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(static_cast<int32_t>((7u - 127u) << 23) + 0x7FFFF)), odd),
      20);
  const __m512i sub = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(_mm512_set1_epi32(141 << 23)))),
      _mm512_set1_epi32(141 << 23));
  const __m512i r = _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(121 << 23)), normal, sub);
  return _mm512_or_si512(r, _mm512_srli_epi32(sign, 24));
}

// e4m3 codes (one a 32-bit lane, as fp8_codes16 gives them) -> their values in fp32,
// exactly: a normal code's exponent and mantissa moved into fp32's places and the
// exponent rebiased by 120; a code whose exponent field is zero is m * 2^-9
inline __m512 fp32_from_fp8_codes16(__m512i c) {
  const __m512i mag = _mm512_and_si512(c, _mm512_set1_epi32(0x7F));
  const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23));
  const __m512i sub = _mm512_castps_si512(_mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(0x1p-9f)));
  const __m512i v = _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32(8)), normal, sub);
  return _mm512_castsi512_ps(_mm512_or_si512(v, _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x80)), 24)));
}

// 16 fp32 values to bf16, rounded to nearest even (c10::BFloat16's rounding; no NaN here)
inline __m256i bf16_from_fp32x16(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16));
}
#endif

// `rounded` (or null): each row as the cache now holds it, back in T: the e4m3 value
// times the scale in fp32, then rounded to T (engine/attention dequantize_kv's bits), for
// every row, stored or not; a prefill step attends over these. Rows whose slot is
// negative are not stored.
template <typename T>
void quantize_rows(uint8_t* cache, const T* src, const int64_t* sp, int64_t T_, int64_t row, int64_t stride,
                   float scale, T* rounded) {
  // a prefill step stores thousands of tokens: threads take runs of them
  at::parallel_for(0, T_, 64, [&](int64_t t0, int64_t t1) {
    std::vector<uint8_t> scratch(rounded != nullptr && row > 0 ? row : 0);
    for (int64_t t = t0; t < t1; ++t) {
      if (sp[t] < 0 && rounded == nullptr) continue;
      uint8_t* dst = sp[t] >= 0 ? cache + sp[t] * row : scratch.data();
      const T* x = src + t * stride;
      int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
        const __m512 vs = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-448.f), hi = _mm512_set1_ps(448.f);
        for (; i + 16 <= row; i += 16) {
          __m512 v;
          if constexpr (std::is_same_v<T, float>)
            v = _mm512_loadu_ps(x + i);
          else
            v = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(x + i))), 16));
          if (scale != 1.f) v = _mm512_div_ps(v, vs);
          // max first, as std::fmax: a NaN becomes -448 on both paths
          const __m512i codes = fp8_codes16(_mm512_min_ps(_mm512_max_ps(v, lo), hi));
          _mm_storeu_si128((__m128i*)(dst + i), _mm512_cvtepi32_epi8(codes));
          if (rounded != nullptr) {
            __m512 back = fp32_from_fp8_codes16(codes);
            if (scale != 1.f) back = _mm512_mul_ps(back, vs);
            if constexpr (std::is_same_v<T, float>)
              _mm512_storeu_ps(rounded + t * row + i, back);
            else
              _mm256_storeu_si256((__m256i*)(rounded + t * row + i), bf16_from_fp32x16(back));
          }
        }
      }
#endif
      const int64_t i0 = i;  // the rest one value at a time
      for (; i < row; ++i) {
        float v = static_cast<float>(x[i]);
        if (scale != 1.f) v = v / scale;  // as engine/attention quantize_kv: a division, then the clamp
        v = std::fmin(std::fmax(v, -448.f), 448.f);
        dst[i] = c10::detail::fp8e4m3fn_from_fp32_value(v);
      }
      if (rounded != nullptr) {
        T* r = rounded + t * row;
        for (int64_t j = i0; j < row; ++j) {
          float v = c10::detail::fp8e4m3fn_to_fp32_value(dst[j]);
          if (scale != 1.f) v = v * scale;
          r[j] = static_cast<T>(v);
        }
      }
    }
  });
}

// K/V rows of the model's dtype into an fp8 e4m3 cache, quantized as they go (the same
// bits as engine/attention quantize_kv's torch operators, then store_kv).
void store_kv_fp8_into(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& key,
                       const at::Tensor& value, const at::Tensor& slots, double k_scale, double v_scale,
                       const at::Tensor* key_out, const at::Tensor* value_out) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.dim() == 4 && k_cache.scalar_type() == at::kFloat8_e4m3fn &&
                  v_cache.scalar_type() == at::kFloat8_e4m3fn,
              "store_kv_fp8: caches must be contiguous float8_e4m3fn [N, bs, Hkv, D] of one shape");
  const int64_t row = k_cache.size(2) * k_cache.size(3), nslots = k_cache.size(0) * k_cache.size(1);
  const int64_t T = key.size(0);
  for (const at::Tensor* t : {&key, &value})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == T && t->size(1) * t->size(2) == row && t->stride(2) == 1 &&
                t->stride(1) == t->size(2) && t->scalar_type() == key.scalar_type(),
                "store_kv_fp8: key and value must be [T, Hkv, D] with contiguous [Hkv, D] rows, of one dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == T,
              "store_kv_fp8: slots must be a contiguous int64 [", T, "]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] < nslots, "store_kv_fp8: slot ", sp[t], " outside the cache");
  uint8_t* kc = static_cast<uint8_t*>(k_cache.data_ptr());
  uint8_t* vc = static_cast<uint8_t*>(v_cache.data_ptr());
  for (const at::Tensor* t : {key_out, value_out})
    TORCH_CHECK(t == nullptr || (t->is_contiguous() && t->scalar_type() == key.scalar_type() && t->numel() == T * row),
                "store_kv_fp8_rounded: key_out and value_out must be contiguous, of key's dtype and shape");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "store_kv_fp8", [&] {
    quantize_rows(kc, key.data_ptr<scalar_t>(), sp, T, row, key.stride(0), static_cast<float>(k_scale),
                  key_out == nullptr ? nullptr : key_out->data_ptr<scalar_t>());
    quantize_rows(vc, value.data_ptr<scalar_t>(), sp, T, row, value.stride(0), static_cast<float>(v_scale),
                  value_out == nullptr ? nullptr : value_out->data_ptr<scalar_t>());
  });
}

void store_kv_fp8(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& key,
                  const at::Tensor& value, const at::Tensor& slots, double k_scale, double v_scale) {
  store_kv_fp8_into(k_cache, v_cache, key, value, slots, k_scale, v_scale, nullptr, nullptr);
}

// the same, and the rows as stored, back in key's dtype, into key_out and value_out
// (a prefill step attends over them: engine/attention write_kv)
void store_kv_fp8_rounded(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& key,
                          const at::Tensor& value, const at::Tensor& slots, double k_scale, double v_scale,
                          const at::Tensor& key_out, const at::Tensor& value_out) {
  store_kv_fp8_into(k_cache, v_cache, key, value, slots, k_scale, v_scale, &key_out, &value_out);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()", &rms_norm);
  m.def("add_rms_norm(Tensor(a!) out, Tensor(b!) residual, Tensor delta, Tensor weight, float eps) -> ()",
        &add_rms_norm);
  m.def("rotary_(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin) -> ()", &rotary_);
  m.def("store_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor key, Tensor value, Tensor slots) -> ()", &store_kv);
  m.def("store_kv_fp8(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor key, Tensor value, Tensor slots, "
        "float k_scale, float v_scale) -> ()", &store_kv_fp8);
  m.def("store_kv_fp8_rounded(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor key, Tensor value, Tensor slots, "
        "float k_scale, float v_scale, Tensor(c!) key_out, Tensor(d!) value_out) -> ()", &store_kv_fp8_rounded);
}
