// Decode attention straight from the paged KV pool, on CPU.
//
// One query token per sequence. For each (sequence, kv head) the kernel reads that head's keys
// and values once, by slot, without gathering them into a temporary: scores for the g query
// heads that share the kv head, a softmax, then the weighted sum of values. Work is split over
// (sequence, kv head) pairs with at::parallel_for, in runs of equal keys per thread; a pair of more than 1,024 keys
// runs as parts of 1,024 merged by their log-sum-exps (kPartKeys). Layouts follow glmserve/layers/attention.py:
// q [B, H, D] float32, cache k/v [Hkv, slots, W], slots [B, L] int64, context lengths [B] int64,
// out [B, H, D] float32; `paged_decode_lse` also returns each head's log-sum-exp of scores [B, H]
// (float32), to merge with attention over keys elsewhere (KV offload).
// Cache rows (glmserve/kv/kv_format.py): float32 / bfloat16 / float16 values (W = D), or quantized
// rows of D 8-bit codes then a float16 scale (W = D + 2): int8 codes (cache dtype int8) or float8
// E4M3 codes (cache dtype uint8, the codes' bits). Quantized rows are dequantized in the kernel: a
// key's dot product is taken over its codes and scaled once, a value's weight is its probability
// times its scale.
// The split into a score pass and a value pass follows the textbook softmax(QK^T)V; see also
// vLLM's csrc/cpu/attention.cpp for the paged layout idea (read, not copied).
// SIMD path (AVX-512: 16 lanes, AVX2 + FMA: 8 lanes; D a multiple of the lane count with D / lanes in 2, 3, 4, 6, 8,
// 16, 32; rows of float32, bfloat16 (widened by a 16-bit shift; in the value pass on AVX-512, 32 at a time from one
// load: Simd::load_pairs), int8, and float16 / fp8 where the build has the conversions): the query heads of a group are
// taken in tiles whose q chunks (score pass) and output accumulators (value pass) stay in registers, so each key and
// value chunk is loaded and widened once per tile (once for the whole group when it fits: SmolLM2's 3 heads of D 64 on
// AVX-512); tiles hold exactly their heads (no padding head is computed); a key's dot products are accumulated lane-
// wise, and the lane sums of N keys are taken together by a transposing reduction tree (one vector of N scores, instead
// of one horizontal sum per key and head), whose first level runs every 4 keys so that few partial sums stay live; the
// softmax's exp is a vector polynomial (exp_ps) and its normalization is applied once to the outputs; key and value
// rows are prefetched by slot into L2, the keys two chunks ahead and, in a task's value pass, the next task's
// keys (on Zen 4, 1.8-1.9x at 160-1,024 bf16 keys of batch 32 from DRAM over an L1 prefetch of the next chunk). The
// scalar loop below is the path of the scalar build and of other shapes.
// `store_kv` is the float32 / bfloat16 pools' KV write (a cast and both sides' copies in one pass).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/extension.h>

#include "vec_math.h"  // abs_max (kv_int8.h)
#include "kv_int8.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kScaleBytes = 2;  // one float16 scale after a quantized row's codes

// Float rows: the values themselves, no scale.
template <typename T>
struct FloatRows {
  using storage = T;
  static constexpr int64_t extra = 0;
  static float value(T x) { return static_cast<float>(x); }
  static float scale(const T*, int64_t) { return 1.f; }
};

inline float half_at(const void* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}
// Quantized rows: D codes, then the row's float16 scale.
struct Int8Rows {
  using storage = int8_t;
  static constexpr int64_t extra = kScaleBytes;
  static float value(int8_t c) { return static_cast<float>(c); }
  static float scale(const int8_t* row, int64_t D) { return half_at(row + D); }
};

const std::array<float, 256> kFp8Values = [] {  // every E4M3 code's value
  std::array<float, 256> table{};
  for (int c = 0; c < 256; ++c)
    table[c] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(c), c10::Float8_e4m3fn::from_bits()));
  return table;
}();

struct Fp8Rows {
  using storage = uint8_t;
  static constexpr int64_t extra = kScaleBytes;
  static float value(uint8_t c) { return kFp8Values[c]; }
  static float scale(const uint8_t* row, int64_t D) { return half_at(row + D); }
};


// ---------------------------------------------------------------------------------------------- SIMD path
// exp(x) for x <= 0 (scores minus their max): x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to
// r^7 (truncation below 1e-8 relative), times 2^n put into the exponent bits; below -87 the result is 0.
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693145751953125f, kLn2Lo = 1.42860682030941723e-6f;
constexpr float kExpMin = -87.0f;

