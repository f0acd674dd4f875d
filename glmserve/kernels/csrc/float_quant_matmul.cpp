// Float quantized linear layers on CPU: float32 activations times FP8 E4M3 or NVFP4 (E2M1) weights that are
// dequantized inside the kernel, with fp32 FMAs (glmserve/quant/cpu_float_backend.py repacks the weights and
// documents the formats); and float32 activations times 16-bit float weights (bf16 or fp16, no scale: the
// high-precision lm_head of a quantized model at half of float32's bytes, glmserve/layers/half_linear.py).
//
// Weights: rows interleaved in tiles of 16 output rows, as the int kernels (quant_matmul.cpp) lay them out,
// so that one SIMD vector holds input i of the tile's 16 rows and a dot product accumulates one row per lane
// with no horizontal sum:
//   fp8: codes [tiles, kp, 16] uint8 (E4M3 bits); scales [tiles, groups, 16] float32, one per row and group
//        of `group` inputs (channel / tensor: one group), times 2^120 / post (see decode below)
//   fp4: codes [tiles, kp / 2, 16] uint8: byte j of row r = code of input 2j (low nibble) | 2j+1 (high);
//        scales [tiles, groups, 16] uint8 (E4M3 bits of NVFP4's per-16 scale); `factor` = 2^120 / (global
//        scale * post)
//   bf16 / f16: codes [tiles, kp, 16] 16-bit floats, no scales (one group of scale 1: the row's sum as it is)
// A weight is value(code) * s(row, group); the output is post * sum_i x_i w_i (post: a power of two that
// keeps the folded scales finite, 1 for any real checkpoint).
//
// Decoding (bit tricks, our own; the idea of moving a small float's exponent and mantissa into fp32 and
// rescaling is the usual one, e.g. the fp16 fallback in quant_matmul.cpp):
//   E4M3 s eeee mmm: sign-extend the byte to 32 bits, shift left 20 and keep bits 31 and 26..20: the fp32
//     number with exponent field eeee and mantissa mmm, which is exactly value * 2^-120 for normal and
//     subnormal codes alike (fp32 subnormals: the kernel relies on denormals not being flushed, torch's
//     default). The 2^120 lives in the scale, so value * s is one multiply and bit-identical to the
//     reference's fp8.float() * scale. NaN codes (0x7F, 0xFF) are not decoded as NaN (quantizers never write them).
//   E2M1: a 16-entry table: AVX-512 vpermps (one instruction), AVX2 vpermps on the magnitude (8 entries)
//     with the sign bit or-ed in, scalar a table lookup.
//   bf16: zero-extend to 32 bits and shift left 16 (exact); fp16: F16C's vcvtph2ps (exact), scalar c10::Half.
// Per tile: batch <= 2 NB rows (NB: 8 AVX-512, 4 AVX2 and scalar), each group of up to NB rows: each input's 16
// weights are decoded into a register, unscaled, and FMA-ed into the rows' accumulators of the current scale group
// (2-4 independent chains at small NB to hide FMA latency); at the group's end one FMA per row adds accumulator x
// scale to the row's total, so the scale costs one multiply per group instead of one per weight (NVFP4: per 16
// inputs). Batch > 2 NB: the tile's weights are decoded once per chunk of KC inputs into an fp32 buffer
// (16 x KC floats, in L1/L2) and every group of NB rows runs an fp32 micro-kernel over it (two tiles at a time on
// AVX-512), so decoding is paid once per weight whatever the batch (the "decode once, reuse" tiling of llama.cpp's
// and vLLM's CPU GEMMs, in our own code). Threads split the tiles (at::parallel_for).
//
// Activations are float32. With fp8 activations (the fp8 schemes' dynamic per-token E4M3), each row is
// fake-quantized first exactly as glmserve/quant/reference.py does (scale = max(amax / 448, 1e-12), codes by
// torch's own E4M3 rounding, c10::Float8_e4m3fn's, in vectorizable bit arithmetic: e4m3_round), then multiplied in
// float: the same numbers as the reference.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/extension.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t ROWS = 16;   // output rows per tile
// Every loop over a kernel's rows, chains or pairs is unrolled before GCC places its arrays of vectors: left to
// itself, GCC 12 kept such an array (the accumulators) in memory as well and stored each FMA's result to the stack
// (tile_direct at 4-7 GMAC/s at batch 1, chunk_fma at 12 with 32 rows, on Zen 3)
#define UNROLL _Pragma("GCC unroll 16")
constexpr int64_t KC = 256;    // inputs per decoded chunk (batched path): 16 KB of fp32 weights
constexpr float FP8_MAX = 448.0f;

