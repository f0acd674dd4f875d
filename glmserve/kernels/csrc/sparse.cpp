// Sparse decode attention's CPU kernels: the block indexer's bounds update and scores
// (glmserve/sparse/block.py), and the selection of each row's slots (glmserve/sparse/selection.py).
//
// bounds_update: for each written token in order, its block restarts from the key when the token sits at
// offset 0 of the block (a fresh or reused block is always written from there), else the block's min/max
// take the key in. Tokens of one block arrive in ascending offsets within a step (a sequence's chunk is
// contiguous), so one sequential pass is exact; a few microseconds per decode token and layer. Keys float32 or
// bf16 (a bf16 prefill's k, layers/attention.py `takes_bf16`), read in place from a fused qkv output (any token
// stride).
//
// learned_scores: the token-level scores of the learned indexer (glmserve/sparse/learned.py) for each decode
// row b and key position j < context_lens[b] (slot tables[b, j / bs] * bs + j % bs):
//   sum_h w[b,h] * relu(qi[b,h] . keys[slot]) + distance_bias[bucket(n_b - 1 - j)] + sink_bias[j] (j < S)
// (w already carries the 1/sqrt(d) scale), -inf past the context. The index keys are read in place from the
// layer's pool, one block (bs contiguous rows of d) at a time: no [B, L, d] gather copy. The distance bucket
// is computed in integers (exact below 8, then two per octave: 8 + floor(2 log2(dist / 8)), the last one
// open): the value of learned.distance_bucket's float formula (tests compare all distances below 100,000).
// Work is split over (row, range of 64 blocks) with at::parallel_for.
//
// block_scores:
// For each decode row b and each of its logical blocks w (physical block tables[b, w]), the sum over the
// query heads of the upper bound of each head's scaled logit on a key of that block:
//   sum over heads h of  scale * sum_d max(q[b,h,d] * lo[blk,kv(h),d], q[b,h,d] * hi[blk,kv(h),d])
// = scale * sum_h (relu(q_h) . hi + min(q_h, 0) . lo)   (Tang et al., 2024, "Quest", arXiv:2406.10774).
// Bounds are read in place ([num_blocks, 2, Hkv, D], float32 or bfloat16), one contiguous row per
// block, so the cost is one pass over the row's bounds (1/block_size of its keys and values); no
// gather copy and no skinny GEMM. Work is split over (row, block range) with at::parallel_for.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <functional>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(double x) { return static_cast<float>(x); }

template <typename bound_t>
void scores_kernel(const float* q, const bound_t* bounds, const int64_t* tables, const int64_t* num_units,
                   float* out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t W, float scale) {
  const int64_t group = H / Hkv;
  // the sum over heads is linear in the bounds: per row and kv head, sum the positive parts of its query
  // heads (they meet the max bound) and the negative parts (they meet the min bound) once
  std::vector<float> pos(B * Hkv * D, 0.f), neg(B * Hkv * D, 0.f);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d) {
        const float x = q[(b * H + h) * D + d];
        float* p = pos.data() + (b * Hkv + h / group) * D + d;
        float* n = neg.data() + (b * Hkv + h / group) * D + d;
        *p += std::max(x, 0.f);
        *n += std::min(x, 0.f);
      }
  at::parallel_for(0, B * W, 64, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / W, w = task % W;
      if (w >= num_units[b]) {
        out[task] = -std::numeric_limits<float>::infinity();
        continue;
      }
      const bound_t* lo = bounds + tables[task] * 2 * Hkv * D;  // [Hkv, D] min, then [Hkv, D] max
      const bound_t* hi = lo + Hkv * D;
      const float* qp = pos.data() + b * Hkv * D;
      const float* qn = neg.data() + b * Hkv * D;
      float total = 0.f;
#pragma omp simd reduction(+ : total)
      for (int64_t i = 0; i < Hkv * D; ++i) total += qp[i] * to_float(hi[i]) + qn[i] * to_float(lo[i]);
      out[task] = total * scale;
    }
  });
}

