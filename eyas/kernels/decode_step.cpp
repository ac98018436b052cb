// A bf16 target's exact-mode decode / verify forward through its decoder layers as one native call.
//
// eyas.models.decode_plan.DecodePlan.run makes ~240 calls a forward from Python (121 block projections, 60 norms,
// 30 RoPE/cache writes, 30 path attentions, and per layer the residual adds, silu, the gate * up product, the
// attention output's rounding and the views between them). On the Zen 4 VM that loop took 6.76 ms for one token
// where its kernel calls alone took 5.49: the ~150 small torch ops cost ~5 us each from Python, and the Python
// around every call a little more. Here the same calls run from one entry, in the same order, on the same tensors:
//
//   h    = rms_norm(x, norm1)                           rms_norm.h
//   qkv  = linear(h, Wqkv)  [N, H + 2 Hk, Dh]           gguf_bf16.h (GGUF blocks, this module's own tuning)
//   q    = rope_cache(qkv) (k, v into the layer's cache) layer_ops.h
//   y    = path_attention(q, cache, slots, lengths)     path_attn.h
//   x    = x + linear(bf16(y), Wo)                      the rounding and the add: here
//   gu   = linear(rms_norm(x, norm2), Wgu)              gate | up
//   x    = x + linear(silu(gate) * up, Wdown)           at::silu (torch's exp), the product and the add: here
//
// The kernels are the headers the Python modules bind; silu is torch's own op; the elementwise steps torch does in
// bf16 (a + b, a * b: each element in float32, rounded to nearest even; float32 -> bf16: rounded to nearest even)
// are 16-lane loops with the same rounding, so the output, the taps and the cache hold the bits DecodePlan.run gives
// (tests/models/test_decode_plan.py), and plain decoding and verification keep taking either path.
#include "gguf_bf16.h"
#include "layer_ops.h"
#include "path_attn.h"
#include "rms_norm.h"

#include <ATen/ops/add.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>

#include <cmath>
#include <tuple>
#include <vector>

namespace {

#if defined(__AVX512F__)
inline __m512 load_bf16x16(const uint16_t* p, __mmask16 live) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, p)), 16));
}

// float32 -> bf16, rounded to nearest even (NaN -> 0x7FC0), as c10::BFloat16(float)
inline void store_bf16x16(uint16_t* p, __m512 v, __mmask16 live) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
  _mm256_mask_storeu_epi16(p, live, _mm512_cvtepi32_epi16(r));
}

inline __mmask16 lanes(int64_t left) { return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1); }

const uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<c10::BFloat16>()); }
#endif

// a + b (bf16 [N, D], contiguous): torch's bf16 add (each element in float32, rounded to nearest even)
at::Tensor add_bf16(const at::Tensor& a, const at::Tensor& b) {
#if defined(__AVX512F__)
  auto out = at::empty_like(a);
  const uint16_t *pa = bits(a), *pb = bits(b);
  uint16_t* po = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  for (int64_t i = 0, n = a.numel(); i < n; i += 16) {
    const __mmask16 live = lanes(n - i);
    store_bf16x16(po + i, _mm512_add_ps(load_bf16x16(pa + i, live), load_bf16x16(pb + i, live)), live);
  }
  return out;
#else
  return at::add(a, b);
#endif
}

// s * gu[:, half:] (s bf16 [N, I] contiguous, gu bf16 [N, 2I]): torch's bf16 product, as a + b above
at::Tensor mul_up_bf16(const at::Tensor& s, const at::Tensor& gu) {
#if defined(__AVX512F__)
  const int64_t n = s.size(0), half = s.size(1);
  auto out = at::empty_like(s);
  const uint16_t *ps = bits(s), *pg = bits(gu);
  uint16_t* po = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < half; j += 16) {
      const __mmask16 live = lanes(half - j);
      const __m512 gate = load_bf16x16(ps + r * half + j, live), up = load_bf16x16(pg + r * 2 * half + half + j, live);
      store_bf16x16(po + r * half + j, _mm512_mul_ps(gate, up), live);
    }
  return out;
#else
  return at::mul(s, gu.slice(1, s.size(1)));
#endif
}

// y (float32, contiguous) -> bf16 of the same shape, rounded to nearest even: torch's .to(torch.bfloat16)
at::Tensor to_bf16(const at::Tensor& y) {
#if defined(__AVX512F__)
  auto out = at::empty(y.sizes(), y.options().dtype(at::kBFloat16));
  const float* py = y.data_ptr<float>();
  uint16_t* po = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  for (int64_t i = 0, n = y.numel(); i < n; i += 16) {
    const __mmask16 live = lanes(n - i);
    store_bf16x16(po + i, _mm512_maskz_loadu_ps(live, py + i), live);
  }
  return out;
#else
  return y.to(at::kBFloat16);
#endif
}

// one projection as the block kernel's linear takes it: blocks, type code, bias (empty for none)
struct Proj {
  at::Tensor data, bias;
  int64_t code;
};

using ProjArgs = std::tuple<at::Tensor, int64_t, at::Tensor>;
// input norm, post-attention norm, q|k|v, o, gate|up, down
using LayerArgs = std::tuple<at::Tensor, at::Tensor, ProjArgs, ProjArgs, ProjArgs, ProjArgs>;

struct Layer {
  at::Tensor norm1, norm2;
  Proj qkv, o, gate_up, down;
};