enum class Fmt { FP8, FP4, BF16, F16 };
constexpr bool half_format(Fmt f) { return f == Fmt::BF16 || f == Fmt::F16; }
// bytes of codes before input i (even) of a tile: 16 rows of 1, 1/2 or 2 bytes each
template <Fmt F> constexpr int64_t code_offset(int64_t i) {
  return F == Fmt::FP4 ? (i / 2) * ROWS : (half_format(F) ? 2 : 1) * i * ROWS;
}

// ---------------------------------------------------------------------------------------------- vectors of 16 rows
#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int MAX_NB = 8;
struct V { __m512 r; };
inline V vzero() { return {_mm512_setzero_ps()}; }
inline V vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void vstore(float* p, V a) { _mm512_storeu_ps(p, a.r); }
inline V vadd(V a, V b) { return {_mm512_add_ps(a.r, b.r)}; }
inline V vmul(V a, V b) { return {_mm512_mul_ps(a.r, b.r)}; }
inline V vset(float x) { return {_mm512_set1_ps(x)}; }
inline V vfma(const float* x, V w, V acc) { return {_mm512_fmadd_ps(_mm512_set1_ps(*x), w.r, acc.r)}; }
inline V vfmav(V a, V b, V acc) { return {_mm512_fmadd_ps(a.r, b.r, acc.r)}; }
inline V fp8_scaled(const uint8_t* p) {  // 16 E4M3 codes -> value * 2^-120
  const __m512i v = _mm512_slli_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 20);
  return {_mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0x87F00000u))))};
}
inline void fp4_pair(const uint8_t* p, V& lo, V& hi) {  // 16 bytes -> the values of their low and high nibbles
  const __m512 table = _mm512_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f);
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo.r = _mm512_permutexvar_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)), table);
  hi.r = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
}
template <bool BF16> inline V half_values(const uint8_t* p) {  // 16 bf16 / fp16 numbers -> float32
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (BF16) return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
  else return {_mm512_cvtph_ps(h)};
}
template <int NB> constexpr int chains() { return NB == 1 ? 4 : 2; }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int MAX_NB = 4;
struct V { __m256 a, b; };
inline V vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v.a); _mm256_storeu_ps(p + 8, v.b); }
inline V vadd(V x, V y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
inline V vmul(V x, V y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
inline V vset(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V vfma(const float* x, V w, V acc) {
  const __m256 b = _mm256_broadcast_ss(x);
  return {_mm256_fmadd_ps(b, w.a, acc.a), _mm256_fmadd_ps(b, w.b, acc.b)};
}
inline V vfmav(V x, V y, V acc) { return {_mm256_fmadd_ps(x.a, y.a, acc.a), _mm256_fmadd_ps(x.b, y.b, acc.b)}; }
inline __m256 fp8_scaled8(const uint8_t* p) {  // 8 codes; the 8-byte load folds into vpmovsxbd
  const __m256i v = _mm256_slli_epi32(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 20);
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0x87F00000u))));
}
inline V fp8_scaled(const uint8_t* p) { return {fp8_scaled8(p), fp8_scaled8(p + 8)}; }
inline void fp4_pair8(const uint8_t* p, __m256& lo, __m256& hi) {
  // vpermps reads the low 3 bits of each index: the magnitude of the low nibble, then (shifted) of the high one
  const __m256 table = _mm256_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f);
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  lo = _mm256_or_ps(_mm256_permutevar8x32_ps(table, v), _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(v, 28), sign)));
  hi = _mm256_or_ps(_mm256_permutevar8x32_ps(table, _mm256_srli_epi32(v, 4)),
                    _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(v, 24), sign)));
}
inline void fp4_pair(const uint8_t* p, V& lo, V& hi) {
  fp4_pair8(p, lo.a, hi.a);
  fp4_pair8(p + 8, lo.b, hi.b);
}
template <bool BF16> inline __m256 half_values8(const uint8_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  else return _mm256_cvtph_ps(h);  // F16C, part of the x86-64-v3 build
}
template <bool BF16> inline V half_values(const uint8_t* p) {
  return {half_values8<BF16>(p), half_values8<BF16>(p + 16)};
}
template <int NB> constexpr int chains() { return NB == 1 ? 2 : 1; }
#else
constexpr int MAX_NB = 4;
struct V { float v[ROWS]; };
inline V vzero() { return V{}; }
inline V vload(const float* p) { V r; std::memcpy(r.v, p, sizeof(r.v)); return r; }
inline void vstore(float* p, const V& a) { std::memcpy(p, a.v, sizeof(a.v)); }
inline V vadd(V a, const V& b) { for (int r = 0; r < ROWS; ++r) a.v[r] += b.v[r]; return a; }
inline V vmul(V a, const V& b) { for (int r = 0; r < ROWS; ++r) a.v[r] *= b.v[r]; return a; }
inline V vset(float x) { V a; for (int r = 0; r < ROWS; ++r) a.v[r] = x; return a; }
inline V vfma(const float* x, const V& w, V acc) { for (int r = 0; r < ROWS; ++r) acc.v[r] += *x * w.v[r]; return acc; }
inline V vfmav(const V& a, const V& b, V acc) { for (int r = 0; r < ROWS; ++r) acc.v[r] += a.v[r] * b.v[r]; return acc; }
inline V fp8_scaled(const uint8_t* p) {
  V a;
  for (int r = 0; r < ROWS; ++r) {
    const uint32_t bits = (static_cast<uint32_t>(static_cast<int32_t>(static_cast<int8_t>(p[r]))) << 20) & 0x87F00000u;
    std::memcpy(&a.v[r], &bits, 4);
  }
  return a;
}
constexpr float E2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
inline void fp4_pair(const uint8_t* p, V& lo, V& hi) {
  for (int r = 0; r < ROWS; ++r) {
    lo.v[r] = E2M1[p[r] & 15];
    hi.v[r] = E2M1[p[r] >> 4];
  }
}
template <bool BF16> inline V half_values(const uint8_t* p) {
  V a;
  for (int r = 0; r < ROWS; ++r) {
    uint16_t h;
    std::memcpy(&h, p + 2 * r, 2);
    if constexpr (BF16) {
      const uint32_t bits = static_cast<uint32_t>(h) << 16;
      std::memcpy(&a.v[r], &bits, 4);
    } else {
      a.v[r] = static_cast<float>(c10::Half(h, c10::Half::from_bits()));
    }
  }
  return a;
}
template <int NB> constexpr int chains() { return 1; }
#endif

