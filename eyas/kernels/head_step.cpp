// An EAGLE-3 draft head's whole call as one native function: the fused taps' projection, embedding, its decoder
// layers (EAGLE-3's first, then any plain Llama layers after it), the final norm, the vocabulary head, log-softmax
// and top-k.
//
// The head runs right after a verify forward has streamed ~100 MB of the target's weights through the caches, and
// each small torch op there pays for its code and bookkeeping coming back from DRAM: on the Zen 4 VM an extension's
// call over 2 rows (~25 ops and 6 kernel calls) took ~1.4 ms first after the target's projections against ~0.48 ms in
// a hot loop (scripts/head_step_cold.py), and reading the head's weights first did not close the gap. Here the call
// is one entry from Python and one pass of C++ over the same kernels:
//
//   hid  = T(fc([taps]))  (an extension, bf16)             gguf_bf16.h (the fused taps' Q8_0 blocks)
//   x    = [norm_in(embed[tokens]), norm_hid(hid)]        rms_norm.h, in the head's dtype T
//   qkv  = T(int8(x @ Wqkv))                               head_i8.h
//   q    = rope_cache(qkv) (k, v to the head's cache)      layer_ops.h
//   y    = T(path_attention(q, cache, paths))              path_attn.h
//   r    = residual + T(int8(y @ Wo))                      residual = hid (or norm_hid(hid))
//   out  = r + T(int8(T(silu(gate)) * up @ Wdown)),  gate | up = T(int8(norm_post(r) @ Wgu))
//   then each further layer l (cache layer l): the same attention and MLP on attn_in = norm_in_l(out), residual out
//   logp = log_softmax(float(T(int8(norm(out) @ Wlm))))   rows logits_from .. T - 1
//   top  = the top_k of each logp row, as target ids      what the tree's books take
//
// Every step is the torch fast path's (Eagle3Head.fuse, Eagle3Head.fast_forward, Eagle3Drafter._logp) with the same
// kernels and the same roundings to T between them, except silu and log-softmax (torch's vectorised exp against
// eyas_vexp's, vexp.h, and the order of log-softmax's sum: the last float bits, rarely a bf16 one). Only the draft
// can change; verification keeps the output lossless.
#include "gguf_bf16.h"
#include "head_i8.h"
#include "layer_ops.h"
#include "path_attn.h"
#include "rms_norm.h"
#include "vexp.h"

#include <cmath>
#include <tuple>
#include <vector>

namespace {

// one projection as eyas.models.int8_rows.Int8Rows holds it: data (tiled: head_i8's pack()), scale, sums
struct Proj {
  at::Tensor data, scale, sums;
  bool tiled;
  int64_t n, k;
};

using ProjArgs = std::tuple<at::Tensor, bool, at::Tensor, at::Tensor>;
// a plain decoder layer after EAGLE-3's first: input norm, post-attention norm, q|k|v, o, gate|up, down
using LayerArgs = std::tuple<at::Tensor, at::Tensor, ProjArgs, ProjArgs, ProjArgs, ProjArgs>;

// one decoder layer's projections and its norms (norm_in: a plain layer's input norm; undefined for EAGLE-3's
// first, whose input is the two normed halves)
struct Layer {
  Proj qkv, o, gu, down;
  at::Tensor norm_in, norm_post;
};

Proj make_proj(const ProjArgs& a, int64_t k, const char* what) {
  auto [data, tiled, scale, sums] = a;
  const int64_t n = scale.numel();
  TORCH_CHECK(data.dim() == 2 && data.scalar_type() == at::kChar && data.size(1) == k && data.is_contiguous(),
              "head_step: ", what, " weights [N, ", k, "] int8, contiguous");
  TORCH_CHECK(!tiled || eyas_head_i8::tiles(), "head_step: ", what, " is tiled but this build reads rows");
  TORCH_CHECK(data.size(0) == eyas_head_i8::weight_rows(n, tiled), "head_step: ", what, " has ", data.size(0),
              " rows for ", n, " outputs");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && sums.scalar_type() == at::kInt && sums.numel() == n &&
                  scale.is_contiguous() && sums.is_contiguous(),
              "head_step: ", what, " scale [N] float32, sums [N] int32");
  return Proj{data, scale, sums, tiled, n, k};
}