Proj make_proj(const ProjArgs& a, const char* what) {
  auto [data, code, bias] = a;
  TORCH_CHECK(data.dim() == 2 && data.scalar_type() == at::kByte && data.is_contiguous(), "decode_step: ", what,
              " blocks [N, bytes] uint8, contiguous");
  TORCH_CHECK(bias.numel() == 0 || bias.numel() == data.size(0), "decode_step: ", what, " bias [N] or empty");
  return Proj{data, bias, code};
}

at::Tensor linear(const at::Tensor& x, const Proj& p) { return eyas_gguf_bf16::linear(x, p.data, p.code, p.bias); }

class DecodeStep {
 public:
  DecodeStep(std::vector<LayerArgs> layers, double eps, int64_t heads, int64_t kv_heads, int64_t head_dim)
      : eps_(eps), h_(heads), hk_(kv_heads), dh_(head_dim) {
    TORCH_CHECK(eyas_gguf_bf16::available(), "decode_step: the bf16 block kernel was not built (no AVX512-BF16)");
    TORCH_CHECK(!layers.empty() && h_ > 0 && hk_ > 0 && h_ % hk_ == 0 && eyas_path_attn::supports(h_ / hk_, dh_),
                "decode_step: no attention kernel for ", h_, " query heads over ", hk_, " KV heads of ", dh_);
    for (size_t l = 0; l < layers.size(); ++l) {
      auto& [n1, n2, qkv, o, gu, down] = layers[l];
      TORCH_CHECK(n1.scalar_type() == at::kBFloat16 && n2.scalar_type() == at::kBFloat16 && n1.dim() == 1 &&
                      n2.sizes() == n1.sizes(),
                  "decode_step: layer ", l, "'s norm weights [D] bfloat16");
      layers_.push_back(Layer{n1.contiguous(), n2.contiguous(), make_proj(qkv, "q|k|v"), make_proj(o, "o"),
                              make_proj(gu, "gate|up"), make_proj(down, "down")});
    }
  }

  // x [N, D] bf16 embeddings; cos, sin [N, Dh] (the rows' RoPE, in x's dtype); caches: layer l's (keys, values)
  // [Hk, S, Dh]; the rows attend slots 0 .. start - 1, then slots[r, 0 .. lengths[r] - 1]; their own k and v go to
  // slots start .. start + N - 1. Returns (the last layer's output [N, D], each layer of ``taps``' input [N, D]).
  std::tuple<at::Tensor, std::vector<at::Tensor>> run(at::Tensor x, at::Tensor cos, at::Tensor sin,
                                                      std::vector<at::Tensor> k_caches,
                                                      std::vector<at::Tensor> v_caches, int64_t start,
                                                      at::Tensor slots, at::Tensor lengths, double scale,
                                                      std::vector<int64_t> taps) const {
    const int64_t nl = static_cast<int64_t>(layers_.size());
    TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == nl && static_cast<int64_t>(v_caches.size()) == nl,
                "decode_step: one key and one value cache a layer (", nl, " layers)");
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(1) == layers_[0].norm1.numel(),
                "decode_step: x [N, D] bfloat16");
    x = x.contiguous();
    const int64_t n = x.size(0);
    std::vector<at::Tensor> tapped;
    size_t next_tap = 0;
    for (int64_t i = 0; i < nl; ++i) {
      const Layer& p = layers_[i];
      if (next_tap < taps.size() && taps[next_tap] == i) {
        tapped.push_back(x);
        ++next_tap;
      }
      at::Tensor qkv = linear(eyas_rms_norm::rms_norm(x, p.norm1, eps_), p.qkv).view({n, h_ + 2 * hk_, dh_});
      at::Tensor q = eyas_layer_ops::rope_cache(qkv, cos, sin, k_caches[i], v_caches[i], start, h_);
      at::Tensor y = eyas_path_attn::path_attention(q, k_caches[i], v_caches[i], start, slots, lengths, scale);
      x = add_bf16(x, linear(to_bf16(y).view({n, h_ * dh_}), p.o));
      at::Tensor gu = linear(eyas_rms_norm::rms_norm(x, p.norm2, eps_), p.gate_up);
      const int64_t half = gu.size(1) / 2;
      x = add_bf16(x, linear(mul_up_bf16(at::silu(gu.slice(1, 0, half)).contiguous(), gu), p.down));
    }
    TORCH_CHECK(next_tap == taps.size(), "decode_step: taps must be layer indices in increasing order, below ", nl);
    return {x, tapped};
  }

 private:
  std::vector<Layer> layers_;
  double eps_;
  int64_t h_, hk_, dh_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<DecodeStep>(m, "DecodeStep")
      .def(py::init<std::vector<LayerArgs>, double, int64_t, int64_t, int64_t>())
      .def("run", &DecodeStep::run, "the decoder layers over x: (output [N, D], the taps' inputs [N, D] each)");
  m.def("set_tuning", &eyas_gguf_bf16::set_tuning,
        "this module's copy of the block kernel's per-CPU choices (gguf_bf16.set_tuning's)", py::arg("prefetch"),
        py::arg("pair_as_triple"), py::arg("fma_rows") = false, py::arg("prefetch_one") = false,
        py::arg("fused_rows") = true);
  m.def("available", &eyas_gguf_bf16::available, "whether the bf16 block kernel was built (AVX512-BF16)");
}
