// Causal prefill attention in bf16 with float32 accumulation (CPU, avx512 build): on the AMX bf16 tiles where the
// CPU has AMX-BF16 (Intel Sapphire Rapids on), else where it has AVX512-BF16 (AMD Zen 4 on, Intel Cooper Lake on) with
// its vdpbf16ps or with float32 FMAs on the bf16 values widened (the faster of the two on Intel cores).
//
//   prefill_attention(q [T, Hq, D] bf16 or float32, k [B, L, Hk, D] bf16 or float32, v (as k), q_lens [B] i64,
//                     kv_lens [B] i64, scale, out_bf16, engine = "") -> out [T, Hq, D] bf16 (out_bf16) or float32
//     (float32 q, k, v are rounded to bf16 as torch's cast rounds them while they are packed: the same result as
//     casting them first, without the casts' copies)
//   prefill_attention_available() -> bool: this build and CPU run it (AMX tiles granted by Linux, or AVX512-BF16)
//   prefill_attention_engines() -> [str]: the engines they run it on, best first ("amx", then "avx512_fma" and
//     "avx512_bf16" in the order of this CPU's vendor: Intel's first, others' last);
//     `engine` picks one ("": the best)
//
// The rows of queries and their keys are prefill_rows.h's (a fresh prompt: B = 1, kv_lens = q_lens = T; a chunk over
// cached context: kv_lens = cached + chunk; grouped-query heads). D is 64 or 128 (the output tiles cover 64 dims at a
// time); the last dimension of q, k and v is contiguous, other strides are free.
//
// The algorithm is FlashAttention-2's (Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism
// and Work Partitioning"): per block of queries, the keys in blocks, an online softmax (running max m, sum l,
// output rescaled when m grows) in float32, the output divided by l once at the end. The blocking follows what
// torch's aten/src/ATen/native/cpu/FlashAttentionKernel.cpp and vLLM's csrc/cpu attention do on CPU (queries
// blocked, K/V packed once, causal blocks above the diagonal skipped); the tile formulation is our own:
//
// Everything is computed transposed, so that the softmax runs down columns (no horizontal reductions):
//   scores^T [64 keys, 16 queries] = K [keys, D] x Q^T: A tiles are 16 rows of K (32 of D each, bf16, K packed
//     once per call), the B tile is a query tile's Q^T in VNNI pairs ([16 pairs of D][16 queries x 2], packed
//     once per work item), D / 32 tdpbf16ps into each of four C tiles (16 keys each); one zmm row per key then
//     holds its 16 queries' scores.
//   softmax in base 2 (scores times scale * log2 e): max, 2^x (vec_math.h's fast_exp2_16_bf16) and sum are lane-wise
//     over the 64 rows; a block that reaches past a query tile's first position masks the keys after each
//     query's; blocks wholly after a tile's last query are skipped (causal: half the work), and the vector engines
//     stop a tile's last block at the multiple of 16 keys that covers its last query (the rest are masked for all
//     16 queries: their P is 0; at 182-1,000 tokens ~10% of the block work).
//   out^T [D, 16 queries] += V^T [D, 64 keys] x P^T: A tiles are 16 dims x 32 keys of V^T (packed once per call,
//     each 64-key block's [D][64] contiguous), two B tiles are P^T in VNNI pairs (the bf16 rows of two
//     consecutive keys interleaved); the float32 accumulator lives in memory (L1), loaded into four C tiles,
//     multiplied lane-wise by 2^(m_old - m_new) first when a max grew.
//   The scores of the next step are computed on the tiles while the vector units run this step's softmax, and
//     stored after it (vector loads issued after a tile store wait for it).
// Without AMX (VectorBf16 below) the same layouts feed vdpbf16ps (_mm512_dpbf16_ps: 16 float32 lanes, each adding the
// dot product of a pair of bf16), one zmm of 16 queries (a Q^T or P^T VNNI row) against a pair of K's or V^T's
// elements broadcast to every lane: scores^T row k (16 queries) = sum over the D / 2 pairs of Q^T's pair rows times
// key k's pair, 16 keys' rows accumulated side by side (independent chains); out^T row d (16 queries) += sum over
// the 32 key pairs of P^T's pair rows times V^T's pair (row d, keys 2j, 2j + 1), 16 dims' rows side by side; two
// units of one key block (two query tiles or heads) run together where they can, each K / V^T pair then broadcast once
// for both (8 keys' or dims' rows x 2 units side by side; 0.87-0.94x the time at 512-8,192 tokens on Zen 5). VectorFma
// (faster on Intel cores) runs the same loops as float32 FMAs, each pair row split into its even and odd halves
// widened to float32 (exact). The softmax, the item order and the output pass are the AMX path's own (`attend`,
// templated on the engine).
// One work item is (row, KV head, two tiles of 16 queries) with the Hq / Hk query heads of that KV head; its
// steps run key block by key block, each block against every head and tile, so each K and V block is read into
// L1 once for all of them. Items are spread over threads with at::parallel_for, heavy and light (long and short
// causal spans) alternating so that contiguous ranges carry similar work.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "prefill_rows.h"
#include "vec_math.h"

#ifdef GLMSERVE_HAS_AMX
#include <immintrin.h>
#endif

namespace {

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& q_lens,
                  const at::Tensor& kv_lens, const std::optional<at::Tensor>& slots) {
  glmserve::check_prefill_rows("prefill_attention", q, k, v, q_lens, kv_lens, slots);
  const int64_t D = q.size(2), kd = k.size(k.dim() - 1);
  TORCH_CHECK(kd == D && (D == 64 || D == 128), "prefill_attention: head dim ", D, " (q) and ", kd,
              " (k) must be equal, 64 or 128");
}

