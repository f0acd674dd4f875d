// Causal prefill attention in float32 for the avx2 build (CPUs without AVX-512: AMD Zen 1-3, Intel before Skylake-X),
// where bf16 has no arithmetic and the layer's attention otherwise runs torch's float32 SDPA:
//
//   prefill_attention_f32(q [T, Hq, D] float32, k [B, L, Hk, D] float32 or bf16, v (as k), q_lens [B] i64,
//                         kv_lens [B] i64, scale) -> out [T, Hq, D] float32: rows of queries over their keys as
//     prefill_rows.h states (a fresh prompt: B = 1, q_lens = kv_lens = T; a chunk over cached context: kv_lens =
//     cached + chunk); D a multiple of 16; the last dimension of q, k and v contiguous, other strides free.
//   prefill_attention_f32_available() -> bool: whether this build runs it (the avx2 build; the avx512 build has the
//     bf16 kernel of prefill_attention.cpp instead)
//
// The algorithm is FlashAttention-2's (Dao 2023): per tile of queries, keys in blocks, an online softmax (running max
// m and sum l, the output rescaled when m grows), the output divided by l at the end. As in prefill_attention.cpp, K and
// V are packed once per call (here widened to float32, each (row, KV head)'s keys contiguous: a work item then streams
// them in order, where the rows of a fused qkv or of the KV pool lie a token stride apart, 8K tokens over 31 MB of
// pages), and the scores run transposed so that the softmax is lane-wise (one ymm lane per query, no horizontal
// reductions):
//   scores^T [keys][8 queries] = K Q^T: per key, D FMAs of Q^T's rows (packed once per work item, times scale * log2 e)
//     with the key's elements broadcast from memory, once for a pair of heads (4 keys x 2 heads of chains);
//   softmax in base 2 (exp2_8), keys past a query masked, key blocks wholly after a tile's last query skipped;
//   out [8 queries][D] += P V: per 4 queries and 16 dims, two value vectors per key and P^T's elements broadcast,
//     accumulated in registers, the output kept in the item's scratch.
// Each FMA's other operand is a broadcast load (6 loads per 8 FMAs in both products): the loop bound is the FMA units
// and the loads. One work item is (row, KV head, QT_ITEM queries) with the KV head's g query heads; each key block
// serves all its heads and tiles. Items are spread over threads heavy and light alternating (prefill_rows.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <tuple>
#include <utility>
#include <vector>

#include "prefill_rows.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
#define GLMSERVE_F32_ATTENTION 1
#endif

namespace {

#ifdef GLMSERVE_F32_ATTENTION
constexpr int QT = 8;          // queries per tile: one per ymm lane
constexpr int TILES = 4;       // tiles per work item
constexpr int QT_ITEM = QT * TILES;
constexpr int KB = 32;         // keys per block
constexpr float kLog2e = 1.44269504088896341f;

struct Problem {
  const float* q;  // [T, Hq, D] contiguous, times scale * log2 e
  int64_t Hq, Hk, D, g;
  const int64_t* q_len;
  const glmserve::PackedRows* rows;  // where each row starts, its keys (kv_len)
  const float* kp;  // packed K, V: per (row, KV head) [padded keys][D], zero past the row's keys
  const float* vp;
  float* out;
};

// 2^x on 8 lanes for x <= 0: x = n + f, |f| <= 1/2, 2^f by its Taylor series to degree 6 (~1e-7 relative), times
// 2^n in the exponent bits; x below -126 (a masked key's -inf too) gives 0
inline __m256 exp2_8(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-126.f), _CMP_GE_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-126.f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(x, n), _mm256_set1_ps(0.693147180559945309f));
  __m256 p = _mm256_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(scale)), live);
}

// Key block `blk` of row b's KV head h of k or v (T: float, or uint16_t for bf16) widened into dst [KB][D], zero
// past the row's kl keys
template <typename T>
void pack_block(const at::Tensor& x, const glmserve::KeyRows& rows, int64_t b, int64_t h, int64_t blk, int64_t kl,
                int64_t D, float* dst) {
  const T* base = static_cast<const T*>(x.data_ptr());
  const int64_t t0 = blk * KB, n = std::min<int64_t>(KB, kl - t0);
  for (int64_t t = 0; t < n; ++t) {
    const T* row = base + rows.offset(b, t0 + t, h);
    float* out = dst + t * D;
    if constexpr (std::is_same_v<T, float>) {
      std::memcpy(out, row, D * sizeof(float));
    } else {
      for (int64_t d = 0; d < D; d += 8) {
        const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d)));
        _mm256_storeu_ps(out + d, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
      }
    }
  }
  std::fill(dst + n * D, dst + KB * D, 0.f);
}

