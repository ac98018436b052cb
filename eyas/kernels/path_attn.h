// Exact-mode tree attention on the CPU, computed in one fixed order per query row.
//
// Row r (a tree node, or the single token of a plain step) attends the committed prefix, slots
// 0 .. start - 1, then its root-to-node path, slots path[r, 0 .. len_r - 1], in that logical order.
// Every quantity is accumulated along that logical order with a fixed lane pattern, so a node's
// output depends only on the keys/values it attends and their order: the same bits as when a plain
// step (path = the token's own slot, prefix = everything before it) computes that token after
// commit, however many rows share the call and however the threads split them. No per-row copy of
// the cache (the "mirror") is needed: every row reads the shared prefix.
//
// The kernel itself; path_attn.cpp binds it for Python and head_step.cpp calls it directly.
#pragma once
#include "torch_ext.h"
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "f32_dot.h"  // reduce8: the AVX2 body's fixed 8-lane reduction (path_attn_avx2.h)

namespace eyas_path_attn {
namespace {  // internal linkage: each module that includes this has its own copy

constexpr int LANES = 16;

// exp for x <= 0 (softmax after max subtraction): 2^n * p(r), |rel err| < 2e-7; branch-free, vectorizes
inline float exp_neg(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// one (row, KV head): G query heads of DH dims over ``total`` attended slots, in logical order
template <int G, int DH>
void attend_one(const float* q, const float* kb, const float* vb, int64_t ks, int64_t vs, int64_t start,
                const int64_t* path, int64_t total, float sc, float* w, float* out) {
  auto slot = [&](int64_t i) { return i < start ? i : path[i - start]; };
  float m[G];
  for (int g = 0; g < G; ++g) m[g] = -INFINITY;
  for (int64_t i = 0; i < total; ++i) {  // scores: each key row read once for the G queries
    const float* kr = kb + slot(i) * ks;
    for (int g = 0; g < G; ++g) {
      float acc[LANES] = {0};
      for (int d0 = 0; d0 < DH; d0 += LANES)
        for (int l = 0; l < LANES; ++l) acc[l] += q[g * DH + d0 + l] * kr[d0 + l];
      for (int half = LANES / 2; half > 0; half /= 2)  // fixed pairwise tree
        for (int l = 0; l < half; ++l) acc[l] += acc[l + half];
      const float x = acc[0] * sc;
      w[g * total + i] = x;
      m[g] = x > m[g] ? x : m[g];
    }
  }
  for (int g = 0; g < G; ++g) {  // softmax weights; the sum in 16 lanes by logical index, then a fixed tree
    float* wg = w + g * total;
    float part[LANES] = {0};
    int64_t i0 = 0;
    for (; i0 + LANES <= total; i0 += LANES)
      for (int l = 0; l < LANES; ++l) {
        const float e = exp_neg(wg[i0 + l] - m[g]);
        wg[i0 + l] = e;
        part[l] += e;
      }
    for (int64_t i = i0; i < total; ++i) {
      const float e = exp_neg(wg[i] - m[g]);
      wg[i] = e;
      part[i - i0] += e;
    }
    for (int half = LANES / 2; half > 0; half /= 2)
      for (int l = 0; l < half; ++l) part[l] += part[l + half];
    const float inv = 1.0f / part[0];
    for (int64_t i = 0; i < total; ++i) wg[i] *= inv;
  }
  float acc[G][DH] = {};
  for (int64_t i = 0; i < total; ++i) {  // values: each row read once for the G queries
    const float* vr = vb + slot(i) * vs;
    for (int g = 0; g < G; ++g) {
      const float wi = w[g * total + i];
      for (int d = 0; d < DH; ++d) acc[g][d] += wi * vr[d];
    }
  }
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < DH; ++d) out[g * DH + d] = acc[g][d];
}

using Fn = void (*)(const float*, const float*, const float*, int64_t, int64_t, int64_t, const int64_t*, int64_t,
                    float, float*, float*);

template <int DH>
Fn pick_group(int64_t g) {
  switch (g) {
    case 1: return attend_one<1, DH>;
    case 2: return attend_one<2, DH>;
    case 3: return attend_one<3, DH>;
    case 4: return attend_one<4, DH>;
    case 6: return attend_one<6, DH>;
    case 8: return attend_one<8, DH>;
    default: return nullptr;
  }
}

Fn pick(int64_t group, int64_t dh) {
  switch (dh) {
    case 16: return pick_group<16>(group);
    case 32: return pick_group<32>(group);
    case 64: return pick_group<64>(group);
    case 128: return pick_group<128>(group);
    default: return nullptr;
  }
}

#if defined(__AVX512F__)
// exp_neg on 16 lanes (the same polynomial); 2^n through scalef
inline __m512 exp_neg16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
// bf16 -> fp32 is exact: the 16 stored bits become the high half
inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
#endif

#include "path_attn_avx2.h"  // the AVX2 body (defines EYAS_PATH_AVX2 where it is built)

// one (row, KV head) on registers: keys once for the G queries, softmax normalised at the end. Attended
// slots in logical order: 0 .. start - 1, then path[0 .. total - start - 1] (decode: start = total, no path).
// Fixed order per row (keys in logical order, the d lanes of a dot product by a fixed reduction, the softmax
// sum in 16 lanes by logical index), so a row's bits depend only on what it attends: path_attention's
// row-invariance promise. T: the cache's element type, float or bfloat16 (as uint16_t; AVX-512 builds only).
template <int G, int DH, typename T>
void decode_one(const float* q, const T* kb, const T* vb, int64_t ks, int64_t vs, int64_t total, float sc,
                float* w, float* out, int64_t start, const int64_t* path) {
#if defined(__AVX512F__)
  if constexpr (DH % 16 == 0) {
    constexpr int NV = DH / 16;
    __m512 qv[G][NV];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < NV; ++j) qv[g][j] = _mm512_mul_ps(_mm512_loadu_ps(q + g * DH + 16 * j), _mm512_set1_ps(sc));
    float m[G];
    for (int g = 0; g < G; ++g) m[g] = -INFINITY;
    for (int64_t i = 0; i < total; ++i) {
      const T* kr = kb + (i < start ? i : path[i - start]) * ks;
      __m512 kx[NV];
      for (int j = 0; j < NV; ++j) kx[j] = load16(kr + 16 * j);
      for (int g = 0; g < G; ++g) {
        __m512 a = _mm512_mul_ps(qv[g][0], kx[0]);
        for (int j = 1; j < NV; ++j) a = _mm512_fmadd_ps(qv[g][j], kx[j], a);
        const float x = _mm512_reduce_add_ps(a);
        w[g * total + i] = x;
        m[g] = x > m[g] ? x : m[g];
      }
    }
    float inv[G];
    for (int g = 0; g < G; ++g) {
      float* wg = w + g * total;
      const __m512 mm = _mm512_set1_ps(m[g]);
      __m512 sum = _mm512_setzero_ps();
      int64_t i0 = 0;
      for (; i0 + 16 <= total; i0 += 16) {
        const __m512 e = exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(wg + i0), mm));
        _mm512_storeu_ps(wg + i0, e);
        sum = _mm512_add_ps(sum, e);
      }
      if (i0 < total) {
        const __mmask16 k = static_cast<__mmask16>((1u << (total - i0)) - 1u);
        const __m512 e = _mm512_maskz_mov_ps(k, exp_neg16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, wg + i0), mm)));
        _mm512_mask_storeu_ps(wg + i0, k, e);
        sum = _mm512_add_ps(sum, e);
      }
      inv[g] = 1.0f / _mm512_reduce_add_ps(sum);
    }
    __m512 acc[G][NV];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < total; ++i) {
      const T* vr = vb + (i < start ? i : path[i - start]) * vs;
      __m512 vx[NV];
      for (int j = 0; j < NV; ++j) vx[j] = load16(vr + 16 * j);
      for (int g = 0; g < G; ++g) {
        const __m512 wi = _mm512_set1_ps(w[g * total + i]);
        for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_fmadd_ps(wi, vx[j], acc[g][j]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < NV; ++j)
        _mm512_storeu_ps(out + g * DH + 16 * j, _mm512_mul_ps(acc[g][j], _mm512_set1_ps(inv[g])));
    return;
  }
#elif defined(EYAS_PATH_AVX2)
  if constexpr (DH % 8 == 0 && std::is_same_v<T, float>) {
    decode_one_avx2<G, DH>(q, kb, vb, ks, vs, total, sc, w, out, start, path);
    return;
  }
#endif
  if constexpr (std::is_same_v<T, float>) attend_one<G, DH>(q, kb, vb, ks, vs, start, path, total, sc, w, out);
}

