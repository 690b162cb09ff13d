// A Llama model's decoder layers for a step of decode tokens only, in one call.
//
// A decode step's layers call a dozen operators each from Python (about 10 us each with
// dispatch); at one stream of a 200M model that came to about 2 ms of a 16.7 ms step on
// the development machine, and more of a small model's batched step. This runs the same
// operators in the same order from C++:
//
//   h = rms_norm(residual) (first layer) or add_rms_norm(residual += delta)
//   qkv = h Wqkv^T; rotary_(q, k); store_kv(k, v); o = paged_decode_attention(q)
//   h = add_rms_norm(residual += o Wo^T)
//   delta = (silu_(h Wg^T) *= h Wu^T) Wd^T   (or quant_linear_tiles_swiglu's one call)
//
// with the kernels this extension registers (tile_linear, small_batch_linear, rms_norm,
// add_rms_norm, rotary_, store_kv, paged_decode_attention) and oneDNN's packed linear layer, reached
// through the dispatcher, and torch's own silu_ and mul_, so every value is rounded where
// engine/models/llama.py rounds it and the outputs are bitwise the same. Layers without
// biases only (the caller checks).
//
// A quantized model (--quantization int8 or fp8, one scale an output row) takes its linear
// layers from quant_linear.cpp instead, as engine/quantization/linear.py's QuantLinear
// calls them: int8 in the tile unit's order through quant_linear_tiles (bf16 models on
// VNNI/AMX builds), else quant_linear on the row-major q (W8A8 with bf16 x where the
// weight sums come, the widening kernel otherwise).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

namespace {

#define TANDEM_STR2(x) #x
#define TANDEM_STR(x) TANDEM_STR2(x)

template <typename Fn>
c10::TypedOperatorHandle<Fn> sibling(const char* name) {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow((std::string(TANDEM_STR(TORCH_EXTENSION_NAME)) + "::" + name).c_str(), "")
      .typed<Fn>();
}

using Linear = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&);
using Norm = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, double);
using AddNorm = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double);
using Rotary = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);
using Store = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);
using StoreFp8 = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      double, double);
using QuantTiles = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const std::optional<at::Tensor>&, const at::Tensor&);
using QuantSwiglu = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&);
using QuantRows = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                       const std::optional<at::Tensor>&, const std::optional<at::Tensor>&);
using Attend = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                    const at::Tensor&, double, bool, double, int64_t, double);

constexpr int64_t kLinears = 5;  // qkv, o, gate, up, down

