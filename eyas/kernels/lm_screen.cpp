// Greedy decoding's output projection without computing every logit exactly: a cheap integer pass over the Q8_0
// blocks finds, for each row, the few vocabulary entries that can still be its argmax; only those are then computed
// exactly (by gguf_bf16.cpp, whose outputs do not depend on which weight rows share a call), so the argmax is the
// one the full bf16 projection gives, bit for bit, ties included.
//
// Per row r and 32-value block b the activations are rounded to int8 with the block's own scale
// (sx = max |x_b| / 127, round to nearest even, llama.cpp's q8_0 activations); a weight block is d * q (q int8, d its
// fp16 scale). With exact int32 block dots (AVX512-VNNI) the approximation is
//   a~[r, v] = sum_b sx[r, b] * d[v, b] * sum_k xq[r, k] q[v, k]
// and it is within E[r, v] of the logit the bf16 kernel returns, a = bf16(fl32(sum_k x[k] * w~[k])) with
// w~ = bf16(d * q) (the loader's weights; d * q is exact in float32), m_b = max |x_b| = 127 sx_b:
//   |sum x (d q) - a~_real|   <= sum_b |d q_b|_1 * sx_b / 2       (activation rounding, |x - sx xq| <= sx / 2)
//   |sum x (w~ - d q)|        <= sum_b |w~_b - d q_b|_1 * m_b     (the weights' bf16 rounding, summed at pack time)
//   both kernels' float32 sums (<= 600 terms each) <= 2^-13 sum_b |d q_b|_1 * m_b  (generous: ~2^-14.2 needed)
//   the final bf16 rounding   <= 2^-8 (|a~| + the above)
// so E = (1 + 2^-10) E' + 2^-8 (|a~| + 1.01 E') + 1e-30 with E' = sum_b m_b * F[v, b],
// F = |d q_b|_1 (0.5001 / 127 + 2^-13) + |w~_b - d q_b|_1 computed once per weight block (pack).
// A row's candidates are every v with a~ + E >= max_u (a~_u - E_u): its true maximum is among them (a~_c + E_c >=
// a_c = max >= a_u >= a~_u - E_u for every u), and so is every entry that ties with it.
// On SmolLM2's output projection (49,152 x 576), rows of real answers: 37 candidates for a 5-row call on average, at
// most 130 (scripts/screen_ab.py --projection).
#include "torch_ext.h"
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

#include "gguf_quants.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
#include <immintrin.h>
#define EYAS_LM_SCREEN 1
#endif