template <typename T>
using DecodeFn = void (*)(const float*, const T*, const T*, int64_t, int64_t, int64_t, float, float*, float*, int64_t,
                          const int64_t*);

template <int DH, typename T>
DecodeFn<T> pick_decode_group(int64_t g) {
  switch (g) {
    case 1: return decode_one<1, DH, T>;
    case 2: return decode_one<2, DH, T>;
    case 3: return decode_one<3, DH, T>;
    case 4: return decode_one<4, DH, T>;
    case 6: return decode_one<6, DH, T>;
    case 8: return decode_one<8, DH, T>;
    default: return nullptr;
  }
}

template <typename T>
DecodeFn<T> pick_decode(int64_t group, int64_t dh) {
  switch (dh) {
    case 16: return pick_decode_group<16, T>(group);
    case 32: return pick_decode_group<32, T>(group);
    case 64: return pick_decode_group<64, T>(group);
    case 128: return pick_decode_group<128, T>(group);
    default: return nullptr;
  }
}

#if defined(__AVX512F__)
constexpr bool DECODE_BF16 = true;
#else
constexpr bool DECODE_BF16 = false;
#endif


bool supports(int64_t group, int64_t head_dim) { return pick(group, head_dim) != nullptr; }

// q [N, H, Dh] fp32; k, v [Hk, S, Dh] fp32, or bf16 in AVX-512 builds (one sequence's cache for one layer; a bf16
// model's keys and values are bf16 values either way, so both give the same bits); path [N, P] int64 slots;
// lengths [N] int64 (1 <= len <= P) -> out [N, H, Dh] fp32
template <typename T>
void path_run(const float* qp, const T* kp, const T* vp, const int64_t* pp, const int64_t* lp, float* op, int64_t n,
              int64_t h, int64_t dh, int64_t hk, int64_t p, int64_t ks0, int64_t ks1, int64_t vs0, int64_t vs1,
              int64_t start, float sc) {
  const int64_t group = h / hk;
  const DecodeFn<T> fn = pick_decode<T>(group, dh);
  TORCH_CHECK(fn != nullptr, "path_attention: unsupported head_dim / group ", dh, " / ", group);
  // one task per (row, KV head); a task's arithmetic does not depend on how the tasks are split
  at::parallel_for(0, n * hk, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> w;
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t r = task / hk, kvh = task % hk;
      const int64_t total = start + lp[r];
      w.resize(group * total);
      const int64_t head0 = r * h + kvh * group;
      fn(qp + head0 * dh, kp + kvh * ks0, vp + kvh * vs0, ks1, vs1, total, sc, w.data(), op + head0 * dh, start,
         pp + r * p);
    }
  });
}

