// The packed quantized weight (quant/cpu_backend.py, csrc/quant_matmul.cpp's header) dequantized into bf16 input
// pairs: one tile (16 output rows) and block (32 inputs) becomes [16 input pairs][16 output rows][2] bf16, the
// operand layout of both AMX's tdpbf16ps (a B tile) and AVX512-BF16's vdpbf16ps (one zmm per input pair: 16 output
// lanes of 2 bf16). w = d * c + m in float32, rounded to nearest even bf16. Callers compile these into the
// avx512 build and call them only on CPUs with AVX512-BF16 (cpuid leaf 7 subleaf 1 EAX bit 5). Needs packed_blocks.h
// (included first by the source: the build stages one level of headers).
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>

#include <cstdint>

#define GLMSERVE_BF16_TARGET __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl")))

namespace glmserve {

constexpr int64_t PAIR_TILE = 16 * 32;  // bf16 elements of one dequantized tile and block: 16 pairs x 16 rows x 2

// AVX512-BF16 (CPUID leaf 7 subleaf 1 EAX bit 5: vcvtne2ps2bf16, vdpbf16ps)
inline bool avx512_bf16_present() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 5) & 1);
  }();
  return ok;
}

// Two rows of input pairs from 64 code bytes [16 out rows][4 inputs 4J..4J+3] (signed i8 codes or nibbles):
// row 2J = inputs 4J, 4J+1 of each out row, row 2J+1 = 4J+2, 4J+3. ds[g], ms[g]: the rows' d and m for out
// rows 4g..4g+3, each repeated over its 4 lanes.
// NIBBLE: 0 = the bytes are signed int8 codes; 1 / 2: the low / high nibbles of the bytes. BYTES, the tile block's
// format (packed_blocks.h): u5 blocks add 16 to out row r's input t of these four where bit 4r + t of `fifth` is
// set; q6 blocks take the top two bits from bits 2k, 2k+1 of the 64 bytes at `top`; t4 / f4 blocks' nibbles index
// `table`'s 16 int8 values
template <int NIBBLE, int64_t BYTES>
GLMSERVE_BF16_TARGET inline void bf16_pair_rows(const uint8_t* bytes, const __m512* ds, const __m512* ms,
                                                uint16_t* out, uint64_t fifth, const uint8_t* top, int k,
                                                __m128i table) {
  __m512 f[4];
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int g = 0; g < 4; ++g) {
    constexpr bool no_nibbles = BYTES == kQ2BlockBytes;  // q2: the two-bit fields alone
    const __m128i v =
        no_nibbles ? _mm_setzero_si128() : _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16 * g));
    __m128i nibbles = _mm_and_si128(NIBBLE == 1 ? v : _mm_srli_epi16(v, 4), low4);
    if constexpr (BYTES == kQ6BlockBytes || BYTES == kQ2BlockBytes) {
      const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(top + 16 * g));
      const __m128i field = _mm_and_si128(_mm_srl_epi16(t, _mm_cvtsi32_si128(2 * k)), _mm_set1_epi8(3));
      nibbles = no_nibbles ? field : _mm_or_si128(nibbles, _mm_slli_epi16(field, 4));  // q 0..3 / 0..63
    }
    constexpr bool tabled = BYTES == kT4BlockBytes || BYTES == kF4BlockBytes;
    __m512i w = NIBBLE == 0 ? _mm512_cvtepi8_epi32(v)
              : tabled      ? _mm512_cvtepi8_epi32(_mm_shuffle_epi8(table, nibbles))
                            : _mm512_cvtepu8_epi32(nibbles);
    if constexpr (BYTES == kU5BlockBytes)
      w = _mm512_mask_add_epi32(w, static_cast<__mmask16>(fifth >> (16 * g)), w, _mm512_set1_epi32(16));
    f[g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(w), ds[g], ms[g]);
  }
  // [out rows 0-7][4 inputs] and [8-15][4] in bf16: each 32-bit lane one pair of inputs of one out row
  const __m512i lo = (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]);
  const __m512i hi = (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]);
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  _mm512_storeu_si512(out, _mm512_permutex2var_epi32(lo, even, hi));
  _mm512_storeu_si512(out + 32, _mm512_permutex2var_epi32(lo, odd, hi));
}

// 16 rows' fp16 values at p (d or m; null: zero) as bf16_pair_rows' per-group vectors: lane l of group g is out
// row 4g + l / 4's
GLMSERVE_BF16_TARGET inline void spread_rows(const uint16_t* p, __m512* groups) {
  const __m512 v = p ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))) : _mm512_setzero_ps();
  const __m512i row_of_lane = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  for (int g = 0; g < 4; ++g) groups[g] = _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_set1_epi32(4 * g), row_of_lane), v);
}