#ifdef GLMSERVE_HAS_AMX  // the avx512 build on x86-64 Linux (amx.h): all engines are compiled there
// The shared code (attend, the softmax) and the AMX engine: the compiler never emits AMX instructions of its own, so
// the shared code runs on CPUs without AMX too (the vector engine's functions need only avx512bf16).
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512bf16")))
#define BF16_TARGET __attribute__((target("avx512bf16")))

// AVX512-BF16 (CPUID leaf 7 subleaf 1 EAX bit 5): vdpbf16ps, vcvtne2ps2bf16
inline bool avx512_bf16_present() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 5) & 1);
  }();
  return ok;
}

// CPUID leaf 0's vendor string is "GenuineIntel" (EBX, EDX, ECX): VectorFma before VectorBf16 there
inline bool intel_cpu() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    return __get_cpuid(0, &a, &b, &c, &d) && b == 0x756e6547 && d == 0x49656e69 && c == 0x6c65746e;
  }();
  return ok;
}

constexpr int64_t QB = 16;  // queries per tile: the columns of the B tiles
constexpr int64_t QT = 2;   // query tiles per work item (each K and V block, once in L1, serves both)
constexpr int64_t KB = 64;  // keys per block: four 16-row A tiles for the scores, the depth of two P^T tiles

struct Problem {
  const void* q;  // bf16 bits, or float32 (q_f32)
  bool q_f32;
  int64_t q_row, q_head;  // strides (elements)
  uint16_t* out16;  // one of these two
  float* out32;
  int64_t Hq, Hk, g, D;
  float scale;
  const int64_t* q_start;  // [B] first token of row b in q / out
  const int64_t* q_len;
  const int64_t* kv_len;
  const glmserve::PackedRows* rows;  // where each row's keys are packed
  const uint16_t* kp;  // packed K: per (row, KV head) [Lpad][D]
  const uint16_t* vt;  // packed V^T: per (row, KV head) [Lpad / KB][D][KB] (each key block's V^T contiguous)
};

using Item = glmserve::PrefillItem;

struct Unit {  // one step of an item: a key block against one head's query tile
  int64_t kb, tile, state;  // first key, query tile, index of the (tile, head) state: tile * g + head
  int64_t nk;  // keys of the block computed: KB, or on a tile's last block the vector engines' multiple of 16 up to
               // its last query (the keys after it are masked for every query of the tile: their P is 0)
};

struct Scratch {  // one thread's buffers; states (query tile, head) = tile * g + head
  std::vector<uint16_t> qt;  // [states][D / 32][16 pairs x 16 queries x 2] Q^T in VNNI pairs
  std::vector<float> o;      // [states][D][16] out^T
  std::vector<float> m, l;   // [states][16]
  std::vector<Unit> units;
  alignas(64) float s[2][KB * QB];   // scores^T of two units (one computed while the other's softmax runs)
  alignas(64) uint16_t pt[2][KB * QB];  // P^T of two units, bf16 in VNNI pairs: 2 x [16 key pairs][16 queries x 2]
  explicit Scratch(const Problem& p)
      : qt(QT * p.g * p.D * QB), o(QT * p.g * p.D * QB), m(QT * p.g * QB), l(QT * p.g * QB) {}
};

AMX_TARGET void tile_config() {
  glmserve::TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;  // every tile 16 rows x 64 bytes
  asm volatile("" : : "r"(&cfg) : "memory");  // keep the stores above (GCC 12 dropped them as dead before ldtilecfg)
  _tile_loadconfig(&cfg);
}

AMX_TARGET void tile_release() { _tile_release(); }

// 16 x 16 32-bit lanes (row i: x[i]) transposed into r: unpack pairs of rows (32-bit, then 64-bit, within 128-bit
// lanes), then a 4 x 4 transpose of the 128-bit lanes
inline void transpose16(const __m512 (&x)[16], __m512* r) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + c], 128-bit lane L: column 4L + c of rows 4i..4i+3
    u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 v0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44), v1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE);
    const __m512 v2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44);
    const __m512 v3 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_f32x4(v0, v2, 0x88);
    r[4 + c] = _mm512_shuffle_f32x4(v0, v2, 0xDD);
    r[8 + c] = _mm512_shuffle_f32x4(v1, v3, 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(v1, v3, 0xDD);
  }
}

// 16 x 16 floats (rows of 16 at `src`) transposed into r
inline void transpose16(const float* src, __m512* r) {
  __m512 x[16];
  for (int i = 0; i < 16; ++i) x[i] = _mm512_loadu_ps(src + i * 16);
  transpose16(x, r);
}

// 32 bf16 of a query row as one 64-byte row: read as they are, or float32 rounded as torch's cast rounds them
inline __m512 query_pairs(const Problem& p, int64_t at) {
  using glmserve::f32_to_bf16_16;
  if (!p.q_f32) return _mm512_loadu_ps(static_cast<const uint16_t*>(p.q) + at);
  const float* x = static_cast<const float*>(p.q) + at;
  const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(f32_to_bf16_16(_mm512_loadu_ps(x))),
                                          f32_to_bf16_16(_mm512_loadu_ps(x + 16)), 1);
  return _mm512_castsi512_ps(both);
}