#if defined(__AVX512F__) && defined(__AVX512BW__)
struct Simd {
  using V = __m512;
  static constexpr int N = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static float reduce_add(V v) { return _mm512_reduce_add_ps(v); }
  static float reduce_max(V v) { return _mm512_reduce_max_ps(v); }
  static V exp(V x) {
    const __mmask16 live = _mm512_cmp_ps_mask(x, set1(kExpMin), _CMP_GE_OQ);
    x = _mm512_max_ps(x, set1(kExpMin));
    const V n = _mm512_roundscale_ps(_mm512_mul_ps(x, set1(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const V r = _mm512_fnmadd_ps(n, set1(kLn2Lo), _mm512_fnmadd_ps(n, set1(kLn2Hi), x));
    V p = set1(1.f / 5040);
    for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = fma(p, r, set1(c));
    return _mm512_maskz_scalef_ps(live, p, n);
  }
  // The lane sums of N vectors as one vector (r[j] = sum of the lanes of v[j], j < 16) by a transposing reduction
  // tree, in two steps so that a caller keeps one vector per 4 inputs live instead of 16: `quad_sums` of 4 vectors
  // (pairs interleaved and added, within 128-bit lanes by unpack: in 128-bit lane k, the sums over lane k of
  // w0..w3), then `merge_quads` of the 4 quads (across 128-bit lanes by shuffles), each level halving the vectors.
  static V quad_sums(const V* w) {
    const V a = add(_mm512_unpacklo_ps(w[0], w[1]), _mm512_unpackhi_ps(w[0], w[1]));  // [w0 w1 w0 w1] per lane
    const V b = add(_mm512_unpacklo_ps(w[2], w[3]), _mm512_unpackhi_ps(w[2], w[3]));
    const __m512d ad = _mm512_castps_pd(a), bd = _mm512_castps_pd(b);
    return add(_mm512_castpd_ps(_mm512_unpacklo_pd(ad, bd)), _mm512_castpd_ps(_mm512_unpackhi_pd(ad, bd)));
  }
  static V merge_quads(const V* t) {
    const V x0 = add(_mm512_shuffle_f32x4(t[0], t[1], 0x88), _mm512_shuffle_f32x4(t[0], t[1], 0xDD));
    const V x1 = add(_mm512_shuffle_f32x4(t[2], t[3], 0x88), _mm512_shuffle_f32x4(t[2], t[3], 0xDD));
    return add(_mm512_shuffle_f32x4(x0, x1, 0x88), _mm512_shuffle_f32x4(x0, x1, 0xDD));
  }
  static V load_row(const float* p) { return load(p); }
  static V load_row(const c10::BFloat16* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static V load_row(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static V load_row(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static V load_row(const uint8_t* p) {  // E4M3 codes: each one's value from the table
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_i32gather_ps(idx, kFp8Values.data(), 4);
  }
  // 32 bf16 values from one 64-byte load, widened in place: the even-indexed ones (each 32-bit lane shifted up 16
  // bits) and the odd-indexed ones (each lane's high half, masked): 3 instructions where two load_row take 6
  static void load_pairs(const c10::BFloat16* p, V& even, V& odd) {
    const __m512i x = _mm512_loadu_si512(p);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  // back in order: the values 0..15 and 16..31 of 32 whose even and odd ones are `even`, `odd` (lanes moved only)
  static void interleave(V even, V odd, V& lo, V& hi) {
    const __m512i ilo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i ihi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    lo = _mm512_permutex2var_ps(even, ilo, odd);
    hi = _mm512_permutex2var_ps(even, ihi, odd);
  }
};
#define GLMSERVE_PAGED_SIMD 1
#define GLMSERVE_PAGED_BF16_PAIRS 1
#elif defined(__AVX2__) && defined(__FMA__)
struct Simd {
  using V = __m256;
  static constexpr int N = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static float reduce_add(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static float reduce_max(V v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
  }
  static V exp(V x) {
    const V live = _mm256_cmp_ps(x, set1(kExpMin), _CMP_GE_OQ);
    x = _mm256_max_ps(x, set1(kExpMin));
    const V n = _mm256_round_ps(_mm256_mul_ps(x, set1(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const V r = _mm256_fnmadd_ps(n, set1(kLn2Lo), _mm256_fnmadd_ps(n, set1(kLn2Hi), x));
    V p = set1(1.f / 5040);
    for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = fma(p, r, set1(c));
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(two_n)), live);
  }
  // r[j] = sum of the lanes of v[j], j < 8, in two steps as above: `quad_sums` hadds pairs of 4 vectors twice
  // (sums within 128-bit lanes), `merge_quads` adds the two quads' halves
  static V quad_sums(const V* w) { return _mm256_hadd_ps(_mm256_hadd_ps(w[0], w[1]), _mm256_hadd_ps(w[2], w[3])); }
  static V merge_quads(const V* t) {
    return add(_mm256_permute2f128_ps(t[0], t[1], 0x20), _mm256_permute2f128_ps(t[0], t[1], 0x31));
  }
  static V load_row(const float* p) { return load(p); }
  static V load_row(const c10::BFloat16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static V load_row(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static V load_row(const uint8_t* p) {
    const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_i32gather_ps(kFp8Values.data(), idx, 4);
  }
  static V load_row(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
};
#define GLMSERVE_PAGED_SIMD 1
#endif

#ifdef GLMSERVE_PAGED_SIMD
template <typename T, typename = void>
struct HasSimdRows : std::false_type {};
template <typename T>
struct HasSimdRows<T, std::void_t<decltype(Simd::load_row(std::declval<const T*>()))>> : std::true_type {};

// Into L2 (T1), not L1 (T0): on Zen 4 (EPYC, 1 thread, batch 32 of SmolLM2's shape, bf16 pools in DRAM) the kernel
// ran 1.55-1.6x faster with T1 than with T0 at 160-1,024 keys (bench/paged_decode_ab.py): the L1's few miss
// buffers held the rows in flight back.
template <typename T>
inline void prefetch_row(const T* row, int64_t width) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t at = 0; at < width * static_cast<int64_t>(sizeof(T)); at += 64) _mm_prefetch(p + at, _MM_HINT_T1);
}

// How far ahead of the score pass its keys are fetched: 2 chunks of keys (on Zen 4 as above, 1.08x over 1 chunk
// at 160 keys, 4 chunks no better).
constexpr int64_t kAheadKeys = 2 * Simd::N;
// How many of the next task's keys a task's value pass fetches: up to 256 KB of rows (all of them at 2,048 bf16 keys
// of D 64), so that they stay in L2 with the values being read; on Zen 4 as above, 1.10-1.13x at 160-1,024 keys over
// fetching its first kAheadKeys only.
template <typename T>
constexpr int64_t next_key_rows(int64_t width) {
  return std::max<int64_t>(kAheadKeys, (int64_t{256} << 10) / (width * static_cast<int64_t>(sizeof(T))));
}

// The keys of the task after this one whose rows the value pass fetches (none: n = 0).
template <typename Rows>
struct NextKeys {
  const typename Rows::storage* kh = nullptr;
  const int64_t* slots = nullptr;
  int64_t n = 0;
};

// Query heads per tile: a tile's q chunks (score pass) or output accumulators (value pass) stay in registers, at
// most 16 vectors on AVX-512 (8 on AVX2) and 4 heads (the score pass also keeps 4 keys' products and one partial
// sum per 4 keys for each head). A group splits into tiles of kTileHeads heads and one exact tile of the rest: no
// padding head is computed (SmolLM2's 3 heads of D 64 on AVX-512 are one tile of 3).
template <int CH>
constexpr int kTileHeads = std::max(1, std::min(4, (Simd::N == 16 ? 16 : 8) / CH));

// Scores of one tile of GT query heads q [GT, D] (D = CH lanes' chunks) over the n keys at `seq_slots`:
// scores[t * stride + j] = scale x (head t . key j). Each key chunk is loaded and widened to float32 once for the
// tile's heads; a key's products are accumulated lane-wise, and every 4 keys' lane-wise sums are folded per head
// into one vector (Simd::quad_sums), the chunk's N scores then taken together (Simd::merge_quads).
template <typename Rows, int CH, int GT>
void score_tile(const float* q, const typename Rows::storage* kh, const typename Rows::storage* vh,
                const int64_t* seq_slots, int64_t n, float scale, float* scores, int64_t stride, bool prefetch,
                int64_t fetched) {
  using S = Simd;
  using V = S::V;
  constexpr int N = S::N;
  constexpr int64_t D = CH * N;
  const int64_t W = D + Rows::extra;
  V qv[GT][CH];
  for (int t = 0; t < GT; ++t)
    for (int c = 0; c < CH; ++c) qv[t][c] = S::load(q + t * D + c * N);
  for (int64_t j0 = 0; j0 < n; j0 += N) {
    const int jn = static_cast<int>(std::min<int64_t>(N, n - j0));
    if (prefetch) {
      // the pool's blocks are a page or less apart, where the hardware prefetcher stops: fetch the keys
      // kAheadKeys on and this chunk's values (read after the softmax) while this chunk's scores are computed;
      // the first `fetched` keys came with the previous task's value pass
      const int64_t from = j0 == 0 ? fetched : std::max(fetched, j0 + kAheadKeys);
      for (int64_t j = from; j < std::min<int64_t>(n, j0 + kAheadKeys + N); ++j) prefetch_row(kh + seq_slots[j] * W, W);
      for (int64_t j = j0; j < j0 + jn; ++j) prefetch_row(vh + seq_slots[j] * W, W);
    }
    V row_scale = S::set1(scale);
    if (Rows::extra) {
      alignas(64) float rs[N];
      for (int j = 0; j < N; ++j) rs[j] = j < jn ? scale * Rows::scale(kh + seq_slots[j0 + j] * W, D) : 0.f;
      row_scale = S::load(rs);
    }
    V quads[GT][N / 4];
    for (int j4 = 0; j4 < N / 4; ++j4) {
      V acc[GT][4];
      for (int w = 0; w < 4; ++w) {
        const int j = 4 * j4 + w;
        for (int t = 0; t < GT; ++t) acc[t][w] = S::zero();
        if (j < jn) {
          const auto* krow = kh + seq_slots[j0 + j] * W;
          for (int c = 0; c < CH; ++c) {
            const V k = S::load_row(krow + c * N);
            for (int t = 0; t < GT; ++t) acc[t][w] = S::fma(qv[t][c], k, acc[t][w]);
          }
        }
      }
      for (int t = 0; t < GT; ++t) quads[t][j4] = S::quad_sums(acc[t]);
    }
    for (int t = 0; t < GT; ++t) S::store(scores + t * stride + j0, S::mul(S::merge_quads(quads[t]), row_scale));
  }
}

// out[t] = inv[t] x sum over the n keys of p[t, j] v[j] for one tile of GT heads (p: the softmax numerators,
// scores[t * stride + j]): each value chunk is loaded and widened once for the tile's heads.
template <typename Rows, int CH, int GT>
void value_tile(const float* scores, int64_t stride, const float* inv, const typename Rows::storage* vh,
                const int64_t* seq_slots, int64_t n, float* out, const NextKeys<Rows>& next) {
  using S = Simd;
  using V = S::V;
  constexpr int N = S::N;
  constexpr int64_t D = CH * N;
  const int64_t W = D + Rows::extra;
  V acc[GT][CH];
  for (int t = 0; t < GT; ++t)
    for (int c = 0; c < CH; ++c) acc[t][c] = S::zero();
#ifdef GLMSERVE_PAGED_BF16_PAIRS
  // bf16 rows: chunks 2s and 2s + 1 are loaded as one pair (Simd::load_pairs), acc[t][2s] then holds the even
  // values of those 32 and acc[t][2s + 1] the odd ones; each output value's products and sum are the same, only
  // the lanes differ, and Simd::interleave puts them back in order
  constexpr bool pairs = std::is_same_v<typename Rows::storage, c10::BFloat16> && CH % 2 == 0;
#else
  constexpr bool pairs = false;
#endif
  for (int64_t j = 0; j < n; ++j) {
    // the next task's keys, one row per value row here (the rest after the loop)
    if (j < next.n) prefetch_row(next.kh + next.slots[j] * W, W);
    const auto* vrow = vh + seq_slots[j] * W;
    const float vs = Rows::extra ? Rows::scale(vrow, D) : 1.f;
    V p[GT];
    for (int t = 0; t < GT; ++t) p[t] = S::set1(scores[t * stride + j] * vs);
    for (int c = 0; c < CH; c += pairs ? 2 : 1) {
      V v[2];
#ifdef GLMSERVE_PAGED_BF16_PAIRS
      if constexpr (pairs) S::load_pairs(vrow + c * N, v[0], v[1]);
      else v[0] = S::load_row(vrow + c * N);
#else
      v[0] = S::load_row(vrow + c * N);
#endif
      for (int h = 0; h < (pairs ? 2 : 1); ++h)
        for (int t = 0; t < GT; ++t) acc[t][c + h] = S::fma(p[t], v[h], acc[t][c + h]);
    }
  }
  for (int64_t j = n; j < next.n; ++j) prefetch_row(next.kh + next.slots[j] * W, W);
  for (int t = 0; t < GT; ++t) {
    const V norm = S::set1(inv[t]);
    for (int c = 0; c < CH; c += pairs ? 2 : 1) {
      V r[2] = {S::mul(acc[t][c], norm), pairs ? S::mul(acc[t][c + pairs], norm) : S::zero()};
#ifdef GLMSERVE_PAGED_BF16_PAIRS
      if constexpr (pairs) S::interleave(r[0], r[1], r[0], r[1]);
#endif
      for (int h = 0; h < (pairs ? 2 : 1); ++h) S::store(out + t * D + (c + h) * N, r[h]);
    }
  }
}

// Calls f(std::integral_constant<int, heads>{}) for a tile of 1 <= heads <= kTileHeads<CH> heads.
template <int CH, typename F>
void with_tile(int heads, F&& f) {
  static_assert(kTileHeads<CH> <= 4);
  switch (heads) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: if constexpr (kTileHeads<CH> >= 2) f(std::integral_constant<int, 2>{}); break;
    case 3: if constexpr (kTileHeads<CH> >= 3) f(std::integral_constant<int, 3>{}); break;
    default: if constexpr (kTileHeads<CH> >= 4) f(std::integral_constant<int, 4>{}); break;
  }
}

// One (sequence, kv head) task: the group's g query heads q [g, D] over the n keys at `seq_slots`, in tiles of
// heads (kTileHeads); the first tile prefetches (its score pass this task's keys and values, its value pass the keys
// of `next`; `fetched`: how many of this task's first keys were fetched so). scores: scratch of g * (n rounded up to
// N) + g floats.
template <typename Rows, int CH>
void decode_task_simd(const float* q, const typename Rows::storage* kh, const typename Rows::storage* vh,
                      const int64_t* seq_slots, int64_t n, int64_t group, float scale, float* scores, float* out,
                      float* lse, const NextKeys<Rows>& next, int64_t fetched) {
  using S = Simd;
  using V = S::V;
  constexpr int N = S::N;
  constexpr int64_t D = CH * N;
  const int64_t stride = (n + N - 1) / N * N;
  float* inv = scores + group * stride;  // each head's 1 / softmax sum
  for (int64_t g0 = 0; g0 < group; g0 += kTileHeads<CH>) {
    with_tile<CH>(static_cast<int>(std::min<int64_t>(kTileHeads<CH>, group - g0)), [&](auto tile) {
      score_tile<Rows, CH, decltype(tile)::value>(q + g0 * D, kh, vh, seq_slots, n, scale, scores + g0 * stride,
                                                  stride, g0 == 0, fetched);
    });
  }
  // softmax numerators in place; the normalization is applied to the outputs
  const int64_t full = n / N * N;
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * stride;
    float mx = -std::numeric_limits<float>::infinity();
    if (full) {
      V m = S::load(s);
      for (int64_t j = N; j < full; j += N) m = S::max(m, S::load(s + j));
      mx = S::reduce_max(m);
    }
    for (int64_t j = full; j < n; ++j) mx = std::max(mx, s[j]);
    V vsum = S::zero();
    const V vneg = S::set1(-mx);
    for (int64_t j = 0; j < full; j += N) {
      const V e = S::exp(S::add(S::load(s + j), vneg));
      S::store(s + j, e);
      vsum = S::add(vsum, e);
    }
    float sum = S::reduce_add(vsum);
    for (int64_t j = full; j < n; ++j) {
      s[j] = std::exp(s[j] - mx);
      sum += s[j];
    }
    inv[g] = 1.f / sum;
    if (lse != nullptr) lse[g] = mx + std::log(sum);
  }
  // out[g] = sum over keys of p[g, j] v[j] / sum[g], tile by tile
  for (int64_t g0 = 0; g0 < group; g0 += kTileHeads<CH>) {
    with_tile<CH>(static_cast<int>(std::min<int64_t>(kTileHeads<CH>, group - g0)), [&](auto tile) {
      value_tile<Rows, CH, decltype(tile)::value>(scores + g0 * stride, stride, inv + g0, vh, seq_slots, n,
                                                  out + g0 * D, g0 == 0 ? next : NextKeys<Rows>{});
    });
  }
}

// Runs the task with D / N chunks as a template argument; false for chunk counts without an instantiation
// (those heads take the scalar loop).
template <typename Rows>
bool decode_task_simd_any(int64_t chunks, const float* q, const typename Rows::storage* kh,
                          const typename Rows::storage* vh, const int64_t* seq_slots, int64_t n, int64_t group,
                          float scale, float* scores, float* out, float* lse, const NextKeys<Rows>& next,
                          int64_t fetched) {
  switch (chunks) {
#define GLMSERVE_CHUNKS(CH)                                                                             \
  case CH:                                                                                              \
    decode_task_simd<Rows, CH>(q, kh, vh, seq_slots, n, group, scale, scores, out, lse, next, fetched); \
    return true;
    GLMSERVE_CHUNKS(2) GLMSERVE_CHUNKS(3) GLMSERVE_CHUNKS(4) GLMSERVE_CHUNKS(6) GLMSERVE_CHUNKS(8)
    GLMSERVE_CHUNKS(16) GLMSERVE_CHUNKS(32)
#undef GLMSERVE_CHUNKS
    default: return false;
  }
}
#endif

// A work item's fixed work (its scratch, the softmax pass, the output rows) counted as this many keys, for the split below
constexpr int64_t kTaskKeys = 32;
// A task of more keys than this runs as parts of kPartKeys keys, each a work item of its own whose normalized output and
// log-sum-exp are merged after (the split over keys of FlashDecoding, Dao et al. 2023; vLLM's paged attention v2 uses
// partitions of 512): batch 1 at long context has only Hkv tasks (3 for SmolLM2) for all the threads. Fixed, not
// derived from the thread count, so that the floats do not depend on how many threads run.
constexpr int64_t kPartKeys = 1024;

// One work item: keys [k0, k0 + n) of task (b, h), its output rows and log-sum-exps (null: none wanted) at out / lse.
struct WorkItem {
  int64_t b, h, k0, n;
  float* out;
  float* lse;
};

// The threads' shares of the items: share s is items [cuts[s], cuts[s + 1]), contiguous runs of about equal cost (keys
// read + kTaskKeys each), not of equal count: an equal count of sequences of mixed lengths (a server's batch; the
// bench's 64 requests of 100..1,000 tokens) left one of two threads waiting for the other's longer half. An item goes
// to the share its middle falls in.
std::vector<int64_t> balanced_shares(const std::vector<WorkItem>& items, int64_t shares) {
  const int64_t count = static_cast<int64_t>(items.size());
  int64_t total = 0;
  for (const WorkItem& item : items) total += item.n + kTaskKeys;
  std::vector<int64_t> cuts(shares + 1, count);
  cuts[0] = 0;
  int64_t i = 0, done = 0;  // done: the cost of items [0, i)
  for (int64_t s = 1; s < shares; ++s) {
    const double target = static_cast<double>(total) * s / shares;
    for (; i < count && done + 0.5 * (items[i].n + kTaskKeys) <= target; ++i) done += items[i].n + kTaskKeys;
    cuts[s] = i;
  }
  return cuts;
}

// out / lse of a task run in `parts` parts: each part's normalized rows out_p [group, D] and log-sum-exps lse_p [group]
// (part p at part_out + p * group * D, part_lse + p * group) weighted by exp(lse_p - lse) with lse = log sum_p exp(lse_p)
void merge_parts(const float* part_out, const float* part_lse, int64_t parts, int64_t group, int64_t D, float* out,
                 float* lse) {
  for (int64_t g = 0; g < group; ++g) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < parts; ++p) mx = std::max(mx, part_lse[p * group + g]);
    float sum = 0.f;
    for (int64_t p = 0; p < parts; ++p) sum += std::exp(part_lse[p * group + g] - mx);
    float* o = out + g * D;
    std::fill(o, o + D, 0.f);
    for (int64_t p = 0; p < parts; ++p) {
      const float w = std::exp(part_lse[p * group + g] - mx) / sum;
      const float* x = part_out + (p * group + g) * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] += w * x[d];
    }
    if (lse != nullptr) lse[g] = mx + std::log(sum);
  }
}

template <typename Rows>
void decode_kernel(const float* q, const typename Rows::storage* k_cache, const typename Rows::storage* v_cache,
                   const int64_t* slots, const int64_t* ctx_lens, float* out, float* lse, int64_t B, int64_t H,
                   int64_t Hkv, int64_t D, int64_t num_slots, int64_t L, float scale) {
  using cache_t = typename Rows::storage;
  const int64_t group = H / Hkv;
  const int64_t W = D + Rows::extra;
  // the work items in task order; a split task's parts write into `partial` (rows, then log-sum-exps)
  std::vector<WorkItem> items;
  std::vector<std::pair<int64_t, int64_t>> split_tasks;  // (task in parts, its first part's index in partial)
  int64_t part_rows = 0;
  for (int64_t task = 0; task < B * Hkv; ++task) {
    const int64_t n = ctx_lens[task / Hkv];
    if (n > kPartKeys) {
      split_tasks.emplace_back(task, part_rows);
      part_rows += (n + kPartKeys - 1) / kPartKeys;
    }
  }
  std::vector<float> partial(part_rows * group * (D + 1));
  float* part_out = partial.data();
  float* part_lse = part_out + part_rows * group * D;
  for (int64_t task = 0, part = 0; task < B * Hkv; ++task) {
    const int64_t b = task / Hkv, h = task % Hkv, n = ctx_lens[b], first = (b * H + h * group);
    if (n <= kPartKeys) {
      items.push_back({b, h, 0, n, out + first * D, lse != nullptr ? lse + first : nullptr});
      continue;
    }
    for (int64_t k0 = 0; k0 < n; k0 += kPartKeys, ++part)
      items.push_back({b, h, k0, std::min(kPartKeys, n - k0), part_out + part * group * D, part_lse + part * group});
  }
  auto run_items = [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(group * D);
#ifdef GLMSERVE_PAGED_SIMD
    int64_t fetched = 0;  // how many of this item's first keys the previous one fetched
#endif
    for (int64_t i = begin; i < end; ++i) {
      const WorkItem& item = items[i];
      const int64_t b = item.b, h = item.h, n = item.n;
      const int64_t* seq_slots = slots + b * L + item.k0;
      const cache_t* kh = k_cache + h * num_slots * W;
      const cache_t* vh = v_cache + h * num_slots * W;
      const float* qh = q + (b * H + h * group) * D;
#ifdef GLMSERVE_PAGED_SIMD
      if constexpr (HasSimdRows<cache_t>::value) {
        if (D % Simd::N == 0 && n > 0) {
          // the scores [group, n rounded up to N], then each head's normalizer; aligned for vectors
          const int64_t floats = group * ((n + Simd::N - 1) / Simd::N * Simd::N) + group + Simd::N;
          scores.resize(floats);
          float* scratch = scores.data();
          scratch += (Simd::N - reinterpret_cast<uintptr_t>(scratch) / sizeof(float) % Simd::N) % Simd::N;
          NextKeys<Rows> next;
          if (i + 1 < end) {
            const WorkItem& after = items[i + 1];
            next = {k_cache + after.h * num_slots * W, slots + after.b * L + after.k0,
                    std::min(after.n, next_key_rows<cache_t>(W))};
          }
          const int64_t this_fetched = std::exchange(fetched, next.n);
          if (decode_task_simd_any<Rows>(D / Simd::N, qh, kh, vh, seq_slots, n, group, scale, scratch, item.out,
                                         item.lse, next, this_fetched))
            continue;
          fetched = 0;
        }
      }
#endif
      scores.assign(group * n, 0.f);
      for (int64_t j = 0; j < n; ++j) {
        const cache_t* krow = kh + seq_slots[j] * W;
        const float row_scale = scale * Rows::scale(krow, D);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qh + g * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * Rows::value(krow[d]);
          scores[g * n + j] = dot * row_scale;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * n;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
        float sum = 0.f;
        for (int64_t j = 0; j < n; ++j) {
          s[j] = std::exp(s[j] - mx);
          sum += s[j];
        }
        const float inv = 1.f / sum;
        for (int64_t j = 0; j < n; ++j) s[j] *= inv;
        if (item.lse != nullptr) item.lse[g] = mx + std::log(sum);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < n; ++j) {
        const cache_t* vrow = vh + seq_slots[j] * W;
        const float row_scale = Rows::scale(vrow, D);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * n + j] * row_scale;
          float* a = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += p * Rows::value(vrow[d]);
        }
      }
      std::copy(acc.begin(), acc.end(), item.out);
    }
  };
  const int64_t count = static_cast<int64_t>(items.size());
  const int64_t shares = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), count));
  const std::vector<int64_t> cuts = balanced_shares(items, shares);
  at::parallel_for(0, shares, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) run_items(cuts[s], cuts[s + 1]);
  });
  at::parallel_for(0, static_cast<int64_t>(split_tasks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto [task, part] = split_tasks[i];
      const int64_t b = task / Hkv, h = task % Hkv;
      const int64_t first = b * H + h * group, parts = (ctx_lens[b] + kPartKeys - 1) / kPartKeys;
      merge_parts(part_out + part * group * D, part_lse + part * group, parts, group, D, out + first * D,
                  lse != nullptr ? lse + first : nullptr);
    }
  });
}

}  // namespace