namespace {

using namespace eyas_gguf;

constexpr int64_t BB = block_bytes(Q8_0);  // an fp16 scale, then QK int8 values
constexpr int64_t LANES = 16;        // outputs a group: one per float32 lane
constexpr int MAXR = 16;             // rows per call (a verify tree's nodes)
constexpr int RB = 8;                // rows per pass over a group: 2 x 8 accumulators + 8 weight registers
// per |d q| of a block, times the row block's max |x|: activation rounding (sx / 2, sx = max / 127; 0.5001 for the
// float32 scale's own rounding) and the float32 sums of both kernels (2^-13)
constexpr double ACT_ROUND = 0.5001 / 127.0 + 0.0001220703125;
// added to every bound: what relative terms cannot cover where values leave float32's normal range (a row of
// magnitudes near 1e-37, subnormal products flushed by the bf16 kernel's VDPBF16PS)
constexpr float ABS_SLACK = 1e-30f;

// Packed layout (pack()): output v = 16 g + l is lane l of group g. Per group and block b:
//   w   [g][b][c][l][4]: bytes 4c .. 4c + 3 of v's block, as q + 128 (uint8), c = 0 .. 7 (64 bytes a c)
//   d   [g][b][l]: v's block scale (float32), 0 for padding lanes
//   l1d [g][b][l]: v's block's factor in the bound, ACT_ROUND * sum |d q| + sum |bf16(d q) - d q|; 0 for padding
// so one VPDPBUSD takes 4 bytes of 16 outputs against 4 activations broadcast: no horizontal sums anywhere.
std::vector<at::Tensor> pack(at::Tensor blocks, int64_t k) {
  TORCH_CHECK(k % QK == 0 && blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.size(1) == k / QK * BB,
              "lm_screen.pack: blocks [V, K / 32 * ", BB, "] contiguous uint8 (Q8_0)");
  const int64_t n = blocks.size(0), nblk = k / QK, groups = (n + LANES - 1) / LANES;
  auto w = at::full({groups, nblk, 8, LANES * 4}, 128, at::kByte);
  auto d = at::zeros({groups, nblk, LANES}, at::kFloat), l1d = at::zeros_like(d);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* wd = w.data_ptr<uint8_t>();
  float *dd = d.data_ptr<float>(), *ld = l1d.data_ptr<float>();
  at::parallel_for(0, n, 1024, [&](int64_t v0, int64_t v1) {
    for (int64_t v = v0; v < v1; ++v) {
      const int64_t g = v / LANES, l = v % LANES;
      for (int64_t b = 0; b < nblk; ++b) {
        const uint8_t* blk = src + (v * nblk + b) * BB;
        float w[QK];  // gguf-py's float32 weights d * q (exact: 8 x 11 bits)
        dequant_block_f32(blk, Q8_0, w);
        double l1 = 0.0, delta = 0.0;  // sum |d q|, and sum |bf16(d q) - d q| (the loader's rounding, exactly)
        for (int64_t j = 0; j < QK; ++j) {
          l1 += std::fabs(static_cast<double>(w[j]));
          delta += std::fabs(static_cast<double>(static_cast<float>(c10::BFloat16(w[j]))) - w[j]);
          const int8_t q = static_cast<int8_t>(blk[2 + j]);
          wd[(((g * nblk + b) * 8 + j / 4) * LANES + l) * 4 + j % 4] = static_cast<uint8_t>(q + 128);
        }
        dd[(g * nblk + b) * LANES + l] = half_to_float(blk);
        // the bound's factor for this block, times the row block's max |x| (sx = max |x| / 127)
        ld[(g * nblk + b) * LANES + l] = static_cast<float>((l1 * ACT_ROUND + delta) * (1.0 + 1e-6));
      }
    }
  });
  return {w, d, l1d};
}

struct Rows {  // one call's rows, quantised per 32-value block
  int64_t r = 0, nblk = 0;
  std::vector<int8_t> xq;      // [r][k], round(x / sx) in -127 .. 127
  std::vector<int32_t> corr;   // [r][nblk]: -128 * sum of the block's xq (the weights are stored + 128)
  std::vector<float> sx, amax;  // [r][nblk]: the block's scale and its max |x| (the bound's factor)
};

Rows quantise(const at::BFloat16* x, int64_t r, int64_t k) {
  Rows q;
  q.r = r;
  q.nblk = k / QK;
  q.xq.assign(static_cast<size_t>(r * k), 0);
  q.corr.assign(static_cast<size_t>(r * q.nblk), 0);
  q.sx.assign(q.corr.size(), 0.0f);
  q.amax.assign(q.corr.size(), 0.0f);
  for (int64_t i = 0; i < r; ++i)
    for (int64_t b = 0; b < q.nblk; ++b) {
      float v[QK], amax = 0.0f;
      bool finite = true;
      for (int j = 0; j < QK; ++j) {
        v[j] = static_cast<float>(x[i * k + b * QK + j]);
        amax = std::max(amax, std::fabs(v[j]));
        finite = finite && std::isfinite(v[j]);
      }
      if (!finite) amax = NAN;  // NaN scales: every approximation of the row is NaN, and candidates() declines
      // in double: 127 / amax overflows float32 for amax below ~3.7e-37 (the bound's absolute slack covers such rows)
      const double inv = amax > 0 ? 127.0 / amax : 0.0;
      const float sx = amax / 127.0f;
      int32_t sum = 0;
      for (int j = 0; j < QK; ++j) {
        const double t = std::min(127.0, std::max(-127.0, std::nearbyint(v[j] * inv)));  // NaN: caught later
        const int8_t c = static_cast<int8_t>(t == t ? t : 0.0);
        q.xq[i * k + b * QK + j] = c;
        sum += c;
      }
      q.corr[i * q.nblk + b] = -128 * sum;
      q.sx[i * q.nblk + b] = sx;
      q.amax[i * q.nblk + b] = amax;
    }
  return q;
}

#ifdef EYAS_LM_SCREEN
// rows [i0, i0 + R) against group g: 16 approximations and bounds each
// pf: the same bytes of a group ahead, prefetched beside each block's (one line per line read), or null
template <int R>
void group_pass(const Rows& q, int64_t i0, const uint8_t* w, const float* d, const float* l1d, __m512* acc,
                __m512* bnd, const uint8_t* pf) {
  const int64_t k = q.nblk * QK;
  for (int i = 0; i < R; ++i) acc[i] = bnd[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < q.nblk; ++b) {
    if (pf)
      for (int c = 0; c < 8; ++c) _mm_prefetch(reinterpret_cast<const char*>(pf + (b * 8 + c) * 64), _MM_HINT_NTA);
    __m512i wv[8];
    for (int c = 0; c < 8; ++c) wv[c] = _mm512_loadu_si512(w + (b * 8 + c) * 64);
    const __m512 dv = _mm512_loadu_ps(d + b * LANES), lv = _mm512_loadu_ps(l1d + b * LANES);
    for (int i = 0; i < R; ++i) {
      const int64_t row = i0 + i;
      const int32_t* x4 = reinterpret_cast<const int32_t*>(q.xq.data() + row * k + b * QK);
      __m512i s = _mm512_set1_epi32(q.corr[row * q.nblk + b]);
      for (int c = 0; c < 8; ++c) s = _mm512_dpbusd_epi32(s, wv[c], _mm512_set1_epi32(x4[c]));
      const __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(q.sx[row * q.nblk + b]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[i]);
      bnd[i] = _mm512_fmadd_ps(lv, _mm512_set1_ps(q.amax[row * q.nblk + b]), bnd[i]);
    }
  }
}

void rows_pass(int rows, const Rows& q, int64_t i0, const uint8_t* w, const float* d, const float* l1d, __m512* acc,
               __m512* bnd, const uint8_t* pf) {
  switch (rows) {
    case 8: group_pass<8>(q, i0, w, d, l1d, acc, bnd, pf); break;
    case 7: group_pass<7>(q, i0, w, d, l1d, acc, bnd, pf); break;
    case 6: group_pass<6>(q, i0, w, d, l1d, acc, bnd, pf); break;
    case 5: group_pass<5>(q, i0, w, d, l1d, acc, bnd, pf); break;
    case 4: group_pass<4>(q, i0, w, d, l1d, acc, bnd, pf); break;
    case 3: group_pass<3>(q, i0, w, d, l1d, acc, bnd, pf); break;
    case 2: group_pass<2>(q, i0, w, d, l1d, acc, bnd, pf); break;
    default: group_pass<1>(q, i0, w, d, l1d, acc, bnd, pf); break;
  }
}
#endif

void check(const at::Tensor& x, const std::vector<at::Tensor>& packed, int64_t n, int64_t prefetch) {
  TORCH_CHECK(prefetch >= 0 && prefetch <= 64, "lm_screen: prefetch is 0 (off) to 64 groups ahead, got ", prefetch);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(1) % QK == 0,
              "lm_screen: x [R, K] bf16 with K a multiple of 32");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= MAXR, "lm_screen: 1 to ", MAXR, " rows, got ", x.size(0));
  TORCH_CHECK(packed.size() == 3 && packed[0].dim() == 4 && packed[0].size(1) == x.size(1) / QK &&
                  packed[0].is_contiguous() && packed[1].is_contiguous() && packed[2].is_contiguous() &&
                  n > 0 && n <= packed[0].size(0) * LANES,
              "lm_screen: packed weights from pack(blocks, K) with x's K, and 0 < V <= their groups * 16");
}