// Q^T of the item's g heads in VNNI pairs; queries past the row's end are zeros. Per head and 32 dims, the nq
// queries' 32 bf16 (16 pairs: one 64-byte row each) transposed as 16 x 16 32-bit lanes: row r = pair r of every query
void pack_queries(const Problem& p, int64_t b, int64_t h, int64_t i0, int64_t nq, uint16_t* qt) {
  const int64_t chunks = p.D / 32;
  for (int64_t j = 0; j < p.g; ++j) {
    const int64_t first = (p.q_start[b] + i0) * p.q_row + (h * p.g + j) * p.q_head;
    for (int64_t c = 0; c < chunks; ++c) {
      __m512 rows[16], pairs[16];
      for (int64_t n = 0; n < 16; ++n)
        rows[n] = n < nq ? query_pairs(p, first + n * p.q_row + c * 32) : _mm512_setzero_ps();
      transpose16(rows, pairs);
      float* dst = reinterpret_cast<float*>(qt + (j * chunks + c) * 32 * QB);
      for (int r = 0; r < 16; ++r) _mm512_storeu_ps(dst + r * QB, pairs[r]);
    }
  }
}

// scores^T [64 keys][16 queries] for keys kb..kb+63 and one head's Q^T (qt) into C tiles 0-3 (16 keys each); they
// stay there until amx_store_scores
AMX_TARGET inline void amx_scores(const Problem& p, const uint16_t* kp, int64_t kb, const uint16_t* qt) {
  const int64_t stride = p.D * 2;
  const uint16_t* k = kp + kb * p.D;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t c = 0; c < p.D / 32; ++c, k += 32) {
    _tile_loadd(6, qt + c * 32 * QB, 64);
    _tile_loadd(4, k, stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(5, k + 16 * p.D, stride);
    _tile_dpbf16ps(1, 5, 6);
    _tile_loadd(4, k + 32 * p.D, stride);
    _tile_dpbf16ps(2, 4, 6);
    _tile_loadd(5, k + 48 * p.D, stride);
    _tile_dpbf16ps(3, 5, 6);
  }
}

AMX_TARGET inline void amx_store_scores(float* s) {
  _tile_stored(0, s, 64);
  _tile_stored(1, s + 16 * QB, 64);
  _tile_stored(2, s + 32 * QB, 64);
  _tile_stored(3, s + 48 * QB, 64);
}

// online softmax over the first nk keys of one block of scores^T s, in base 2 (scores times scale * log2 e, so that
// the exponential is vec_math.h's fast_exp2_16_bf16, ~1e-4: P is rounded to bf16 for P x V, and l sums the same
// values); P^T into pt as bf16 VNNI pairs (two B tiles: keys 0-31, 32-63); m, l: the head's running max (scaled,
// base 2) and sum for its 16 queries; returns whether the max grew for some query, with alpha = 2^(m_old - m_new) (the
// factor of the output so far, and of l: its error cancels; computed to ~1e-7 all the same)
template <bool Masked>
AMX_TARGET inline bool softmax_block(const Problem& p, int64_t kb, int64_t nk, __m512 qpos, const float* s,
                                     uint16_t* pt, float* m, float* l, __m512& alpha) {
  const __m512 scale = _mm512_set1_ps(p.scale * glmserve::kLog2e);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 live[KB];
  __m512 mx = ninf;
  for (int k = 0; k < nk; ++k) {
    const __m512 x = _mm512_load_ps(s + k * QB);
    if constexpr (Masked) {  // keys after the query's position
      live[k] = _mm512_cmp_ps_mask(_mm512_set1_ps(static_cast<float>(kb + k)), qpos, _CMP_LE_OQ);
      mx = _mm512_mask_max_ps(mx, live[k], mx, x);
    } else {
      mx = _mm512_max_ps(mx, x);
    }
  }
  const __m512 m_old = _mm512_loadu_ps(m), m_new = _mm512_max_ps(m_old, _mm512_mul_ps(mx, scale));
  // exactly 1 where the max stayed; m_old = -inf (the first block) gives 2^-126
  alpha = glmserve::fast_exp2_16(_mm512_max_ps(_mm512_sub_ps(m_old, m_new), _mm512_set1_ps(-126.0f)));
  __m512 sum = _mm512_setzero_ps();
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int k = 0; k < nk; k += 2) {
    __m512 e0 = glmserve::fast_exp2_16_bf16(_mm512_fmsub_ps(_mm512_load_ps(s + k * QB), scale, m_new));
    __m512 e1 = glmserve::fast_exp2_16_bf16(_mm512_fmsub_ps(_mm512_load_ps(s + (k + 1) * QB), scale, m_new));
    if constexpr (Masked) {
      e0 = _mm512_maskz_mov_ps(live[k], e0);
      e1 = _mm512_maskz_mov_ps(live[k + 1], e1);
    }
    sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
    // keys k and k+1 of each query side by side: [q0 k, q0 k+1, q1 k, q1 k+1, ...]
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);  // [e0 (16), e1 (16)]
    _mm512_store_si512(pt + k * QB, _mm512_permutexvar_epi16(pairs, both));
  }
  _mm512_storeu_ps(m, m_new);
  _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), alpha, sum));
  return _mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.0f), _CMP_LT_OQ) != 0;
}

// out^T [D][16] += V^T [D][keys kb..kb+63] x P^T, four C tiles of 16 dims at a time
AMX_TARGET inline void amx_accumulate(const Problem& p, const uint16_t* vt, int64_t kb, const uint16_t* pt,
                                      float* o) {
  constexpr int64_t stride = KB * 2;  // bytes per row of a key block's V^T
  _tile_loadd(6, pt, 64);
  _tile_loadd(7, pt + 32 * QB, 64);
  for (int64_t d = 0; d < p.D; d += 64, o += 64 * QB) {
    const uint16_t* v = vt + kb * p.D + d * KB;
    _tile_loadd(0, o, 64);
    _tile_loadd(1, o + 16 * QB, 64);
    _tile_loadd(2, o + 32 * QB, 64);
    _tile_loadd(3, o + 48 * QB, 64);
    _tile_loadd(4, v, stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(5, v + 32, stride);
    _tile_dpbf16ps(0, 5, 7);
    _tile_loadd(4, v + 16 * KB, stride);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, v + 16 * KB + 32, stride);
    _tile_dpbf16ps(1, 5, 7);
    _tile_loadd(4, v + 32 * KB, stride);
    _tile_dpbf16ps(2, 4, 6);
    _tile_loadd(5, v + 32 * KB + 32, stride);
    _tile_dpbf16ps(2, 5, 7);
    _tile_loadd(4, v + 48 * KB, stride);
    _tile_dpbf16ps(3, 4, 6);
    _tile_loadd(5, v + 48 * KB + 32, stride);
    _tile_dpbf16ps(3, 5, 7);
    _tile_stored(0, o, 64);
    _tile_stored(1, o + 16 * QB, 64);
    _tile_stored(2, o + 32 * QB, 64);
    _tile_stored(3, o + 48 * QB, 64);
  }
}