template <typename T>
inline float f(T x) { return static_cast<float>(x); }

class HeadStep {
 public:
  HeadStep(at::Tensor embed, std::vector<at::Tensor> norms, double eps, ProjArgs qkv, ProjArgs o, ProjArgs gate_up,
           ProjArgs down, ProjArgs lm_head, at::Tensor id_map, at::Tensor fc_blocks, int64_t fc_qtype, int64_t heads,
           int64_t kv_heads, int64_t head_dim, bool norm_before_residual, int64_t prefetch,
           std::vector<LayerArgs> extra)
      : embed_(embed.contiguous()), id_map_(id_map.contiguous()), fc_blocks_(fc_blocks), fc_qtype_(fc_qtype),
        eps_(static_cast<float>(eps)), h_(heads), hk_(kv_heads), dh_(head_dim),
        d_(embed.size(1)), norm_before_residual_(norm_before_residual), prefetch_(prefetch),
        scale_(static_cast<float>(std::pow(static_cast<double>(head_dim), -0.5))) {  // Python's dh ** -0.5
    const auto t = embed_.scalar_type();
    TORCH_CHECK(embed_.dim() == 2 && (t == at::kBFloat16 || t == at::kFloat), "head_step: embed [V, D] bf16 or float32");
    TORCH_CHECK(norms.size() == 4, "head_step: four norm weights (input, hidden, post-attention, final)");
    for (auto& w : norms) {
      TORCH_CHECK(w.scalar_type() == t && w.numel() == d_, "head_step: norm weights [D] in the embedding's dtype");
      norms_.push_back(w.contiguous());
    }
    layers_.push_back(make_layer(qkv, o, gate_up, down, 2 * d_, at::Tensor(), norms_[2], "layer 0"));
    for (size_t l = 0; l < extra.size(); ++l) {
      auto& [n_in, n_post, e_qkv, e_o, e_gu, e_down] = extra[l];
      for (const at::Tensor* w : {&n_in, &n_post})
        TORCH_CHECK(w->scalar_type() == t && w->numel() == d_, "head_step: layer ", l + 1,
                    "'s norm weights [D] in the embedding's dtype");
      layers_.push_back(make_layer(e_qkv, e_o, e_gu, e_down, d_, n_in.contiguous(), n_post.contiguous(),
                                   "a later layer"));
    }
    lm_ = make_proj(lm_head, d_, "lm_head");
    TORCH_CHECK(!fuses() || (t == at::kBFloat16 && eyas_gguf_bf16::available() && fc_blocks_.size(0) == d_),
                "head_step: the fused taps' projection runs here only as bf16 GGUF blocks of D rows (AVX512-BF16)");
    TORCH_CHECK(id_map_.scalar_type() == at::kLong && id_map_.numel() == lm_.n,
                "head_step: id_map [V_draft] int64 (each draft entry's target id)");
    TORCH_CHECK(eyas_path_attn::supports(h_ / hk_, dh_) && h_ % hk_ == 0 && dh_ % 2 == 0 && dh_ <= 512,
                "head_step: no attention kernel for ", h_ / hk_, " query heads a KV head of ", dh_);
  }