std::vector<at::Tensor> run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& slots, const at::Tensor& ctx_lens, double scale, bool with_lse) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: contiguous [B, H, D] float32");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous(), "cache: [Hkv, slots, D]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 2, "slots: [B, L] int64");
  TORCH_CHECK(ctx_lens.scalar_type() == at::kLong && ctx_lens.is_contiguous(), "ctx_lens: [B] int64");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(0), num_slots = k_cache.size(1), L = slots.size(1);
  const auto dtype = k_cache.scalar_type();
  const bool quantized = dtype == at::kChar || dtype == at::kByte;
  TORCH_CHECK(v_cache.scalar_type() == dtype && v_cache.sizes() == k_cache.sizes(), "k/v caches differ");
  TORCH_CHECK(k_cache.size(2) == D + (quantized ? kScaleBytes : 0) && H % Hkv == 0, "head sizes do not match");
  auto out = at::empty_like(q);
  auto lse = with_lse ? at::empty({B, H}, q.options()) : at::Tensor();
  float* lse_ptr = with_lse ? lse.data_ptr<float>() : nullptr;
  auto launch = [&](auto rows) {
    using Rows = decltype(rows);
    using cache_t = typename Rows::storage;
    decode_kernel<Rows>(q.data_ptr<float>(), static_cast<const cache_t*>(k_cache.data_ptr()),
                        static_cast<const cache_t*>(v_cache.data_ptr()), slots.data_ptr<int64_t>(),
                        ctx_lens.data_ptr<int64_t>(), out.data_ptr<float>(), lse_ptr, B, H, Hkv, D, num_slots, L,
                        static_cast<float>(scale));
  };
  if (dtype == at::kChar) {
    launch(Int8Rows{});
  } else if (dtype == at::kByte) {
    launch(Fp8Rows{});
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "paged_decode", [&] {
      launch(FloatRows<scalar_t>{});
    });
  }
  return with_lse ? std::vector<at::Tensor>{out, lse} : std::vector<at::Tensor>{out};
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& slots, const at::Tensor& ctx_lens, double scale) {
  return run(q, k_cache, v_cache, slots, ctx_lens, scale, false)[0];
}