// bucket of a query-key distance >= 0: dist for dist < 8, else 8 + floor(2 log2(dist / 8)) = 8 + 2 (m - 3) + [dist >=
// 2^m sqrt 2] with m = floor(log2 dist), i.e. [dist^2 >= 2^(2m+1)]; clamped to the last of `buckets`
inline int64_t distance_bucket(int64_t dist, int64_t buckets) {
  if (dist < 8) return std::min(dist, buckets - 1);
  const int64_t m = 63 - __builtin_clzll(static_cast<unsigned long long>(dist));
  const int64_t half = dist * dist >= (int64_t{1} << (2 * m + 1)) ? 1 : 0;
  return std::min(8 + 2 * (m - 3) + half, buckets - 1);
}

// sum_h w[h] * relu(q[h] . k) of one key k [d] against the index queries q [Hi, d]
template <typename key_t>
inline float key_score(const float* q, const float* w, const key_t* k, int64_t Hi, int64_t d) {
  float total = 0.f;
  for (int64_t h = 0; h < Hi; ++h) {
    const float* qh = q + h * d;
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t i = 0; i < d; ++i) dot += qh[i] * to_float(k[i]);
    total += w[h] * std::max(dot, 0.f);
  }
  return total;
}

#if defined(__AVX2__) && defined(__FMA__)
// 8 key values as floats: float as is; a bfloat16 is the high half of a float: widen and shift
inline __m256 load8(const float* k) { return _mm256_loadu_ps(k); }
inline __m256 load8(const c10::BFloat16* k) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(k));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// The same for float or bfloat16 keys of d = 32 and heads in fours (the default indexer: 4 heads of 32):
// the four heads' dot products are reduced together by three horizontal adds instead of one horizontal sum
// each, the cost that dominated the compiler's version of the loop above.
template <typename key_t>
inline float key_score_d32(const float* q, const float* w, const key_t* k, int64_t Hi) {
  const __m256 k0 = load8(k), k1 = load8(k + 8), k2 = load8(k + 16), k3 = load8(k + 24);
  __m128 total = _mm_setzero_ps();
  for (int64_t h0 = 0; h0 < Hi; h0 += 4) {
    __m256 acc[4];
    for (int64_t j = 0; j < 4; ++j) {
      const float* qh = q + (h0 + j) * 32;
      __m256 a = _mm256_mul_ps(_mm256_loadu_ps(qh), k0);
      a = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8), k1, a);
      a = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 16), k2, a);
      acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 24), k3, a);
    }
    // [h0 0..3 sums, h1, h2, h3 | the same of lanes 4..7], then the two halves added: the four dots
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    const __m128 dots = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    total = _mm_fmadd_ps(_mm_loadu_ps(w + h0), _mm_max_ps(dots, _mm_setzero_ps()), total);
  }
  const __m128 pair = _mm_add_ps(total, _mm_movehl_ps(total, total));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
}
#endif