// The engines `attend` runs on (AmxTiles, VectorBf16, VectorFma). start_scores(p, kp, kb, qt, nk) begins scores^T of
// the first nk keys of block kb against one head's query tile and finish_scores(s) leaves them in s ([nk][QB] floats):
// the AMX engine computes on the tiles in the first (the vector units run the previous block's softmax meanwhile) and
// stores in the second; the vector engines do all of it in the second. accumulate(p, vt, kb, pt, o, nk): out^T o
// [D][QB] += V^T (block kb, its first nk keys) x P^T (pt). kTrims: whether the engine takes nk < KB (the AMX tiles
// always compute whole blocks of KB keys). kPairs: whether the engine also runs two units of one key block and
// length together (scores_pair, accumulate_pair: `attend` then takes units two at a time where it can).
struct AmxTiles {
  static constexpr bool kTrims = false;
  static constexpr bool kPairs = false;
  AMX_TARGET static void begin() { tile_config(); }
  AMX_TARGET static void end() { tile_release(); }
  AMX_TARGET void start_scores(const Problem& p, const uint16_t* kp, int64_t kb, const uint16_t* qt, int64_t) {
    amx_scores(p, kp, kb, qt);
  }
  AMX_TARGET void finish_scores(const Problem&, float* s) { amx_store_scores(s); }
  AMX_TARGET static void accumulate(const Problem& p, const uint16_t* vt, int64_t kb, const uint16_t* pt, float* o,
                                    int64_t) {
    amx_accumulate(p, vt, kb, pt, o);
  }
};

// 32 bits (a pair of bf16) at `at`, in every lane: vdpbf16ps's broadcast operand (one vpbroadcastd load, no ALU work)
BF16_TARGET inline __m512bh pair_everywhere(const uint16_t* at) {
  int32_t bits;
  std::memcpy(&bits, at, 4);
  return (__m512bh)_mm512_set1_epi32(bits);
}

struct VectorBf16 {
  static constexpr bool kTrims = true;
  static constexpr bool kPairs = true;
  const uint16_t* k = nullptr;  // the pending block's first key row (packed K: [KB][D])
  const uint16_t* qt = nullptr;
  int64_t nk = KB;
  static void begin() {}
  static void end() {}
  void start_scores(const Problem& p, const uint16_t* kp, int64_t kb, const uint16_t* q, int64_t keys) {
    k = kp + kb * p.D, qt = q, nk = keys;
  }

  BF16_TARGET void finish_scores(const Problem& p, float* s) const {
    if (p.D == 64)
      scores<64>(s);
    else
      scores<128>(s);
  }