std::vector<at::Tensor> paged_decode_lse(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                         const at::Tensor& slots, const at::Tensor& ctx_lens, double scale) {
  return run(q, k_cache, v_cache, slots, ctx_lens, scale, true);
}

// bf16 rows widened to float32 and float32 rows rounded to bf16 as torch's cast (vec_math.h)
inline void widen_bf16(const c10::BFloat16* x, float* out, int64_t n) {
  glmserve::bf16_to_f32_n(reinterpret_cast<const uint16_t*>(x), out, n);
}

inline void narrow_to_bf16(const float* x, c10::BFloat16* out, int64_t n) {
  glmserve::f32_to_bf16_n(x, reinterpret_cast<uint16_t*>(out), n);
}

// Rows x [T, Hkv, D] (float32 or bf16, contiguous rows) into cache [Hkv, num_slots, W] at slot[t], cast to T_out
// (bf16 into bf16: copied), or quantized into int8 rows (T_out int8_t: W = D + 2, kv_int8.h), then (`seen`, int8 rows
// only, else null: [T, Hkv, D] contiguous, x's dtype) the values as a reader dequantizes them (int8_roundtrip's).
// Tokens are split over torch's intra-op threads (slots are distinct).
template <typename T_in, typename T_out>
void store_rows(const at::Tensor& x, T_out* cache, const int64_t* slot, int64_t num_slots, T_in* seen) {
  const T_in* data = x.data_ptr<T_in>();
  const int64_t T = x.size(0), Hkv = x.size(1), D = x.size(2), st = x.stride(0), sh = x.stride(1);
  constexpr bool int8_rows = std::is_same_v<T_out, int8_t>;
  constexpr bool f32_in = std::is_same_v<T_in, float>;
  const int64_t W = int8_rows ? D + glmserve::kInt8ScaleBytes : D;
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> widened(int8_rows && !f32_in ? D : 0), back(int8_rows && !f32_in && seen ? D : 0);
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < Hkv; ++h) {
        const T_in* row = data + t * st + h * sh;
        T_out* out = cache + (h * num_slots + slot[t]) * W;
        T_in* seen_row = seen ? seen + (t * Hkv + h) * D : nullptr;
        if constexpr (int8_rows && f32_in) {
          glmserve::quantize_int8_row(row, out, seen_row, D);
        } else if constexpr (int8_rows) {
          widen_bf16(row, widened.data(), D);
          glmserve::quantize_int8_row(widened.data(), out, seen ? back.data() : nullptr, D);
          if (seen) narrow_to_bf16(back.data(), seen_row, D);
        } else if constexpr (std::is_same_v<T_in, T_out>) {
          std::memcpy(out, row, D * sizeof(T_out));
        } else {
          for (int64_t d = 0; d < D; ++d) out[d] = static_cast<T_out>(static_cast<float>(row[d]));
        }
      }
  });
}

