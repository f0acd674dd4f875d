// int8 KV rows (glmserve/kv/kv_format.py, `--kv-cache-dtype int8`), written by the KV stores of paged_decode.cpp
// (store_kv) and prefill_ops.cpp (rope_store_kv): D values -> D int8 codes, then the row's float16 scale, the same
// bytes as KVFormat.quantize:
//
//   scale = float16(clamp(absmax / 127, 2^-24, 65504))    (rounded to nearest even)
//   code  = round_half_even(clamp(x * (1 / float(scale)), -127, 127))
//
// and optionally the values a reader dequantizes (code * float(scale), kv_format.dequantize) into `back`.
// Includers include vec_math.h first (abs_max; headers include none: kernels/build.py hashes the ones a source
// includes). Bit-exact under the builds' -ffast-math: the float16 rounding is F16C's or integer arithmetic (c10::Half's
// conversion leans on float products fast-math may fold), the one division by 127 goes through a volatile (fast-math
// would turn a division by a constant into a product by its inexact reciprocal), and each value is multiplied by the
// reciprocal as the Python side does (a division by a loop-invariant divisor may be rewritten so).
#pragma once

#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace glmserve {

constexpr int64_t kInt8ScaleBytes = 2;  // the float16 scale after a row's codes
inline volatile float kInt8Max = 127.f;  // volatile: see the header comment
constexpr float kInt8MinScale = 5.9604644775390625e-08f;  // 2^-24, float16's smallest subnormal
constexpr float kInt8MaxScale = 65504.f;                  // float16's largest finite

// float -> float16 bits, to nearest even (overflow to inf, NaN kept quiet), as torch's .half() rounds.
inline uint16_t f32_to_f16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u, exp = (u >> 23) & 0xffu, mant = u & 0x7fffffu;
  if (exp == 0xffu) return static_cast<uint16_t>(sign | 0x7c00u | (mant ? 0x200u : 0u));
  const int32_t e = static_cast<int32_t>(exp) - 127 + 15;
  if (e >= 31) return static_cast<uint16_t>(sign | 0x7c00u);
  if (e <= 0) {  // float16 subnormal (or zero): the full mantissa shifted down, rounded
    if (e < -10) return static_cast<uint16_t>(sign);
    const uint32_t full = mant | 0x800000u, shift = static_cast<uint32_t>(14 - e);
    uint32_t h = full >> shift;
    const uint32_t rest = full & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  uint32_t h = (static_cast<uint32_t>(e) << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent rounds up correctly
  return static_cast<uint16_t>(sign | h);
}

// One row of `d` float32 values into `row` (d codes, then the scale's two bytes); `back` (or null): the values as
// dequantized.
inline void quantize_int8_row(const float* x, int8_t* row, float* back, int64_t d) {
  const float amax = abs_max(x, d);
  float scale = amax / kInt8Max;
  scale = scale < kInt8MinScale ? kInt8MinScale : (scale > kInt8MaxScale ? kInt8MaxScale : scale);
#if defined(__F16C__)
  const uint16_t bits = _cvtss_sh(scale, _MM_FROUND_TO_NEAREST_INT);  // to nearest even, as f32_to_f16_bits
  const float s = _cvtsh_ss(bits), inv = 1.f / s;
#else
  const uint16_t bits = f32_to_f16_bits(scale);
  const float s = static_cast<float>(c10::Half(bits, c10::Half::from_bits())), inv = 1.f / s;  // exact
#endif
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 vinv = _mm512_set1_ps(inv), vs = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.f),
               hi = _mm512_set1_ps(127.f);
  for (; j + 16 <= d; j += 16) {
    const __m512 y = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_loadu_ps(x + j), vinv), lo), hi);
    const __m512 c = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(row + j), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(c)));
    if (back) _mm512_storeu_ps(back + j, _mm512_mul_ps(c, vs));
  }
#endif
  for (; j < d; ++j) {
    float y = x[j] * inv;
    y = y < -127.f ? -127.f : (y > 127.f ? 127.f : y);
    const float c = std::nearbyint(y);
    row[j] = static_cast<int8_t>(c);
    if (back) back[j] = c * s;
  }
  std::memcpy(row + d, &bits, kInt8ScaleBytes);
}

}  // namespace glmserve