// kD: the index dim when known at compile time (the common 32: the dot products unroll into a few vector
// FMAs), 0 = d at run time
template <typename key_t, int64_t kD>
void learned_kernel(const float* qi, const float* w, const key_t* keys, const int64_t* tables, const int64_t* ctx,
                    const float* dist_bias, const float* sink_bias, float* out, int64_t B, int64_t Hi, int64_t d,
                    int64_t W, int64_t L, int64_t bs, int64_t NB, int64_t S) {
  if (kD > 0) d = kD;
  const float ninf = -std::numeric_limits<float>::infinity();
  constexpr int64_t kBlocksPerTask = 64;
  const int64_t chunks = (W + kBlocksPerTask - 1) / kBlocksPerTask;
  at::parallel_for(0, B * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> dots(Hi);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / chunks, c = task % chunks;
      const int64_t n = std::min(ctx[b], L);
      const float* q = qi + b * Hi * d;
      const float* wb = w + b * Hi;
      float* row = out + b * L;
      const int64_t j_begin = c * kBlocksPerTask * bs, j_end = std::min(L, j_begin + kBlocksPerTask * bs);
      for (int64_t j0 = j_begin; j0 < j_end; j0 += bs) {
        const int64_t len = std::min(bs, std::max<int64_t>(0, std::min(n, j_end) - j0));
        const key_t* kb = keys + tables[b * W + j0 / bs] * bs * d;
        if (j0 + bs < std::min(n, j_end)) {  // the next block is elsewhere in the pool: prefetch it whole
          const char* next = reinterpret_cast<const char*>(keys + tables[b * W + j0 / bs + 1] * bs * d);
          for (int64_t byte = 0; byte < bs * d * static_cast<int64_t>(sizeof(key_t)); byte += 64)
            __builtin_prefetch(next + byte);
        }
        for (int64_t o = 0; o < len; ++o) {
          const key_t* k = kb + o * d;
          float total;
#if defined(__AVX2__) && defined(__FMA__)
          if constexpr ((std::is_same_v<key_t, float> || std::is_same_v<key_t, c10::BFloat16>) && kD == 32)
            total = Hi % 4 == 0 ? key_score_d32(q, wb, k, Hi) : key_score(q, wb, k, Hi, d);
          else
#endif
            total = key_score(q, wb, k, Hi, d);
          const int64_t j = j0 + o;
          total += dist_bias[distance_bucket(n - 1 - j, NB)];
          if (j < S) total += sink_bias[j];
          row[j] = total;
        }
        for (int64_t o = len; o < std::min(bs, j_end - j0); ++o) row[j0 + o] = ninf;
      }
    }
  });
}

// Tokens come in runs (consecutive slots of one block: a row's tokens in that block): each run's min and max are
// taken in float32 over its keys (and the block's stored bounds, unless the run starts the block at offset 0),
// then rounded to bound_t once. Rounding is monotonic, so this equals folding in each rounded key in turn.
template <typename key_t, typename bound_t>
void update_kernel(const int64_t* slots, const key_t* keys, int64_t key_stride, bound_t* bounds, int64_t T, int64_t HD,
                   int64_t block_size) {
  std::vector<float> lo(HD), hi(HD);
  for (int64_t t = 0, end = 0; t < T; t = end) {
    const int64_t block = slots[t] / block_size;
    for (end = t + 1; end < T && slots[end] == slots[end - 1] + 1 && slots[end] / block_size == block;) ++end;
    bound_t* blo = bounds + block * 2 * HD;
    bound_t* bhi = blo + HD;
    const bool restart = slots[t] % block_size == 0;
    for (int64_t i = 0; i < HD; ++i) {
      lo[i] = restart ? to_float(keys[t * key_stride + i]) : to_float(blo[i]);
      hi[i] = restart ? to_float(keys[t * key_stride + i]) : to_float(bhi[i]);
    }
    for (int64_t s = t; s < end; ++s) {
      const key_t* k = keys + s * key_stride;
      for (int64_t i = 0; i < HD; ++i) {
        const float v = to_float(k[i]);
        lo[i] = v < lo[i] ? v : lo[i];
        hi[i] = v > hi[i] ? v : hi[i];
      }
    }
    for (int64_t i = 0; i < HD; ++i) {
      blo[i] = static_cast<bound_t>(lo[i]);
      bhi[i] = static_cast<bound_t>(hi[i]);
    }
  }
}