// ---------------------------------------------------------------------------------------------- one tile
struct Tile {
  const uint8_t* codes;   // fp8: [kp, 16]; fp4: [kp / 2, 16]; bf16 / f16: [kp, 16] 16-bit
  const float* scales;    // fp8: [groups, 16] (folded)
  const uint8_t* sbytes;  // fp4: [groups, 16] E4M3 bits
};

struct Shape {
  int64_t kp, group, groups;
  float factor;  // fp4: 2^120 / (global * post)
};

// Input columns kept in float beside the codes (zero codes there): their product, x[:, cols] times part's rows, is
// added to the output after `post`; the rows the codes multiply have these columns zeroed (so that they do not set
// an fp8 row's scale), as glmserve/layers/linear.py adds them outside a kernel
struct FloatColumns {
  const float* x = nullptr;      // the activations as given, [N, stride]
  int64_t stride = 0;
  const int64_t* cols = nullptr;  // [n]
  int64_t n = 0;
  const float* part = nullptr;   // [tiles, n, 16]: rows interleaved as the codes'
};

template <Fmt F>
inline V group_scale(const Tile& t, const Shape& s, int64_t g) {
  if constexpr (F == Fmt::FP4) return vmul(fp8_scaled(t.sbytes + g * ROWS), vset(s.factor));
  else if constexpr (F == Fmt::FP8) return vload(t.scales + g * ROWS);
  else return vset(1.f);
}