at::Tensor path_attention(at::Tensor q, at::Tensor k, at::Tensor v, int64_t start, at::Tensor path,
                             at::Tensor lengths, double scale) {
  const bool bf16 = k.dtype() == at::kBFloat16;
  TORCH_CHECK(q.dtype() == at::kFloat && (k.dtype() == at::kFloat || (bf16 && DECODE_BF16)) &&
                  v.dtype() == k.dtype(),
              "path_attention: fp32 q and an fp32 (or, with AVX-512, bf16) cache");
  TORCH_CHECK(q.is_contiguous() && k.stride(2) == 1 && v.stride(2) == 1, "path_attention: contiguous head dims");
  TORCH_CHECK(path.dtype() == at::kLong && lengths.dtype() == at::kLong, "path_attention: int64 slots");
  const int64_t n = q.size(0), h = q.size(1), dh = q.size(2), hk = k.size(0), p = path.size(1);
  auto path_c = path.contiguous();
  auto len_c = lengths.contiguous();
  auto out = at::empty_like(q);
  const float sc = static_cast<float>(scale);
  if (bf16)
    path_run(q.data_ptr<float>(), reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>()),
             reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>()), path_c.data_ptr<int64_t>(),
             len_c.data_ptr<int64_t>(), out.data_ptr<float>(), n, h, dh, hk, p, k.stride(0), k.stride(1), v.stride(0),
             v.stride(1), start, sc);
  else
    path_run(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), path_c.data_ptr<int64_t>(),
             len_c.data_ptr<int64_t>(), out.data_ptr<float>(), n, h, dh, hk, p, k.stride(0), k.stride(1), v.stride(0),
             v.stride(1), start, sc);
  return out;
}

