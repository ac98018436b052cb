// The small steps of a decode layer's attention as one call: RoPE on q and k, k and v into the KV cache,
// q handed to the attention kernel in float32 (the cache float32 or bf16: the same values either way).
//
// A decode or verify forward of a small model runs ~20 torch ops a layer around its projections, each a few
// microseconds of dispatch for a few hundred elements: RoPE alone is five (split, flip, join, multiply,
// multiply-add), the cache write two strided copies with conversions, q's conversion one more. Here they are
// one pass over the fused q/k/v projection's rows.
//
// Numerics are torch's for the same bf16 or float32 tensors, bit for bit (built with -ffp-contract=off):
//   xc  = T(x * cos)                      (eyas.models.native.Rope: x * cos in T)
//   out = bf16(float(xc) + float(sw) * sin)  (torch.addcmul in bf16: product, then sum, in float32)
//   out = fma(sw, sin, xc)                   (torch.addcmul in float32: one fused multiply-add)
// where T is the dtype (bf16 or float32), sw is x with its two halves swapped and cos,
// sin (signed) are the tables Rope holds. k and v go to the float32 cache as their exact values, as
// KVCache.update writes them.
//
// The kernel itself; layer_ops.cpp binds it for Python and head_step.cpp calls it directly.
#pragma once
#include "torch_ext.h"
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace eyas_layer_ops {
namespace {  // internal linkage: each module that includes this has its own copy

inline float f(c10::BFloat16 x) { return static_cast<float>(x); }
inline float f(float x) { return x; }

// torch.addcmul(xc, sw, sn): in bf16 the product, then the sum, in float32; in float32 one fused multiply-add
inline c10::BFloat16 addcmul(c10::BFloat16 xc, c10::BFloat16 sw, c10::BFloat16 sn) {
  const float prod = f(sw) * f(sn);
  return c10::BFloat16(f(xc) + prod);
}
inline float addcmul(float xc, float sw, float sn) { return std::fma(sw, sn, xc); }

// one head of dh values of T (bf16 or float32): rotated, as T
template <typename T>
inline void rope_head(const T* x, const T* cs, const T* sn, int64_t dh, T* out) {
  const int64_t half = dh / 2;
  for (int64_t d = 0; d < dh; ++d) out[d] = addcmul(T(f(x[d]) * f(cs[d])), x[d < half ? d + half : d - half], sn[d]);
}

template <typename T>
inline void put(float* dst, T x) { *dst = f(x); }
inline void put(c10::BFloat16* dst, c10::BFloat16 x) { *dst = x; }

template <typename T, typename C>
void rope_rows(const T* src, int64_t rs, const T* cp, const T* sp, int64_t n, int64_t h, int64_t hk, int64_t dh,
               float* qp, C* kp, C* vp, int64_t ks0, int64_t ks1, int64_t vs0, int64_t vs1, int64_t start) {
  T buf[512];
  for (int64_t r = 0; r < n; ++r) {
    const T* row = src + r * rs;
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
      const T* v = row + (h + hk + j) * dh;
      C* dst = vp + j * vs0 + (start + r) * vs1;
      for (int64_t d = 0; d < dh; ++d) put(dst + d, v[d]);
    }
  }
}

template <typename T>
void rope_into(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
               at::Tensor& v_cache, int64_t start, int64_t h, at::Tensor& q) {
  const int64_t n = qkv.size(0), dh = qkv.size(2), hk = (qkv.size(1) - h) / 2;
  const T* src = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  const int64_t rs = qkv.stride(0), ks0 = k_cache.stride(0), ks1 = k_cache.stride(1);
  const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1);
  if (k_cache.scalar_type() == at::kFloat)
    rope_rows(src, rs, cp, sp, n, h, hk, dh, q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
              ks0, ks1, vs0, vs1, start);
  else if constexpr (std::is_same_v<T, c10::BFloat16>)  // a bf16 cache takes bf16 rows only (rope_cache checks)
    rope_rows(src, rs, cp, sp, n, h, hk, dh, q.data_ptr<float>(), k_cache.data_ptr<c10::BFloat16>(),
              v_cache.data_ptr<c10::BFloat16>(), ks0, ks1, vs0, vs1, start);
}