struct Scratch {  // one thread's buffers; states (tile, head) = tile * g + head
  std::vector<float> qt, ot, m, l, sc;
  explicit Scratch(const Problem& p)
      : qt(TILES * p.g * p.D * QT), ot(TILES * p.g * QT * p.D), m(TILES * p.g * QT), l(TILES * p.g * QT),
        sc(2 * KB * QT) {}
};

// scores^T of the block's keys k0..k0+K-1 (kf rows) against H states' Q^T (qt, qt + D * QT, ...: heads of one tile),
// into sc rows k0.. (head h's at sc + h * KB * QT): 8 chains, each K element broadcast once for the H heads, so that
// loads per FMA fall from 9 / 8 (one head) to 6 / 8 (two). Three heads of 3 keys (6 loads per 9 FMAs) measured slower
// (63 against 69 GFLOP/s at 2,048 tokens, one Zen 3 core)
template <int H, int K>
inline void score_group(const float* qt, const float* kf, int64_t D, int k0, float* sc) {
  __m256 acc[K][H];
  for (int k = 0; k < K; ++k)
    for (int h = 0; h < H; ++h) acc[k][h] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m256 qd[H];
    for (int h = 0; h < H; ++h) qd[h] = _mm256_loadu_ps(qt + h * D * QT + d * QT);
    for (int k = 0; k < K; ++k) {
      const __m256 kd = _mm256_broadcast_ss(kf + (k0 + k) * D + d);
      for (int h = 0; h < H; ++h) acc[k][h] = _mm256_fmadd_ps(kd, qd[h], acc[k][h]);
    }
  }
  for (int k = 0; k < K; ++k)
    for (int h = 0; h < H; ++h) _mm256_storeu_ps(sc + h * KB * QT + (k0 + k) * QT, acc[k][h]);
}

// the scores of H heads of a tile over the first tk keys of the block, K keys a group (up to the multiple of K: the
// scores of the rows after tk, later keys or the block's zero padding, are not read)
template <int H, int K>
inline void score_heads(const float* qt, const float* kf, int64_t D, int tk, float* sc) {
  for (int k0 = 0; k0 < tk; k0 += K) score_group<H, K>(qt, kf, D, k0, sc);
}

// out [8 queries][D] += P (sc: P^T rows of the nk keys, the softmax numerators) x V (vf rows): per 4 queries and 16
// dims, two value vectors per key and one broadcast of P per query (6 loads per 8 FMAs)
inline void accumulate(const float* vf, const float* sc, int64_t D, int nk, float* ot) {
  for (int q0 = 0; q0 < QT; q0 += 4)
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      __m256 acc[4][2];
      for (int i = 0; i < 4; ++i)
        for (int c = 0; c < 2; ++c) acc[i][c] = _mm256_loadu_ps(ot + (q0 + i) * D + d0 + 8 * c);
      for (int k = 0; k < nk; ++k) {
        const __m256 v0 = _mm256_loadu_ps(vf + k * D + d0), v1 = _mm256_loadu_ps(vf + k * D + d0 + 8);
        for (int i = 0; i < 4; ++i) {
          const __m256 pk = _mm256_broadcast_ss(sc + k * QT + q0 + i);
          acc[i][0] = _mm256_fmadd_ps(pk, v0, acc[i][0]);
          acc[i][1] = _mm256_fmadd_ps(pk, v1, acc[i][1]);
        }
      }
      for (int i = 0; i < 4; ++i)
        for (int c = 0; c < 2; ++c) _mm256_storeu_ps(ot + (q0 + i) * D + d0 + 8 * c, acc[i][c]);
    }
}