  // scores^T row r = sum over pairs c of (Q^T pair row c: 16 queries x 2 dims) . (key r's dims 2c, 2c + 1), 16 keys
  // at a time in 16 accumulators (D a constant: the 16 keys' rows are one pointer and fixed offsets)
  template <int D>
  BF16_TARGET void scores(float* s) const {
    for (int64_t r0 = 0; r0 < nk; r0 += 16) {
      __m512 acc[16];
      for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
      const uint16_t* rows = k + r0 * D;
      for (int c = 0; c < D / 2; ++c) {
        const __m512bh q = (__m512bh)_mm512_loadu_si512(qt + c * 2 * QB);
        for (int r = 0; r < 16; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], q, pair_everywhere(rows + r * D + 2 * c));
      }
      for (int r = 0; r < 16; ++r) _mm512_store_ps(s + (r0 + r) * QB, acc[r]);
    }
  }

  // out^T row d += sum over key pairs j of (P^T pair row j: 16 queries x keys 2j, 2j + 1) . (V^T row d's keys 2j,
  // 2j + 1), 16 dims at a time in 16 accumulators
  BF16_TARGET static void accumulate(const Problem& p, const uint16_t* vt, int64_t kb, const uint16_t* pt, float* o,
                                     int64_t nk) {
    const uint16_t* block = vt + kb * p.D;
    for (int64_t d0 = 0; d0 < p.D; d0 += 16) {
      __m512 acc[16];
      for (int r = 0; r < 16; ++r) acc[r] = _mm512_loadu_ps(o + (d0 + r) * QB);
      for (int64_t j = 0; j < nk / 2; ++j) {
        const __m512bh pj = (__m512bh)_mm512_load_si512(pt + j * 2 * QB);
        for (int r = 0; r < 16; ++r)
          acc[r] = _mm512_dpbf16_ps(acc[r], pj, pair_everywhere(block + (d0 + r) * KB + 2 * j));
      }
      for (int r = 0; r < 16; ++r) _mm512_storeu_ps(o + (d0 + r) * QB, acc[r]);
    }
  }

  // The two forms above for two units a, b of the same key block and length (two query tiles or heads of the item):
  // each K or V^T pair is broadcast once for both, 8 keys or dims x 2 units in 16 accumulators. The single forms load
  // a broadcast per vdpbf16ps, which held them at ~80-90% of its rate on Zen 5 (2 a cycle there: the loads bound them);
  // each accumulator's sum is the same as theirs, in the same order.
  BF16_TARGET void scores_pair(const Problem& p, const uint16_t* qa, const uint16_t* qb, float* sa, float* sb) const {
    if (p.D == 64)
      scores_pair<64>(qa, qb, sa, sb);
    else
      scores_pair<128>(qa, qb, sa, sb);
  }

  template <int D>
  BF16_TARGET void scores_pair(const uint16_t* qa, const uint16_t* qb, float* sa, float* sb) const {
    for (int64_t r0 = 0; r0 < nk; r0 += 8) {
      __m512 a[8], b[8];
      for (int r = 0; r < 8; ++r) a[r] = _mm512_setzero_ps(), b[r] = _mm512_setzero_ps();
      const uint16_t* rows = k + r0 * D;
      for (int c = 0; c < D / 2; ++c) {
        const __m512bh x = (__m512bh)_mm512_loadu_si512(qa + c * 2 * QB);
        const __m512bh y = (__m512bh)_mm512_loadu_si512(qb + c * 2 * QB);
        for (int r = 0; r < 8; ++r) {
          const __m512bh key = pair_everywhere(rows + r * D + 2 * c);
          a[r] = _mm512_dpbf16_ps(a[r], x, key);
          b[r] = _mm512_dpbf16_ps(b[r], y, key);
        }
      }
      for (int r = 0; r < 8; ++r) {
        _mm512_store_ps(sa + (r0 + r) * QB, a[r]);
        _mm512_store_ps(sb + (r0 + r) * QB, b[r]);
      }
    }
  }

  BF16_TARGET static void accumulate_pair(const Problem& p, const uint16_t* vt, int64_t kb, const uint16_t* pta,
                                          const uint16_t* ptb, float* oa, float* ob, int64_t nk) {
    const uint16_t* block = vt + kb * p.D;
    for (int64_t d0 = 0; d0 < p.D; d0 += 8) {
      __m512 a[8], b[8];
      for (int r = 0; r < 8; ++r) a[r] = _mm512_loadu_ps(oa + (d0 + r) * QB), b[r] = _mm512_loadu_ps(ob + (d0 + r) * QB);
      for (int64_t j = 0; j < nk / 2; ++j) {
        const __m512bh x = (__m512bh)_mm512_load_si512(pta + j * 2 * QB);
        const __m512bh y = (__m512bh)_mm512_load_si512(ptb + j * 2 * QB);
        for (int r = 0; r < 8; ++r) {
          const __m512bh v = pair_everywhere(block + (d0 + r) * KB + 2 * j);
          a[r] = _mm512_dpbf16_ps(a[r], x, v);
          b[r] = _mm512_dpbf16_ps(b[r], y, v);
        }
      }
      for (int r = 0; r < 8; ++r) {
        _mm512_storeu_ps(oa + (d0 + r) * QB, a[r]);
        _mm512_storeu_ps(ob + (d0 + r) * QB, b[r]);
      }
    }
  }
};

// bf16 bits to float32: the low (even) and high (odd) halves of each 32-bit lane of a VNNI pair row
inline __m512 even_halves(__m512i pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }
inline __m512 odd_halves(__m512i pairs) {
  return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// n bf16 values (a multiple of 16) at src widened to float32 at dst
inline void widen(const uint16_t* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; i += 16) {
    const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    _mm512_store_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)));
  }
}

// VectorBf16's products as float32 FMAs on the bf16 values widened (exact): on Intel's Golden Cove server cores
// (Sapphire / Emerald Rapids, when AMX is not granted) a zmm vdpbf16ps issues once per ~2.2 cycles (8 cycles latency),
// 64 flops, while vfmadd231ps issues twice a cycle, 2 x 32 flops (measured on an Emerald Rapids Xeon, independent
// chains: 0.78 vs 0.19 ns per instruction), so this engine runs first on Intel CPUs and VectorBf16 on others (AMD
// Zen 4's FMA units are 256 bits wide, and vdpbf16ps was its fast path). The current key block's K ([KB][D]) and V^T
// ([D][KB]) are widened into `kf` / `vf` once (a block serves every head and query tile of the item in turn); Q^T's
// and P^T's VNNI pair rows are split into their even and odd halves in registers (two ALU operations per 32 FMAs).
// Each FMA's other operand is one float32 of K or V^T broadcast from memory (folded into the FMA as {1to16}).
struct VectorFma {
  static constexpr bool kTrims = true;
  static constexpr bool kPairs = false;
  const uint16_t* k = nullptr;  // the pending block's first key row (packed K: [KB][D])
  const uint16_t* qt = nullptr;
  int64_t nk = KB;
  const uint16_t* k_in_kf = nullptr;  // the bf16 blocks kf and vf hold widened
  const uint16_t* v_in_vf = nullptr;
  alignas(64) float kf[KB * 128];
  alignas(64) float vf[128 * KB];
  static void begin() {}
  static void end() {}
  void start_scores(const Problem& p, const uint16_t* kp, int64_t kb, const uint16_t* q, int64_t keys) {
    k = kp + kb * p.D, qt = q, nk = keys;
  }

  void finish_scores(const Problem& p, float* s) {
    if (k != k_in_kf) widen(k, KB * p.D, kf), k_in_kf = k;
    if (p.D == 64)
      scores<64>(s);
    else
      scores<128>(s);
  }