// The KV write of one layer for float32 / bfloat16 / int8 pools: k, v [T, Hkv, D] float32 or bf16 (rows of D
// contiguous values, any row and head strides: views of the fused qkv output) into caches [Hkv, slots, W] at slots [T]
// int64, each value rounded as torch's cast rounds it (bf16: to nearest, ties to even, in integer arithmetic) or each
// row quantized as kv_format.py's KVFormat.quantize (int8: W = D + 2, kv_int8.h). One pass instead of a cast (or a
// quantize's several ops) and an index_copy_ per side. Not float16: c10::Half's float conversion relies on float
// overflow to reach inf, which this build's -ffast-math folds away (NaN bits came out of 131008.f).
// `roundtrip` (int8 caches): also returns k and v [T, Hkv, D] contiguous as their readers see them (int8_roundtrip's
// floats: a prefill attends to its own keys as stored) from the same pass; else nothing.
std::vector<at::Tensor> store_kv(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
                                 const at::Tensor& k, const at::Tensor& v, bool roundtrip) {
  TORCH_CHECK(k.dim() == 3 && (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16) &&
                  k.stride(2) == 1 && v.sizes() == k.sizes() && v.scalar_type() == k.scalar_type() && v.stride(2) == 1,
              "k, v: [T, Hkv, D] float32 or bf16 (one dtype) with contiguous rows");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "caches: contiguous [Hkv, slots, W] of one dtype");
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16 ||
                  k_cache.scalar_type() == at::kChar,
              "store_kv: float32, bfloat16 or int8 caches, got ", k_cache.scalar_type());
  TORCH_CHECK(!roundtrip || k_cache.scalar_type() == at::kChar, "store_kv: roundtrip is for int8 caches");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 1, "slots: [T] int64");
  const int64_t T = k.size(0), Hkv = k.size(1), D = k.size(2), num_slots = k_cache.size(1);
  const int64_t W = k_cache.scalar_type() == at::kChar ? D + glmserve::kInt8ScaleBytes : D;
  TORCH_CHECK(slots.size(0) == T && k_cache.size(0) == Hkv && k_cache.size(2) == W, "shapes do not match");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slot ", slot[t], " outside the cache's ", num_slots);
  std::vector<at::Tensor> seen;
  if (roundtrip) seen = {at::empty({T, Hkv, D}, k.options()), at::empty({T, Hkv, D}, k.options())};
  const auto into = [&](const at::Tensor& x, auto* out, at::Tensor* back) {
    using Out = std::remove_pointer_t<decltype(out)>;
    if (x.scalar_type() == at::kBFloat16)
      store_rows<c10::BFloat16, Out>(x, out, slot, num_slots, back ? back->data_ptr<c10::BFloat16>() : nullptr);
    else
      store_rows<float, Out>(x, out, slot, num_slots, back ? back->data_ptr<float>() : nullptr);
  };
  const auto side = [&](const at::Tensor& x, const at::Tensor& cache, at::Tensor* back) {
    switch (cache.scalar_type()) {
      case at::kFloat: into(x, cache.data_ptr<float>(), nullptr); break;
      case at::kBFloat16: into(x, cache.data_ptr<c10::BFloat16>(), nullptr); break;
      default: into(x, cache.data_ptr<int8_t>(), back);
    }
  };
  side(k, k_cache, roundtrip ? &seen[0] : nullptr);
  side(v, v_cache, roundtrip ? &seen[1] : nullptr);
  return seen;
}

