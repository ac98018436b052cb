// y = x @ W^T (+ bias) for a draft head's few rows, in int8 with AVX512-VNNI (or AVX2: head_i8_avx2.h, the same
// bits): W as per-row int8 (scale sw[n]), each input row quantised on the fly to int8 with its own scale
// (sx[i] = max |x[i]| / 127, round to nearest even).
//
// A draft head's projections are a few rows (a tree level's frontier) against ~10 M weights, right after a verify
// forward pushed them out of the caches. The float32 block kernel (gguf_f32.cpp) spends its time rebuilding each
// float weight from its Q8_0 block and on 16 multiply-adds an instruction; here a weight is a byte used as it is and
// VPDPBUSD does 64 multiply-adds an instruction into exact int32 sums. Only the draft changes (measured on 24 tuning
// questions: top-1 by depth within 0.003 of the float head for every projection but the fused taps ``fc``, which
// keeps its Q8_0 float path); verification keeps the output lossless.
//
// Per output (i, n), with xu = round(x[i] / sx[i]) + 128 (uint8) and q[n] the weight row's int8 values:
//   acc = sum_k xu[k] * q[n, k]  (int32, exact: |acc| < K * 255 * 127 < 2^31 for K <= 66,000)
//   y   = float(acc - 128 * sum_k q[n, k]) * (sx[i] * sw[n])  (+ bias[n] after, a separate add)
// so tests reproduce it bit for bit in torch.
//
// The kernel itself; head_i8.cpp binds it for Python and head_step.cpp calls it directly.
#pragma once
#include "torch_ext.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define EYAS_HEAD_I8 1
#define EYAS_HEAD_I8_VNNI 1
#elif defined(__AVX2__)
#define EYAS_HEAD_I8 1
#include "head_i8_avx2.h"  // the same sums through VPMADDUBSW (Zen 3 and other AVX2-only CPUs)
#endif

#ifdef EYAS_HEAD_I8_VNNI
namespace eyas_head_i8 {
constexpr int64_t NB = 4;        // weight rows per group (sum4 reduces 4 at once)
constexpr int MR = 6;            // input rows per pass: 6 x 4 accumulators + 4 weights + 1 input of 32 registers
constexpr int PASS_ROWS = MR;
constexpr int64_t CHUNK = 64;    // bytes per VPDPBUSD
constexpr int32_t OFFSET = 128;  // xu = xq + 128: acc - 128 * sums is sum xq * q

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {  // bf16 -> float32 exactly (the high half of the float's bits)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// one row of K values -> K bytes round(x * 127 / amax) + 128, and its scale amax / 127 (0 for an all-zero row)
template <typename T>
float quantize_row(const T* x, int64_t k, uint8_t* out) {
  __m512 mx = _mm512_setzero_ps();
  for (int64_t c = 0; c < k; c += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(load16(x + c)));
  const float amax = _mm512_reduce_max_ps(mx);
  const float inv = amax > 0 ? 127.0f / amax : 0.0f;
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (int64_t c = 0; c < k; c += 16) {
    __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x + c), vinv));  // round to nearest even (MXCSR default)
    q = _mm512_min_epi32(_mm512_max_epi32(q, lo), hi);
    const __m128i b = _mm512_cvtepi32_epi8(q);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + c), _mm_xor_si128(b, _mm_set1_epi8(static_cast<char>(0x80))));
  }
  return amax / 127.0f;
}

// the 16 lanes of each of 4 accumulators summed at once: (a0 .. a3 totals) (integer: any order is exact)
inline __m128i sum4(const __m512i* a) {
  const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[0], a[1]), _mm512_unpackhi_epi32(a[0], a[1]));
  const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2], a[3]), _mm512_unpackhi_epi32(a[2], a[3]));
  // each 128-bit lane: a0, a1, a2, a3 partial sums
  const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
  const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(u), _mm512_extracti64x4_epi64(u, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// rows xu[0 .. R) against the NB weight rows w[j]: acc[i * NB + j] = sum_k xu[i][k] * w[j][k]. TILED: the group's
// weights interleaved by 64-byte chunk (pack(): row j's chunk at byte c is at w[j] + NB * c, w[j] = group + 64 j), so
// a group is read front to back as one stream; else w[j] is row j and its chunk at byte c is w[j] + c.
template <int R, bool TILED>
inline void micro(const uint8_t* const* xu, const int8_t* const* w, int64_t k, int32_t* acc) {
  __m512i a[R][NB];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NB; ++j) a[i][j] = _mm512_setzero_si512();
  for (int64_t c = 0; c < k; c += CHUNK) {
    __m512i wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_si512(w[j] + (TILED ? NB * c : c));
    for (int i = 0; i < R; ++i) {
      const __m512i xv = _mm512_loadu_si512(xu[i] + c);
      for (int j = 0; j < NB; ++j) a[i][j] = _mm512_dpbusd_epi32(a[i][j], xv, wv[j]);
    }
  }
  for (int i = 0; i < R; ++i) _mm_storeu_si128(reinterpret_cast<__m128i*>(acc + i * NB), sum4(a[i]));
}