// the code values (times 2^-120 for E4M3) of inputs i and i + 1 (i even) of the tile's 16 rows, unscaled
template <Fmt F>
inline void decode_raw_pair(const Tile& t, int64_t i, V& w0, V& w1) {
  const uint8_t* p = t.codes + code_offset<F>(i);
  if constexpr (F == Fmt::FP4) {
    fp4_pair(p, w0, w1);
  } else if constexpr (F == Fmt::FP8) {
    w0 = fp8_scaled(p);
    w1 = fp8_scaled(p + ROWS);
  } else {
    w0 = half_values<F == Fmt::BF16>(p);
    w1 = half_values<F == Fmt::BF16>(p + 2 * ROWS);
  }
}

// the same weights times their group's scale
template <Fmt F>
inline void decode_pair(const Tile& t, int64_t i, const V& sg, V& w0, V& w1) {
  decode_raw_pair<F>(t, i, w0, w1);
  w0 = vmul(w0, sg);
  w1 = vmul(w1, sg);
}

// The direct path reads each weight once per call, from DRAM in a decode step: it asks for the codes PF_BYTES
// ahead (past the tile's end: the next tile's, which follows in memory) and for NVFP4's scale bytes PF_GROUPS
// groups ahead, as the int kernels' tiles do (quant_matmul.cpp PF_BLOCKS)
constexpr int64_t PF_BYTES = 1024, PF_GROUPS = 4;

// NB activation rows (x rows of stride kp) x one tile, decoding in registers: out [NB, 16]
template <int NB, Fmt F>
void tile_direct(const Tile& t, const Shape& s, const float* x, float* out) {
  constexpr int CH = chains<NB>();  // independent accumulators per row (1, 2 or 4)
  constexpr int STEP = CH < 2 ? 2 : CH;  // inputs per step: whole pairs
  V total[NB];
  UNROLL for (int n = 0; n < NB; ++n) total[n] = vzero();
  for (int64_t g = 0; g < s.groups; ++g) {
    V acc[NB][CH];
    UNROLL for (int n = 0; n < NB; ++n)
      UNROLL for (int c = 0; c < CH; ++c) acc[n][c] = vzero();
    const int64_t end = std::min(s.kp, (g + 1) * s.group);
    if constexpr (F == Fmt::FP4) __builtin_prefetch(t.sbytes + (g + PF_GROUPS) * ROWS);
    for (int64_t i = g * s.group; i < end; i += STEP) {
      __builtin_prefetch(t.codes + code_offset<F>(i) + PF_BYTES);
      UNROLL for (int p = 0; p < STEP; p += 2) {
        V w0, w1;
        decode_raw_pair<F>(t, i + p, w0, w1);
        UNROLL for (int n = 0; n < NB; ++n) {
          const float* xi = x + n * s.kp + i + p;
          acc[n][p % CH] = vfma(xi, w0, acc[n][p % CH]);
          acc[n][(p + 1) % CH] = vfma(xi + 1, w1, acc[n][(p + 1) % CH]);
        }
      }
    }
    const V sg = group_scale<F>(t, s, g);
    UNROLL for (int n = 0; n < NB; ++n) {
      V sum = acc[n][0];
      UNROLL for (int c = 1; c < CH; ++c) sum = vadd(sum, acc[n][c]);
      total[n] = vfmav(sum, sg, total[n]);
    }
  }
  UNROLL for (int n = 0; n < NB; ++n) vstore(out + n * ROWS, total[n]);
}