  // scores^T row r = sum over dims d of (Q^T row d: 16 queries) x key r's dim d, 16 keys at a time in 16
  // accumulators (D a constant: the 16 keys' rows are one pointer and fixed offsets)
  template <int D>
  void scores(float* s) const {
    for (int64_t r0 = 0; r0 < nk; r0 += 16) {
      __m512 acc[16];
      for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
      const float* rows = kf + r0 * D;
      for (int c = 0; c < D / 2; ++c) {
        const __m512i q = _mm512_loadu_si512(qt + c * 2 * QB);
        const __m512 q0 = even_halves(q), q1 = odd_halves(q);
        for (int r = 0; r < 16; ++r) {
          acc[r] = _mm512_fmadd_ps(q0, _mm512_set1_ps(rows[r * D + 2 * c]), acc[r]);
          acc[r] = _mm512_fmadd_ps(q1, _mm512_set1_ps(rows[r * D + 2 * c + 1]), acc[r]);
        }
      }
      for (int r = 0; r < 16; ++r) _mm512_store_ps(s + (r0 + r) * QB, acc[r]);
    }
  }

  // out^T row d += sum over keys j of (P^T row j: 16 queries) x V^T row d's key j, 16 dims at a time in 16
  // accumulators
  void accumulate(const Problem& p, const uint16_t* vt, int64_t kb, const uint16_t* pt, float* o, int64_t keys) {
    const uint16_t* block = vt + kb * p.D;
    if (block != v_in_vf) widen(block, KB * p.D, vf), v_in_vf = block;
    for (int64_t d0 = 0; d0 < p.D; d0 += 16) {
      __m512 acc[16];
      for (int r = 0; r < 16; ++r) acc[r] = _mm512_loadu_ps(o + (d0 + r) * QB);
      const float* rows = vf + d0 * KB;
      for (int64_t j = 0; j < keys / 2; ++j) {
        const __m512i pj = _mm512_load_si512(pt + j * 2 * QB);
        const __m512 p0 = even_halves(pj), p1 = odd_halves(pj);
        for (int r = 0; r < 16; ++r) {
          acc[r] = _mm512_fmadd_ps(p0, _mm512_set1_ps(rows[r * KB + 2 * j]), acc[r]);
          acc[r] = _mm512_fmadd_ps(p1, _mm512_set1_ps(rows[r * KB + 2 * j + 1]), acc[r]);
        }
      }
      for (int r = 0; r < 16; ++r) _mm512_storeu_ps(o + (d0 + r) * QB, acc[r]);
    }
  }
};

template <class Engine>
AMX_TARGET void attend(const Problem& p, const Item& it, Scratch& w) {
  const int64_t ql = p.q_len[it.b], kl = p.kv_len[it.b];
  const int64_t i0 = it.block * QB * QT, tiles = std::min(QT, (ql - i0 + QB - 1) / QB);
  int64_t nq[QT], first[QT], last[QT];  // per query tile: queries, positions of its first and last
  __m512 qpos[QT];
  for (int64_t t = 0; t < tiles; ++t) {
    nq[t] = std::min(QB, ql - i0 - t * QB);
    first[t] = kl - ql + i0 + t * QB, last[t] = first[t] + nq[t] - 1;
    alignas(64) float pos[QB];
    for (int64_t n = 0; n < QB; ++n) pos[n] = static_cast<float>(first[t] + std::min(n, nq[t] - 1));
    qpos[t] = _mm512_load_ps(pos);
    pack_queries(p, it.b, it.h, i0 + t * QB, nq[t], w.qt.data() + t * p.g * p.D * QB);
  }
  const int64_t region = p.rows->region(it.b, it.h, p.Hk, p.D);
  const uint16_t* kp = p.kp + region;
  const uint16_t* vt = p.vt + region;
  std::fill(w.o.begin(), w.o.end(), 0.0f);
  std::fill(w.m.begin(), w.m.end(), -std::numeric_limits<float>::infinity());
  std::fill(w.l.begin(), w.l.end(), 0.0f);
  // units (key block, head, query tile) in this order, so that a block's K and V serve all heads and tiles from
  // L1; blocks wholly after a tile's last query are skipped (causal: half the work)
  w.units.clear();
  for (int64_t kb = 0; kb <= last[tiles - 1]; kb += KB)
    for (int64_t j = 0; j < p.g; ++j)
      for (int64_t t = 0; t < tiles; ++t)
        if (kb <= last[t])
          w.units.push_back({kb, t, t * p.g + j,
                             Engine::kTrims ? std::min(KB, (last[t] - kb + 16) / 16 * 16) : KB});
  const int64_t units = static_cast<int64_t>(w.units.size());
  auto q_of = [&](const Unit& x) { return w.qt.data() + x.state * p.D * QB; };
  auto o_of = [&](const Unit& x) { return w.o.data() + x.state * p.D * QB; };
  // the online softmax of unit x over its scores s into P^T pt, and its output so far rescaled where a max grew
  auto softmax_unit = [&](const Unit& x, const float* s, uint16_t* pt) {
    float* m = &w.m[x.state * QB];
    float* l = &w.l[x.state * QB];
    __m512 alpha;
    const bool grew = x.kb + x.nk - 1 > first[x.tile]
                          ? softmax_block<true>(p, x.kb, x.nk, qpos[x.tile], s, pt, m, l, alpha)
                          : softmax_block<false>(p, x.kb, x.nk, qpos[x.tile], s, pt, m, l, alpha);
    if (grew && x.kb > 0) {  // (the first block finds the output still zero)
      float* o = o_of(x);
      for (int64_t d = 0; d < p.D; ++d) _mm512_storeu_ps(o + d * QB, _mm512_mul_ps(_mm512_loadu_ps(o + d * QB), alpha));
    }
  };
  Engine e;
  if constexpr (Engine::kPairs) {
    // two units at a time where the next one has the same key block and length (the item's heads and tiles over
    // one block, but where its tiles' last blocks end apart): scores of both, both softmaxes, both outputs
    for (int64_t u = 0; u < units;) {
      const Unit x = w.units[u];
      const bool pair = u + 1 < units && w.units[u + 1].kb == x.kb && w.units[u + 1].nk == x.nk;
      e.start_scores(p, kp, x.kb, q_of(x), x.nk);
      if (!pair) {
        e.finish_scores(p, w.s[0]);
        softmax_unit(x, w.s[0], w.pt[0]);
        e.accumulate(p, vt, x.kb, w.pt[0], o_of(x), x.nk);
        ++u;
        continue;
      }
      const Unit y = w.units[u + 1];
      e.scores_pair(p, q_of(x), q_of(y), w.s[0], w.s[1]);
      softmax_unit(x, w.s[0], w.pt[0]);
      softmax_unit(y, w.s[1], w.pt[1]);
      e.accumulate_pair(p, vt, x.kb, w.pt[0], w.pt[1], o_of(x), o_of(y), x.nk);
      u += 2;
    }
  } else {
    // the scores of unit u + 1 are computed during unit u's softmax (the tiles work while the vector units run it)
    // and stored after it: the softmax's loads do not wait behind tile stores issued before them
    e.start_scores(p, kp, 0, q_of(w.units[0]), w.units[0].nk);
    e.finish_scores(p, w.s[0]);
    for (int64_t u = 0; u < units; ++u) {
      if (u + 1 < units) e.start_scores(p, kp, w.units[u + 1].kb, q_of(w.units[u + 1]), w.units[u + 1].nk);
      const Unit x = w.units[u];
      softmax_unit(x, w.s[u & 1], w.pt[0]);
      if (u + 1 < units) e.finish_scores(p, w.s[(u + 1) & 1]);
      e.accumulate(p, vt, x.kb, w.pt[0], o_of(x), x.nk);
    }
  }
  for (int64_t t = 0; t < tiles; ++t) {
    for (int64_t j = 0; j < p.g; ++j) {  // out = out^T transposed, divided by l
      const int64_t state = t * p.g + j, head = it.h * p.g + j;
      alignas(64) float inv[QB];
      _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_loadu_ps(&w.l[state * QB])));
      for (int64_t d = 0; d < p.D; d += 16) {
        __m512 r[QB];
        transpose16(w.o.data() + (state * p.D + d) * QB, r);
        for (int64_t n = 0; n < nq[t]; ++n) {
          const int64_t at = ((p.q_start[it.b] + i0 + t * QB + n) * p.Hq + head) * p.D + d;
          const __m512 y = _mm512_mul_ps(r[n], _mm512_set1_ps(inv[n]));
          if (p.out16)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.out16 + at), (__m256i)_mm512_cvtneps_pbh(y));
          else
            _mm512_storeu_ps(p.out32 + at, y);
        }
      }
    }
  }
}