// qkv [N, H + 2 Hk, Dh] bf16 or float32 (rows may be strided, heads and dims contiguous); cos, sin [N, Dh] of qkv's
// dtype; k_cache, v_cache [Hk, S, Dh] float32 or bf16 (one layer, one sequence; dims contiguous; a float32 qkv needs
// a float32 cache); slots start .. start + N. Writes rotated k and v at those slots and returns rotated q as
// float32 [N, H, Dh].
at::Tensor rope_cache(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor k_cache,
                         at::Tensor v_cache, int64_t start, int64_t h) {
  const auto xt = qkv.scalar_type();
  TORCH_CHECK(qkv.dim() == 3 && (xt == at::kBFloat16 || xt == at::kFloat) && qkv.stride(2) == 1 &&
                  qkv.stride(1) == qkv.size(2),
              "rope_cache: qkv [N, H + 2 Hk, Dh] bf16 or float32 with contiguous heads");
  const int64_t n = qkv.size(0), dh = qkv.size(2), hk = (qkv.size(1) - h) / 2;
  TORCH_CHECK(h > 0 && hk > 0 && h + 2 * hk == qkv.size(1) && dh % 2 == 0 && dh <= 512,
              "rope_cache: H + 2 Hk heads of an even head_dim up to 512");
  TORCH_CHECK(cos.scalar_type() == xt && sin.scalar_type() == xt && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.numel() == n * dh && sin.numel() == n * dh,
              "rope_cache: cos, sin [N, Dh] contiguous, in qkv's dtype");
  const auto ct = k_cache.scalar_type();
  TORCH_CHECK((ct == at::kFloat || ct == at::kBFloat16) && v_cache.scalar_type() == ct && k_cache.dim() == 3 &&
                  v_cache.dim() == 3 && k_cache.size(0) == hk && v_cache.size(0) == hk && k_cache.size(2) == dh &&
                  v_cache.size(2) == dh && k_cache.stride(2) == 1 && v_cache.stride(2) == 1,
              "rope_cache: k_cache, v_cache [Hk, S, Dh] float32 or bf16");
  TORCH_CHECK(xt == at::kBFloat16 || ct == at::kFloat, "rope_cache: a float32 qkv writes a float32 cache");
  TORCH_CHECK(start >= 0 && start + n <= k_cache.size(1) && start + n <= v_cache.size(1),
              "rope_cache: slots past the cache (raise max_slots)");
  auto q = at::empty({n, h, dh}, qkv.options().dtype(at::kFloat));
  if (xt == at::kFloat)
    rope_into<float>(qkv, cos, sin, k_cache, v_cache, start, h, q);
  else
    rope_into<c10::BFloat16>(qkv, cos, sin, k_cache, v_cache, start, h, q);
  return q;
}

// torch.argmax's answer for one float32 row: the first maximal index, or the first NaN's index if there is one
int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0;
  float best = -INFINITY;
#if defined(__AVX512F__)
  __m512 mx = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    mx = _mm512_max_ps(mx, v);
  }
  if (nan) i = 0;  // the scalar loop below finds the first NaN
  else best = _mm512_reduce_max_ps(mx);
#endif
  for (; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    best = x[i] > best ? x[i] : best;
  }
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 b = _mm512_set1_ps(best);
  for (; j + 16 <= n; j += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j), b, _CMP_EQ_OQ);
    if (hit) return j + __builtin_ctz(hit);
  }
#endif
  for (; j < n; ++j)
    if (x[j] == best) return j;
  return 0;  // a row of -inf only
}


// x [N, V] float32 -> [N] int64: torch.argmax(x, -1) (first maximal index; NaN counts as the maximum), one pass
// of 16-lane max then a search for its first position. The greedy verifier's argmax over a few vocabulary rows:
// ~4x faster than torch's for [4, 49152] on the Zen 5 VM.
at::Tensor argmax_rows(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "argmax_rows: x [N, V] float32");
  const int64_t n = x.size(0), v = x.size(1);
  TORCH_CHECK(v > 0, "argmax_rows: empty rows");
  auto out = at::empty({n}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  const float* p = x.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) o[r] = argmax_row(p + r * x.stride(0), v);
  return out;
}

}  // namespace
}  // namespace eyas_layer_ops