// the tile's weights of inputs [k0, k1) decoded and scaled into buf [k1 - k0, 16]
template <Fmt F>
void decode_chunk(const Tile& t, const Shape& s, int64_t k0, int64_t k1, float* buf) {
  for (int64_t g = k0 / s.group; g * s.group < k1; ++g) {
    const V sg = group_scale<F>(t, s, g);
    const int64_t lo = std::max(k0, g * s.group), hi = std::min(k1, (g + 1) * s.group);
    for (int64_t i = lo; i < hi; i += 2) {
      V w0, w1;
      decode_pair<F>(t, i, sg, w0, w1);
      vstore(buf + (i - k0) * ROWS, w0);
      vstore(buf + (i - k0 + 1) * ROWS, w1);
    }
  }
}

// NB rows x T decoded chunks of `len` inputs (T tiles side by side, buf [T][KC][16]): acc [T][N][16] (in memory,
// across chunks; `n_stride` = N * 16 floats between tiles) += x[:, k0:k0+len] w. Two tiles (AVX-512) load each row's
// broadcast input once for two FMAs and keep 16 accumulators in flight
template <int NB, int T>
void chunk_fma(const float* buf, int64_t len, const float* x, int64_t kp, float* acc, int64_t n_stride) {
  V a[T][NB];
  UNROLL for (int t = 0; t < T; ++t)
    UNROLL for (int n = 0; n < NB; ++n) a[t][n] = vload(acc + t * n_stride + n * ROWS);
  for (int64_t i = 0; i < len; ++i) {
    V w[T];
    UNROLL for (int t = 0; t < T; ++t) w[t] = vload(buf + t * KC * ROWS + i * ROWS);
    UNROLL for (int n = 0; n < NB; ++n)
      UNROLL for (int t = 0; t < T; ++t) a[t][n] = vfma(x + n * kp + i, w[t], a[t][n]);
  }
  UNROLL for (int t = 0; t < T; ++t)
    UNROLL for (int n = 0; n < NB; ++n) vstore(acc + t * n_stride + n * ROWS, a[t][n]);
}

template <int NB, int T>
void chunk_rows(int rows, const float* buf, int64_t len, const float* x, int64_t kp, float* acc, int64_t n_stride) {
  if constexpr (NB > 1) {
    if (rows < NB) return chunk_rows<NB - 1, T>(rows, buf, len, x, kp, acc, n_stride);
  }
  chunk_fma<NB, T>(buf, len, x, kp, acc, n_stride);
}

// rows up to which each group of MAX_NB rows decodes the weights in registers again (the direct path) rather than
// once into a chunk buffer: a second decode costs less than the chunk's stores and reloads at 9-16 rows
constexpr int64_t DIRECT_ROWS = 2 * MAX_NB;
// tiles per pass of the batched path: two where 16 accumulators and their weights fit the registers (AVX-512)
constexpr int PASS_TILES = MAX_NB == 8 ? 2 : 1;

// T tiles (t0 and the next T - 1) x N rows through decoded chunks: acc [T][N][16]
template <Fmt F, int T>
void chunked_tiles(const Tile* t, const Shape& s, const float* x, int64_t N, float* buf, float* acc) {
  std::fill(acc, acc + T * N * ROWS, 0.f);
  for (int64_t k0 = 0; k0 < s.kp; k0 += KC) {
    const int64_t len = std::min(KC, s.kp - k0);
    for (int u = 0; u < T; ++u) decode_chunk<F>(t[u], s, k0, k0 + len, buf + u * KC * ROWS);
    for (int64_t n0 = 0; n0 < N; n0 += MAX_NB)
      chunk_rows<MAX_NB, T>(static_cast<int>(std::min<int64_t>(MAX_NB, N - n0)), buf, len, x + n0 * s.kp + k0, s.kp,
                            acc + n0 * ROWS, N * ROWS);
  }
}

template <Fmt F, int NB>
void direct_rows(int rows, const Tile& t, const Shape& s, const float* x, float* out) {
  if constexpr (NB > 1) {
    if (rows < NB) return direct_rows<F, NB - 1>(rows, t, s, x, out);
  }
  tile_direct<NB, F>(t, s, x, out);
}