// Order-preserving integer key of a float: a larger float has a larger key (-inf and +inf included; -0 is
// +0), and back.
inline uint32_t order_key(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if (u == 0x80000000u) u = 0;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

inline float from_order_key(uint32_t key) {
  const uint32_t u = (key & 0x80000000u) ? (key & 0x7fffffffu) : ~key;
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// The min-max normalized score test of threshold mode (all candidates equal: all pass).
struct ThresholdTest {
  bool on;  // a threshold is set and the candidates' scores span a range
  float lo, span, threshold;
  bool passes(float x) const { return !on || (x - lo) / span >= threshold; }
};

// The k-th largest (1 <= k) of the m values of x that pass `test`, given that at least k pass, and how
// many of those are larger than it; `skip` (null: none) marks values left out (pinned units).
//
// Fast path: a strided sample of 1,024 values estimates a bound a little below the k-th largest; one pass
// collects the passing values at or above it, and when there are at least k of them the k-th largest is
// among them (nth_element on a few thousand values), as are all the values larger than it. Otherwise (an
// unlucky sample) the radix select below, which is exact on any input. On a 128K-token row with a budget of
// ~2,000 this is one pass instead of two, and no 65,536-bin histogram.
std::pair<float, int64_t> kth_largest_radix(const float* x, const char* skip, int64_t m, int64_t k,
                                            const ThresholdTest& test, std::vector<int32_t>& hist);

std::pair<float, int64_t> kth_largest(const float* x, const char* skip, int64_t m, int64_t k,
                                      const ThresholdTest& test, std::vector<int32_t>& hist,
                                      std::vector<float>& top) {
  constexpr int64_t kSample = 1024;
  const auto counted = [&](int64_t i) { return !(skip && skip[i]) && test.passes(x[i]); };
  if (m >= 8 * kSample) {
    top.clear();
    const int64_t stride = m / kSample;
    for (int64_t i = 0; i < m; i += stride)
      if (counted(i)) top.push_back(x[i]);
    const int64_t n = static_cast<int64_t>(top.size());
    // the sample rank of the k-th largest, lowered by a few standard deviations of its estimate
    const double expected = static_cast<double>(k) * n / m;
    const int64_t rank = static_cast<int64_t>(expected + 4.0 * std::sqrt(expected) + 8.0);
    if (rank < n) {
      std::nth_element(top.begin(), top.begin() + rank, top.end(), std::greater<float>());
      const float bound = top[rank];
      top.clear();
      for (int64_t i = 0; i < m; ++i)
        if (x[i] >= bound && counted(i)) top.push_back(x[i]);
      if (static_cast<int64_t>(top.size()) >= k) {
        const auto kth = top.begin() + (k - 1);
        std::nth_element(top.begin(), kth, top.end(), std::greater<float>());
        const float cut = *kth;
        int64_t above = 0;
        for (const float v : top) above += v > cut;
        return {cut, above};
      }
    }
  }
  return kth_largest_radix(x, skip, m, k, test, hist);
}

// The same by a radix select on the order keys, a histogram of their top 16 bits
// finding the bin of the k-th largest, then one of the low 16 bits of that bin's values. Two branch-light
// passes instead of nth_element's mispredicted compares over the whole row (a 128K-token decode row: ~2 ms
// -> a few 0.1 ms), as fast when many scores are equal.
std::pair<float, int64_t> kth_largest_radix(const float* x, const char* skip, int64_t m, int64_t k,
                                            const ThresholdTest& test, std::vector<int32_t>& hist) {
  uint32_t prefix = 0;
  int64_t above = 0;  // passing values above the bins left
  for (int shift : {16, 0}) {
    hist.assign(int64_t{1} << 16, 0);
    for (int64_t i = 0; i < m; ++i) {
      const uint32_t key = order_key(x[i]);
      if ((shift == 0 ? key >> 16 == prefix >> 16 : true) && !(skip && skip[i]) && test.passes(x[i]))
        ++hist[(key >> shift) & 0xffffu];
    }
    uint32_t bin = (1u << 16) - 1;
    while (above + hist[bin] < k) above += hist[bin--];
    prefix |= bin << shift;
  }
  return {from_order_key(prefix), above};
}

// The selection rule of glmserve/sparse/settings.py for one row; kept positions, ascending. Candidates
// (units not wholly kept anyway) are a contiguous range of units; pinned candidates (`pins`: ascending unit
// indices, -1 = none; glmserve/sparse/pinning.py) are kept and take their share of the budget first.
// The budget's cut is the budget-th largest passing unpinned candidate score (kth_largest): the kept
// candidates are those above it plus, of those equal to it, the earliest ones (ties go to the earlier
// unit); one pass in unit order then writes the positions.
void select_row(const float* scores, int64_t U, int64_t n, int64_t top_k, float threshold, int64_t sink,
                int64_t local, const int64_t* pins, int64_t num_pins, std::vector<int64_t>& out,
                std::vector<int32_t>& hist, std::vector<float>& top, std::vector<char>& pinned) {
  const bool whole = threshold < 0 && (top_k < 0 || n <= top_k);
  if (whole) {
    out.resize(n);
    for (int64_t j = 0; j < n; ++j) out[j] = j;
    return;
  }
  const int64_t local_start = n - local;  // positions >= local_start are the local window
  const int64_t units = (n + U - 1) / U;
  int64_t u_begin = 0, u_end = units;
  while (u_begin < units && std::min((u_begin + 1) * U, n) <= sink) ++u_begin;
  while (u_end > u_begin && (u_end - 1) * U >= local_start) --u_end;
  ThresholdTest test{false, 0.f, 0.f, threshold};
  if (threshold >= 0 && u_end > u_begin) {
    float lo = std::numeric_limits<float>::infinity(), hi = -lo;
    for (int64_t u = u_begin; u < u_end; ++u) lo = std::min(lo, scores[u]), hi = std::max(hi, scores[u]);
    test = {hi - lo > 0, lo, hi - lo, threshold};
  }
  // pinned candidates: marked in `pinned` (indexed from u_begin), null when the row has none
  int64_t num_pinned = 0;
  const char* skip = nullptr;
  for (int64_t i = 0; i < num_pins; ++i) {
    const int64_t u = pins[i];
    if (u < u_begin || u >= u_end) continue;  // -1 padding, or a unit kept anyway / past the context
    if (skip == nullptr) pinned.assign(u_end - u_begin, 0), skip = pinned.data();
    num_pinned += !pinned[u - u_begin];
    pinned[u - u_begin] = 1;
  }
  const auto is_pinned = [&](int64_t u) { return skip != nullptr && skip[u - u_begin] != 0; };
  // the budget left after sinks, local window and pins, in whole units: the best ones
  const int64_t total = top_k < 0 ? -1 : std::max<int64_t>(0, top_k - std::min(n, sink + local)) / U;
  const int64_t budget = total < 0 ? -1 : std::max<int64_t>(0, total - num_pinned);
  bool capped = false;  // more unpinned candidates pass than the budget takes
  float cut = 0.f;
  int64_t ties = 0;  // candidates equal to the cut still to keep
  if (budget >= 0 && u_end - u_begin - num_pinned > budget) {
    int64_t passing = u_end - u_begin - num_pinned;
    if (test.on) {
      passing = 0;
      for (int64_t u = u_begin; u < u_end; ++u) passing += !is_pinned(u) && test.passes(scores[u]);
    }
    capped = passing > budget;
    if (capped && budget > 0) {
      int64_t larger;
      std::tie(cut, larger) = kth_largest(scores + u_begin, skip, u_end - u_begin, budget, test, hist, top);
      ties = budget - larger;
    }
  }
  // room for every kept position
  out.resize(capped ? std::min(n, sink + local + (budget + num_pinned + 2) * U) : n);
  int64_t* o = out.data();
  int64_t count = 0;
  for (int64_t j = 0; j < std::min(n, u_begin * U); ++j) o[count++] = j;
  for (int64_t u = u_begin; u < u_end; ++u) {
    const float x = scores[u];
    bool keep = is_pinned(u);
    if (!keep) {
      keep = test.passes(x);
      if (keep && capped) keep = budget > 0 && (x > cut || (x == cut && ties-- > 0));
    }
    const int64_t start = u * U, end = std::min(start + U, n);
    for (int64_t j = start; j < end; ++j)
      if (keep || j < sink || j >= local_start) o[count++] = j;
  }
  for (int64_t j = u_end * U; j < n; ++j) o[count++] = j;
  out.resize(count);
}

}  // namespace

std::vector<at::Tensor> select_slots(const at::Tensor& scores, int64_t unit_size, const at::Tensor& ctx_lens,
                                     const at::Tensor& top_k, const at::Tensor& threshold, const at::Tensor& sink,
                                     const at::Tensor& local, const at::Tensor& kv_slots, const at::Tensor& pins) {
  TORCH_CHECK(scores.scalar_type() == at::kFloat && scores.is_contiguous() && scores.dim() == 2, "scores: [B, U] f32");
  TORCH_CHECK(kv_slots.scalar_type() == at::kLong && kv_slots.is_contiguous() && kv_slots.dim() == 2, "kv_slots");
  for (const auto* t : {&ctx_lens, &top_k, &sink, &local})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "per-row settings: [B] int64");
  TORCH_CHECK(threshold.scalar_type() == at::kFloat && threshold.is_contiguous(), "threshold: [B] float32");
  TORCH_CHECK(pins.scalar_type() == at::kLong && pins.is_contiguous() && pins.dim() == 2 && pins.size(0) == scores.size(0),
              "pins: [B, P] int64");
  const int64_t B = scores.size(0), NU = scores.size(1), L = kv_slots.size(1);
  const int64_t* n = ctx_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(n[b] <= L && (n[b] + unit_size - 1) / unit_size <= NU, "context");
  const int64_t P = pins.size(1);
  std::vector<std::vector<int64_t>> rows(B);
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> hist;
    std::vector<float> top;
    std::vector<char> pinned;
    for (int64_t b = begin; b < end; ++b)
      select_row(scores.data_ptr<float>() + b * NU, unit_size, n[b], top_k.data_ptr<int64_t>()[b],
                 threshold.data_ptr<float>()[b], sink.data_ptr<int64_t>()[b], local.data_ptr<int64_t>()[b],
                 pins.data_ptr<int64_t>() + b * P, P, rows[b], hist, top, pinned);
  });
  int64_t width = 1;
  for (const auto& r : rows) width = std::max<int64_t>(width, r.size());
  auto slots = at::zeros({B, width}, kv_slots.options());
  auto lengths = at::empty({B}, ctx_lens.options());
  int64_t* out = slots.data_ptr<int64_t>();
  const int64_t* src = kv_slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    lengths.data_ptr<int64_t>()[b] = rows[b].size();
    for (size_t i = 0; i < rows[b].size(); ++i) out[b * width + i] = src[b * L + rows[b][i]];
  }
  return {slots, lengths};
}