#ifdef EYAS_LM_SCREEN
// One call's rows (x [R, K] bf16, quantised) against pack()'s tensors: group after group of one thread's share, each
// group's 16 approximations and bounds per row in registers, visit(g, acc, bound) for rows 0 .. r - 1 (r vectors).
struct Screen {
  const Rows q;
  const uint8_t* w;
  const float *d, *l;
  int64_t nblk;
  int64_t ahead;  // groups ahead to prefetch (0: none)

  Screen(const at::Tensor& x, const std::vector<at::Tensor>& packed, int64_t prefetch)  // x contiguous
      : q(quantise(x.data_ptr<at::BFloat16>(), x.size(0), x.size(1))),
        w(packed[0].data_ptr<uint8_t>()),
        d(packed[1].data_ptr<float>()),
        l(packed[2].data_ptr<float>()),
        nblk(x.size(1) / QK),
        ahead(prefetch) {}

  template <typename Visit>
  void run(int64_t g0, int64_t g1, Visit visit) const {
    __m512 acc[MAXR], bnd[MAXR];
    const __m512 grow = _mm512_set1_ps(1.0f + 0.0009765625f), out = _mm512_set1_ps(0.00390625f);
    const __m512 slack = _mm512_set1_ps(1.01f), tiny = _mm512_set1_ps(ABS_SLACK);
    const int64_t gw = nblk * 8 * 64, gs = nblk * LANES;
    // Software prefetch (``ahead`` groups on, the thread's own range only): each line of the group ahead is asked
    // for beside the line read, non-temporal (read once: it should not push the draft head's weights, read next,
    // out of the L3). Measured on the Zen 5 VM (eyas.models.lm_screen, EYAS_LM_SCREEN_PREFETCH). Asking for a
    // whole group in one burst measured slower (Zen 4, in decoding: the screen at 1 / 4 rows 1.07-1.31 / 1.48-1.69
    // ms with it, 0.83-1.16 / 1.03-1.34 without).
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* pf = ahead > 0 && g + ahead < g1 ? w + (g + ahead) * gw : nullptr;
      for (int64_t i0 = 0; i0 < q.r; i0 += RB) {
        const int rows = static_cast<int>(std::min<int64_t>(RB, q.r - i0));
        rows_pass(rows, q, i0, w + g * gw, d + g * gs, l + g * gs, acc + i0, bnd + i0, i0 == 0 ? pf : nullptr);
        for (int i = i0; i < i0 + rows; ++i)
          bnd[i] = _mm512_add_ps(_mm512_fmadd_ps(
              grow, bnd[i], _mm512_mul_ps(out, _mm512_fmadd_ps(slack, bnd[i], _mm512_abs_ps(acc[i])))), tiny);
      }
      visit(g, acc, bnd);
    }
  }
};
#endif