  // Row i: token tokens[i], feature hid[rows[i]] (hid[i] without rows), position pos0 + pos_step * i; its k and v go
  // to slot write_start + i of sequence 0 of the caches (decoder layer l's to cache layer l), and it attends slots
  // 0 .. prefix - 1, then prefix + seen[i][0], prefix + seen[i][1], ... (its path, itself last). Returns (out [T, D] in the head's dtype,
  // logp [T - logits_from, V_draft] float32, the top_k largest log-probs of each of those rows [R, top_k] float32 and
  // their target ids [R, top_k] int64, best first, ties to the lower draft id; empty for top_k 0).
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> run(
      std::vector<int64_t> tokens, at::Tensor hid, std::vector<at::Tensor> taps, std::vector<int64_t> rows, at::Tensor cos_table,
      at::Tensor sin_table, int64_t pos0, int64_t pos_step, at::Tensor k_cache, at::Tensor v_cache,
      int64_t write_start, int64_t prefix, std::vector<std::vector<int64_t>> seen, int64_t logits_from,
      int64_t top_k) {
    const int64_t t = static_cast<int64_t>(tokens.size());
    TORCH_CHECK(t >= 1 && t <= 64, "head_step: 1 to 64 tokens, got ", t);
    const int64_t nl = static_cast<int64_t>(layers_.size());
    if (!taps.empty()) {
      TORCH_CHECK(rows.empty(), "head_step: taps feed the rows in order (no rows)");
      hid = fuse(taps, t);
    }
    TORCH_CHECK(hid.scalar_type() == embed_.scalar_type() && hid.dim() == 2 && hid.size(1) == d_ && hid.is_contiguous(),
                "head_step: hid [P, D] contiguous, in the head's dtype");
    TORCH_CHECK(rows.empty() ? hid.size(0) == t : static_cast<int64_t>(rows.size()) == t,
                "head_step: rows, one per token into hid, or none with hid [T, D]");
    TORCH_CHECK(cos_table.scalar_type() == at::kFloat && sin_table.scalar_type() == at::kFloat &&
                    cos_table.is_contiguous() && sin_table.is_contiguous() && cos_table.size(1) == dh_ &&
                    sin_table.sizes() == cos_table.sizes(),
                "head_step: cos, signed sin tables [S, Dh] float32");
    const int64_t last = pos0 + pos_step * (t - 1);
    TORCH_CHECK(pos0 >= 0 && last >= 0 && pos0 < cos_table.size(0) && last < cos_table.size(0),
                "head_step: positions past the RoPE table");
    // the head's cache: [L, B, Hk, S, Dh] float32, layers 0 .. (decoder layers - 1) of sequence 0 used
    TORCH_CHECK(k_cache.dim() == 5 && k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat &&
                    v_cache.sizes() == k_cache.sizes() && k_cache.size(0) >= nl && k_cache.size(2) == hk_ &&
                    k_cache.size(4) == dh_ && k_cache.stride(4) == 1 && v_cache.stride(4) == 1,
                "head_step: k, v caches [L, B, Hk, S, Dh] float32 with a layer for each of the head's ", nl,
                " decoder layers");
    TORCH_CHECK(write_start >= 0 && write_start + t <= k_cache.size(3) && prefix >= 0 && prefix <= write_start,
                "head_step: slots past the head's cache");
    TORCH_CHECK(static_cast<int64_t>(seen.size()) == t, "head_step: one path (seen) per token");
    TORCH_CHECK(logits_from >= 0 && logits_from < t, "head_step: logits_from in 0 .. T - 1");
    TORCH_CHECK(top_k >= 0 && top_k <= 64 && top_k <= lm_.n, "head_step: top_k 0 to 64");
    for (int64_t i = 0; i < t; ++i) {
      TORCH_CHECK(tokens[i] >= 0 && tokens[i] < embed_.size(0), "head_step: token ", tokens[i], " outside the embedding");
      TORCH_CHECK(rows.empty() || (rows[i] >= 0 && rows[i] < hid.size(0)), "head_step: row ", rows[i], " outside hid");
    }
    // the paths as path attention reads them: [T, P] absolute slots (padded with the last) and their lengths
    int64_t width = 1;
    for (const auto& p : seen) width = std::max<int64_t>(width, static_cast<int64_t>(p.size()));
    std::vector<int64_t> slots(t * width), lengths(t);
    for (int64_t i = 0; i < t; ++i) {
      const auto& p = seen[i];
      TORCH_CHECK(!p.empty(), "head_step: an empty path (each row attends at least itself)");
      for (int64_t j = 0; j < width; ++j) {
        const int64_t e = p[std::min<int64_t>(j, static_cast<int64_t>(p.size()) - 1)];
        TORCH_CHECK(e >= 0 && prefix + e < write_start + t, "head_step: path entry ", e, " past the written slots");
        slots[i * width + j] = prefix + e;
      }
      lengths[i] = static_cast<int64_t>(p.size());
    }
    auto out = at::empty({t, d_}, hid.options());
    const int64_t lr = t - logits_from;
    auto logp = at::empty({lr, lm_.n}, hid.options().dtype(at::kFloat));
    auto top_v = at::empty({lr, top_k}, hid.options().dtype(at::kFloat));
    auto top_i = at::empty({lr, top_k}, hid.options().dtype(at::kLong));
    const Call c{tokens.data(), rows.empty() ? nullptr : rows.data(), t, cos_table.data_ptr<float>(),
                 sin_table.data_ptr<float>(), pos0, pos_step, k_cache, v_cache, write_start, prefix,
                 slots.data(), width, lengths.data(), logits_from};
    if (hid.scalar_type() == at::kBFloat16)
      run_t(c, hid.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), logp.data_ptr<float>());
    else
      run_t(c, hid.data_ptr<float>(), out.data_ptr<float>(), logp.data_ptr<float>());
    const int64_t* ids = id_map_.data_ptr<int64_t>();
    for (int64_t r = 0; r < lr; ++r)
      top_row(logp.data_ptr<float>() + r * lm_.n, lm_.n, top_k, ids, top_v.data_ptr<float>() + r * top_k,
              top_i.data_ptr<int64_t>() + r * top_k);
    return {out, logp, top_v, top_i};
  }

  // whether the fused taps' projection (EAGLE-3's fc) runs here: run(..., taps) then stands for hid = fc(taps)
  bool fuses() const { return fc_blocks_.defined() && fc_blocks_.numel() > 0; }

  // the k largest of x [v], best first (equal values: the lower index first), as values and ids[index]. With
  // AVX-512, 16 values at a time are compared with the k-th best so far and only those above it are offered, in
  // index order: the same insertions as offering every value (one that is not above the k-th best is never kept),
  // so the same result; ~13 -> ~2 us a draft-vocabulary row.
  static void top_row(const float* x, int64_t v, int64_t k, const int64_t* ids, float* vals, int64_t* out) {
    std::vector<int64_t> best;  // indices, best first
    best.reserve(k + 1);
    const auto full = [&] { return static_cast<int64_t>(best.size()) == k; };
    const auto offer = [&](int64_t j) {
      if (full() && !(x[j] > x[best.back()])) return;
      auto at = best.end();
      while (at != best.begin() && x[j] > x[*(at - 1)]) --at;
      best.insert(at, j);
      if (static_cast<int64_t>(best.size()) > k) best.pop_back();
    };
    int64_t j = 0;
    if (k > 0) {
#if defined(__AVX512F__)
      for (; j < v && !full(); ++j) offer(j);
      for (; j + 16 <= v; j += 16) {
        __mmask16 above = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j), _mm512_set1_ps(x[best.back()]), _CMP_GT_OQ);
        for (; above; above &= above - 1) offer(j + __builtin_ctz(above));
      }