// One block's online softmax for one state: sc rows 0..nk-1 (keys kb..kb+nk-1) masked past each lane's query
// (query positions qa..qa+7), P^T in place; m, l (8 lanes) updated, out [8][D] scaled where a query's max grew
void softmax_block(float* sc, int nk, int64_t kb, int64_t qa, float* m, float* l, float* ot, int64_t D) {
  const __m256 lanes = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const bool masked = kb + nk - 1 > qa;
  __m256 mx = ninf;
  for (int k = 0; k < nk; ++k) {
    __m256 s = _mm256_loadu_ps(sc + k * QT);
    if (masked) {  // key kb + k is visible to lane i where kb + k <= qa + i
      const __m256 keep = _mm256_cmp_ps(_mm256_set1_ps(static_cast<float>(kb + k - qa)), lanes, _CMP_LE_OQ);
      s = _mm256_blendv_ps(ninf, s, keep);
      _mm256_storeu_ps(sc + k * QT, s);
    }
    mx = _mm256_max_ps(mx, s);
  }
  const __m256 m_old = _mm256_loadu_ps(m), m_new = _mm256_max_ps(m_old, mx);
  __m256 sum = _mm256_setzero_ps();
  for (int k = 0; k < nk; ++k) {
    const __m256 e = exp2_8(_mm256_sub_ps(_mm256_loadu_ps(sc + k * QT), m_new));
    _mm256_storeu_ps(sc + k * QT, e);
    sum = _mm256_add_ps(sum, e);
  }
  const __m256 alpha = exp2_8(_mm256_sub_ps(m_old, m_new));  // 0 at the first block (m_old = -inf)
  _mm256_storeu_ps(l, _mm256_fmadd_ps(_mm256_loadu_ps(l), alpha, sum));
  _mm256_storeu_ps(m, m_new);
  if (_mm256_movemask_ps(_mm256_cmp_ps(m_new, m_old, _CMP_GT_OQ))) {
    alignas(32) float a[QT];
    _mm256_store_ps(a, alpha);
    for (int i = 0; i < QT; ++i) {
      const __m256 ai = _mm256_set1_ps(a[i]);
      for (int64_t d = 0; d < D; d += 8)
        _mm256_storeu_ps(ot + i * D + d, _mm256_mul_ps(_mm256_loadu_ps(ot + i * D + d), ai));
    }
  }
}

// Work item `it`: its g heads' QT_ITEM queries (of row it.b, positions from qa0) against the row's keys up to the last
// query's, block by block
void attend_item(const Problem& p, const glmserve::PrefillItem& it, Scratch& w) {
  const int64_t D = p.D, ql = p.q_len[it.b], i0 = it.block * QT_ITEM;
  const int64_t nq = std::min<int64_t>(QT_ITEM, ql - i0), tiles = (nq + QT - 1) / QT;
  const int64_t qa0 = p.rows->kv_len[it.b] - ql + i0, first_token = p.rows->q_start[it.b] + i0;
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t j = 0; j < p.g; ++j) {
      float* qt = w.qt.data() + (t * p.g + j) * D * QT;
      const float* q = p.q + (first_token + t * QT) * p.Hq * D + (it.h * p.g + j) * D;
      for (int i = 0; i < QT; ++i) {
        const bool live = t * QT + i < nq;
        for (int64_t d = 0; d < D; ++d) qt[d * QT + i] = live ? q[i * p.Hq * D + d] : 0.f;
      }
    }
  const int64_t states = tiles * p.g;
  std::fill(w.ot.begin(), w.ot.begin() + states * QT * D, 0.f);
  std::fill(w.m.begin(), w.m.begin() + states * QT, -std::numeric_limits<float>::infinity());
  std::fill(w.l.begin(), w.l.begin() + states * QT, 0.f);
  const int64_t region = p.rows->region(it.b, it.h, p.Hk, D), keys = qa0 + nq;  // the last query's keys
  for (int64_t kb = 0; kb < keys; kb += KB) {
    const int nk = static_cast<int>(std::min<int64_t>(KB, keys - kb));
    const float* kf = p.kp + region + kb * D;
    const float* vf = p.vp + region + kb * D;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t qa = qa0 + t * QT;
      if (kb > qa + QT - 1) continue;  // every key of the block is after the tile's queries
      // the tile's last query sees keys up to qa + 7: the block's keys after it are masked for all lanes
      const int tk = static_cast<int>(std::min<int64_t>(nk, qa + QT - kb));
      for (int64_t j = 0; j < p.g;) {  // heads in pairs (one K broadcast for both), a last one alone
        const int heads = static_cast<int>(std::min<int64_t>(2, p.g - j));
        const float* qt = w.qt.data() + (t * p.g + j) * D * QT;
        if (heads == 2) score_heads<2, 4>(qt, kf, D, tk, w.sc.data());
        else score_heads<1, 8>(qt, kf, D, tk, w.sc.data());
        for (int e = 0; e < heads; ++e) {
          const int64_t s = t * p.g + j + e;
          float* ot = w.ot.data() + s * QT * D;
          float* sc = w.sc.data() + e * KB * QT;
          softmax_block(sc, tk, kb, qa, w.m.data() + s * QT, w.l.data() + s * QT, ot, D);
          accumulate(vf, sc, D, tk, ot);
        }
        j += heads;
      }
    }
  }
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t j = 0; j < p.g; ++j) {
      const int64_t s = t * p.g + j, head = it.h * p.g + j;
      const float* ot = w.ot.data() + s * QT * D;
      for (int i = 0; i < QT && t * QT + i < nq; ++i) {
        const __m256 inv = _mm256_set1_ps(1.f / w.l[s * QT + i]);
        float* o = p.out + ((first_token + t * QT + i) * p.Hq + head) * D;
        for (int64_t d = 0; d < D; d += 8)
          _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(ot + i * D + d), inv));
      }
    }
}
#endif

}  // namespace