// Batched decode (one new token per row, rows of different lengths, as in `eyas data`): row b's queries attend
// slots 0 .. lengths[b] - 1 of its own cache row, nothing past them (torch's fused attention reads every row
// up to the longest one under a mask). q [B, H, Dh] fp32; k, v [B, Hk, S, Dh] fp32 (head dims contiguous);
// lengths [B] int64 (1 <= len <= S) -> out [B, H, Dh] fp32. With AVX-512, register-blocked (decode_one), and the
// cache may be bf16 (a bf16 model's cache holds bf16-rounded values anyway: the same results, half the bytes).
template <typename T>
void decode_run(const float* qp, const T* kp, const T* vp, const int64_t* lp, float* op, int64_t b, int64_t h,
                int64_t dh, int64_t hk, int64_t kb, int64_t kh, int64_t ks, int64_t vb, int64_t vh, int64_t vs,
                float sc) {
  const int64_t group = h / hk;
  const DecodeFn<T> fn = pick_decode<T>(group, dh);
  TORCH_CHECK(fn != nullptr, "decode_attention: unsupported head_dim / group ", dh, " / ", group);
  // tasks (row, KV head) in order, cut into one contiguous range per thread of about equal key count
  const int64_t tasks = b * hk;
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks));
  std::vector<int64_t> bound(nt + 1, tasks);
  bound[0] = 0;
  int64_t all = 0;
  for (int64_t r = 0; r < b; ++r) all += lp[r] * hk;
  int64_t acc = 0, t = 1;
  for (int64_t task = 0; task < tasks && t < nt; ++task) {
    acc += lp[task / hk];
    while (t < nt && acc * nt >= all * t) bound[t++] = task + 1;
  }
  at::parallel_for(0, nt, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> w;
    for (int64_t part = lo; part < hi; ++part)
      for (int64_t task = bound[part]; task < bound[part + 1]; ++task) {
        const int64_t r = task / hk, kvh = task % hk, total = lp[r];
        w.resize(group * total);
        const int64_t head0 = r * h + kvh * group;
        fn(qp + head0 * dh, kp + r * kb + kvh * kh, vp + r * vb + kvh * vh, ks, vs, total, sc, w.data(),
           op + head0 * dh, total, nullptr);
      }
  });
}

at::Tensor decode_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor lengths,
                               double scale) {
  const bool bf16 = k.dtype() == at::kBFloat16;
  TORCH_CHECK(q.dtype() == at::kFloat && (k.dtype() == at::kFloat || (bf16 && DECODE_BF16)) &&
                  v.dtype() == k.dtype(),
              "decode_attention: fp32 q and an fp32 (or, with AVX-512, bf16) cache");
  TORCH_CHECK(q.is_contiguous() && k.stride(3) == 1 && v.stride(3) == 1, "decode_attention: contiguous head dims");
  TORCH_CHECK(lengths.dtype() == at::kLong && lengths.numel() == q.size(0), "decode_attention: [B] int64 lengths");
  const int64_t b = q.size(0), h = q.size(1), dh = q.size(2), hk = k.size(1), s = k.size(2);
  auto len_c = lengths.contiguous();
  const int64_t* lp = len_c.data_ptr<int64_t>();
  for (int64_t r = 0; r < b; ++r) TORCH_CHECK(lp[r] >= 1 && lp[r] <= s, "decode_attention: length out of range");
  auto out = at::empty_like(q);
  const float sc = static_cast<float>(scale);
  if (bf16)
    decode_run(q.data_ptr<float>(), reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>()),
               reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>()), lp, out.data_ptr<float>(), b, h, dh,
               hk, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), sc);
  else
    decode_run(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), lp, out.data_ptr<float>(), b, h, dh,
               hk, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), sc);
  return out;
}

bool decode_bf16() { return DECODE_BF16; }

}  // namespace
}  // namespace eyas_path_attn