template <class Engine>
void attend_items(const Problem& p, const std::vector<Item>& order, int64_t begin, int64_t end, Scratch& w) {
  Engine::begin();
  for (int64_t i = begin; i < end; ++i) attend<Engine>(p, order[i], w);
  Engine::end();
}

// 16 values of a row from `x` as bf16 bits in the low halves of 16 32-bit lanes (float32 rounded as torch's cast rounds)
inline __m512i bf16_lanes(const uint16_t* x) {
  return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}
inline __m512i bf16_lanes(const float* x) { return _mm512_cvtepu16_epi32(glmserve::f32_to_bf16_16(_mm512_loadu_ps(x))); }

// V^T of one key block from its n <= KB value rows (rows[t]): block[d * KB + t] = row t's dim d in bf16 (keys past n:
// zero in the last 32 keys written, the rest as the caller left them). 16 pairs of keys at a time: a pair's rows interleaved into 32-bit words (lane d: keys 2p and
// 2p + 1 of dim d), then 16 x 16 words transposed (transpose16) into 64-byte rows of V^T, where an element at a time
// took a store per value.
template <typename T>
void pack_vt(const T* const* rows, int64_t n, int64_t D, uint16_t* block) {
  for (int64_t p0 = 0; 2 * p0 < n; p0 += 16)
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      __m512 words[16], r[16];
      for (int64_t p = 0; p < 16; ++p) {
        const int64_t t = 2 * (p0 + p);
        const __m512i even = t < n ? bf16_lanes(rows[t] + d0) : _mm512_setzero_si512();
        const __m512i odd = t + 1 < n ? bf16_lanes(rows[t + 1] + d0) : _mm512_setzero_si512();
        words[p] = _mm512_castsi512_ps(_mm512_or_si512(even, _mm512_slli_epi32(odd, 16)));
      }
      transpose16(words, r);
      for (int64_t d = 0; d < 16; ++d) _mm512_storeu_ps(reinterpret_cast<float*>(block + (d0 + d) * KB + 2 * p0), r[d]);
    }
}