// one block of one tile of the packed weight (its code bytes c, its 16 d and m fp16 bits; m null: zero) ->
// PAIR_TILE bf16 at o. BYTES, the block's format (packed_blocks.h): int8 codes; nibbles; u5: the 256 nibble bytes
// followed by 8 masks of 64 fifth bits (mask i: the bytes of i8 group i, i.e. the low nibbles of group i < 4, the high
// ones of group i - 4); t4: the nibbles followed by the 16 int8 values they index; q6: the nibbles, 2 x 64 bytes of
// top bits and the rows' fp16 scales of inputs 16..31, w = d * (q - 32) (as fma(q, d, -32 d): exact, both are);
// s4: the nibbles and those scales, w = d * (q - 8); f4: the nibbles, their table of codes q and those scales,
// w = d * (q - 32); q2: q6's top bits alone, then the scales and the mins of inputs 16..31, w = d * q + m
template <int64_t BYTES>
GLMSERVE_BF16_TARGET inline void dequantize_bf16_pairs(const uint8_t* c, const uint16_t* d, const uint16_t* m,
                                                       uint16_t* o) {
  __m512 ds[4], ms[4];
  spread_rows(d, ds);
  spread_rows(m, ms);
  if constexpr (BYTES == kI8BlockBytes) {
    for (int j = 0; j < 8; ++j) bf16_pair_rows<0, BYTES>(c + j * 64, ds, ms, o + 2 * j * 32, 0, nullptr, 0, __m128i());
  } else {
    __m512 dh[4], mh[4];  // the high nibbles' (inputs 16..31) d and m: q6's / s4's / f4's / q2's own, else the block's
    [[maybe_unused]] const uint16_t* high = reinterpret_cast<const uint16_t*>(c + high_scales_at(BYTES));
    if constexpr (BYTES == kQ2BlockBytes) {
      spread_rows(high, dh);
      spread_rows(high + 16, mh);
    } else if constexpr (BYTES == kQ6BlockBytes || BYTES == kS4BlockBytes || BYTES == kF4BlockBytes) {
      spread_rows(high, dh);
      const __m512 offset = _mm512_set1_ps(BYTES == kS4BlockBytes ? -8.f : -32.f);
      for (int g = 0; g < 4; ++g) ms[g] = _mm512_mul_ps(ds[g], offset), mh[g] = _mm512_mul_ps(dh[g], offset);
    } else {
      for (int g = 0; g < 4; ++g) dh[g] = ds[g], mh[g] = ms[g];
    }
    uint64_t fifth[8] = {};
    if constexpr (BYTES == kU5BlockBytes) __builtin_memcpy(fifth, c + kU4BlockBytes, 64);
    const uint8_t* top = c + (BYTES == kQ2BlockBytes ? 0 : kU4BlockBytes);  // q6 / q2: the low nibbles' top bits,
    // then the high nibbles'
    const __m128i table = BYTES == kT4BlockBytes || BYTES == kF4BlockBytes
                              ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + kU4BlockBytes))
                              : _mm_setzero_si128();
    for (int j = 0; j < 4; ++j) {  // low nibbles: inputs 4j.., high nibbles: 16 + 4j..
      bf16_pair_rows<1, BYTES>(c + j * 64, ds, ms, o + 2 * j * 32, fifth[j], top, j, table);
      bf16_pair_rows<2, BYTES>(c + j * 64, dh, mh, o + 2 * (4 + j) * 32, fifth[4 + j], top + 64, j, table);
    }
  }
}

// dequantize_bf16_pairs of one block of a packed weight whose tile blocks are `block_bytes` long (packed_blocks.h)
GLMSERVE_BF16_TARGET inline void dequantize_bf16_block(int64_t block_bytes, const uint8_t* c, const uint16_t* d,
                                                       const uint16_t* m, uint16_t* o) {
  switch (block_bytes) {
    case kU4BlockBytes: return dequantize_bf16_pairs<kU4BlockBytes>(c, d, m, o);
    case kU5BlockBytes: return dequantize_bf16_pairs<kU5BlockBytes>(c, d, m, o);
    case kT4BlockBytes: return dequantize_bf16_pairs<kT4BlockBytes>(c, d, m, o);
    case kQ6BlockBytes: return dequantize_bf16_pairs<kQ6BlockBytes>(c, d, m, o);
    case kS4BlockBytes: return dequantize_bf16_pairs<kS4BlockBytes>(c, d, m, o);
    case kF4BlockBytes: return dequantize_bf16_pairs<kF4BlockBytes>(c, d, m, o);
    case kQ2BlockBytes: return dequantize_bf16_pairs<kQ2BlockBytes>(c, d, m, o);
    default: return dequantize_bf16_pairs<kI8BlockBytes>(c, d, m, o);
  }
}

}  // namespace glmserve
#endif