// oneDNN's linear layer on a weight packed by mkldnn::_reorder_linear_weight, as
// PackedLinear calls it from Python (no bias, no post-op); a plain weight (PlainLinear:
// fp32, or bf16 where oneDNN has no native bf16) takes at::linear, as F.linear does
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& w) {
  if (!w.is_mkldnn()) return at::linear(x, w);
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, w, c10::IValue(), std::string("none"), c10::List<std::optional<at::Scalar>>(),
                          std::string("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// `residual` [M, hidden] holds the embedded tokens and is updated in place, as the
// Python layers update it; returns the last layer's MLP output (the next delta).
// The linear layers' weights: `packed` for oneDNN; and either `tiles` (the tile kernel's
// copies, for steps of up to `tile_rows` tokens) or `plain` (row-major copies for the
// row-major kernel, up to `small_rows`), or neither: engine/models/packed.py's choice.
// Or, for a quantized model, `packed`, `plain` and `tiles` empty and `quant` holding each
// linear layer's (q, scale [N, 1] fp32, weight sums) in turn, 15 a layer: q in tile order
// when `quant_tiles`, else row-major; the weight sums (int32, W8A8) all defined or none
// (an empty tensor each). In tile order a layer's gate and up may come fused (QuantSwiGLU:
// the interleaved tiles, scales and sums in the gate's place, three empty tensors in the
// up's), which quant_linear_tiles_swiglu runs.
at::Tensor decode_layers(const at::Tensor& residual, at::TensorList norms,
                   at::TensorList packed, at::TensorList plain, at::TensorList tiles,
                   at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& positions,
                   const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t num_heads,
                   int64_t num_kv_heads, int64_t head_dim, double scale, double eps, bool bf16_pairs,
                   int64_t small_rows, int64_t tile_rows, at::ArrayRef<double> kv_scales,
                   at::IntArrayRef windows, at::TensorList quant, bool quant_tiles) {
  static const auto linear = sibling<Linear>("small_batch_linear");
  static const auto tile_linear = sibling<Linear>("tile_linear");
  static const auto norm = sibling<Norm>("rms_norm");
  static const auto add_norm = sibling<AddNorm>("add_rms_norm");
  static const auto rotary = sibling<Rotary>("rotary_");
  static const auto store = sibling<Store>("store_kv");
  static const auto store_fp8 = sibling<StoreFp8>("store_kv_fp8");
  static const auto attend = sibling<Attend>("paged_decode_attention");
  const bool quantized = !quant.empty();

  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(L > 0 && static_cast<int64_t>(norms.size()) == 2 * L &&
                  (quantized ? packed.empty() && plain.empty() && tiles.empty() &&
                                   static_cast<int64_t>(quant.size()) == 3 * kLinears * L
                             : static_cast<int64_t>(packed.size()) == kLinears * L) &&
                  (plain.empty() || static_cast<int64_t>(plain.size()) == kLinears * L) &&
                  (tiles.empty() || static_cast<int64_t>(tiles.size()) == kLinears * L) &&
                  static_cast<int64_t>(v_caches.size()) == L,
              "decode_layers: 2 norms, ", kLinears, " packed (and optionally ", kLinears,
              " row-major or tile-order) weights and one K and V cache per layer");
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous(), "decode_layers: residual must be contiguous [M, hidden]");
  const int64_t M = residual.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  // an fp8 cache (--kv-cache-dtype fp8): each layer's (K, V) scales, 2 a layer
  const bool fp8 = k_caches[0].scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(!fp8 || static_cast<int64_t>(kv_scales.size()) == 2 * L,
              "decode_layers: an fp8 cache needs a K and a V scale per layer");
  // each layer's sliding window (0: none), or none at all
  TORCH_CHECK(windows.empty() || static_cast<int64_t>(windows.size()) == L,
              "decode_layers: a window per layer, or none");
  const auto opts = residual.options();
  // the linear layers as engine/models/packed.py runs them: the tile kernel on the
  // tile-order copy, or the row-major kernel on the row-major one, for steps of up to
  // their rows; oneDNN on the packed weight otherwise
  const bool tiled = M <= tile_rows && !tiles.empty();
  const bool small = !tiled && M <= small_rows && !plain.empty();
  static const auto quant_tiled = sibling<QuantTiles>("quant_linear_tiles");
  static const auto quant_rows = sibling<QuantRows>("quant_linear");
  static const auto quant_swiglu = sibling<QuantSwiglu>("quant_linear_tiles_swiglu");
  // a layer's output features: its scale's rows (quantized), else its packed weight's
  auto n_out_of = [&](int64_t layer, int64_t j) -> int64_t {
    return quantized ? quant[3 * (kLinears * layer + j) + 1].size(0) : packed[kLinears * layer + j].size(0);
  };
  auto project = [&](const at::Tensor& x, int64_t layer, int64_t j, int64_t n_out) -> at::Tensor {
    if (quantized) {
      const int64_t i = 3 * (kLinears * layer + j);
      at::Tensor y = at::empty({M, n_out}, opts);
      const at::Tensor& sums = quant[i + 2];
      if (quant_tiles) {
        quant_tiled.call(y, x, quant[i], quant[i + 1], std::nullopt, sums);
      } else {
        quant_rows.call(y, x, quant[i], quant[i + 1], quant[i].size(1), std::nullopt,
                        sums.numel() ? std::optional<at::Tensor>(sums) : std::nullopt);
      }
      return y;
    }
    if (tiled || small) {
      at::Tensor y = at::empty({M, n_out}, opts);
      if (tiled) tile_linear.call(y, x, tiles[kLinears * layer + j], std::nullopt);
      else linear.call(y, x, plain[kLinears * layer + j], std::nullopt);
      return y;
    }
    return packed_linear(x, packed[kLinears * layer + j]);
  };
  at::Tensor d;  // the previous layer's MLP output
  for (int64_t l = 0; l < L; ++l) {
    at::Tensor h = at::empty_like(residual);
    if (l == 0) norm.call(h, residual, norms[2 * l], eps);
    else add_norm.call(h, residual, d, norms[2 * l], eps);
    at::Tensor qkv = project(h, l, 0, q_size + 2 * kv_size);
    at::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({M, num_heads + num_kv_heads, head_dim});
    rotary.call(qk, positions, cos, sin);
    at::Tensor k = qk.narrow(1, num_heads, num_kv_heads);
    at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({M, num_kv_heads, head_dim});
    at::Tensor o = at::empty({M, num_heads, head_dim}, opts);
    const int64_t window = windows.empty() ? 0 : windows[l];
    if (fp8) {  // the K scale into the softmax scale, the V scale onto the output (as the Python layers)
      store_fp8.call(k_caches[l], v_caches[l], k, v, slots, kv_scales[2 * l], kv_scales[2 * l + 1]);
      attend.call(o, qk.narrow(1, 0, num_heads), k_caches[l], v_caches[l], block_tables, seq_lens,
                  scale * kv_scales[2 * l], bf16_pairs, kv_scales[2 * l + 1], window, 0.0);
    } else {
      store.call(k_caches[l], v_caches[l], k, v, slots);
      attend.call(o, qk.narrow(1, 0, num_heads), k_caches[l], v_caches[l], block_tables, seq_lens, scale, bf16_pairs,
                  1.0, window, 0.0);
    }
    at::Tensor attn = project(o.view({M, q_size}), l, 1, residual.size(1));
    h = at::empty_like(residual);
    add_norm.call(h, residual, attn, norms[2 * l + 1], eps);
    if (quantized && quant_tiles && quant[3 * (kLinears * l + 3)].numel() == 0) {
      // gate and up fused (QuantSwiGLU: their interleaved tiles in the gate's place, the
      // up's empty): silu(gate) * up in one call, the bits of the three below
      const int64_t i = 3 * (kLinears * l + 2);
      at::Tensor act = at::empty({M, quant[i + 1].size(0) / 2}, opts);
      quant_swiglu.call(act, h, quant[i], quant[i + 1], quant[i + 2]);
      d = project(act, l, 4, residual.size(1));
      continue;
    }
    const int64_t inter = n_out_of(l, 2);
    at::Tensor gate = project(h, l, 2, inter);
    at::Tensor up = project(h, l, 3, inter);
    at::silu_(gate);
    gate.mul_(up);
    d = project(gate, l, 4, residual.size(1));
  }
  return d;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(TORCH_EXTENSION_NAME, m) {
  m.def("decode_layers(Tensor(a!) residual, Tensor[] norms, Tensor[] packed, Tensor[] plain, Tensor[] tiles, "
        "Tensor[] k_caches, Tensor[] v_caches, Tensor positions, Tensor cos, Tensor sin, Tensor slots, Tensor block_tables, "
        "Tensor seq_lens, int num_heads, int num_kv_heads, int head_dim, float scale, float eps, bool bf16_pairs, "
        "int small_rows, int tile_rows, float[] kv_scales, int[] windows, Tensor[] quant, "
        "bool quant_tiles) -> Tensor",
        &decode_layers);
}