// acc [N, 16] += the float columns' product for tile ti
inline void add_float_columns(const FloatColumns& fc, int64_t ti, int64_t N, float* acc) {
  const float* part = fc.part + ti * fc.n * ROWS;
  for (int64_t n = 0; n < N; ++n) {
    V sum = vzero();
    for (int64_t j = 0; j < fc.n; ++j) sum = vfma(fc.x + n * fc.stride + fc.cols[j], vload(part + j * ROWS), sum);
    vstore(acc + n * ROWS, sum);
  }
}

template <Fmt F>
void matmul_impl(const float* x, int64_t N, const uint8_t* codes, const float* scales, const uint8_t* sbytes,
                 int64_t tiles, const Shape& s, float post, int64_t out_features, float* o, const FloatColumns& fc) {
  const int64_t code_bytes = code_offset<F>(s.kp);
  const auto tile = [&](int64_t ti) {
    return Tile{codes + ti * code_bytes, F == Fmt::FP8 ? scales + ti * s.groups * ROWS : nullptr,
                F == Fmt::FP4 ? sbytes + ti * s.groups * ROWS : nullptr};
  };
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    const bool chunked = N > DIRECT_ROWS;
    std::vector<float> acc(PASS_TILES * N * ROWS), buf(chunked ? PASS_TILES * KC * ROWS : 0);
    std::vector<float> extra(fc.n ? N * ROWS : 0);
    for (int64_t ti = begin; ti < end;) {
      const int pass = chunked && ti + PASS_TILES <= end ? PASS_TILES : 1;
      if (!chunked) {
        const Tile t = tile(ti);
        for (int64_t n0 = 0; n0 < N; n0 += MAX_NB)
          direct_rows<F, MAX_NB>(static_cast<int>(std::min<int64_t>(MAX_NB, N - n0)), t, s, x + n0 * s.kp,
                                 acc.data() + n0 * ROWS);
      } else if (pass == 1) {
        const Tile t = tile(ti);
        chunked_tiles<F, 1>(&t, s, x, N, buf.data(), acc.data());
      } else {
        Tile t[PASS_TILES];
        for (int u = 0; u < PASS_TILES; ++u) t[u] = tile(ti + u);
        chunked_tiles<F, PASS_TILES>(t, s, x, N, buf.data(), acc.data());
      }
      for (int u = 0; u < pass; ++u, ++ti) {
        const float* a = acc.data() + u * N * ROWS;
        const int64_t r0 = ti * ROWS, cols = std::min<int64_t>(ROWS, out_features - r0);
        if (fc.n) add_float_columns(fc, ti, N, extra.data());
        for (int64_t n = 0; n < N; ++n)
          for (int64_t c = 0; c < cols; ++c)
            o[n * out_features + r0 + c] = a[n * ROWS + c] * post + (fc.n ? extra[n * ROWS + c] : 0.f);
      }
    }
  });
}

// v rounded to the nearest E4M3 value, ties to even (|v| <= 448 here), as c10::Float8_e4m3fn(v) converts it and
// float() widens it back; branch-free bit arithmetic on fp32 so that the loop over a row vectorizes (the same steps
// as c10's fp8e4m3fn_from_fp32_value, which converts one value at a time: ~11 ns a value measured on Zen 5):
//   |v| >= 2^-6 (E4M3 normals): the fp32 mantissa rounded to its top 3 bits (a carry moves into the exponent);
//   below (E4M3 subnormals, multiples of 2^-9): |v| + 2^14 rounds there in fp32 arithmetic, then 2^14 comes off.
// Compiled without fast math (as fp8_row), so that the add and subtract are not folded away.
__attribute__((optimize("no-fast-math"))) inline float e4m3_round(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  const uint32_t normal = (magnitude + 0x7FFFFu + ((magnitude >> 20) & 1u)) & 0xFFF00000u;
  float m;
  std::memcpy(&m, &magnitude, 4);
  const float sub = (m + 16384.f) - 16384.f;
  uint32_t sub_bits;
  std::memcpy(&sub_bits, &sub, 4);
  const uint32_t rounded = (magnitude < 0x3C800000u ? sub_bits : normal) | (bits & 0x80000000u);  // 2^-6
  float out;
  std::memcpy(&out, &rounded, 4);
  return out;
}