// int8 rows as their readers see them, in one pass where torch takes several ops (kv_format.py dequantize /
// roundtrip): `int8_dequantize` widens stored rows [N, D + 2] (int8, contiguous) to code x scale; `int8_roundtrip`
// quantizes float32 or bf16 rows [N, D] (contiguous) as store_kv would store them and returns that; both round the
// float32 product once to bf16 where the output (or the roundtrip's input, as dequantize(quantize(x), x.dtype)) is
// bf16, to nearest even as torch's cast. Rows are split over torch's intra-op threads.
at::Tensor int8_rows_out(int64_t n, int64_t d, bool bf16) {
  return at::empty({n, d}, at::TensorOptions().dtype(bf16 ? at::kBFloat16 : at::kFloat));
}

template <typename F>
void each_row_into(at::Tensor& out, bool round_bf16, F&& values_of) {
  const int64_t n = out.size(0), d = out.size(1);
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> row(d);
    for (int64_t i = begin; i < end; ++i) {
      values_of(i, row.data());
      if (bf16) {
        narrow_to_bf16(row.data(), out.data_ptr<c10::BFloat16>() + i * d, d);
      } else {
        float* o = out.data_ptr<float>() + i * d;
        for (int64_t j = 0; j < d; ++j) o[j] = round_bf16 ? static_cast<float>(c10::BFloat16(row[j])) : row[j];
      }
    }
  });
}