#endif
      for (; j < v; ++j) offer(j);
    }
    for (int64_t i = 0; i < k; ++i) {
      vals[i] = x[best[i]];
      out[i] = ids[best[i]];
    }
  }

 private:
  // hid [T, D] = fc([taps[0][i] | taps[1][i] | ...]) for the T rows, on gguf_bf16.h's kernel (Eagle3Head.fuse's bits)
  at::Tensor fuse(const std::vector<at::Tensor>& taps, int64_t t) const {
    TORCH_CHECK(fuses(), "head_step: this head's fused taps are projected in Python (run without taps)");
    const int64_t dt = taps[0].size(-1), l = static_cast<int64_t>(taps.size());
    auto x = at::empty({t, l * dt}, embed_.options());
    auto* xd = x.data_ptr<at::BFloat16>();
    for (int64_t j = 0; j < l; ++j) {
      const at::Tensor& tap = taps[j];
      TORCH_CHECK(tap.dim() == 2 && tap.size(0) == t && tap.size(1) == dt && tap.stride(1) == 1 &&
                      tap.scalar_type() == at::kBFloat16,
                  "head_step: taps [T, D_target] bf16 with contiguous rows, one per fused layer");
      const auto* src = tap.data_ptr<at::BFloat16>();
      for (int64_t i = 0; i < t; ++i)
        std::copy(src + i * tap.stride(0), src + i * tap.stride(0) + dt, xd + (i * l + j) * dt);
    }
    return eyas_gguf_bf16::linear(x, fc_blocks_, fc_qtype_, at::Tensor());
  }

  struct Call {
    const int64_t* tokens;
    const int64_t* rows;  // nullptr: hid's rows in order
    int64_t t;
    const float* cos;
    const float* sin;
    int64_t pos0, pos_step;
    const at::Tensor& k_cache;
    const at::Tensor& v_cache;
    int64_t write_start, prefix;
    const int64_t* slots;
    int64_t path_width;
    const int64_t* lengths;
    int64_t logits_from;
  };

  // a decoder layer's projections checked against the head's shapes (k_in: q|k|v's input width)
  Layer make_layer(const ProjArgs& qkv, const ProjArgs& o, const ProjArgs& gate_up, const ProjArgs& down, int64_t k_in,
                   at::Tensor norm_in, at::Tensor norm_post, const char* what) const {
    Layer l{make_proj(qkv, k_in, "q|k|v"), make_proj(o, h_ * dh_, "o_proj"), make_proj(gate_up, d_, "gate|up"), {},
            norm_in, norm_post};
    l.down = make_proj(down, l.gu.n / 2, "down_proj");
    TORCH_CHECK(l.qkv.n == (h_ + 2 * hk_) * dh_ && l.o.n == d_ && l.down.n == d_ && l.gu.n % 2 == 0, "head_step: ",
                what, "'s projection shapes do not match heads ", h_, "/", hk_, " x ", dh_, " and D ", d_);
    return l;
  }

  template <typename T>
  void norm(const T* x, int64_t rows, const at::Tensor& w, T* y) const {
    eyas_rms_norm::norm_rows(x, w.data_ptr<T>(), y, rows, d_, eps_);
  }

  // y [m, n] in T = T(x [m, k] @ W^T): the int8 kernel's float32 sums rounded to T, as Int8Rows.linear returns them
  template <typename T>
  void project(const Proj& p, const T* x, int64_t m, std::vector<float>& acc, T* y) const {
    acc.resize(m * p.n);
    eyas_head_i8::run_into(x, m, p.k, p.data.data_ptr<int8_t>(), p.tiled, p.scale.data_ptr<float>(),
                           p.sums.data_ptr<int32_t>(), nullptr, p.n, acc.data(), prefetch_);
    for (int64_t i = 0; i < m * p.n; ++i) y[i] = static_cast<T>(acc[i]);
  }

  template <typename T>
  void run_t(const Call& c, const T* hid, T* out, float* logp) const {
    const int64_t t = c.t, d = d_;
    // EAGLE-3's layer reads [T, 2D]: norm_in(embedding) | norm_hid(hid), and adds to hid (or norm_hid(hid))
    std::vector<T> emb(t * d), hrows(t * d), normed(t * d), x(t * 2 * d);
    const T* table = embed_.data_ptr<T>();
    for (int64_t i = 0; i < t; ++i) {
      std::copy(table + c.tokens[i] * d, table + (c.tokens[i] + 1) * d, emb.begin() + i * d);
      const int64_t r = c.rows ? c.rows[i] : i;
      std::copy(hid + r * d, hid + (r + 1) * d, hrows.begin() + i * d);
    }
    norm(emb.data(), t, norms_[0], emb.data());
    norm(hrows.data(), t, norms_[1], normed.data());
    for (int64_t i = 0; i < t; ++i) {
      std::copy(emb.begin() + i * d, emb.begin() + (i + 1) * d, x.begin() + i * 2 * d);
      std::copy(normed.begin() + i * d, normed.begin() + (i + 1) * d, x.begin() + i * 2 * d + d);
    }
    std::vector<T> cs(t * dh_), sn(t * dh_);
    for (int64_t i = 0; i < t; ++i) {  // RopeTable.rows: the float32 tables' rows at each position, rounded to T
      const int64_t p = c.pos0 + c.pos_step * i;
      for (int64_t j = 0; j < dh_; ++j) {
        cs[i * dh_ + j] = static_cast<T>(c.cos[p * dh_ + j]);
        sn[i * dh_ + j] = static_cast<T>(c.sin[p * dh_ + j]);
      }
    }
    layer(c, 0, x.data(), norm_before_residual_ ? normed.data() : hrows.data(), cs.data(), sn.data(), out);
    for (size_t l = 1; l < layers_.size(); ++l) {  // a plain layer: attn_in = norm_in(out), residual out
      std::copy(out, out + t * d, hrows.begin());
      norm(hrows.data(), t, layers_[l].norm_in, normed.data());
      layer(c, static_cast<int64_t>(l), normed.data(), hrows.data(), cs.data(), sn.data(), out);
    }
    // draft log-probs of rows logits_from .. T - 1: norm, vocabulary head (its logits rounded to T), log-softmax
    const int64_t lr = t - c.logits_from, v = lm_.n;
    std::vector<float> acc;
    std::vector<T> fin(lr * d), lg(lr * v);
    norm(out + c.logits_from * d, lr, norms_[3], fin.data());
    project(lm_, fin.data(), lr, acc, lg.data());
    for (int64_t i = 0; i < lr; ++i) log_softmax(lg.data() + i * v, v, logp + i * v);
  }

  // decoder layer l (cache layer l) over T rows: attention on attn_in [T, K_in] (RoPE rows cs, sn [T, Dh]) added to
  // residual [T, D], then the MLP: out [T, D] in T, fast_layer's roundings
  template <typename T>
  void layer(const Call& c, int64_t l, const T* attn_in, const T* residual, const T* cs, const T* sn, T* out) const {
    const Layer& w = layers_[l];
    const int64_t t = c.t, d = d_, qn = h_ * dh_;
    std::vector<float> acc;
    // attention: q|k|v, RoPE with k and v into the cache, each row over the committed slots and its path
    std::vector<T> qkv(t * w.qkv.n);
    project(w.qkv, attn_in, t, acc, qkv.data());
    const at::Tensor& kc = c.k_cache;
    const at::Tensor& vc = c.v_cache;
    float* kp = kc.data_ptr<float>() + l * kc.stride(0);
    float* vp = vc.data_ptr<float>() + l * vc.stride(0);
    std::vector<float> q(t * qn), y(t * qn);
    eyas_layer_ops::rope_rows(qkv.data(), w.qkv.n, cs, sn, t, h_, hk_, dh_, q.data(), kp, vp, kc.stride(2),
                              kc.stride(3), vc.stride(2), vc.stride(3), c.write_start);
    eyas_path_attn::path_run(q.data(), static_cast<const float*>(kp), static_cast<const float*>(vp), c.slots,
                             c.lengths, y.data(), t, h_, dh_, hk_, c.path_width, kc.stride(2), kc.stride(3),
                             vc.stride(2), vc.stride(3), c.prefix, scale_);
    std::vector<T> yt(t * qn), ao(t * d), r(t * d), rn(t * d);
    for (int64_t i = 0; i < t * qn; ++i) yt[i] = static_cast<T>(y[i]);
    project(w.o, yt.data(), t, acc, ao.data());
    for (int64_t i = 0; i < t * d; ++i) r[i] = static_cast<T>(f(residual[i]) + f(ao[i]));
    // MLP: down(T(silu(gate)) * up), gate | up one projection
    const int64_t inter = w.gu.n / 2;
    std::vector<T> gu(t * w.gu.n), m(t * inter), dn(t * d);
    norm(r.data(), t, w.norm_post, rn.data());
    project(w.gu, rn.data(), t, acc, gu.data());
    std::vector<float> e(inter);  // e^-gate of a row (eyas_vexp: SIMD lanes, not libm's scalar expf)
    for (int64_t i = 0; i < t; ++i) {
      for (int64_t j = 0; j < inter; ++j) e[j] = -f(gu[i * w.gu.n + j]);
      eyas_vexp::exp_array(e.data(), e.data(), inter);
      for (int64_t j = 0; j < inter; ++j) {
        const T s = static_cast<T>(f(gu[i * w.gu.n + j]) / (1.0f + e[j]));
        m[i * inter + j] = static_cast<T>(f(s) * f(gu[i * w.gu.n + inter + j]));
      }
    }
    project(w.down, m.data(), t, acc, dn.data());
    for (int64_t i = 0; i < t * d; ++i) out[i] = static_cast<T>(f(r[i]) + f(dn[i]));
  }

  // out [v] = log_softmax(float(x)): (x - max) - log(sum of e^(x - max)), eyas_vexp's SIMD exp and lane sums
  template <typename T>
  static void log_softmax(const T* x, int64_t v, float* out) {
    for (int64_t j = 0; j < v; ++j) out[j] = f(x[j]);
    eyas_vexp::log_softmax(out, v, out);
  }

  at::Tensor embed_, id_map_, fc_blocks_;
  int64_t fc_qtype_;
  std::vector<at::Tensor> norms_;
  float eps_;
  int64_t h_, hk_, dh_, d_;
  bool norm_before_residual_;
  int64_t prefetch_;
  float scale_;
  std::vector<Layer> layers_;  // EAGLE-3's layer, then the plain ones (cache layers 0, 1, ...)
  Proj lm_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<HeadStep>(m, "HeadStep")
      .def(py::init<at::Tensor, std::vector<at::Tensor>, double, ProjArgs, ProjArgs, ProjArgs, ProjArgs, ProjArgs,
                    at::Tensor, at::Tensor, int64_t, int64_t, int64_t, int64_t, bool, int64_t,
                    std::vector<LayerArgs>>())
      .def("run", &HeadStep::run,
           "one head call: (out [T, D], logp [R, V_draft] float32, top-k log-probs [R, k], their target ids [R, k])")
      .def_property_readonly("fuses", &HeadStep::fuses, "whether run(..., taps) projects the fused taps itself");
  m.def("available", &eyas_head_i8::available, "whether the int8 projections were built (AVX512-VNNI or AVX2)");
  // the call's row functions on float32 tensors, for tests (tests/drafters/test_vexp.py)
  m.def("exp", [](at::Tensor x) {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "head_step.exp: float32 input");
    x = x.contiguous();
    auto y = at::empty_like(x);
    eyas_vexp::exp_array(x.data_ptr<float>(), y.data_ptr<float>(), x.numel());
    return y;
  }, "e^x elementwise, as the head's silu computes it");
  m.def("top_k", [](at::Tensor x, int64_t k) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 1 && k >= 1 && k <= x.numel(),
                "head_step.top_k: a float32 row [V] and 1 <= k <= V");
    x = x.contiguous();
    std::vector<int64_t> ids(x.numel());
    for (int64_t i = 0; i < x.numel(); ++i) ids[i] = i;
    auto vals = at::empty({k}, x.options());
    auto idx = at::empty({k}, x.options().dtype(at::kLong));
    HeadStep::top_row(x.data_ptr<float>(), x.numel(), k, ids.data(), vals.data_ptr<float>(), idx.data_ptr<int64_t>());
    return std::make_tuple(vals, idx);
  }, "a row's k largest values and their indices, best first, ties to the lower index (the call's top-k)");
  m.def("log_softmax", [](at::Tensor x) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 1, "head_step.log_softmax: a float32 row [V]");
    x = x.contiguous();
    auto y = at::empty_like(x);
    eyas_vexp::log_softmax(x.data_ptr<float>(), x.numel(), y.data_ptr<float>());
    return y;
  }, "a row's log-softmax, as the head's draft log-probs are computed");
}