// the input rows quantised for VPDPBUSD: xu = xq + 128 (uint8)
struct Input {
  std::vector<uint8_t> xu;
  std::vector<float> sx;

  template <typename T>
  Input(const T* x, int64_t m, int64_t k) : xu(m * k), sx(m) {
    for (int64_t i = 0; i < m; ++i) sx[i] = quantize_row(x + i * k, k, xu.data() + i * k);
  }
  // rows [i0, i0 + rows) against the group's NB weight rows ws (tiled: micro's TILED layout): acc[r * NB + j]. With
  // ahead > 0, first the group ``ahead`` bytes on (a later one's NB rows, contiguous) is asked for, in one burst.
  void pass(int64_t i0, int rows, int64_t k, const int8_t* const* ws, bool tiled, int32_t* acc, int64_t ahead) const {
    if (ahead > 0) {
      const char* p = reinterpret_cast<const char*>(ws[0] + ahead);
      for (int64_t o = 0; o < NB * k; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
    }
    const uint8_t* xs[MR];
    for (int r = 0; r < rows; ++r) xs[r] = xu.data() + (i0 + r) * k;
    if (tiled) {
      dispatch<true>(rows, xs, ws, k, acc);
    } else {
      dispatch<false>(rows, xs, ws, k, acc);
    }
  }
  template <bool TILED>
  static void dispatch(int rows, const uint8_t* const* xs, const int8_t* const* ws, int64_t k, int32_t* acc) {
    switch (rows) {
      case 6: micro<6, TILED>(xs, ws, k, acc); break;
      case 5: micro<5, TILED>(xs, ws, k, acc); break;
      case 4: micro<4, TILED>(xs, ws, k, acc); break;
      case 3: micro<3, TILED>(xs, ws, k, acc); break;
      case 2: micro<2, TILED>(xs, ws, k, acc); break;
      default: micro<1, TILED>(xs, ws, k, acc); break;
    }
  }
};
}  // namespace eyas_head_i8
#endif

namespace eyas_head_i8 {
namespace {  // internal linkage: each module that includes this has its own copy

// Software prefetch: each thread asks for the weight group this many groups ahead while it multiplies this one
// (0: off). The first head call of a step reads its weights from DRAM (the verify forward evicted them), and the
// hardware prefetcher alone leaves much of that latency exposed: on the Ice Lake VM the head's five projections at
// 4 rows (scripts/head_cold.py), caches flushed first, 1.20 -> 0.97 ms with 2 groups, and 0.94 -> 0.68 ms for the
// call after (weights then in L3); 1, 4 and 8 groups within 0.07 ms of 2.
// The sums do not change. set_prefetch() sets it (eyas.models.int8_rows: EYAS_HEAD_I8_PREFETCH).
int64_t prefetch_groups = 2;

#ifdef EYAS_HEAD_I8
using namespace eyas_head_i8;

// rows of w that linear() reads for n outputs: pack()'s padded groups of NB where tiled, else n
inline int64_t weight_rows(int64_t n, bool tiled) { return tiled ? (n + NB - 1) / NB * NB : n; }

// y [m, n] float32 = x [m, k] (T) @ W^T (+ bias): the whole kernel on raw pointers (head_step.cpp calls it with its
// own buffers); ``ahead``: the software prefetch distance in weight groups (0: off)
template <typename T>
void run_into(const T* x, int64_t m, int64_t k, const int8_t* wd, bool tiled, const float* swd, const int32_t* sd,
              const float* bd, int64_t n, float* od, int64_t ahead_groups) {
  const Input in(x, m, k);
  const int64_t groups = (n + NB - 1) / NB;
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    int32_t acc[PASS_ROWS * NB];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t j0 = g * NB, nr = std::min<int64_t>(NB, n - j0);
      const int8_t* ws[NB];
      for (int64_t j = 0; j < NB; ++j)  // tiled: chunk 0 of row j; rows: row j (a short group repeats its last)
        ws[j] = tiled ? wd + j0 * k + CHUNK * j : wd + (j0 + std::min(j, nr - 1)) * k;
      // the group ahead_groups on, asked for by the first pass (each body in its own way)
      const int64_t ahead = ahead_groups > 0 && g + ahead_groups < g1 ? ahead_groups * NB * k : 0;
      for (int64_t i0 = 0; i0 < m; i0 += PASS_ROWS) {
        const int rows = static_cast<int>(std::min<int64_t>(m - i0, PASS_ROWS));
        in.pass(i0, rows, k, ws, tiled, acc, i0 == 0 ? ahead : 0);
        for (int r = 0; r < rows; ++r)
          for (int64_t j = 0; j < nr; ++j) {
            const int64_t col = j0 + j;
            const float dot = static_cast<float>(acc[r * NB + j] - OFFSET * sd[col]);
            const float y = dot * (in.sx[i0 + r] * swd[col]);
            od[(i0 + r) * n + col] = bd ? y + bd[col] : y;
          }
      }
    }
  });
}