at::Tensor int8_dequantize(const at::Tensor& rows, bool out_bf16) {
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kChar && rows.is_contiguous() &&
                  rows.size(1) > glmserve::kInt8ScaleBytes,
              "int8_dequantize: rows must be a contiguous int8 [N, D + 2] tensor");
  const int64_t w = rows.size(1), d = w - glmserve::kInt8ScaleBytes;
  at::Tensor out = int8_rows_out(rows.size(0), d, out_bf16);
  const int8_t* src = rows.data_ptr<int8_t>();
  each_row_into(out, false, [&](int64_t i, float* values) {
    const int8_t* r = src + i * w;
    const float s = half_at(r + d);
    for (int64_t j = 0; j < d; ++j) values[j] = static_cast<float>(r[j]) * s;
  });
  return out;
}

at::Tensor int8_roundtrip(const at::Tensor& x, bool out_bf16) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "int8_roundtrip: x must be a contiguous float32 or bf16 [N, D] tensor");
  const int64_t d = x.size(1);
  const bool in_bf16 = x.scalar_type() == at::kBFloat16;
  at::Tensor out = int8_rows_out(x.size(0), d, out_bf16);
  const float* f32 = in_bf16 ? nullptr : x.data_ptr<float>();
  const c10::BFloat16* b16 = in_bf16 ? x.data_ptr<c10::BFloat16>() : nullptr;
  each_row_into(out, in_bf16, [&](int64_t i, float* values) {
    thread_local std::vector<float> widened;
    thread_local std::vector<int8_t> stored;
    stored.resize(d + glmserve::kInt8ScaleBytes);
    const float* row = in_bf16 ? nullptr : f32 + i * d;
    if (in_bf16) {
      widened.resize(d);
      widen_bf16(b16 + i * d, widened.data(), d);
      row = widened.data();
    }
    glmserve::quantize_int8_row(row, stored.data(), values, d);
  });
  return out;
}