// one row fake-quantized to E4M3 per token in place, as reference.fake_quantize_activations: (x / scale) -> e4m3 ->
// * scale, the row zero-padded from k to kp. Without fast math, so that x / scale is a true division (as torch's)
// rather than a reciprocal multiply. Both loops vectorize (in place: no aliasing check to fall back on scalar code).
__attribute__((optimize("no-fast-math"))) void fp8_row(float* row, int64_t k, int64_t kp) {
  uint32_t largest = 0;  // |x| compared as bits: the floats' order (no NaN), and a maximum that vectorizes
  for (int64_t i = 0; i < k; ++i) {
    uint32_t bits;
    std::memcpy(&bits, row + i, 4);
    largest = std::max(largest, bits & 0x7FFFFFFFu);
  }
  float amax;
  std::memcpy(&amax, &largest, 4);
  const float scale = std::max(amax / FP8_MAX, 1e-12f);
  for (int64_t i = 0; i < k; ++i) row[i] = e4m3_round(row[i] / scale) * scale;
  for (int64_t i = k; i < kp; ++i) row[i] = 0.f;
}

// x [N, k] -> [N, kp] float32 rows the kernel reads: the float columns zeroed, fake-quantized to fp8 per token,
// zero-padded, or x itself
at::Tensor kernel_rows(const at::Tensor& x, int64_t kp, bool fp8_tokens, const FloatColumns& fc = {}) {
  const int64_t N = x.size(0), k = x.size(1);
  if (!fp8_tokens && k == kp && !fc.n) return x;
  auto rows = at::empty({N, kp}, at::kFloat);
  const float* xp = x.data_ptr<float>();
  float* rp = rows.data_ptr<float>();
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      float* row = rp + n * kp;
      std::memcpy(row, xp + n * k, k * sizeof(float));
      std::fill(row + k, row + kp, 0.f);
      for (int64_t j = 0; j < fc.n; ++j) row[fc.cols[j]] = 0.f;
      if (fp8_tokens) fp8_row(row, k, kp);
    }
  });
  return rows;
}

// the fp8 activation rows alone (tests compare them with the reference's)
at::Tensor fp8_fake_quantize_rows(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "fp8_fake_quantize_rows: x must be a 2-D float32 CPU tensor");
  const auto x = x_in.contiguous();
  return kernel_rows(x, x.size(1), true);
}