void bounds_update(const at::Tensor& slots, const at::Tensor& keys, at::Tensor& bounds, int64_t block_size) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 1, "slots: [T] int64");
  TORCH_CHECK((keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kBFloat16) && keys.dim() == 3 &&
                  keys.stride(2) == 1 && keys.stride(1) == keys.size(2),
              "keys: [T, Hkv, D] f32 or bf16, each token's heads contiguous (any token stride)");
  TORCH_CHECK(bounds.dim() == 4 && bounds.size(1) == 2 && bounds.is_contiguous(), "bounds: [blocks, 2, Hkv, D]");
  const int64_t T = keys.size(0), HD = keys.size(1) * keys.size(2);
  TORCH_CHECK(slots.size(0) == T && bounds.size(2) * bounds.size(3) == HD, "shapes do not match");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, bounds.scalar_type(), "bounds_update", [&] {
    if (keys.scalar_type() == at::kBFloat16) {
      update_kernel(slots.data_ptr<int64_t>(), keys.data_ptr<c10::BFloat16>(), keys.stride(0),
                    bounds.data_ptr<scalar_t>(), T, HD, block_size);
    } else {
      update_kernel(slots.data_ptr<int64_t>(), keys.data_ptr<float>(), keys.stride(0), bounds.data_ptr<scalar_t>(), T,
                    HD, block_size);
    }
  });
}