template <typename T>
at::Tensor run(const at::Tensor& x, const at::Tensor& w, bool tiled, const at::Tensor& sw, const at::Tensor& sums,
               const at::Tensor& bias) {
  const int64_t m = x.size(0), k = x.size(1), n = sw.numel();
  auto out = at::empty({m, n}, x.options().dtype(at::kFloat));
  run_into(x.data_ptr<T>(), m, k, w.data_ptr<int8_t>(), tiled, sw.data_ptr<float>(), sums.data_ptr<int32_t>(),
           bias.defined() && bias.numel() ? bias.data_ptr<float>() : nullptr, n, out.data_ptr<float>(),
           prefetch_groups);
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}
#endif

// whether linear() takes tiled weights (pack()): the VNNI body; the AVX2 body reads rows
bool tiles() {
#ifdef EYAS_HEAD_I8_VNNI
  return true;
#else
  return false;
#endif
}

// w [N, K] int8 -> the VNNI body's tiled layout [G * NB, K] (G = ceil(N / NB) groups of NB rows, a short last group
// padded with copies of its last row): group g's bytes are, for each 64-byte chunk c of K, that chunk of its NB rows
// one after another, so the kernel reads a group front to back (a single stream the hardware prefetcher follows; the
// rows layout is NB interleaved streams of K bytes). Where tiles() is false, w as it is.
at::Tensor pack(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.size(1) % CHUNK == 0,
              "head_i8.pack: w [N, K] int8 with K a multiple of ", CHUNK);
  w = w.contiguous();
#ifdef EYAS_HEAD_I8_VNNI
  const int64_t n = w.size(0), k = w.size(1), groups = (n + NB - 1) / NB;
  auto out = at::empty({groups * NB, k}, w.options());
  const int8_t* src = w.data_ptr<int8_t>();
  int8_t* dst = out.data_ptr<int8_t>();
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t c = 0; c < k; c += CHUNK)
      for (int64_t j = 0; j < NB; ++j) {
        const int64_t row = std::min(g * NB + j, n - 1);
        std::memcpy(dst + g * NB * k + NB * c + CHUNK * j, src + row * k + c, CHUNK);
      }
  return out;
#else
  return w;
#endif
}

// x [M, K] float32 or bf16; w [N, K] int8 rows, or (tiled) pack()'s layout of them; sw [N] float32, sums [N] int32
// (sum_k w[n, k]), bias [N] float32 or empty -> [M, N] in x's dtype
at::Tensor linear(at::Tensor x, at::Tensor w, bool tiled, at::Tensor sw, at::Tensor sums, at::Tensor bias) {
#ifdef EYAS_HEAD_I8
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "head_i8.linear: x [M, K] float32 or bf16");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.size(1) == x.size(1) && x.size(1) % CHUNK == 0,
              "head_i8.linear: w [N, K] int8 with K = x's and a multiple of ", CHUNK);
  TORCH_CHECK(!tiled || tiles(), "head_i8.linear: tiled weights need the AVX512-VNNI build (tiles() is false)");
  const int64_t n = sw.numel(), rows_needed = weight_rows(n, tiled);
  TORCH_CHECK(w.size(0) == rows_needed, "head_i8.linear: w has ", w.size(0), " rows, ", rows_needed, " expected for ",
              n, " outputs", tiled ? " (tiled: pack()'s padded groups)" : "");
  TORCH_CHECK(sw.scalar_type() == at::kFloat && sums.scalar_type() == at::kInt && sums.numel() == n,
              "head_i8.linear: sw [N] float32 and sums [N] int32");
  TORCH_CHECK(!bias.numel() || (bias.scalar_type() == at::kFloat && bias.numel() == n),
              "head_i8.linear: bias [N] float32 or empty");
  x = x.contiguous();
  w = w.contiguous();
  if (x.scalar_type() == at::kFloat)
    return run<float>(x, w, tiled, sw.contiguous(), sums.contiguous(), bias.contiguous());
  return run<at::BFloat16>(x, w, tiled, sw.contiguous(), sums.contiguous(), bias.contiguous());
#else
  TORCH_CHECK(false, "head_i8.linear: built without AVX2 or AVX512-VNNI");
#endif
}

void set_prefetch(int64_t groups) {
  TORCH_CHECK(groups >= 0 && groups <= 64, "head_i8.set_prefetch: 0 (off) to 64 groups ahead, got ", groups);
  prefetch_groups = groups;
}

bool available() {
#ifdef EYAS_HEAD_I8
  return true;
#else
  return false;
#endif
}

}  // namespace
}  // namespace eyas_head_i8