bool prefill_attention_f32_available() {
#ifdef GLMSERVE_F32_ATTENTION
  return true;
#else
  return false;
#endif
}

// slots: k and v are KV pools read by slot (prefill_rows.h)
at::Tensor prefill_attention_f32(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& q_lens, const at::Tensor& kv_lens, double scale,
                                 const std::optional<at::Tensor>& slots) {
  TORCH_CHECK(prefill_attention_f32_available(), "prefill_attention_f32: not in this build (the avx2 variant has it)");
  glmserve::check_prefill_rows("prefill_attention_f32", q_in, k, v, q_lens, kv_lens, slots);
  TORCH_CHECK(q_in.scalar_type() == at::kFloat, "prefill_attention_f32: q must be float32");
  const glmserve::KeyRows krs(k, slots), vrs(v, slots);
  const int64_t T = q_in.size(0), Hq = q_in.size(1), D = q_in.size(2), B = krs.B, Hk = krs.Hk;
  TORCH_CHECK(krs.D == D && D % 16 == 0 && D > 0, "prefill_attention_f32: head dim ", D, " (q) and ", krs.D,
              " (k) must be equal, a multiple of 16");
  auto out = at::empty({T, Hq, D}, q_in.options());
#ifdef GLMSERVE_F32_ATTENTION
  if (T == 0) return out;
  const int64_t* ql = q_lens.data_ptr<int64_t>();
  const int64_t* kl = kv_lens.data_ptr<int64_t>();
  // scores in base 2: scale * log2 e folded into a contiguous copy of q (any strides)
  const auto qs = (q_in * static_cast<float>(scale * kLog2e)).contiguous();
  const glmserve::PackedRows rows(ql, kl, B, KB);
  at::Tensor packed = at::empty({2, rows.keys * Hk * D}, q_in.options());  // every block is written whole
  float* kp = packed.data_ptr<float>();
  float* vp = kp + rows.keys * Hk * D;
  rows.pack_blocks(Hk, [&](int64_t b, int64_t h, int64_t blk) {
    const int64_t at = rows.region(b, h, Hk, D) + blk * KB * D;
    for (const auto& [x, xrs, dst] : {std::tuple{&k, &krs, kp + at}, std::tuple{&v, &vrs, vp + at}}) {
      if (x->scalar_type() == at::kFloat) pack_block<float>(*x, *xrs, b, h, blk, kl[b], D, dst);
      else pack_block<uint16_t>(*x, *xrs, b, h, blk, kl[b], D, dst);
    }
  });
  const Problem p{qs.data_ptr<float>(), Hq, Hk, D, Hq / Hk, ql, &rows, kp, vp, out.data_ptr<float>()};
  const std::vector<glmserve::PrefillItem> order = glmserve::balanced_items(ql, kl, B, Hk, QT_ITEM, KB);
  at::parallel_for(0, static_cast<int64_t>(order.size()), 1, [&](int64_t begin, int64_t end) {
    Scratch w(p);
    for (int64_t i = begin; i < end; ++i) attend_item(p, order[i], w);
  });
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("prefill_attention_f32", &prefill_attention_f32, "causal float32 prefill attention (avx2 build)", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("q_lens"), py::arg("kv_lens"), py::arg("scale"),
        py::arg("slots") = py::none());
  m.def("prefill_attention_f32_available", &prefill_attention_f32_available, "whether this build runs it");
}