// out [N, out_features] = x [N, k] (fp8-fake-quantized per row first when fp8_tokens) x the packed weight, plus
// x[:, columns] x float_part's rows where columns is not empty (columns [n] int64, float_part [tiles, n, 16] float32)
at::Tensor float_quant_linear(const at::Tensor& x_in, bool fp8_tokens, const at::Tensor& codes, const at::Tensor& scales,
                              bool fp4, int64_t group, double factor, double post, int64_t out_features,
                              const at::Tensor& columns, const at::Tensor& float_part) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "float_quant_linear: x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.size(2) == ROWS,
              "float_quant_linear: codes [tiles, kp or kp / 2, 16] uint8");
  const int64_t tiles = codes.size(0), kp = fp4 ? codes.size(1) * 2 : codes.size(1);
  TORCH_CHECK(kp % 16 == 0 && group > 0 && group % 16 == 0, "float_quant_linear: inputs padded to 16, groups of 16s");
  const int64_t groups = (kp + group - 1) / group;
  TORCH_CHECK(scales.is_contiguous() && scales.dim() == 3 && scales.size(0) == tiles && scales.size(1) == groups &&
                  scales.size(2) == ROWS && scales.scalar_type() == (fp4 ? at::kByte : at::kFloat),
              "float_quant_linear: scales [tiles, groups, 16] (float32 for fp8, E4M3 bytes for fp4)");
  TORCH_CHECK(tiles * ROWS >= out_features, "float_quant_linear: ", tiles, " tiles hold fewer rows than ", out_features);
  const auto x = x_in.contiguous();
  TORCH_CHECK(x.size(1) <= kp && x.size(1) > kp - 16, "float_quant_linear: input has ", x.size(1),
              " features, the weight ", kp, " (padded)");
  FloatColumns fc;
  if (columns.numel()) {
    TORCH_CHECK(columns.dim() == 1 && columns.scalar_type() == at::kLong && columns.is_contiguous() &&
                    float_part.scalar_type() == at::kFloat && float_part.is_contiguous() &&
                    float_part.sizes() == at::IntArrayRef({tiles, columns.numel(), ROWS}),
                "float_quant_linear: columns [n] int64 and float_part [tiles, n, 16] float32");
    const int64_t* cols = columns.data_ptr<int64_t>();
    TORCH_CHECK(std::all_of(cols, cols + columns.numel(), [&](int64_t c) { return c >= 0 && c < x.size(1); }),
                "float_quant_linear: a float column outside the input's ", x.size(1));
    fc = {x.data_ptr<float>(), x.size(1), cols, columns.numel(), float_part.data_ptr<float>()};
  }
  const auto rows = kernel_rows(x, kp, fp8_tokens, fc);
  const int64_t N = x.size(0);
  auto out = at::empty({N, out_features}, at::kFloat);
  const Shape s{kp, group, groups, static_cast<float>(factor)};
  if (fp4)
    matmul_impl<Fmt::FP4>(rows.data_ptr<float>(), N, codes.data_ptr<uint8_t>(), nullptr, scales.data_ptr<uint8_t>(),
                          tiles, s, static_cast<float>(post), out_features, out.data_ptr<float>(), fc);
  else
    matmul_impl<Fmt::FP8>(rows.data_ptr<float>(), N, codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), nullptr,
                          tiles, s, static_cast<float>(post), out_features, out.data_ptr<float>(), fc);
  return out;
}

// out [N, out_features] = x [N, k] x a weight of 16-bit floats packed in tiles of 16 rows (codes [tiles, kp, 16]:
// bf16 or fp16 bits), each weight widened exactly to float32
at::Tensor half_linear(const at::Tensor& x_in, const at::Tensor& codes, bool bf16, int64_t out_features) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "half_linear: x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(codes.dim() == 3 && codes.element_size() == 2 && codes.is_contiguous() && codes.size(2) == ROWS,
              "half_linear: codes [tiles, kp, 16] of 16-bit floats");
  const int64_t tiles = codes.size(0), kp = codes.size(1);
  TORCH_CHECK(kp % 16 == 0 && tiles * ROWS >= out_features, "half_linear: inputs padded to 16, ", tiles,
              " tiles for ", out_features, " rows");
  const auto x = x_in.contiguous();
  TORCH_CHECK(x.size(1) <= kp && x.size(1) > kp - 16, "half_linear: input has ", x.size(1), " features, the weight ",
              kp, " (padded)");
  const auto rows = kernel_rows(x, kp, false);
  const int64_t N = x.size(0);
  auto out = at::empty({N, out_features}, at::kFloat);
  const Shape s{kp, kp, 1, 1.f};
  const auto* bytes = static_cast<const uint8_t*>(codes.data_ptr());
  if (bf16)
    matmul_impl<Fmt::BF16>(rows.data_ptr<float>(), N, bytes, nullptr, nullptr, tiles, s, 1.f, out_features,
                           out.data_ptr<float>(), {});
  else
    matmul_impl<Fmt::F16>(rows.data_ptr<float>(), N, bytes, nullptr, nullptr, tiles, s, 1.f, out_features,
                          out.data_ptr<float>(), {});
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("float_quant_linear", &float_quant_linear, "float32 activations x packed FP8 / NVFP4 weights (CPU)");
  m.def("half_linear", &half_linear, "float32 activations x packed bf16 / fp16 weights (CPU)");
  m.def("fp8_fake_quantize_rows", &fp8_fake_quantize_rows, "E4M3 per-token fake quantization of activation rows");
}
