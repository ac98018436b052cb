// The small steps of a decode layer's attention as one call: RoPE on q and k, k and v into the KV cache,
// q handed to the attention kernel in float32.
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

// qkv [N, H + 2 Hk, Dh] bf16 (rows may be strided, heads and dims contiguous); cos, sin [N, Dh] bf16;
// k_cache, v_cache [Hk, S, Dh] float32 (one layer, one sequence; dims contiguous); slots start .. start + N.
// Writes rotated k and v at those slots and returns rotated q as float32 [N, H, Dh].
torch::Tensor rope_cache(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                         torch::Tensor v_cache, int64_t start, int64_t h) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.scalar_type() == at::kBFloat16 && qkv.stride(2) == 1 &&
                  qkv.stride(1) == qkv.size(2),
              "rope_cache: qkv [N, H + 2 Hk, Dh] bf16 with contiguous heads");
  const int64_t n = qkv.size(0), dh = qkv.size(2), hk = (qkv.size(1) - h) / 2;
  TORCH_CHECK(h > 0 && hk > 0 && h + 2 * hk == qkv.size(1) && dh % 2 == 0, "rope_cache: H + 2 Hk heads");
  TORCH_CHECK(cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16 && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.numel() == n * dh && sin.numel() == n * dh,
              "rope_cache: cos, sin [N, Dh] contiguous bf16");
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat && k_cache.dim() == 3 &&
                  v_cache.dim() == 3 && k_cache.size(0) == hk && v_cache.size(0) == hk && k_cache.size(2) == dh &&
                  v_cache.size(2) == dh && k_cache.stride(2) == 1 && v_cache.stride(2) == 1,
              "rope_cache: k_cache, v_cache [Hk, S, Dh] float32");
  TORCH_CHECK(start >= 0 && start + n <= k_cache.size(1) && start + n <= v_cache.size(1),
              "rope_cache: slots past the cache (raise max_slots)");
  auto q = torch::empty({n, h, dh}, qkv.options().dtype(at::kFloat));
  const auto* src = qkv.data_ptr<c10::BFloat16>();
  const auto* cp = cos.data_ptr<c10::BFloat16>();
  const auto* sp = sin.data_ptr<c10::BFloat16>();
  float* qp = q.data_ptr<float>();
  float* kp = k_cache.data_ptr<float>();
  float* vp = v_cache.data_ptr<float>();
  const int64_t rs = qkv.stride(0), ks0 = k_cache.stride(0), ks1 = k_cache.stride(1);
  const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1);
  c10::BFloat16 buf[512];
  TORCH_CHECK(dh <= 512, "rope_cache: head_dim up to 512");
  for (int64_t r = 0; r < n; ++r) {
    const c10::BFloat16* row = src + r * rs;
    const c10::BFloat16* cr = cp + r * dh;
    const c10::BFloat16* sr = sp + r * dh;
    for (int64_t j = 0; j < h + hk; ++j) {
      rope_head(row + j * dh, cr, sr, dh, buf);
      float* dst = j < h ? qp + (r * h + j) * dh : kp + (j - h) * ks0 + (start + r) * ks1;
      for (int64_t d = 0; d < dh; ++d) dst[d] = f(buf[d]);
    }
    for (int64_t j = 0; j < hk; ++j) {
      const c10::BFloat16* v = row + (h + hk + j) * dh;
      float* dst = vp + j * vs0 + (start + r) * vs1;
      for (int64_t d = 0; d < dh; ++d) dst[d] = f(v[d]);
    }
  }
  return q;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rope_cache", &rope_cache, "RoPE on q and k, k and v into a float32 cache, q as float32 (CPU, bf16)");
}