at::Tensor block_scores(const at::Tensor& q, const at::Tensor& bounds, const at::Tensor& tables,
                        const at::Tensor& num_units, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: contiguous [B, H, D] float32");
  TORCH_CHECK(bounds.dim() == 4 && bounds.size(1) == 2 && bounds.is_contiguous(), "bounds: [blocks, 2, Hkv, D]");
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.is_contiguous() && tables.dim() == 2, "tables: [B, W] int64");
  TORCH_CHECK(num_units.scalar_type() == at::kLong && num_units.is_contiguous(), "num_units: [B] int64");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = bounds.size(2), W = tables.size(1);
  TORCH_CHECK(bounds.size(3) == D && H % Hkv == 0 && tables.size(0) == B, "shapes do not match");
  auto out = at::empty({B, W}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, bounds.scalar_type(), "block_scores", [&] {
    scores_kernel<scalar_t>(q.data_ptr<float>(), bounds.data_ptr<scalar_t>(), tables.data_ptr<int64_t>(),
                            num_units.data_ptr<int64_t>(), out.data_ptr<float>(), B, H, Hkv, D, W,
                            static_cast<float>(scale));
  });
  return out;
}

at::Tensor learned_scores(const at::Tensor& qi, const at::Tensor& w, const at::Tensor& keys, const at::Tensor& tables,
                          int64_t block_size, int64_t length, const at::Tensor& context_lens,
                          const at::Tensor& distance_bias, const at::Tensor& sink_bias) {
  TORCH_CHECK(qi.dim() == 3 && qi.scalar_type() == at::kFloat && qi.is_contiguous(), "qi: contiguous [B, Hi, d] f32");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous(), "w: contiguous [B, Hi] f32");
  TORCH_CHECK(keys.dim() == 2 && keys.is_contiguous(), "keys: contiguous [slots, d]");
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.is_contiguous() && tables.dim() == 2, "tables: [B, W] int64");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.is_contiguous(), "context_lens: [B] int64");
  for (const auto* t : {&distance_bias, &sink_bias})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 1, "biases: [n] float32");
  const int64_t B = qi.size(0), Hi = qi.size(1), d = qi.size(2), W = tables.size(1);
  TORCH_CHECK(w.size(0) == B && w.size(1) == Hi && keys.size(1) == d && tables.size(0) == B &&
                  context_lens.numel() == B && distance_bias.numel() > 0,
              "shapes do not match");
  TORCH_CHECK(block_size > 0 && length >= 0 && length <= W * block_size, "length: at most the block tables' positions");
  const int64_t slots = keys.size(0);
  const int64_t* tab = tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < tables.numel(); ++i)
    TORCH_CHECK(tab[i] >= 0 && (tab[i] + 1) * block_size <= slots, "block table entry outside the key pool");
  auto out = at::empty({B, length}, qi.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, keys.scalar_type(), "learned_scores", [&] {
    auto kernel = d == 32 ? learned_kernel<scalar_t, 32> : learned_kernel<scalar_t, 0>;
    kernel(qi.data_ptr<float>(), w.data_ptr<float>(), keys.data_ptr<scalar_t>(), tab, context_lens.data_ptr<int64_t>(),
           distance_bias.data_ptr<float>(), sink_bias.data_ptr<float>(), out.data_ptr<float>(), B, Hi, d, W, length,
           block_size, distance_bias.numel(), sink_bias.numel());
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bounds_update", &bounds_update, "fold written keys into the per-block key bounds (CPU)");
  m.def("block_scores", &block_scores, "Quest block scores (CPU)");
  m.def("learned_scores", &learned_scores, "learned indexer token scores over index keys read in place (CPU)");
  m.def("select_slots", &select_slots, "each decode row's attended slots by the sparse selection rule (CPU)");
}