// Test-only: the at::get_thread_num() that ran each of `n` items of an at::parallel_for with grain 1, as
// int64 [n]; tests check that our builds' parallel loops use torch's intra-op threads (build.py, -fopenmp).
at::Tensor parallel_thread_ids(int64_t n) {
  TORCH_CHECK(n > 0, "parallel_thread_ids: n must be positive, got ", n);
  at::Tensor ids = at::full({n}, -1, at::kLong);
  int64_t* out = ids.data_ptr<int64_t>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) out[i] = at::get_thread_num();
  });
  return ids;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU)");
  m.def("paged_decode_lse", &paged_decode_lse, "paged decode attention (CPU) and the log-sum-exp per head");
  m.def("store_kv", &store_kv, "KV write of one layer into float32 / bf16 / int8 caches (CPU)", py::arg("k_cache"),
        py::arg("v_cache"), py::arg("slots"), py::arg("k"), py::arg("v"), py::arg("roundtrip") = false);
  m.def("int8_dequantize", &int8_dequantize, "int8 KV rows widened to code x scale (CPU)");
  m.def("int8_roundtrip", &int8_roundtrip, "rows as int8 KV stores and dequantizes them (CPU)");
  m.def("parallel_thread_ids", &parallel_thread_ids, "test-only: the intra-op thread that ran each item");
}
