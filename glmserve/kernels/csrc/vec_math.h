// Small numeric helpers shared by the prefill kernels (prefill_ops.cpp, prefill_attention.cpp, quant_matmul.cpp):
// bf16 <-> float32 conversion as torch rounds, exp(x) as a scalar function the compiler vectorizes (fast_exp) and, in
// AVX-512 builds, 2^x on one 16-lane vector (fast_exp2_16, and fast_exp2_16_bf16 for weights rounded to bf16 next)
// and the bf16 rounding on 16 lanes (f32_to_bf16_16); in every build both conversions over n values (bf16_to_f32_n,
// f32_to_bf16_n: 16 lanes at a time where AVX-512);
// SwiGLU's silu(g) * u on those (silu_mul, silu_mul_16), so that silu_and_mul and the fused gate-up linear agree;
// a row's largest |x| (abs_max).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace glmserve {

// The largest |x| of n floats: lanes of max in SIMD builds (a scalar loop is a chain of dependent maxima: without
// -ffinite-math-only the compiler does not vectorize it), exact in any order (quant_matmul.cpp's activation scales,
// kv_int8.h's row scales).
inline float abs_max(const float* x, int64_t n) {
  int64_t i = 0;
  float amax = 0.f;
#if defined(__AVX512F__)
  __m512 m = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
  amax = _mm512_reduce_max_ps(m);
#elif defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  for (float v : lanes) amax = std::max(amax, v);
#endif
  for (; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  return amax;
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch's .to(torch.bfloat16); NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// exp(x) for x in [-87, 88], ~2 ulp: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by Cephes' degree-6 polynomial, times
// 2^n built in the exponent bits (x below -87 gives exp(-87), above 88 exp(88)). Branch-free and free of library
// calls (no fmin/fmax, nearbyint or fma, which are calls without -ffinite-math-only or FMA), so that loops over it
// vectorize; -ffast-math contracts the products and sums into FMAs where the variant has them. ln2 is split so
// that n * ln2_hi is exact.
constexpr float kExpLo = -87.0f, kExpHi = 88.0f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693145751953125f, kLn2Lo = 1.428606765330187e-06f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float fast_exp(float x) {
  x = x < kExpLo ? kExpLo : (x > kExpHi ? kExpHi : x);
  const int32_t i = static_cast<int32_t>(x * kLog2e + 128.5f) - 128;  // round(x / ln2), positive trunc
  const float n = static_cast<float>(i);
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  float p = kExpPoly[0];
  for (int k = 1; k < 6; ++k) p = p * r + kExpPoly[k];
  p = p * r * r + r + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(i + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// silu(g) * u = g / (1 + e^-g) * u
inline float silu_mul(float g, float u) { return g / (1.0f + fast_exp(-g)) * u; }

#if defined(__AVX512F__)
// 2^x on 16 lanes for finite x: x = n + f with n = round(x), |f| <= 1/2, 2^f by the polynomial 1 + f (c[N-1] + f (...
// c[0])), times 2^n by vscalefps, which also gives 0 below -149 and +inf above 128 without clamps. 3 + N instructions.
template <int N>
inline __m512 exp2_16(__m512 x, const float (&c)[N]) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(c[0]);
  for (int k = 1; k < N; ++k) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[k]));
  return _mm512_scalef_ps(_mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f)), n);
}

// ~1e-7 relative: e^(f ln2) by its Taylor series to degree 6 (truncation ~1.2e-7)
constexpr float kExp2Taylor[6] = {1.5403530393e-4f, 1.3333558146e-3f, 9.6181291076e-3f,
                                  5.5504108665e-2f, 2.4022650696e-1f, 6.9314718056e-1f};  // ln2^k / k!, k = 6..1
inline __m512 fast_exp2_16(__m512 x) { return exp2_16(x, kExp2Taylor); }

// ~1e-4 relative (max over |f| <= 1/2): a degree-3 polynomial fitted for least maximum relative error (iteratively
// reweighted least squares on Chebyshev nodes), for weights that are rounded to bf16 (2^-9 relative) next: the
// softmax of prefill_attention.cpp, 3 instructions fewer per 16 scores than fast_exp2_16
constexpr float kExp2Fit3[3] = {5.5008890785e-2f, 2.4221097165e-1f, 6.932829351e-1f};
inline __m512 fast_exp2_16_bf16(__m512 x) { return exp2_16(x, kExp2Fit3); }

// f32_to_bf16 on 16 lanes: the bf16 bits of x rounded to nearest even, a NaN kept a (quiet) NaN
inline __m256i f32_to_bf16_16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i top = _mm512_srli_epi32(u, 16);
  const __m512i even = _mm512_and_si512(top, _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), even), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(top, _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(r);
}

// silu(g) * u on 16 lanes: e^-g as 2^(-g log2 e), capped at 2^126 (g < -87: silu ~0) so that 1 + e and its
// reciprocal stay finite; the reciprocal as vrcp14ps (2^-14 relative) refined by one Newton step r + r (1 - d r)
// (~2^-28), where vdivps takes 16 cycles a vector on Intel's port 0 (the AMX GEMM's SwiGLU store: bench/RESULTS.md)
inline __m512 silu_mul_16(__m512 g, __m512 u) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 e = fast_exp2_16(_mm512_min_ps(_mm512_mul_ps(g, _mm512_set1_ps(-kLog2e)), _mm512_set1_ps(126.f)));
  const __m512 d = _mm512_add_ps(one, e);
  __m512 r = _mm512_rcp14_ps(d);
  r = _mm512_fmadd_ps(r, _mm512_fnmadd_ps(d, r, one), r);
  return _mm512_mul_ps(_mm512_mul_ps(g, r), u);
}
#endif

// n bf16 values (bits) widened to float32, and n float32 values rounded to bf16 as bf16_to_f32 / f32_to_bf16 (torch's
// cast), 16 lanes at a time where the build has AVX-512
inline void bf16_to_f32_n(const uint16_t* x, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, _mm512_castsi512_ps(_mm512_slli_epi32(
                                  _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i))), 16)));
#endif
  for (; i < n; ++i) out[i] = bf16_to_f32(x[i]);
}

inline void f32_to_bf16_n(const float* x, uint16_t* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), f32_to_bf16_16(_mm512_loadu_ps(x + i)));
#endif
  for (; i < n; ++i) out[i] = f32_to_bf16(x[i]);
}

}  // namespace glmserve
