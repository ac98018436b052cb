// The small steps of a decode layer's attention as one call: RoPE on q and k, k and v into the KV cache,
// q handed to the attention kernel in float32 (the cache float32 or bf16: the same values either way).
//
// A decode or verify forward of a small model runs ~20 torch ops a layer around its projections, each a few
// microseconds of dispatch for a few hundred elements: RoPE alone is five (split, flip, join, multiply,
// multiply-add), the cache write two strided copies with conversions, q's conversion one more. Here they are
// one pass over the fused q/k/v projection's rows.
//
// Numerics are torch's for the same bf16 tensors, bit for bit (built with -ffp-contract=off):
//   xc  = bf16(x * cos)                      (eyas.models.native.Rope: x * cos in bf16)
//   out = bf16(float(xc) + float(sw) * sin)  (torch.addcmul in bf16: product, then sum, in float32)
// where sw is x with its two halves swapped and cos, sin (signed) are the bf16 tables Rope holds. k and v go
// to the float32 cache as their exact bf16 values, as KVCache.update writes them.
#include <torch/extension.h>
#include <c10/util/BFloat16.h>

#include <cstdint>

namespace {

inline float f(c10::BFloat16 x) { return static_cast<float>(x); }

// one head of dh values: rotated, as bf16
inline void rope_head(const c10::BFloat16* x, const c10::BFloat16* cs, const c10::BFloat16* sn, int64_t dh,
                      c10::BFloat16* out) {
  const int64_t half = dh / 2;
  for (int64_t d = 0; d < dh; ++d) {
    const c10::BFloat16 xc = c10::BFloat16(f(x[d]) * f(cs[d]));
    const float prod = f(x[d < half ? d + half : d - half]) * f(sn[d]);
    out[d] = c10::BFloat16(f(xc) + prod);
  }
}

inline void put(float* dst, c10::BFloat16 x) { *dst = f(x); }
inline void put(c10::BFloat16* dst, c10::BFloat16 x) { *dst = x; }

template <typename C>
void rope_rows(const c10::BFloat16* src, int64_t rs, const c10::BFloat16* cp, const c10::BFloat16* sp, int64_t n,
               int64_t h, int64_t hk, int64_t dh, float* qp, C* kp, C* vp, int64_t ks0, int64_t ks1, int64_t vs0,
               int64_t vs1, int64_t start) {
  c10::BFloat16 buf[512];
  for (int64_t r = 0; r < n; ++r) {
    const c10::BFloat16* row = src + r * rs;
    for (int64_t j = 0; j < h + hk; ++j) {
      rope_head(row + j * dh, cp + r * dh, sp + r * dh, dh, buf);
      if (j < h) {
        float* dst = qp + (r * h + j) * dh;
        for (int64_t d = 0; d < dh; ++d) dst[d] = f(buf[d]);
      } else {
        C* dst = kp + (j - h) * ks0 + (start + r) * ks1;
        for (int64_t d = 0; d < dh; ++d) put(dst + d, buf[d]);
      }
    }
    for (int64_t j = 0; j < hk; ++j) {
      const c10::BFloat16* v = row + (h + hk + j) * dh;
      C* dst = vp + j * vs0 + (start + r) * vs1;
      for (int64_t d = 0; d < dh; ++d) put(dst + d, v[d]);
    }
  }
}

// qkv [N, H + 2 Hk, Dh] bf16 (rows may be strided, heads and dims contiguous); cos, sin [N, Dh] bf16;
// k_cache, v_cache [Hk, S, Dh] float32 or bf16 (one layer, one sequence; dims contiguous); slots start .. start + N.
// Writes rotated k and v at those slots and returns rotated q as float32 [N, H, Dh].
torch::Tensor rope_cache(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                         torch::Tensor v_cache, int64_t start, int64_t h) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.scalar_type() == at::kBFloat16 && qkv.stride(2) == 1 &&
                  qkv.stride(1) == qkv.size(2),
              "rope_cache: qkv [N, H + 2 Hk, Dh] bf16 with contiguous heads");
  const int64_t n = qkv.size(0), dh = qkv.size(2), hk = (qkv.size(1) - h) / 2;
  TORCH_CHECK(h > 0 && hk > 0 && h + 2 * hk == qkv.size(1) && dh % 2 == 0 && dh <= 512,
              "rope_cache: H + 2 Hk heads of an even head_dim up to 512");
  TORCH_CHECK(cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16 && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.numel() == n * dh && sin.numel() == n * dh,
              "rope_cache: cos, sin [N, Dh] contiguous bf16");
  const auto ct = k_cache.scalar_type();
  TORCH_CHECK((ct == at::kFloat || ct == at::kBFloat16) && v_cache.scalar_type() == ct && k_cache.dim() == 3 &&
                  v_cache.dim() == 3 && k_cache.size(0) == hk && v_cache.size(0) == hk && k_cache.size(2) == dh &&
                  v_cache.size(2) == dh && k_cache.stride(2) == 1 && v_cache.stride(2) == 1,
              "rope_cache: k_cache, v_cache [Hk, S, Dh] float32 or bf16");
  TORCH_CHECK(start >= 0 && start + n <= k_cache.size(1) && start + n <= v_cache.size(1),
              "rope_cache: slots past the cache (raise max_slots)");
  auto q = torch::empty({n, h, dh}, qkv.options().dtype(at::kFloat));
  const auto* src = qkv.data_ptr<c10::BFloat16>();
  const auto* cp = cos.data_ptr<c10::BFloat16>();
  const auto* sp = sin.data_ptr<c10::BFloat16>();
  const int64_t rs = qkv.stride(0), ks0 = k_cache.stride(0), ks1 = k_cache.stride(1);
  const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1);
  if (ct == at::kFloat)
    rope_rows(src, rs, cp, sp, n, h, hk, dh, q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
              ks0, ks1, vs0, vs1, start);
  else
    rope_rows(src, rs, cp, sp, n, h, hk, dh, q.data_ptr<float>(), k_cache.data_ptr<c10::BFloat16>(),
              v_cache.data_ptr<c10::BFloat16>(), ks0, ks1, vs0, vs1, start);
  return q;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rope_cache", &rope_cache, "RoPE on q and k, k and v into the cache, q as float32 (CPU, bf16)");
}