// x [R, K] bf16, pack()'s tensors, V -> (approx [R, V], bound [R, V]) float32; prefetch: groups ahead (Screen)
std::vector<at::Tensor> approx(at::Tensor x, std::vector<at::Tensor> packed, int64_t n, int64_t prefetch) {
  check(x, packed, n, prefetch);
#ifdef EYAS_LM_SCREEN
  x = x.contiguous();
  const int64_t r = x.size(0), groups = (n + LANES - 1) / LANES, stride = groups * LANES;
  const Screen screen(x, packed, prefetch);
  auto a = at::empty({r, stride}, x.options().dtype(at::kFloat)), e = at::empty_like(a);
  float *ad = a.data_ptr<float>(), *ed = e.data_ptr<float>();
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    screen.run(g0, g1, [&](int64_t g, const __m512* acc, const __m512* bnd) {
      for (int64_t i = 0; i < r; ++i) {
        _mm512_storeu_ps(ad + i * stride + g * LANES, acc[i]);
        _mm512_storeu_ps(ed + i * stride + g * LANES, bnd[i]);
      }
    });
  });
  return {a.narrow(1, 0, n), e.narrow(1, 0, n)};
#else
  TORCH_CHECK(false, "lm_screen: built without AVX512-VNNI");
#endif
}