// Key block `blk` of one (row, KV head): its KB rows of K ([KB][D], at kp + blk * KB * D) and its V^T ([D][KB], at
// vt + blk * KB * D), zero past the row's kl keys
// (T: uint16_t for bf16 k and v, float for float32 ones, rounded to bf16 as torch's cast rounds)
template <typename T>
void pack_block(const at::Tensor& k, const at::Tensor& v, const glmserve::KeyRows& krs, const glmserve::KeyRows& vrs,
                int64_t b, int64_t h, int64_t blk, int64_t kl, int64_t D, uint16_t* kp, uint16_t* vt) {
  const auto* ks = static_cast<const T*>(k.data_ptr());
  const auto* vs = static_cast<const T*>(v.data_ptr());
  const int64_t t0 = blk * KB, n = std::min(kl - t0, KB);
  uint16_t* krows = kp + t0 * D;
  uint16_t* block = vt + t0 * D;
  for (int64_t t = 0; t < n; ++t) {
    const T* row = ks + krs.offset(b, t0 + t, h);
    if constexpr (std::is_same_v<T, float>) {
      for (int64_t d = 0; d < D; d += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(krows + t * D + d),
                            glmserve::f32_to_bf16_16(_mm512_loadu_ps(row + d)));
    } else {
      std::memcpy(krows + t * D, row, D * 2);
    }
  }
  if (n < KB) {
    std::memset(krows + n * D, 0, (KB - n) * D * 2);
    std::memset(block, 0, KB * D * 2);
  }
  const T* vrows[KB];
  for (int64_t t = 0; t < n; ++t) vrows[t] = vs + vrs.offset(b, t0 + t, h);
  pack_vt(vrows, n, D, block);
}

at::Tensor run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int64_t* ql, const int64_t* kl,
               double scale, bool out_bf16, const std::string& engine, const std::optional<at::Tensor>& slots) {
  const glmserve::KeyRows krs(k, slots), vrs(v, slots);
  const int64_t B = krs.B, Hk = krs.Hk, D = q.size(2), Hq = q.size(1), T = q.size(0);
  const glmserve::PackedRows rows(ql, kl, B, KB);
  // K and V^T packed by key block, the blocks of every (row, KV head) split over the threads (uninitialized
  // buffers: every block is written whole)
  const int64_t keys = rows.keys;
  at::Tensor kv_packed = at::empty({2, keys * Hk * D}, q.options().dtype(at::kBFloat16));
  uint16_t* kp = reinterpret_cast<uint16_t*>(kv_packed.data_ptr<at::BFloat16>());
  uint16_t* vt = kp + keys * Hk * D;
  rows.pack_blocks(Hk, [&](int64_t b, int64_t h, int64_t blk) {
    const int64_t region = rows.region(b, h, Hk, D);
    if (k.scalar_type() == at::kFloat)
      pack_block<float>(k, v, krs, vrs, b, h, blk, kl[b], D, kp + region, vt + region);
    else
      pack_block<uint16_t>(k, v, krs, vrs, b, h, blk, kl[b], D, kp + region, vt + region);
  });
  at::Tensor out = at::empty({T, Hq, D}, q.options().dtype(out_bf16 ? at::kBFloat16 : at::kFloat));
  Problem p{q.data_ptr(), q.scalar_type() == at::kFloat, q.stride(0), q.stride(1),
            out_bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr,
            out_bf16 ? nullptr : out.data_ptr<float>(), Hq, Hk, Hq / Hk, D, static_cast<float>(scale),
            rows.q_start.data(), ql, kl, &rows, kp, vt};
  const std::vector<Item> order = glmserve::balanced_items(ql, kl, B, Hk, QB * QT, KB);
  at::parallel_for(0, static_cast<int64_t>(order.size()), 1, [&](int64_t begin, int64_t end) {
    Scratch w(p);
    if (engine == "amx")
      attend_items<AmxTiles>(p, order, begin, end, w);
    else if (engine == "avx512_fma")
      attend_items<VectorFma>(p, order, begin, end, w);
    else
      attend_items<VectorBf16>(p, order, begin, end, w);
  });
  return out;
}
#endif

// The engines this build and CPU run, best first: "amx" (tiles granted by Linux), then the vector engines
std::vector<std::string> prefill_attention_engines() {
  std::vector<std::string> engines;
#ifdef GLMSERVE_HAS_AMX
  if (glmserve::amx_bf16_permitted()) engines.emplace_back("amx");
  if (avx512_bf16_present()) {  // the vector engines (their softmax rounds P with AVX512-BF16's conversions)
    engines.emplace_back(intel_cpu() ? "avx512_fma" : "avx512_bf16");
    engines.emplace_back(intel_cpu() ? "avx512_bf16" : "avx512_fma");
  }
#endif
  return engines;
}

bool prefill_attention_available() { return !prefill_attention_engines().empty(); }

// engine: "" for the best one, else one of prefill_attention_engines() (tests run each); slots: k and v are KV pools
// read by slot (prefill_rows.h)
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& q_lens,
                             const at::Tensor& kv_lens, double scale, bool out_bf16, const std::string& engine,
                             const std::optional<at::Tensor>& slots) {
  check_inputs(q, k, v, q_lens, kv_lens, slots);
  const std::vector<std::string> engines = prefill_attention_engines();
  TORCH_CHECK(!engines.empty(),
              "prefill_attention: needs the avx512 build on a CPU with AVX512-BF16 (or AMX-BF16 tiles granted by Linux)");
  const std::string chosen = engine.empty() ? engines[0] : engine;
  TORCH_CHECK(std::find(engines.begin(), engines.end(), chosen) != engines.end(), "prefill_attention: engine '",
              chosen, "' does not run here");
#ifdef GLMSERVE_HAS_AMX
  return run(q, k, v, q_lens.data_ptr<int64_t>(), kv_lens.data_ptr<int64_t>(), scale, out_bf16, chosen, slots);
#else
  return at::Tensor();
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("prefill_attention", &prefill_attention,
        "causal prefill attention in bf16 on the AMX tiles or with AVX512-BF16 (CPU)", py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("q_lens"), py::arg("kv_lens"), py::arg("scale"), py::arg("out_bf16"),
        py::arg("engine") = "", py::arg("slots") = py::none());
  m.def("prefill_attention_available", &prefill_attention_available,
        "whether this build and CPU run prefill_attention");
  m.def("prefill_attention_engines", &prefill_attention_engines,
        "the engines this build and CPU run prefill_attention on, best first: amx, avx512_fma / avx512_bf16");
}