// x [R, K] bf16, pack()'s tensors, V -> [C] long: sorted vocabulary ids that can be some row's argmax (every v with
// a[i, v] + e[i, v] >= max_u (a[i, u] - e[i, u]) for some row i, approx()'s values); empty when an approximation is
// not finite (the caller then computes every logit). Nothing [R, V] is written: each chunk of groups keeps, as it
// goes, the ids whose interval reaches its running best lower bound (a superset: the bound only rises) with their
// upper ends, and the merged list is filtered by the rows' final bounds.
at::Tensor candidates(at::Tensor x, std::vector<at::Tensor> packed, int64_t n, int64_t prefetch) {
  check(x, packed, n, prefetch);
#ifdef EYAS_LM_SCREEN
  x = x.contiguous();
  const int64_t r = x.size(0), groups = (n + LANES - 1) / LANES;
  const Screen screen(x, packed, prefetch);
  struct Share {  // one chunk's: where it began, its ids, their upper ends [id][row], its rows' best lower bounds
    int64_t g0 = 0;
    std::vector<int64_t> ids;
    std::vector<float> hi;
    float lo[MAXR];
    bool bad = false;
  };
  std::vector<Share> shares;
  std::mutex done;
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    Share s;
    s.g0 = g0;
    std::fill(s.lo, s.lo + MAXR, -INFINITY);
    alignas(64) float top[MAXR][LANES];
    screen.run(g0, g1, [&](int64_t g, const __m512* acc, const __m512* bnd) {
      const int64_t live = std::min<int64_t>(LANES, n - g * LANES);
      const __mmask16 valid = live == LANES ? __mmask16(0xFFFF) : __mmask16((1u << live) - 1);
      __mmask16 hit = 0;
      for (int64_t i = 0; i < r; ++i) {
        s.bad |= (_mm512_mask_fpclass_ps_mask(valid, acc[i], 0x99) | _mm512_mask_fpclass_ps_mask(valid, bnd[i], 0x99));
        s.lo[i] = std::max(s.lo[i], _mm512_mask_reduce_max_ps(valid, _mm512_sub_ps(acc[i], bnd[i])));
        const __m512 up = _mm512_add_ps(acc[i], bnd[i]);
        hit |= _mm512_mask_cmp_ps_mask(valid, up, _mm512_set1_ps(s.lo[i]), _CMP_GE_OQ);
        _mm512_store_ps(top[i], up);
      }
      for (; hit; hit &= hit - 1) {
        const int lane = __builtin_ctz(hit);
        s.ids.push_back(g * LANES + lane);
        for (int64_t i = 0; i < r; ++i) s.hi.push_back(top[i][lane]);
      }
    });
    std::lock_guard<std::mutex> lock(done);
    shares.push_back(std::move(s));
  });
  float lo[MAXR];
  std::fill(lo, lo + MAXR, -INFINITY);
  for (const Share& s : shares) {
    if (s.bad) return at::empty({0}, at::kLong);
    for (int64_t i = 0; i < r; ++i) lo[i] = std::max(lo[i], s.lo[i]);
  }
  std::sort(shares.begin(), shares.end(), [](const Share& a, const Share& b) { return a.g0 < b.g0; });  // ids ascend
  std::vector<int64_t> ids;
  for (const Share& s : shares)
    for (size_t j = 0; j < s.ids.size(); ++j)
      for (int64_t i = 0; i < r; ++i)
        if (s.hi[j * r + i] >= lo[i]) {
          ids.push_back(s.ids[j]);
          break;
        }
  auto out = at::empty({static_cast<int64_t>(ids.size())}, at::kLong);
  std::memcpy(out.data_ptr<int64_t>(), ids.data(), ids.size() * sizeof(int64_t));
  return out;
#else
  return at::Tensor();
#endif
}

bool available() {
#ifdef EYAS_LM_SCREEN
  return true;
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "Q8_0 blocks [V, K / 32 * 34] -> the screen's layout (weights + 128, scales, bound factors)");
  m.def("approx", &approx, "(approx, bound) [R, V]: q8 activations x the packed weights, and the distance bound",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("prefetch") = 0);
  m.def("candidates", &candidates, "sorted vocabulary ids that can be some row's bf16 argmax (empty: not finite)",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("prefetch") = 0);
  m.def("available", &available, "whether the screen was built (AVX512-VNNI at compile time)");
  m.def("max_rows", [] { return MAXR; }, "rows a call takes at most");
}
