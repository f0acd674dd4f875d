// Quantized linear layers on CPU: int8 activations times int8 or int4 weights in blocks of 32 inputs, with
// integer dot products and an fp32 sum of the scaled block results (glmserve/quant/cpu_backend.py repacks
// the weights and documents the formats).
//
// Weights, per block of 32 inputs of an output row: w = d * c + m, with d (and the optional m) fp16 and
// c either a signed int8 code ("i8"), an unsigned nibble 0..15 ("u4": int4 symmetric codes are stored
// as c + 8 with m = -8 d; Q4_1 and asymmetric int4 keep their codes, m = their min or -d * zero), or a nibble
// and a fifth bit, 0..31 ("u5": GGUF Q5_0's codes stored as c + 16 with m = -16 d, Q5_1's as they are). GGUF
// Q6_K ("q6") has a scale per 16 inputs: w = d * (q - 32) with q 0..63 a nibble and two top bits, d the block's
// for inputs 0..15 and the one kept in the block for 16..31 (no m); GGUF Q3_K ("s4") likewise w = d * (q - 8) with
// q a nibble.
// Rows are interleaved in tiles of 16 output rows so that one SIMD register holds the same 4 inputs of 16
// (AVX-512) or 8 (AVX2) rows: a dot product then accumulates one row per 32-bit lane, with no horizontal
// sum, and the tile's 16 scales are one contiguous fp16 vector. Per tile and block:
//   i8: 8 groups j of [16 rows][4 bytes] (512 bytes): inputs 4j..4j+3 of each row
//   u4: 4 groups j of [16 rows][4 bytes] (256 bytes): low nibbles inputs 4j..4j+3, high nibbles 16+4j..
//   u5: the u4 bytes, then the fifth bits as 8 masks of 64 bits (320 bytes): bit 4r + t of mask i is the fifth
//       bit of row r's input 4i + t, i.e. mask i flags the bytes of i8 group i that the nibbles unpack into (the
//       low nibbles of group i for i < 4, the high nibbles of group i - 4 after), so one masked byte add per
//       64 unpacked bytes (AVX-512: vpaddb with the mask; AVX2: the mask's bits spread into bytes) restores them.
//   t4: the u4 bytes, then a table of 16 int8 values (272 bytes): each nibble is an index into the block's table,
//       the code its value (GGUF IQ4_NL / IQ4_XS: llama.cpp's kvalues_iq4nl), looked up 16 at a time by a byte
//       shuffle (vpshufb) after the unpacking, then summed as signed int8 codes.
//   q6: the u4 bytes, then the codes' top two bits as 2 x 64 bytes: bits 2k, 2k+1 of byte 4r + t of vector h are
//       those of row r's input 4i + t, i = 4h + k the i8 group (so a group's 64 bytes take theirs by one shift and a
//       masked merge, as llama.cpp's Q6_K kernels take qh's), then the 16 rows' fp16 scales of inputs 16..31 (416
//       bytes: 6.5 bits a weight, 7 with d). The low nibbles (inputs 0..15) and the high ones (16..31) sum
//       separately, each from -32 times its 16 activations' sum, and scale by their own d (ggml's block_q6_K,
//       whose sub-block scales gguf_mapped.py flattens into these fp16 ones).
//   s4: the u4 bytes, then the 16 rows' fp16 scales of inputs 16..31 (288 bytes), codes q - 8: q6 without top bits.
//   f4: t4 with s4's second scale (304 bytes; GGUF NVFP4): the u4 bytes, a table of codes q + 32, the scales.
//   q2: q6's top bits alone as the codes 0..3 (GGUF Q2_K), then the 16 rows' fp16 scales and fp16 mins of inputs
//       16..31 (192 bytes); w = d * q + m per half, the mins times each half's activation sum.
//       The kernels' `u4` argument means codes narrower than a byte; 320-byte blocks carry the fifth bits, 272-byte
//       ones a table, 416-byte ones six bits, 288-byte ones a second scale, 304-byte ones both, 192-byte ones two bits.
//   d, m: [16] fp16 each (arrays of their own, [tiles, blocks, 16])
//
// Activations are quantized once per input row (quantize_activations): int8 codes q = round(x / dx) with
// dx = amax / 127 per block of 32 (llama.cpp's q8_0 / q8_1 blocks), or per row (W8A8's dynamic per-token
// scale); with each block's code sum (integer, and times dx: q8_1's "s") for the weights' mins:
//   out[n, r] = sum over blocks b of  d[r,b] dx[n,b] (sum_i c[r,i] q[n,i])  +  m[r,b] dx[n,b] sum_i q[n,i]
// The integer sums are exact; only the fp32 sum over blocks rounds.
//
// Integer dot products (the ideas of llama.cpp's ggml/src/ggml-cpu/ggml-cpu-quants.c, vec_dot_q8_0_q8_0 and
// vec_dot_q4_1_q8_1: maddubs on |w| with x signed by w for signed int8, and the block sum for mins; the code
// here is our own):
//   AVX-512 VNNI: vpdpbusd (u8 x s8, 4 products per 32-bit lane), the activations' 4 bytes broadcast from its
//     memory operand. i8 codes are flipped to unsigned c + 128 (xor 0x80) and a block's sum starts from
//     -128 * sum(q).
//   AVX2: vpmaddubsw + vpmaddwd. u4: nibble x int8 pairs (at most 2 * 15 * 127) add up in int16 over the
//     whole block (8 steps: at most 30,480), one vpmaddwd per block. i8: |c| x sign(q, c) per step.
//   scalar: the same sums in plain C++ (any CPU).
// AMX (avx512 build, CPUs with AMX-INT8, Linux; batches from 6 rows for int8 blocks, 10 for u4 ones): the i8
//   block layout above is already an AMX B tile for K = 32 (8 rows of [16 output rows][4 bytes]); u4 blocks are
//   unpacked into one (low nibbles rows 0-3, high nibbles rows 4-7). Per group of 16 activation rows and block, one
//   tdpbssd (s8 x s8: the u4 codes 0..15 are non-negative int8) gives the 16 x 16 integer sums of the block,
//   stored and scaled into fp32 accumulators with AVX-512 (the block's scales are an outer product of the
//   weights' d and the activations' dx, so integer sums cannot run across blocks). The conversion and FMAs of
//   the scales, not the TMUL, bound this: per activation row and block a convert, a multiply and one FMA (two
//   with mins) of 16 lanes. So the tile products run 4 blocks ahead of the scaling on 4 accumulator tiles,
//   the accumulators of a group stay in registers over all blocks, u4 blocks are unpacked 8 blocks ahead, and
//   the next weight tile is prefetched. This follows llama.cpp's ggml/src/ggml-cpu/amx/mmq.cpp (K-blocks of 32
//   through tdpbssd/tdpbusd, the scales applied after _tile_stored); the layout and code here are our own.
//   The last group of a batch (17-31 rows: 1-15) is padded with zero rows; under the thresholds above it runs
//   on the VNNI tiles instead. The same integer sums, scaled and summed in the same order: the VNNI tiles'
//   floats bit for bit. set_amx(false) turns it off (tests, benchmarks), as does GLMSERVE_CPU_AMX=0 at load.
// Batch: each tile computes NB activation rows at once (8 on AVX-512, 4 on AVX2, 1 scalar) so that its
// weights are loaded (and nibbles unpacked) once per NB rows; a tile's weights (16 x in bytes or half of it)
// stay in L1/L2 across the batch. The AVX-512 tiles read the activations regrouped once per call (quant_linear
// quantizes each row straight into them; quant_matmul regroups its quantized tensors with pack_groups:
// per 8 rows and block, their codes, scales and sums side by side), so that one pointer addresses them all.
// Batch 1 is the same loop with NB = 1 (a GEMV). Threads split the tiles (at::parallel_for).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "packed_blocks.h"  // bytes per tile block of each code format (bf16_linear_args.h, bf16_pairs.h)
#include "bf16_linear_args.h"  // amx_bf16_linear's argument checks and activation rows (shared with bf16_gemm.cpp)
#include "vec_math.h"  // silu_mul: SwiGLU as silu_and_mul (prefill_ops.cpp) computes it; abs_max

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__x86_64__) && \
    defined(__linux__)
#include "amx.h"  // the tile permission checks and TileConfig
#include "bf16_pairs.h"  // a tile and block of the packed weight as one bf16 B tile (dequantize_bf16_pairs)
#define GLMSERVE_AMX 1
#endif

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t QK = 32;     // inputs per block
constexpr int64_t ROWS = 16;   // output rows per tile
constexpr int64_t I8_BLOCK = glmserve::kI8BlockBytes;  // bytes per tile and block (packed_blocks.h)
constexpr int64_t U4_BLOCK = glmserve::kU4BlockBytes;
constexpr int64_t U5_BLOCK = glmserve::kU5BlockBytes;
constexpr int64_t T4_BLOCK = glmserve::kT4BlockBytes;
constexpr int64_t Q6_BLOCK = glmserve::kQ6BlockBytes;
constexpr int64_t S4_BLOCK = glmserve::kS4BlockBytes;
constexpr int64_t F4_BLOCK = glmserve::kF4BlockBytes;
constexpr int64_t Q2_BLOCK = glmserve::kQ2BlockBytes;

// a packed weight's code format (the header's i8 / u4 / u5 / t4 / q6 / s4 / f4 / q2)
enum Codes { I8, U4, U5, T4, Q6, S4, F4, Q2 };

constexpr int64_t block_bytes_of(Codes c) {
  return c == I8 ? I8_BLOCK : c == U4 ? U4_BLOCK : c == U5 ? U5_BLOCK : c == T4 ? T4_BLOCK : c == Q6 ? Q6_BLOCK
       : c == S4 ? S4_BLOCK : c == F4 ? F4_BLOCK : Q2_BLOCK;
}

// the formats with a second scale per block (inputs 16..31), whose halves sum apart
constexpr bool two_scales(Codes c) { return c == Q6 || c == S4 || c == F4 || c == Q2; }
// q6 / f4 codes stored as c + 32 (f4: its table's), s4 codes as c + 8, q2 codes 0..3 as they are
constexpr int code_offset(Codes c) { return c == S4 ? 8 : c == Q2 ? 0 : 32; }
// the factor of the activations' half sums in the two-scale formats' extra words: -offset (each half's integer sum
// starts there), or for q2 1 (its sums start at 0; its two mins multiply the half sums themselves)
constexpr int half_sum_factor(Codes c) { return c == Q2 ? 1 : -code_offset(c); }

// the format of codes [tiles, blocks, bytes] passed with the kernels' `u4` flag (nibble codes): an error where the
// bytes per tile and block are not one of the format's
Codes codes_of(bool u4, int64_t bytes, const char* name) {
  TORCH_CHECK(u4 ? glmserve::nibble_block_bytes(bytes) : bytes == I8_BLOCK, name,
              ": block bytes ", bytes,
              u4 ? " (nibble codes: 256, 320 with fifth bits, 272 with a table, 416 with six bits, 288 with two scales,"
                   " 304 with a table and two scales; 2-bit codes: 192)"
                 : " (int8 codes: 512)");
  return !u4 ? I8 : bytes == U4_BLOCK ? U4 : bytes == U5_BLOCK ? U5 : bytes == T4_BLOCK ? T4 : bytes == Q6_BLOCK ? Q6
       : bytes == S4_BLOCK ? S4 : bytes == F4_BLOCK ? F4 : Q2;
}

// f(std::integral_constant<Codes, kind>{}): a runtime format to the template argument of a kernel instantiated per
// format (`decltype(c)::value` in f)
template <typename F>
void with_codes(Codes kind, F&& f) {
  switch (kind) {
    case U4: return f(std::integral_constant<Codes, U4>{});
    case U5: return f(std::integral_constant<Codes, U5>{});
    case T4: return f(std::integral_constant<Codes, T4>{});
    case Q6: return f(std::integral_constant<Codes, Q6>{});
    case S4: return f(std::integral_constant<Codes, S4>{});
    case F4: return f(std::integral_constant<Codes, F4>{});
    case Q2: return f(std::integral_constant<Codes, Q2>{});
    default: return f(std::integral_constant<Codes, I8>{});
  }
}

// a t4 block's table of 16 int8 values (f4: codes c + 32)
inline const int8_t* table_of(const uint8_t* block) { return reinterpret_cast<const int8_t*>(block + U4_BLOCK); }

// mask i of a u5 block's fifth bits (bit 4r + t: row r's input 4i + t)
inline uint64_t fifth_mask(const uint8_t* block, int i) {
  uint64_t m;
  std::memcpy(&m, block + U4_BLOCK + 8 * i, 8);
  return m;
}

// the 64 bytes of a q6 / q2 block's top-bit vector h (i8 groups 4h..4h+3, two bits each: q2 has no nibbles before)
template <Codes C>
inline const uint8_t* top_bits(const uint8_t* block, int h) { return block + (C == Q2 ? 0 : U4_BLOCK) + 64 * h; }

// the two-bit field of row r's input t of i8 group i of a q6 / q2 block
template <Codes C>
inline int32_t top_field(const uint8_t* block, int i, int r, int t) {
  return (top_bits<C>(block, i / 4)[4 * r + t] >> (2 * (i % 4))) & 3;
}

// a q6 / s4 / f4 / q2 block's 16 fp16 scales of inputs 16..31 (one per row)
template <Codes C>
inline const uint16_t* high_scales(const uint8_t* block) {
  return reinterpret_cast<const uint16_t*>(block + glmserve::high_scales_at(block_bytes_of(C)));
}

// a q2 block's 16 fp16 mins of inputs 16..31, after its scales (those of 0..15: the tile's m)
inline const uint16_t* high_mins(const uint8_t* block) { return high_scales<Q2>(block) + ROWS; }

// row r's code t of i8 group i of a nibble block, given its nibble: with its fifth bit where C is U5, its table's
// value where C is T4 (minus 32 where F4), q - 32 of its six bits where C is Q6, q - 8 where C is S4; where C is Q2
// (no nibbles: the caller passes 0) its two bits, fields i % 4 of the top-bit vector i / 4
template <Codes C>
inline int32_t nibble_code(const uint8_t* block, int i, int r, int t, uint8_t nibble) {
  if constexpr (C == Q2) return top_field<C>(block, i, r, t);
  if constexpr (C == U5) return nibble | static_cast<int32_t>((fifth_mask(block, i) >> (4 * r + t)) & 1) << 4;
  if constexpr (C == Q6) return (nibble | top_field<C>(block, i, r, t) << 4) - 32;
  if constexpr (C == S4) return nibble - 8;
  if constexpr (C == T4) return table_of(block)[nibble];
  if constexpr (C == F4) return table_of(block)[nibble] - 32;
  return nibble;
}

// A q6 / s4 / f4 block's two integer sums (inputs 0..15 and 16..31) scaled by their own d: low * d_low + high * d_high,
// which every path then multiplies by the activations' dx into its accumulator (acc + part * dx: two operations fewer
// per row and block than scaling each half by d * dx; the SIMD paths fuse the multiply-adds)
inline float scale_halves(int32_t low, int32_t high, float d_low, float d_high) {
  return static_cast<float>(low) * d_low + static_cast<float>(high) * d_high;
}

// a q2 block's mins: the activations' half sums (inputs 0..15, 16..31) times the halves' mins, added to scale_halves's
// part before the multiply by dx
inline float min_halves(int32_t x_low, int32_t x_high, float m_low, float m_high) {
  return static_cast<float>(x_low) * m_low + static_cast<float>(x_high) * m_high;
}

// The words of a two-scale block for one activation row: `factor` (half_sum_factor: -offset for q6 / s4 / f4, the
// starts of their two integer sums; 1 for q2, the half sums its mins take) times the sums of its codes q[0..15] and
// q[16..31] (`sum`: all 32 codes' sum), into out[0], out[1]: the VNNI tiles read them from their activation groups
// (put_row), the AVX2 tiles from a per-call array (half_offsets)
inline void half_offsets_of(const int8_t* q, int32_t sum, int factor, int32_t* out) {
  int32_t low = 0;
  for (int i = 0; i < QK / 2; ++i) low += q[i];
  out[0] = factor * low;
  out[1] = factor * (sum - low);
}

constexpr float INV127 = 1.0f / 127.0f;     // dx = amax * INV127 (the test's emulation multiplies the same)
constexpr int VNNI_NB = 8;                  // activation rows per AVX-512 VNNI tile
// outputs of at least this many bytes (the lm_head from 43 rows) are written with non-temporal stores, whole 64-byte
// rows of a tile (amx_tiles, and the VNNI tiles' simd_rows): their row stride, a multiple of 4 KB there, maps every
// batch row's 64 bytes of a tile onto a few cache sets. On AMX the lm_head at 64 rows (12.6 MB) took 0.65x the time
// alone, 0.77-0.80x with an argmax or softmax over the logits after it; at 32 rows (6.3 MB) even, at 8-16 rows slower
// (1.06-1.27x with the reduction after it), hence 8 MB. On Zen 5's VNNI tiles the mix's decode steps of ~60 rows took
// 59.1 / 59.9 ms against 62.6 / 61.3 (bench/profile_throughput.py, alternating).
constexpr int64_t STREAM_BYTES = int64_t(8) << 20;

union GroupWord;  // the VNNI tiles' regrouped activations (AVX-512 VNNI builds)

struct Acts {  // quantized activations
  const int8_t* q;       // [N, kp]
  const float* d;        // [N, nb] scale per block
  const float* s;        // [N, nb] d * sum(q) per block
  const int32_t* isum;   // [N, nb] sum(q) per block
  int64_t kp, nb;
  const GroupWord* groups = nullptr;  // VNNI builds: the rows from row0 on regrouped (pack_groups)
  int64_t row0 = 0;
  const int32_t* half_offsets = nullptr;  // AVX2 builds, two-scale weights: [N, nb, 2] half_offsets_of's words
};

struct Weights {  // one tile
  const uint8_t* codes;  // [nb, block bytes]
  const uint16_t* d;     // [nb, 16] fp16 bits
  const uint16_t* m;     // [nb, 16] fp16 bits, or nullptr
  bool first_read = false;  // the call's first pass over the tile (the AVX2 tiles prefetch ahead in it)
  bool small_tables = false;  // t4 on the AVX2 tiles: every block's table in [-32, 31] (simd_rows sets it)
};

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// ---------------------------------------------------------------------------------------------- scalar
template <Codes C>
void tile_scalar(const Weights& w, const Acts& a, int64_t n0, int nb_rows, int64_t nblocks, float* out /*[nb_rows,16]*/) {
  for (int n = 0; n < nb_rows; ++n) {
    const int8_t* q = a.q + (n0 + n) * a.kp;
    float acc[ROWS] = {0.f};
    for (int64_t b = 0; b < nblocks; ++b) {
      const uint8_t* c = w.codes + b * block_bytes_of(C);
      const int8_t* qb = q + b * QK;
      const float dx = a.d[(n0 + n) * a.nb + b], sx = a.s[(n0 + n) * a.nb + b];
      [[maybe_unused]] int32_t halves[2];  // q2: the block's activation half sums, which its mins take
      if constexpr (C == Q2) half_offsets_of(qb, a.isum[(n0 + n) * a.nb + b], half_sum_factor(C), halves);
      for (int64_t r = 0; r < ROWS; ++r) {
        int32_t sum = 0, high = 0;  // q6 / s4 / f4: inputs 0..15 in sum, 16..31 in high (scaled apart)
        if constexpr (C != I8) {
          for (int j = 0; j < 4; ++j)
            for (int t = 0; t < 4; ++t) {
              const uint8_t byte = C == Q2 ? 0 : c[(j * ROWS + r) * 4 + t];
              sum += nibble_code<C>(c, j, r, t, byte & 0x0F) * qb[4 * j + t];
              high += nibble_code<C>(c, 4 + j, r, t, byte >> 4) * qb[16 + 4 * j + t];
            }
          if constexpr (!two_scales(C)) sum += high;
        } else {
          for (int j = 0; j < 8; ++j)
            for (int t = 0; t < 4; ++t)
              sum += static_cast<int32_t>(static_cast<int8_t>(c[(j * ROWS + r) * 4 + t])) * qb[4 * j + t];
        }
        if constexpr (two_scales(C)) {
          const float d_low = half_to_float(w.d[b * ROWS + r]), d_high = half_to_float(high_scales<C>(c)[r]);
          float part = scale_halves(sum, high, d_low, d_high);
          if constexpr (C == Q2)
            part += min_halves(halves[0], halves[1], half_to_float(w.m[b * ROWS + r]), half_to_float(high_mins(c)[r]));
          acc[r] += part * dx;
          continue;
        }
        acc[r] += static_cast<float>(sum) * (half_to_float(w.d[b * ROWS + r]) * dx);
        if (w.m) acc[r] += half_to_float(w.m[b * ROWS + r]) * sx;
      }
    }
    std::memcpy(out + n * ROWS, acc, sizeof(acc));
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// ---------------------------------------------------------------------------------------------- AVX2
inline __m256 half8_to_float(const uint16_t* p) {  // (the SIMD builds are -mf16c)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// An empty asm that takes v in a register and gives it back: the running integer sums stay one chain of adds, step by
// step. Without it GCC reassociates each block's adds into a tree: all 32 products of a half-block live at once, and
// at 4 rows they went to the stack (21 MAC per cycle on Zen 3)
inline void in_register(__m256i& v) { asm("" : "+x"(v)); }

// H halves (8 output rows each: h0, and h0 + 1 where H = 2) of a tile for NB activation rows, over all blocks. Each
// row's 4 activation bytes are broadcast once per step and used by the H halves. The registers held through a block
// are NB * H accumulators, NB * H integer sums, 2H unpacked weight vectors, the broadcasts and two constants: the
// dispatcher runs NB = 1 on both halves at once (a GEMV reads each block's 64-byte groups whole) and more rows one
// half at a time (NB = 4: 14 of the 16 ymm registers). Q4_1 at 64-512 rows, one Zen 3 core: 82-85 GMAC/s; the tile
// it replaced (both halves of 2 rows, whose sums and shared broadcasts GCC spilled to the stack) 60, with F16C
// (bench/ab_quant_kernels.py)
// Decode's weights stream from DRAM once per step (the default model's 96 MB per token): with the hardware prefetcher
// alone one core's batch-1 tiles read 17.9 GB/s. In a call's first pass over a tile (the later passes, more rows of a
// batch, find it in L1) they ask for the lines PF_BLOCKS blocks ahead, 2 KB of Q4_1 codes: 23.1 GB/s (bench/RESULTS.md,
// "Software prefetch in the AVX2 tiles"; 4 and 16 blocks measured slower in the engine)
constexpr int64_t PF_BLOCKS = 8;

// the 64-byte lines of bytes [offset, offset + bytes) from `base` into L1; addresses past the array are only hints
inline void prefetch_lines(const void* base, int64_t offset, int64_t bytes) {
  const uintptr_t at = reinterpret_cast<uintptr_t>(base) + offset;
  for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch(reinterpret_cast<const char*>(at + l), _MM_HINT_T0);
}

// bytes 32h..32h+31 of i8 group i of a u5 block as 0 or 16: their fifth bits (bits 32h.. of mask i) spread one per
// byte (each byte takes its bit's byte of the mask, then compares its own bit)
inline __m256i fifth_bits_avx2(const uint8_t* block, int i, int h) {
  uint32_t bits;
  std::memcpy(&bits, block + U4_BLOCK + 8 * i + 4 * h, 4);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(bits)),
                                             _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                              2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

// the two-bit fields k of q6 top-bit bytes moved to bits 4-5 (other bits: neighbours' fields, masked by the caller)
inline __m256i top_bits_at_4_avx2(__m256i top, int k) {
  return k < 2 ? _mm256_slli_epi16(top, 4 - 2 * k) : _mm256_srli_epi16(top, 2 * k - 4);
}

// One q6 / s4 / f4 / q2 block into acc (tile_avx2_halves' accumulators): per half of the block (inputs 0..15, then
// 16..31) its unsigned codes q times the activations (vpmaddubsw: pairs up to 2 * 63 * 127, two groups' pairs summed
// in int16 before vpmaddwd) from -offset sum(q) (Acts::half_offsets; q2: from 0); the halves' sums scaled as
// scale_halves does, q2's mins added as min_halves does
template <Codes C, int NB, int H>
inline void two_scale_block_avx2(const uint8_t* block, const uint16_t* d, const uint16_t* m, const Acts& a, int64_t n0,
                                 int64_t b, int h0, __m256 (&acc)[NB][H]) {
  const __m256i ones16 = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0F), top2 = _mm256_set1_epi8(0x30);
  const int8_t* q0 = a.q + n0 * a.kp + b * QK;
  [[maybe_unused]] const __m256i table =
      C == F4 ? _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table_of(block))))
              : low4;
  __m256 part[NB][H];
  for (int half = 0; half < 2; ++half) {
    __m256i isum[NB][H], top[H];
    if constexpr (C == Q6 || C == Q2)
      for (int h = 0; h < H; ++h)
        top[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(top_bits<C>(block, half) + (h0 + h) * 32));
    for (int n = 0; n < NB; ++n)
      for (int h = 0; h < H; ++h)
        isum[n][h] = C == Q2 ? _mm256_setzero_si256()
                             : _mm256_set1_epi32(a.half_offsets[((n0 + n) * a.nb + b) * 2 + half]);
    for (int j = 0; j < 4; j += 2) {  // byte groups j, j + 1: i8 groups 4 half + j, + 1
      __m256i q[2][H];
      for (int k = 0; k < 2; ++k)
        for (int h = 0; h < H; ++h) {
          if constexpr (C == Q2) {  // fields j + k of the half's top-bit vector
            q[k][h] = _mm256_and_si256(_mm256_srli_epi16(top[h], 2 * (j + k)), _mm256_set1_epi8(3));
            continue;
          }
          const uint8_t* at = block + (j + k) * 64 + (h0 + h) * 32;
          const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
          q[k][h] = _mm256_and_si256(half ? _mm256_srli_epi16(bytes, 4) : bytes, low4);
          if constexpr (C == Q6)
            q[k][h] = _mm256_or_si256(q[k][h], _mm256_and_si256(top_bits_at_4_avx2(top[h], j + k), top2));
          if constexpr (C == F4) q[k][h] = _mm256_shuffle_epi8(table, q[k][h]);
        }
      for (int n = 0; n < NB; ++n) {
        const int8_t* x = q0 + n * a.kp + 16 * half + 4 * j;
        const __m256i x0 = _mm256_set1_epi32(load_i32(x)), x1 = _mm256_set1_epi32(load_i32(x + 4));
        for (int h = 0; h < H; ++h) {
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(q[0][h], x0), _mm256_maddubs_epi16(q[1][h], x1));
          isum[n][h] = _mm256_add_epi32(isum[n][h], _mm256_madd_epi16(pairs, ones16));
          in_register(isum[n][h]);
        }
      }
    }
    for (int h = 0; h < H; ++h) {
      const __m256 dw = half8_to_float((half ? high_scales<C>(block) : d) + (h0 + h) * 8);
      for (int n = 0; n < NB; ++n)
        part[n][h] = half ? _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[n][h]), dw, part[n][h])
                          : _mm256_mul_ps(_mm256_cvtepi32_ps(isum[n][h]), dw);
    }
  }
  if constexpr (C == Q2) {  // min_halves: each half's activation sum (half_offsets: factor 1) times its mins, after
    // both halves' products (the VNNI tiles' order)
    for (int half = 0; half < 2; ++half)
      for (int h = 0; h < H; ++h) {
        const __m256 mw = half8_to_float((half ? high_mins(block) : m) + (h0 + h) * 8);
        for (int n = 0; n < NB; ++n) {
          const float x = static_cast<float>(a.half_offsets[((n0 + n) * a.nb + b) * 2 + half]);
          part[n][h] = _mm256_fmadd_ps(_mm256_set1_ps(x), mw, part[n][h]);
        }
      }
  }
  for (int n = 0; n < NB; ++n)
    for (int h = 0; h < H; ++h)
      acc[n][h] = _mm256_fmadd_ps(part[n][h], _mm256_set1_ps(a.d[(n0 + n) * a.nb + b]), acc[n][h]);
}

// half_offsets_of every block of rows [0, N) ([N, nb, 2] with `factor`: the AVX2 tiles' words of two-scale blocks),
// into the calling thread's buffer
const int32_t* half_offsets(const Acts& a, int64_t N, int factor) {
  thread_local std::vector<int32_t> buffer;
  buffer.resize(static_cast<size_t>(N * a.nb * 2));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t b = 0; b < a.nb; ++b)
      half_offsets_of(a.q + n * a.kp + b * QK, a.isum[n * a.nb + b], factor, buffer.data() + (n * a.nb + b) * 2);
  return buffer.data();
}

// whether every value of a t4 block's table is in [-32, 31] (MXFP4's E2M1 values, doubled: -12..12): then v + 32
// is at most 63, as q6's codes, and two groups' vpmaddubsw pairs sum in int16 (at most 4 * 63 * 127 = 32,004)
inline bool small_table(__m128i table) {
  return _mm_testz_si128(_mm_add_epi8(table, _mm_set1_epi8(32)), _mm_set1_epi8(static_cast<char>(0xC0)));
}

// `table` at the nibbles of i8 groups j (low nibbles: lo) and 4 + j (high: hi) of a t4 block's 32-byte half h (c: the
// block's bytes of the tile half the caller starts at)
inline void table_at_nibbles(__m256i table, const uint8_t* c, int j, int h, __m256i& lo, __m256i& hi) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + j * 64 + h * 32));
  lo = _mm256_shuffle_epi8(table, _mm256_and_si256(v, low4));
  hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
}

// A t4 block with a small table (small_table) into isum (tile_avx2_halves' integer sums; c: the block's bytes of
// half h0): its codes as unsigned v + 32 through vpmaddubsw, the low and high nibbles' pairs summed in int16 before
// vpmaddwd, from -32 sum(q): the signed path's sums exactly, in 5 operations a row and i8 group pair instead of 8
template <int NB, int H>
inline void small_table_block_avx2(__m128i table, const uint8_t* c, const Acts& a, int64_t n0, int64_t b,
                                   __m256i (&isum)[NB][H]) {
  const __m256i ones16 = _mm256_set1_epi16(1);
  const __m256i codes = _mm256_broadcastsi128_si256(_mm_add_epi8(table, _mm_set1_epi8(32)));
  for (int n = 0; n < NB; ++n)
    for (int h = 0; h < H; ++h) isum[n][h] = _mm256_set1_epi32(-32 * a.isum[(n0 + n) * a.nb + b]);
  for (int j = 0; j < 4; ++j) {
    __m256i lo[H], hi[H];
    for (int h = 0; h < H; ++h) table_at_nibbles(codes, c, j, h, lo[h], hi[h]);
    for (int n = 0; n < NB; ++n) {
      const int8_t* qb = a.q + (n0 + n) * a.kp + b * QK;
      const __m256i ql = _mm256_set1_epi32(load_i32(qb + 4 * j)), qh = _mm256_set1_epi32(load_i32(qb + 16 + 4 * j));
      for (int h = 0; h < H; ++h) {
        const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], ql), _mm256_maddubs_epi16(hi[h], qh));
        isum[n][h] = _mm256_add_epi32(isum[n][h], _mm256_madd_epi16(pairs, ones16));
        in_register(isum[n][h]);
      }
    }
  }
}

// whether every block of a t4 tile (`codes`, nblocks of them) has a small table: tile_avx2 then takes the unsigned
// path for the whole tile (decided once per simd_rows call: checked per block, IQ4's tiles measured 3-4% slower)
inline bool small_tables(const uint8_t* codes, int64_t nblocks) {
  for (int64_t b = 0; b < nblocks; ++b)
    if (!small_table(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table_of(codes + b * T4_BLOCK))))) return false;
  return true;
}

// SMALL: a t4 tile whose tables are all small (small_tables)
template <int NB, int H, Codes C, bool MINS, bool SMALL = false>
void tile_avx2_halves(const Weights& w, const Acts& a, int64_t n0, int64_t nblocks, int h0, float* out) {
  __m256 acc[NB][H];
  for (int n = 0; n < NB; ++n)
    for (int h = 0; h < H; ++h) acc[n][h] = _mm256_setzero_ps();
  const __m256i ones16 = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0F);
  const int8_t* q0 = a.q + n0 * a.kp;
  constexpr int64_t block_bytes = block_bytes_of(C);
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* block = w.codes + b * block_bytes;
    const uint8_t* c = block + h0 * 32;
    if (w.first_read && h0 == 0) {  // the codes PF_BLOCKS blocks ahead (past this tile's last: the next tile's), the scales every other
      prefetch_lines(w.codes, (b + PF_BLOCKS) * block_bytes, block_bytes);  // block
      if (b % 2 == 0) {
        prefetch_lines(w.d, (b + PF_BLOCKS) * ROWS * 2, 64);
        if (MINS) prefetch_lines(w.m, (b + PF_BLOCKS) * ROWS * 2, 64);
      }
    }
    if constexpr (two_scales(C)) {
      two_scale_block_avx2<C, NB, H>(block, w.d + b * ROWS, w.m ? w.m + b * ROWS : nullptr, a, n0, b, h0, acc);
      continue;
    }
    __m256i isum[NB][H];
    if constexpr (C == T4) {  // unsigned codes v + 32 where every value is in [-32, 31] (MXFP4's table), else the
      // signed values as the i8 path takes its codes: |v| x sign(q, v)
      const __m128i table16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(table_of(block)));
      if constexpr (SMALL) {
        small_table_block_avx2<NB, H>(table16, c, a, n0, b, isum);
      } else {
        const __m256i table = _mm256_broadcastsi128_si256(table16);
        for (int n = 0; n < NB; ++n)
          for (int h = 0; h < H; ++h) isum[n][h] = _mm256_setzero_si256();
        for (int j = 0; j < 4; ++j) {
          __m256i lo[H], hi[H];
          for (int h = 0; h < H; ++h) table_at_nibbles(table, c, j, h, lo[h], hi[h]);
          for (int n = 0; n < NB; ++n) {
            const int8_t* qb = q0 + n * a.kp + b * QK;
            const __m256i ql = _mm256_set1_epi32(load_i32(qb + 4 * j)), qh = _mm256_set1_epi32(load_i32(qb + 16 + 4 * j));
            for (int h = 0; h < H; ++h) {
              const __m256i pl = _mm256_maddubs_epi16(_mm256_sign_epi8(lo[h], lo[h]), _mm256_sign_epi8(ql, lo[h]));
              const __m256i ph = _mm256_maddubs_epi16(_mm256_sign_epi8(hi[h], hi[h]), _mm256_sign_epi8(qh, hi[h]));
              isum[n][h] = _mm256_add_epi32(isum[n][h], _mm256_add_epi32(_mm256_madd_epi16(pl, ones16),  // (each
                                                                         _mm256_madd_epi16(ph, ones16)));  // to 32,258)
              in_register(isum[n][h]);
            }
          }
        }
      }
    } else if constexpr (C != I8) {
      __m256i s16[NB][H];
      for (int n = 0; n < NB; ++n)
        for (int h = 0; h < H; ++h) s16[n][h] = _mm256_setzero_si256(), isum[n][h] = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        __m256i lo[H], hi[H];
        for (int h = 0; h < H; ++h) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + j * 64 + h * 32));
          lo[h] = _mm256_and_si256(v, low4), hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
          if constexpr (C == U5) {
            lo[h] = _mm256_or_si256(lo[h], fifth_bits_avx2(block, j, h0 + h));
            hi[h] = _mm256_or_si256(hi[h], fifth_bits_avx2(block, 4 + j, h0 + h));
          }
        }
        for (int n = 0; n < NB; ++n) {
          const int8_t* qb = q0 + n * a.kp + b * QK;
          const __m256i ql = _mm256_set1_epi32(load_i32(qb + 4 * j)), qh = _mm256_set1_epi32(load_i32(qb + 16 + 4 * j));
          for (int h = 0; h < H; ++h) {
            s16[n][h] = _mm256_add_epi16(s16[n][h], _mm256_maddubs_epi16(lo[h], ql));
            s16[n][h] = _mm256_add_epi16(s16[n][h], _mm256_maddubs_epi16(hi[h], qh));
            in_register(s16[n][h]);
          }
        }
        // u5: codes up to 31 make a pair's products up to 7,874, so the int16 sums take two steps (31,496) at most
        if (C == U5 && j == 1) {
          for (int n = 0; n < NB; ++n)
            for (int h = 0; h < H; ++h)
              isum[n][h] = _mm256_madd_epi16(s16[n][h], ones16), s16[n][h] = _mm256_setzero_si256();
        }
      }
      for (int n = 0; n < NB; ++n)
        for (int h = 0; h < H; ++h) isum[n][h] = _mm256_add_epi32(isum[n][h], _mm256_madd_epi16(s16[n][h], ones16));
    } else {
      for (int n = 0; n < NB; ++n)
        for (int h = 0; h < H; ++h) isum[n][h] = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        __m256i v[H], av[H];
        for (int h = 0; h < H; ++h) {
          v[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + j * 64 + h * 32));
          av[h] = _mm256_sign_epi8(v[h], v[h]);
        }
        for (int n = 0; n < NB; ++n) {
          const __m256i qv = _mm256_set1_epi32(load_i32(q0 + n * a.kp + b * QK + 4 * j));
          for (int h = 0; h < H; ++h) {
            const __m256i sx = _mm256_sign_epi8(qv, v[h]);
            isum[n][h] = _mm256_add_epi32(isum[n][h], _mm256_madd_epi16(_mm256_maddubs_epi16(av[h], sx), ones16));
            in_register(isum[n][h]);
          }
        }
      }
    }
    for (int h = 0; h < H; ++h) {
      const __m256 dw = half8_to_float(w.d + b * ROWS + (h0 + h) * 8);
      const __m256 mw = MINS ? half8_to_float(w.m + b * ROWS + (h0 + h) * 8) : _mm256_setzero_ps();
      for (int n = 0; n < NB; ++n) {
        const int64_t i = (n0 + n) * a.nb + b;
        acc[n][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[n][h]), _mm256_mul_ps(dw, _mm256_set1_ps(a.d[i])), acc[n][h]);
        if (MINS) acc[n][h] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.s[i]), acc[n][h]);
      }
    }
  }
  for (int n = 0; n < NB; ++n)
    for (int h = 0; h < H; ++h) _mm256_storeu_ps(out + n * ROWS + (h0 + h) * 8, acc[n][h]);
}

// NB activation rows x one tile (16 output rows) into out [NB][16]
template <int NB, Codes C, bool MINS>
void tile_avx2(const Weights& w, const Acts& a, int64_t n0, int64_t nblocks, float* out) {
  if constexpr (C == T4) {
    if (w.small_tables) {
      if constexpr (NB == 1) {
        tile_avx2_halves<1, 2, C, MINS, true>(w, a, n0, nblocks, 0, out);
      } else {
        tile_avx2_halves<NB, 1, C, MINS, true>(w, a, n0, nblocks, 0, out);
        tile_avx2_halves<NB, 1, C, MINS, true>(w, a, n0, nblocks, 1, out);
      }
      return;
    }
  }
  if constexpr (NB == 1) {
    tile_avx2_halves<1, 2, C, MINS>(w, a, n0, nblocks, 0, out);
  } else {
    tile_avx2_halves<NB, 1, C, MINS>(w, a, n0, nblocks, 0, out);
    tile_avx2_halves<NB, 1, C, MINS>(w, a, n0, nblocks, 1, out);
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// ---------------------------------------------------------------------------------------------- AVX-512 VNNI
// The activations regrouped for the VNNI tiles (pack_groups, once per call): per group of G rows (VNNI_NB, the last
// one the rows left) and block, GROUP_WORDS * G 32-bit words: q[8][G] (q[j][n]: row n's codes 4j..4j+3), dx[G],
// s[G] (dx * sum(q)) and bias[G] (-128 * sum(q): the i8 codes' flip to c + 128, the start of the integer sum), so
// that every broadcast of a tile's block is at a fixed offset from one pointer (with one pointer per row, GCC ran out
// of general registers at 8 rows and parked the int8 path's 128 * sum(q) in mask registers: 105 GMAC/s against 130
// for u4), and a batch of one row reads 44 bytes per block. For two-scale weights two more, half[2][G]:
// half_offsets_of's words (-offset times the sums of codes 0..15 and 16..31, the start of each half's sum; q2: the
// sums themselves, for its mins), computed only for them.
union GroupWord {
  int32_t i;
  float f;
};
constexpr int GROUP_WORDS = 11, TWO_SCALE_GROUP_WORDS = 13;
constexpr int group_words(Codes c) { return two_scales(c) ? TWO_SCALE_GROUP_WORDS : GROUP_WORDS; }

// the calling thread's buffer of `words` group words (reused: no allocation per call)
GroupWord* group_buffer(size_t words) {
  thread_local std::vector<GroupWord> buffer;
  if (buffer.size() < words) buffer.resize(words);
  return buffer.data();
}

// row n (of N, from `first` on) of quantized activations (codes q [nb * 32], scales d, dx * sum s and sums isum [nb])
// into its place in the groups at `data` for weights of `kind` (group_words)
void put_row(const int8_t* q, const float* d, const float* s, const int32_t* isum, int64_t nb, int64_t first,
             int64_t n, int64_t N, Codes kind, GroupWord* data) {
  const int words = group_words(kind);
  const int64_t g0 = first + (n - first) / VNNI_NB * VNNI_NB;  // the group's first row
  const int64_t rows = std::min<int64_t>(VNNI_NB, N - g0), r = n - g0;
  GroupWord* g = data + (g0 - first) * nb * words;
  for (int64_t b = 0; b < nb; ++b) {
    GroupWord* x = g + b * words * rows;
    for (int j = 0; j < 8; ++j) x[j * rows + r].i = load_i32(q + b * QK + 4 * j);
    x[8 * rows + r].f = d[b];
    x[9 * rows + r].f = s[b];
    x[10 * rows + r].i = -128 * isum[b];
    if (two_scales(kind)) {
      int32_t starts[2];
      half_offsets_of(q + b * QK, isum[b], half_sum_factor(kind), starts);
      x[11 * rows + r].i = starts[0];
      x[12 * rows + r].i = starts[1];
    }
  }
}

// rows [first, N) of the activations in groups of VNNI_NB from `first` on, for weights of `kind`, into the calling
// thread's buffer (rows split over the intra-op threads for large batches)
const GroupWord* pack_groups(const Acts& a, int64_t first, int64_t N, Codes kind) {
  GroupWord* data = group_buffer(static_cast<size_t>((N - first) * a.nb * group_words(kind)));
  at::parallel_for(first, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      put_row(a.q + n * a.kp, a.d + n * a.nb, a.s + n * a.nb, a.isum + n * a.nb, a.nb, first, n, N, kind, data);
  });
  return data;
}

// top_bits_at_4_avx2 on 64 bytes
inline __m512i top_bits_at_4(__m512i top, int k) {
  return k < 2 ? _mm512_slli_epi16(top, 4 - 2 * k) : _mm512_srli_epi16(top, 2 * k - 4);
}

// acc + the 4-byte products of w's lanes and the int32 at x broadcast to all lanes, with the broadcast embedded in
// vpdpbusd's memory operand (GCC emits a separate vpbroadcastd load for _mm512_set1_epi32 of memory)
inline __m512i dpbusd_broadcast(__m512i acc, __m512i w, const int32_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
  return acc;
}

// One group of NB <= VNNI_NB rows (g: its blocks) x one weight tile. Per block the same integer sums (u4: nibble
// x code; i8: (c + 128) x code from -128 sum(q)) and the same fp32 operations in the same order as before the
// regrouping, the scalar and AVX2 tiles and the AMX tiles: the floats are unchanged. Each 4-byte piece of the
// activations is broadcast by vpdpbusd from memory (the pieces j of the group's rows: NB words side by side).
template <int NB, Codes C, bool MINS>
void tile_avx512(const Weights& w, const GroupWord* g, int64_t nblocks, float* out) {
  __m512 acc[NB];  // its two loops unrolled: GCC otherwise also keeps acc on the stack, stored every block
#pragma GCC unroll 16
  for (int n = 0; n < NB; ++n) acc[n] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i sixteen = _mm512_set1_epi8(16), top2 = _mm512_set1_epi8(0x30);
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* c = w.codes + b * block_bytes_of(C);
    const GroupWord* x = g + b * group_words(C) * NB;
    const GroupWord *dx = x + 8 * NB, *sx = x + 9 * NB, *bias = x + 10 * NB;
    // two scales: the two halves' sums side by side (each from -offset sum(q), q2's from 0), then scale_halves's
    // floats (q2: and min_halves's)
    if constexpr (two_scales(C)) {
      constexpr bool top = C == Q6 || C == Q2;
      [[maybe_unused]] const __m512i top_low = top ? _mm512_loadu_si512(top_bits<C>(c, 0)) : low4;
      [[maybe_unused]] const __m512i top_high = top ? _mm512_loadu_si512(top_bits<C>(c, 1)) : low4;
      [[maybe_unused]] const __m512i codes =
          C == F4 ? _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table_of(c)))) : low4;
      __m512i low[NB], high[NB];
      for (int n = 0; n < NB; ++n) {  // q2's sums start at 0 (its words are the half sums its mins take)
        low[n] = C == Q2 ? _mm512_setzero_si512() : _mm512_set1_epi32(x[11 * NB + n].i);
        high[n] = C == Q2 ? _mm512_setzero_si512() : _mm512_set1_epi32(x[12 * NB + n].i);
      }
      for (int j = 0; j < 4; ++j) {  // i8 groups j (the low nibbles: inputs 4j..) and 4 + j (the high: 16 + 4j..)
        __m512i ql, qh;
        if constexpr (C == Q2) {  // fields j of the two top-bit vectors
          ql = _mm512_and_si512(_mm512_srli_epi16(top_low, 2 * j), _mm512_set1_epi8(3));
          qh = _mm512_and_si512(_mm512_srli_epi16(top_high, 2 * j), _mm512_set1_epi8(3));
        } else {
          const __m512i v = _mm512_loadu_si512(c + j * 64);
          ql = _mm512_and_si512(v, low4), qh = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        }
        if constexpr (C == Q6) {  // a | (b & c): the top bits merged in
          ql = _mm512_ternarylogic_epi32(ql, top_bits_at_4(top_low, j), top2, 0xF8);
          qh = _mm512_ternarylogic_epi32(qh, top_bits_at_4(top_high, j), top2, 0xF8);
        }
        if constexpr (C == F4) ql = _mm512_shuffle_epi8(codes, ql), qh = _mm512_shuffle_epi8(codes, qh);
        for (int n = 0; n < NB; ++n) {
          low[n] = dpbusd_broadcast(low[n], ql, &x[j * NB + n].i);
          high[n] = dpbusd_broadcast(high[n], qh, &x[(4 + j) * NB + n].i);
        }
      }
      const __m512 dl = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.d + b * ROWS)));
      const __m512 dh = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(high_scales<C>(c))));
      [[maybe_unused]] const __m512 ml =
          C == Q2 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.m + b * ROWS))) : dl;
      [[maybe_unused]] const __m512 mh =
          C == Q2 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(high_mins(c)))) : dl;
      for (int n = 0; n < NB; ++n) {
        __m512 part =
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(high[n]), dh, _mm512_mul_ps(_mm512_cvtepi32_ps(low[n]), dl));
        if constexpr (C == Q2) {  // min_halves
          part = _mm512_fmadd_ps(_mm512_set1_ps(static_cast<float>(x[11 * NB + n].i)), ml, part);
          part = _mm512_fmadd_ps(_mm512_set1_ps(static_cast<float>(x[12 * NB + n].i)), mh, part);
        }
        acc[n] = _mm512_fmadd_ps(part, _mm512_set1_ps(dx[n].f), acc[n]);
      }
      continue;
    }
    __m512i isum[NB];
    // t4: the table's values flipped to unsigned (c + 128) and summed from -128 sum(q), as i8 codes are
    for (int n = 0; n < NB; ++n)
      isum[n] = C == U4 || C == U5 ? _mm512_setzero_si512() : _mm512_set1_epi32(bias[n].i);
    [[maybe_unused]] const __m512i table =
        C == T4 ? _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table_of(c)))),
                                   flip)
                : _mm512_setzero_si512();
    if constexpr (C != I8) {
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(c + j * 64);
        __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        if constexpr (C == T4) lo = _mm512_shuffle_epi8(table, lo), hi = _mm512_shuffle_epi8(table, hi);
        if constexpr (C == U5) {
          lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(fifth_mask(c, j)), lo, sixteen);
          hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(fifth_mask(c, 4 + j)), hi, sixteen);
        }
        for (int n = 0; n < NB; ++n) {
          isum[n] = dpbusd_broadcast(isum[n], lo, &x[j * NB + n].i);
          isum[n] = dpbusd_broadcast(isum[n], hi, &x[(4 + j) * NB + n].i);
        }
      }
    } else {
      for (int j = 0; j < 8; ++j) {
        const __m512i v = _mm512_xor_si512(_mm512_loadu_si512(c + j * 64), flip);  // c + 128, unsigned
        for (int n = 0; n < NB; ++n) isum[n] = dpbusd_broadcast(isum[n], v, &x[j * NB + n].i);
      }
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.d + b * ROWS)));
    const __m512 mw = MINS ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.m + b * ROWS)))
                           : _mm512_setzero_ps();
    for (int n = 0; n < NB; ++n) {
      acc[n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[n]), _mm512_mul_ps(dw, _mm512_set1_ps(dx[n].f)), acc[n]);
      if (MINS) acc[n] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[n].f), acc[n]);
    }
  }
#pragma GCC unroll 16
  for (int n = 0; n < NB; ++n) _mm512_storeu_ps(out + n * ROWS, acc[n]);
}
#endif


#ifdef GLMSERVE_AMX
// ---------------------------------------------------------------------------------------------- AMX
constexpr int64_t AMX_ROWS = 16;       // activation rows per A tile (a group)
// a group of fewer real rows runs on the VNNI tiles: an AMX group costs its tile products and stores whatever its
// rows, the VNNI tiles cost per row; the break-even measured at about 6 rows for int8 blocks and 9-10 for u4 ones,
// which pay the nibble unpacking per group too (bench/RESULTS.md, "AMX int8 tiles for decode batches")
constexpr int64_t AMX_GROUP_MIN_I8 = 6, AMX_GROUP_MIN_U4 = 10;
constexpr int64_t amx_group_min(Codes kind) { return kind == I8 ? AMX_GROUP_MIN_I8 : AMX_GROUP_MIN_U4; }
constexpr int64_t AMX_UNPACK_ONCE = 24;  // u4 / u5 tiles of up to this many blocks: unpacked once for all groups (amx_tiles)
constexpr int64_t AMX_AHEAD = 4;       // blocks whose tile products run ahead of their scaling: C tiles 0-3
constexpr int64_t AMX_RING = 2 * AMX_AHEAD;  // int32 result buffers of [16][16], written by tile stores

std::atomic<bool> amx_wanted{[] {
  const char* env = std::getenv("GLMSERVE_CPU_AMX");
  return env == nullptr || std::string(env) != "0";
}()};

// tiles 0-3: C [16 act rows][16 out rows] int32, one per block in flight; 4/5: A [16 act rows][32 codes];
// 6/7: B [8][16 out rows x 4] (4/6 for even blocks, 5/7 for odd ones)
__attribute__((target("amx-tile,amx-int8"))) void amx_config() {
  glmserve::TileConfig cfg;
  for (int t : {0, 1, 2, 3}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  for (int t : {4, 5}) cfg.rows[t] = 16, cfg.colsb[t] = QK;
  for (int t : {6, 7}) cfg.rows[t] = QK / 4, cfg.colsb[t] = 64;
  asm volatile("" : : "r"(&cfg) : "memory");  // GCC 12 dropped the stores above as dead before ldtilecfg
  _tile_loadconfig(&cfg);
}

// One block's 16 x 16 integer sums into `dst` ([16][16] int32): GCC's tile intrinsics stringize their tile
// numbers, so they are literals here. The store is our own asm naming the 1 KB it writes: GCC's _tile_stored
// clobbers all memory, which made the compiler keep the fp32 accumulators on the stack (a load and a store per
// row and block, on the store port the tile stores need).
#define GLMSERVE_AMX_BLOCK(C, A, B, act, stride, codes, dst)                                             \
  do {                                                                                                   \
    _tile_zero(C);                                                                                       \
    _tile_loadd(A, act, stride);                                                                         \
    _tile_loadd(B, codes, 64);                                                                           \
    _tile_dpbssd(C, A, B);                                                                               \
    asm volatile("tilestored %%tmm" #C ", (%1,%2,1)"                                                    \
                 : "=m"(*reinterpret_cast<int32_t(*)[AMX_ROWS * ROWS]>(dst))                              \
                 : "r"(dst), "r"(int64_t{64}));                                                          \
  } while (0)

// A u4 / u5 / t4 block unpacked into an AMX B tile (low nibbles rows 0-3, high nibbles rows 4-7; u5: row i's bytes
// plus 16 where mask i says; t4: the table's values): the signed int8 layout, codes 0..15 / 0..31 / the table's
inline void amx_unpack(Codes kind, const uint8_t* codes, uint8_t* out) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(16);
  const __m512i table = kind == T4 ? _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table_of(codes))))
                                   : _mm512_setzero_si512();
  for (int j = 0; j < 4; ++j) {
    const __m512i v = _mm512_loadu_si512(codes + j * 64);
    __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    if (kind == T4) lo = _mm512_shuffle_epi8(table, lo), hi = _mm512_shuffle_epi8(table, hi);
    if (kind == U5) {
      lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(fifth_mask(codes, j)), lo, sixteen);
      hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(fifth_mask(codes, 4 + j)), hi, sixteen);
    }
    _mm512_store_si512(out + j * 64, lo);
    _mm512_store_si512(out + (4 + j) * 64, hi);
  }
}

// out [rows, cols] (row stride ldo) for activation rows n0..n0+rows-1 (rows <= 16; q padded to whole A tiles)
// and the first cols <= 16 output rows of one weight tile whose blocks are AMX B tiles (`btiles`, [nblocks][512]).
// The tile products of block b + AMX_AHEAD are issued halfway through block b's scaling (up to 9% faster than
// before it), so the TMUL and the tile stores of the next blocks overlap this block's conversion and FMAs (the
// bound: per activation row and block, a convert, a multiply and one or two FMAs of 16 lanes), and the 16 fp32
// accumulators stay in registers over all blocks. Per element the same operations in the same block order as
// tile_avx512, so the sums are the VNNI tiles' bit for bit. `next` (the following weight tile's bytes, or
// nullptr) is prefetched, `next_bytes` of it spread over the blocks; `stream`: whole 16-column rows of out are
// written with non-temporal stores (amx_tiles). The pipelining and the store-then-scale per block of 32 follow
// llama.cpp's ggml/src/ggml-cpu/amx/mmq.cpp (its tinygemm_kernel_amx); the layout and the code are our own.
template <int R, Codes C, bool MINS>  // R: the rows computed (rows rounded up to 4; the padded rows' scales are 0)
__attribute__((target("amx-tile,amx-int8"))) void tile_amx(const Weights& w, const Acts& a, int64_t n0, int rows,
                                                             int64_t nblocks, const uint8_t* next,
                                                             int64_t next_bytes, float* out, int64_t ldo,
                                                             int cols, bool stream) {
  alignas(64) int32_t ring[AMX_RING][AMX_ROWS * ROWS];
  // u4 / u5: block b is unpacked AMX_AHEAD blocks before its tile load (a tile load right after the vector stores
  // of its data stalls until they reach L1), into a ring of 2 AMX_RING blocks
  constexpr bool nibbles = C != I8;
  alignas(64) uint8_t unpacked[nibbles ? 2 * AMX_RING : 1][I8_BLOCK];
  auto unpack = [&](int64_t b) {
    if (nibbles && b < nblocks) amx_unpack(C, w.codes + b * block_bytes_of(C), unpacked[b % (2 * AMX_RING)]);
  };
  const uint16_t *wd = w.d, *wm = w.m;
  // one named accumulator per row: GCC does not keep an array of 16 zmm (1 KB) in registers
#define GLMSERVE_FIRST_HALF(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
#define GLMSERVE_SECOND_HALF(X) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)
#define GLMSERVE_EACH_ROW(X) GLMSERVE_FIRST_HALF(X) GLMSERVE_SECOND_HALF(X)
#define GLMSERVE_ACC(r) [[maybe_unused]] __m512 acc##r = _mm512_setzero_ps();
  GLMSERVE_EACH_ROW(GLMSERVE_ACC)
  const int8_t* q = a.q + n0 * a.kp;
  const int64_t stride = a.kp;
  auto issue = [&](int64_t b) {
    const int8_t* act = q + b * QK;
    const uint8_t* codes = nibbles ? unpacked[b % (2 * AMX_RING)] : w.codes + b * I8_BLOCK;
    int32_t* dst = ring[b % AMX_RING];
    switch (b % AMX_AHEAD) {
      case 0: GLMSERVE_AMX_BLOCK(0, 4, 6, act, stride, codes, dst); break;
      case 1: GLMSERVE_AMX_BLOCK(1, 5, 7, act, stride, codes, dst); break;
      case 2: GLMSERVE_AMX_BLOCK(2, 4, 6, act, stride, codes, dst); break;
      default: GLMSERVE_AMX_BLOCK(3, 5, 7, act, stride, codes, dst); break;
    }
  };
  const float* dx = a.d + n0 * a.nb;
  const float* sx = a.s + n0 * a.nb;
  const int64_t nb = a.nb;
  const int64_t lines = next ? (next_bytes + 63) / 64 : 0, per_block = (lines + nblocks - 1) / nblocks;
  for (int64_t b = 0; b < 2 * AMX_AHEAD; ++b) unpack(b);
  for (int64_t b = 0; b < std::min(AMX_AHEAD, nblocks); ++b) issue(b);
  for (int64_t b = 0; b < nblocks; ++b) {
    unpack(b + 2 * AMX_AHEAD);
    for (int64_t l = b * per_block; l < std::min(lines, (b + 1) * per_block); ++l)
      _mm_prefetch(reinterpret_cast<const char*>(next + l * 64), _MM_HINT_T0);
    const int32_t* sums = ring[b % AMX_RING];
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wd + b * ROWS)));
    const __m512 mw = MINS ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wm + b * ROWS)))
                           : _mm512_setzero_ps();
#define GLMSERVE_SCALE(r)                                                                              \
    if constexpr (r < R) {                                                                             \
      const __m512 x = _mm512_cvtepi32_ps(_mm512_load_si512(sums + r * ROWS));                         \
      acc##r = _mm512_fmadd_ps(x, _mm512_mul_ps(dw, _mm512_set1_ps(dx[r * nb + b])), acc##r);          \
      if (MINS) acc##r = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[r * nb + b]), acc##r);                  \
    }
    GLMSERVE_FIRST_HALF(GLMSERVE_SCALE)
    if (b + AMX_AHEAD < nblocks) issue(b + AMX_AHEAD);
    GLMSERVE_SECOND_HALF(GLMSERVE_SCALE)
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
#define GLMSERVE_STORE(r) \
  if constexpr (r < R) {  \
    if (r < rows) _mm512_mask_storeu_ps(out + r * ldo, keep, acc##r); \
  }
#define GLMSERVE_STREAM(r) \
  if constexpr (r < R) {   \
    if (r < rows) _mm512_stream_ps(out + r * ldo, acc##r); \
  }
  if (stream && cols == ROWS) {
    GLMSERVE_EACH_ROW(GLMSERVE_STREAM)
  } else {
    GLMSERVE_EACH_ROW(GLMSERVE_STORE)
  }
#undef GLMSERVE_STREAM
#undef GLMSERVE_STORE
#undef GLMSERVE_SCALE
#undef GLMSERVE_ACC
#undef GLMSERVE_EACH_ROW
#undef GLMSERVE_FIRST_HALF
#undef GLMSERVE_SECOND_HALF
}

// tile_amx for `rows` rows, R = rows rounded up to 4
template <Codes C, bool MINS>
void tile_amx_rows(const Weights& w, const Acts& a, int64_t n0, int rows, int64_t nblocks, const uint8_t* next,
                   int64_t next_bytes, float* out, int64_t ldo, int cols, bool stream) {
  switch ((rows + 3) / 4) {
    case 1: return tile_amx<4, C, MINS>(w, a, n0, rows, nblocks, next, next_bytes, out, ldo, cols, stream);
    case 2: return tile_amx<8, C, MINS>(w, a, n0, rows, nblocks, next, next_bytes, out, ldo, cols, stream);
    case 3: return tile_amx<12, C, MINS>(w, a, n0, rows, nblocks, next, next_bytes, out, ldo, cols, stream);
    default: return tile_amx<16, C, MINS>(w, a, n0, rows, nblocks, next, next_bytes, out, ldo, cols, stream);
  }
}
#undef GLMSERVE_AMX_BLOCK

__attribute__((target("amx-tile,amx-int8"))) void amx_release() { _tile_release(); }

// ---------------------------------------------------------------------------------------------- AMX bf16 GEMM
// Prefill-sized batches (quant/cpu_backend.py dense_apply): bf16 activations x the packed weight dequantized
// to bf16 panel by panel, float32 sums on the AMX bf16 tiles, bf16 out. One tile and block of the packed
// layout (16 output rows x 32 inputs) is exactly one AMX bf16 B tile (16 rows of K pairs x [16 columns][2]):
// dequantizing it (d * c + m, rounded to bf16) into that VNNI order is the only reordering there is, and no
// dense copy of the weight is ever made or kept. Blocking (the ideas of oneDNN's brgemm, as vLLM-CPU and IPEX
// run it, and of llama.cpp's ggml/src/ggml-cpu/amx/mmq.cpp: a B panel in L2, a block of A rows swept over it,
// accumulators held over the whole K; the code is our own):
//   a thread takes a panel of PT output tiles (PT * K * 32 bytes, at most ~BF16_PANEL_BYTES: L2-resident)
//   and dequantizes it once; then for each block of 32 activation rows (2 A tiles, L1/L2-resident across the
//   panel) and each pair of output tiles: 4 fp32 accumulator tiles (2 x 2) over all K blocks, one tdpbf16ps
//   each per block of 32 inputs, no per-block scaling (the dequantization applied d and m), stored once and
//   rounded to bf16. Batch rows past a multiple of 16 and inputs past a multiple of 32 come from a zero-padded
//   copy of the activations (a padded input's weight is m, not 0).
constexpr int64_t BF16_PANEL_BYTES = 512 * 1024;  // one panel's B tiles (two are held: L2)
constexpr int64_t PANEL_TILES_MAX = 32;
constexpr int64_t K_CHUNK = 8;  // blocks of 32 inputs per chunk of K (A: 32 rows x 8 KB, in L1)
constexpr int64_t B_TILE = ROWS * QK;  // bf16 elements of one B tile: 16 K pairs x 16 columns x 2

// tiles 0-3: C [16 act rows][16 out rows] fp32 (C[i][j] = tile 2i + j); 4, 5: A [16 act rows][32 inputs] bf16;
// 6, 7: B [16 input pairs][16 out rows x 2] bf16
__attribute__((target("amx-tile,amx-bf16"))) void amx_bf16_config() {
  glmserve::TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  asm volatile("" : : "r"(&cfg) : "memory");  // as amx_config
  _tile_loadconfig(&cfg);
}

// rows x cols of c (row stride 32) rounded to bf16 into out (row stride ldo)
__attribute__((target("avx512bf16"))) void store_bf16(const float* c, int rows, int cols, uint16_t* out, int64_t ldo) {
  const __mmask16 lo = static_cast<__mmask16>(cols >= 16 ? 0xFFFF : (1u << cols) - 1);
  const __mmask16 hi = static_cast<__mmask16>(cols <= 16 ? 0 : cols >= 32 ? 0xFFFF : (1u << (cols - 16)) - 1);
  for (int r = 0; r < rows; ++r) {
    const float* cr = c + r * 32;
    uint16_t* o = out + r * ldo;
    _mm256_mask_storeu_epi16(o, lo, (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(cr)));
    if (hi) _mm256_mask_storeu_epi16(o + 16, hi, (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(cr + 16)));
  }
}

// 16 floats rounded to bf16 as store_bf16 rounds them, widened back (exact)
__attribute__((target("avx512bf16"))) inline __m512 bf16_rounded(const float* x) {
  const __m256i bits = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// silu(g) * u of rows of a finished 32 x 32 block of a merged gate-up product (row stride 32: columns 0-15 gate tile
// i, 16-31 up tile i) into 16 bf16 outputs per row (row stride ldo): the gate and up sums rounded to bf16, then
// vec_math.h's silu_mul_16 and its rounding, as silu_and_mul computes it on the bf16 product
__attribute__((target("avx512bf16"))) void store_swiglu_bf16(const float* c, int rows, uint16_t* out, int64_t ldo) {
  for (int r = 0; r < rows; ++r) {
    const float* cr = c + r * 32;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo),
                        glmserve::f32_to_bf16_16(glmserve::silu_mul_16(bf16_rounded(cr), bf16_rounded(cr + 16))));
  }
}

// The vector work that runs between the AMX tile products (gemm_block): the next panel of output slots t0..t0+nt-1
// dequantized into buf ([nt][nblocks] B tiles), one B tile at a time (`advance`), and the previous block's fp32
// sums rounded into the output (`defer_store`, done a few rows at a time during the next block's tile products,
// `store_some`), so that neither waits for the tiles nor keeps them waiting. A slot is the weight tile of
// that index, or with `up_offset` (a merged gate-up weight of that many gate tiles, SwiGLU'd in the store) slots 2i
// and 2i + 1 are gate tile i and up tile i, so that each pair of slots (gemm_block's two B tiles) holds one output tile
struct VectorWork {
  const uint8_t* cp;
  const uint16_t *dp, *mp;
  Codes kind;
  int64_t nblocks, up_offset = 0, t0 = 0, total = 0, done = 0;
  uint16_t* buf = nullptr;
  const float* c = nullptr;  // a deferred store_bf16 or store_swiglu_bf16 (none while c is null)
  int rows = 0, cols = 0, stored = 0;  // stored: rows of the deferred store done
  uint16_t* out = nullptr;
  int64_t ldo = 0;

  int64_t tile_of(int64_t slot) const { return up_offset ? slot / 2 + (slot & 1) * up_offset : slot; }
  void start(int64_t first_slot, int64_t slots, uint16_t* into) { t0 = first_slot, total = slots * nblocks, done = 0, buf = into; }
  void advance(int64_t n) {
    for (const int64_t stop = std::min(total, done + n); done < stop; ++done) {
      const int64_t t = tile_of(t0 + done / nblocks), b = done % nblocks, at = t * nblocks + b;
      const uint16_t* m = mp ? mp + at * ROWS : nullptr;
      const int64_t bytes = block_bytes_of(kind);
      glmserve::dequantize_bf16_block(bytes, cp + at * bytes, dp + at * ROWS, m, buf + done * B_TILE);
    }
  }
  void defer_store(const float* from, int r, int n, uint16_t* to, int64_t ld) {
    flush_store();
    c = from, rows = r, cols = n, out = to, ldo = ld, stored = 0;
  }
  // the deferred store's next n rows (all that are left: flush_store)
  void store_some(int n) {
    if (!c) return;
    n = std::min(n, rows - stored);
    if (up_offset) store_swiglu_bf16(c + stored * 32, n, out + stored * ldo, ldo);
    else store_bf16(c + stored * 32, n, cols, out + stored * ldo, ldo);
    stored += n;
    if (stored == rows) c = nullptr;
  }
  void flush_store() { store_some(rows); }
};

// C [MA * 16 act rows][NB * 16 out rows] fp32 (row stride 32 floats, in c) += A rows (a0: rows 0-15, a1: 16-31,
// lda elements apart) x B tiles k0..k1-1 of NB out tiles (b: [NB][bstride]); C starts at zero where `first`, else
// from c. `work`'s deferred store is done a share of its rows after each step's tile products (all of them by the
// end), and `units` of its B tiles are dequantized in between, before the stores that wait for the products (a c
// loaded at the start must not be the deferred store's buffer).
template <int MA, int NB>
__attribute__((target("amx-tile,amx-bf16"))) void gemm_block(const uint16_t* a0, const uint16_t* a1, int64_t lda,
                                                             const uint16_t* b, int64_t bstride, int64_t k0,
                                                             int64_t k1, bool first, float* c, VectorWork& work,
                                                             int64_t units) {
  const int64_t per_step = (units + (k1 - k0) - 1) / (k1 - k0);
  // SwiGLU's store (a division per 16 outputs) spread over the steps; a plain one at the first (0.97x if spread)
  const int store_rows = work.up_offset ? static_cast<int>((32 + (k1 - k0) - 1) / (k1 - k0)) : 32;
  if (first) {
    _tile_zero(0);
    if (NB > 1) _tile_zero(1);
    if (MA > 1) _tile_zero(2);
    if (MA > 1 && NB > 1) _tile_zero(3);
  } else {
    _tile_loadd(0, c, 128);
    if (NB > 1) _tile_loadd(1, c + 16, 128);
    if (MA > 1) _tile_loadd(2, c + 16 * 32, 128);
    if (MA > 1 && NB > 1) _tile_loadd(3, c + 16 * 32 + 16, 128);
  }
  const uint16_t* b1 = b + bstride;
  for (int64_t k = k0; k < k1; ++k) {
    if (k + 1 < k1) {  // the next step's B tiles from the L2 panel into L1 while these products run: mean 1.04x
      // (0.98-1.11x by shape) at 128-2,048 rows on a 2-vCPU AMX guest (bench/gemm_micro.py --dense --a-source), 64 neutral
      const char* nb = reinterpret_cast<const char*>(b + (k + 1) * B_TILE);
      const char* nb1 = reinterpret_cast<const char*>(b1 + (k + 1) * B_TILE);
      for (int l = 0; l < 1024; l += 64) {
        _mm_prefetch(nb + l, _MM_HINT_T0);
        if (NB > 1) _mm_prefetch(nb1 + l, _MM_HINT_T0);
      }
    }
    _tile_loadd(4, a0 + k * QK, lda * 2);
    _tile_loadd(6, b + k * B_TILE, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (NB > 1) {
      _tile_loadd(7, b1 + k * B_TILE, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (MA > 1) {
      _tile_loadd(5, a1 + k * QK, lda * 2);
      _tile_dpbf16ps(2, 5, 6);
      if (NB > 1) _tile_dpbf16ps(3, 5, 7);
    }
    if (k == k0 || work.up_offset) work.store_some(store_rows);  // vector work while the tile products run
    work.advance(per_step);
  }
  _tile_stored(0, c, 128);
  if (NB > 1) _tile_stored(1, c + 16, 128);
  if (MA > 1) _tile_stored(2, c + 16 * 32, 128);
  if (MA > 1 && NB > 1) _tile_stored(3, c + 16 * 32 + 16, 128);
}

using GemmBlock = void (*)(const uint16_t*, const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, int64_t,
                          bool, float*, VectorWork&, int64_t);

// Output slots [first, first + count) (VectorWork: weight tiles, or with `up_offset` gate and up tiles in turn) of
// out = a [M, kp] x the packed weight, on the calling thread: out [M, out_features] bf16, or with up_offset
// [M, out_features / 2] = silu(gate) * up. Panel by panel: a lead panel of about a quarter of the others (its
// dequantization is the only one that no tile products hide: per B tile the products of 512 rows take ~4x its
// dequantization), then panels of equal size, at most BF16_PANEL_BYTES / 2 of B tiles each; a: bf16 rows (zero past
// the inputs), the rows past the last multiple of 16 from `tail` [16, kp] (zero past M; null where M is a multiple
// of 16)
void amx_bf16_tiles(const uint16_t* a, const uint16_t* tail, int64_t M, const uint8_t* cp, const uint16_t* dp,
                    const uint16_t* mp, Codes kind, int64_t first, int64_t count, int64_t nblocks, int64_t out_features,
                    int64_t up_offset, uint16_t* out) {
  const int64_t kp = nblocks * QK, tile_elems = nblocks * B_TILE;
  const int64_t pt_max = std::max<int64_t>(2, std::min<int64_t>(PANEL_TILES_MAX, BF16_PANEL_BYTES / (2 * tile_elems)) & ~int64_t(1));
  const int64_t lead = std::min(count, std::max<int64_t>(2, (std::min(pt_max, count) / 4 + 1) & ~int64_t(1)));
  const int64_t rest = count - lead, rest_panels = (rest + pt_max - 1) / pt_max;
  // the other panels alike, of an even size
  const int64_t pt = rest ? std::min(pt_max, ((rest + rest_panels - 1) / rest_panels + 1) & ~int64_t(1)) : lead;
  const int64_t panels = 1 + (rest + pt - 1) / pt, most = std::max(lead, pt);
  const auto panel_start = [&](int64_t i) { return i == 0 ? first : first + lead + (i - 1) * pt; };
  const auto panel_tiles = [&](int64_t i) { return i == 0 ? lead : std::min(pt, first + count - panel_start(i)); };
  const int64_t chunks = (nblocks + K_CHUNK - 1) / K_CHUNK, kc = (nblocks + chunks - 1) / chunks;
  const int64_t m_blocks = (M + 31) / 32;
  uint16_t* bufs = static_cast<uint16_t*>(std::aligned_alloc(64, 2 * most * tile_elems * 2));  // two panels
  float* cbuf = static_cast<float*>(std::aligned_alloc(64, (most + 1) / 2 * 32 * 32 * sizeof(float)));
  amx_bf16_config();
  VectorWork next{cp, dp, mp, kind, nblocks, up_offset};
  const int64_t ldo = up_offset ? out_features / 2 : out_features;
  next.start(first, lead, bufs);
  next.advance(next.total);
  for (int64_t panel = 0; panel < panels; ++panel) {
    const int64_t t0 = panel_start(panel), nt = panel_tiles(panel);
    const uint16_t* bbuf = next.buf;
    uint16_t* other = bbuf == bufs ? bufs + most * tile_elems : bufs;
    next.start(t0 + nt, panel + 1 < panels ? panel_tiles(panel + 1) : 0, other);
    const int64_t per_call = (next.total + m_blocks * chunks * ((nt + 1) / 2) - 1) / (m_blocks * chunks * ((nt + 1) / 2));
    for (int64_t m0 = 0; m0 < M; m0 += 32) {
      const int rows = static_cast<int>(std::min<int64_t>(32, M - m0));
      const uint16_t* a0 = m0 + 16 <= M ? a + m0 * kp : tail;
      const uint16_t* a1 = m0 + 32 <= M ? a0 + 16 * kp : tail;
      const GemmBlock two_b = rows > 16 ? gemm_block<2, 2> : gemm_block<1, 2>;
      const GemmBlock one_b = rows > 16 ? gemm_block<2, 1> : gemm_block<1, 1>;
      for (int64_t k0 = 0; k0 < nblocks; k0 += kc) {  // K in chunks: the A rows' chunk stays in L1 over the panel
        const int64_t k1 = std::min(nblocks, k0 + kc);
        for (int64_t t = 0; t < nt; t += 2) {
          float* c = cbuf + t / 2 * 32 * 32;
          (t + 1 < nt ? two_b : one_b)(a0, a1, kp, bbuf + t * tile_elems, tile_elems, k0, k1, k0 == 0, c, next,
                                       per_call);
          if (k1 == nblocks) {  // SwiGLU: slots t0 + t and t0 + t + 1 give output tile (t0 + t) / 2
            const int64_t n0 = (up_offset ? (t0 + t) / 2 : t0 + t) * ROWS;
            next.defer_store(c, rows, static_cast<int>(std::min<int64_t>(up_offset ? ROWS : 32, out_features - n0)),
                             out + m0 * ldo + n0, ldo);
          }
        }
      }
    }
    next.advance(next.total);
  }
  next.flush_store();
  amx_release();
  std::free(cbuf);
  std::free(bufs);
}

// out [M, out_features] bf16 = a [M, kp] x the packed weight, or with `swiglu` out [M, out_features / 2] = silu(gate)
// * up of a merged gate-up weight (a, tail as amx_bf16_tiles). Threads: the output slots split into one contiguous
// share per thread, equal to within a pair of slots, so that every thread gets the same work and dequantizes only
// its own tiles (a split over panels of up to 28 tiles left one of two threads 4 of qkv's 60)
void amx_bf16_gemm(const uint16_t* a, const uint16_t* tail, int64_t M, const uint8_t* cp, const uint16_t* dp,
                   const uint16_t* mp, Codes kind, int64_t tiles, int64_t nblocks, int64_t out_features, bool swiglu,
                   uint16_t* out) {
  const int64_t pairs = (tiles + 1) / 2;
  const int64_t shares = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), pairs));
  at::parallel_for(0, shares, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const int64_t first = 2 * (pairs * s / shares), last = std::min(tiles, 2 * (pairs * (s + 1) / shares));
      amx_bf16_tiles(a, tail, M, cp, dp, mp, kind, first, last - first, nblocks, out_features, swiglu ? tiles / 2 : 0,
                     out);
    }
  });
}
#endif

// ---------------------------------------------------------------------------------------------- dispatch
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr int MAX_NB = VNNI_NB;
// rows n0..n0+NB-1: one of the groups of a.groups (n0 = a.row0 + a multiple of VNNI_NB; NB its rows)
template <int NB, Codes C>
void tile(const Weights& w, const Acts& a, int64_t n0, int64_t nblocks, float* out) {
  const GroupWord* g = a.groups + (n0 - a.row0) * a.nb * group_words(C);
  if (w.m) tile_avx512<NB, C, true>(w, g, nblocks, out);
  else tile_avx512<NB, C, false>(w, g, nblocks, out);
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int MAX_NB = 4;
template <int NB, Codes C>
void tile(const Weights& w, const Acts& a, int64_t n0, int64_t nblocks, float* out) {
  if (w.m) tile_avx2<NB, C, true>(w, a, n0, nblocks, out);
  else tile_avx2<NB, C, false>(w, a, n0, nblocks, out);
}
#else
constexpr int MAX_NB = 1;
template <int NB, Codes C>
void tile(const Weights& w, const Acts& a, int64_t n0, int64_t nblocks, float* out) { tile_scalar<C>(w, a, n0, NB, nblocks, out); }
#endif

template <Codes C, int NB>
void tile_rows(const Weights& w, const Acts& a, int64_t n0, int rows, int64_t nblocks, float* out) {
  if constexpr (NB > 1) {
    if (rows < NB) return tile_rows<C, NB - 1>(w, a, n0, rows, nblocks, out);
  }
  tile<NB, C>(w, a, n0, nblocks, out);
}

// whether out [N, out_features] at o is written by non-temporal stores (STREAM_BYTES): whole aligned 64-byte rows of
// every tile, in a build that has them (the AVX-512 ones)
inline bool stream_output(const float* o, int64_t N, int64_t out_features) {
#if defined(__AVX512F__)
  return out_features % ROWS == 0 && reinterpret_cast<uintptr_t>(o) % 64 == 0 &&
         N * out_features * static_cast<int64_t>(sizeof(float)) >= STREAM_BYTES;
#else
  (void)o, (void)N, (void)out_features;
  return false;
#endif
}

// rows n0..n0+count-1 of one weight tile's 16 output rows, on the variant's own tiles (MAX_NB rows at a time), into
// out (row n0's first output of the tile; rows ldo apart): the first `cols` (<= 16) of each row; `stream`: whole rows
// of 16 by non-temporal stores (STREAM_BYTES; the caller fences)
void simd_rows(const Weights& w, const Acts& a, int64_t n0, int64_t count, int64_t nblocks, Codes kind, float* out,
               int64_t ldo, int cols, bool stream = false) {
  float buf[MAX_NB * ROWS];
  Weights rest = w;
#if !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)) && defined(__AVX2__) && defined(__FMA__)
  rest.small_tables = kind == T4 && small_tables(w.codes, nblocks);  // (the AVX2 tiles' variant)
#endif
  Weights first = rest;
  first.first_read = true;
  for (int64_t n = n0; n < n0 + count; n += MAX_NB) {
    const int rows = static_cast<int>(std::min<int64_t>(MAX_NB, n0 + count - n));
    const Weights& tile_w = n == n0 ? first : rest;
    with_codes(kind, [&](auto c) { tile_rows<decltype(c)::value, MAX_NB>(tile_w, a, n, rows, nblocks, buf); });
    for (int i = 0; i < rows; ++i) {
      float* dst = out + (n - n0 + i) * ldo;
#if defined(__AVX512F__)
      // one store a row (non-temporal where `stream`, else masked): a libc memcpy call per 64 bytes was ~1% of the
      // 64-request mix (perf, Zen 5)
      if (stream && cols == ROWS) _mm512_stream_ps(dst, _mm512_loadu_ps(buf + i * ROWS));
      else _mm512_mask_storeu_ps(dst, static_cast<__mmask16>((1u << cols) - 1u), _mm512_loadu_ps(buf + i * ROWS));
#else
      std::memcpy(dst, buf + i * ROWS, cols * sizeof(float));
#endif
    }
  }
}

#ifdef GLMSERVE_AMX
// weight tiles [begin, end) on the AMX tiles, groups of 16 activation rows (a group of fewer than AMX_GROUP_MIN_*
// real rows on the VNNI tiles). u4 / u5 weights of up to AMX_UNPACK_ONCE blocks run by more than one group are
// unpacked once per tile for all its groups (12 KB at most, which leaves L1 room for the activations; 0.88-0.96x
// the time at 32-63 rows for 576 inputs, and a loss at 1,536 inputs, where a whole tile is 24 KB) instead of
// once per group. Outputs of STREAM_BYTES or more (the lm_head from 43 rows) bypass the caches (stream_output; the
// regular stores cost up to 46% of the lm_head at 64 rows here)
void amx_tiles(const uint8_t* cp, const uint16_t* dp, const uint16_t* mp, const Acts& a, int64_t N, int64_t begin,
               int64_t end, int64_t nblocks, Codes kind, float* o, int64_t out_features) {
  const int64_t tile_bytes = nblocks * block_bytes_of(kind);
  TORCH_CHECK(!two_scales(kind), "quant_matmul: q6 / s4 / f4 / q2 blocks (two scales a block) have no AMX int8 tiles");
  const bool u4 = kind != I8;  // nibble codes
  const bool unpack_once = u4 && N > AMX_ROWS && nblocks <= AMX_UNPACK_ONCE;
  const bool stream = stream_output(o, N, out_features);
  alignas(64) uint8_t unpacked[AMX_UNPACK_ONCE * I8_BLOCK];
  amx_config();
  for (int64_t t = begin; t < end; ++t) {
    const Weights w{cp + t * tile_bytes, dp + t * nblocks * ROWS, mp ? mp + t * nblocks * ROWS : nullptr};
    const int64_t r0 = t * ROWS;
    const int cols = static_cast<int>(std::min<int64_t>(ROWS, out_features - r0));
    const uint8_t* next = t + 1 < end ? w.codes + tile_bytes : nullptr;
    Weights wt = w;  // unpacked once: the int8 B tiles as they are
    if (unpack_once) {
      for (int64_t b = 0; b < nblocks; ++b) amx_unpack(kind, w.codes + b * block_bytes_of(kind), unpacked + b * I8_BLOCK);
      wt.codes = unpacked;
    }
    for (int64_t n0 = 0; n0 < N; n0 += AMX_ROWS) {
      const int rows = static_cast<int>(std::min<int64_t>(AMX_ROWS, N - n0));
      if (rows < amx_group_min(kind)) {
        simd_rows(w, a, n0, rows, nblocks, kind, o + n0 * out_features + r0, out_features, cols);
        continue;
      }
      const uint8_t* ahead = n0 == 0 ? next : nullptr;  // the next tile's codes, prefetched during the first group
      float* dst = o + n0 * out_features + r0;
      const Codes tiles_of = unpack_once ? I8 : kind;  // unpacked once: the i8 layout
      with_codes(tiles_of, [&](auto c) {
        constexpr Codes C = decltype(c)::value;
        if constexpr (!two_scales(C)) {  // (refused above)
          if (w.m) tile_amx_rows<C, true>(wt, a, n0, rows, nblocks, ahead, tile_bytes, dst, out_features, cols, stream);
          else tile_amx_rows<C, false>(wt, a, n0, rows, nblocks, ahead, tile_bytes, dst, out_features, cols, stream);
        }
      });
    }
  }
  if (stream) _mm_sfence();
  amx_release();
}
#endif

// prefill-sized batches on the SIMD tiles run in chunks of rows of about this many bytes of int8 activations, each
// chunk swept by all of a thread's weight tiles: the whole batch's activations once per tile fell out of L2 (2,048
// rows of 576 inputs: 1.2 MB per tile; bench/RESULTS.md, "Prefill on AVX512-BF16 without AMX")
constexpr int64_t SIMD_CHUNK_BYTES = 256 * 1024;
// quant_linear_swiglu's runs of gate tiles whose up tiles follow them (matmul_impl): a run's product, [rows][2 x 16 x
// run] floats, of at most this many bytes (L2), and runs as long as that allows (at least 8 tiles): the weights are
// read in long runs in order (gate and up tile by tile, two regions alternating, took 1.2x the time of the unfused
// product at batch 1 with the weights from DRAM)
constexpr int64_t SWIGLU_RUN_BYTES = 512 * 1024;

// whether N rows of a weight of `kind` run on the AMX int8 tiles (two-scale formats never: their blocks have a scale
// per 16 inputs, the tiles' products one sum per 32)
bool use_amx(int64_t N, Codes kind) {
#ifdef GLMSERVE_AMX
  return !two_scales(kind) && N >= amx_group_min(kind) && amx_wanted.load() && glmserve::amx_int8_permitted();
#else
  (void)N, (void)kind;
  return false;
#endif
}

// out [N, I] = silu(gate) * up of y [N, 2I] (rows ldy apart): gate = y[:, :I], up = y[:, I:] (vec_math.h's silu_mul,
// as silu_and_mul computes it)
void silu_mul_rows(const float* y, int64_t ldy, int64_t N, int64_t I, float* out, int64_t ldo) {
  for (int64_t n = 0; n < N; ++n) {
    const float *g = y + n * ldy, *u = g + I;
    float* o = out + n * ldo;
    int64_t j = 0;
#if defined(__AVX512F__)
    for (; j + 16 <= I; j += 16)
      _mm512_storeu_ps(o + j, glmserve::silu_mul_16(_mm512_loadu_ps(g + j), _mm512_loadu_ps(u + j)));
#endif
    for (; j < I; ++j) o[j] = glmserve::silu_mul(g[j], u[j]);
  }
}

// out [N, out_features] = the activations x the packed weight; with `swiglu` (the merged gate-up projection of a
// gated MLP: out_features = 2I, I a multiple of 16) out [N, I] = silu(gate) * up instead, computed per run of gate
// tiles t.. and their up tiles t + I / 16.. on the same rows (SWIGLU_RUN_BYTES), so that the [N, 2I] product is never
// written out and read back (on the AMX tiles it is, and silu_mul_rows runs after)
at::Tensor matmul_impl(const Acts& a_in, int64_t N, const at::Tensor& codes, const at::Tensor& wd, const at::Tensor& wm,
                       bool u4, int64_t out_features, bool swiglu) {
  const int64_t tiles = codes.size(0), nblocks = codes.size(1);
  TORCH_CHECK(nblocks == a_in.nb, "quant_matmul: the weight has ", nblocks, " blocks of 32 inputs, the activations ", a_in.nb);
  TORCH_CHECK(tiles * ROWS >= out_features, "quant_matmul: ", tiles, " tiles of 16 rows hold fewer than ", out_features);
  const Codes kind = codes_of(u4, codes.size(2), "quant_matmul");
  TORCH_CHECK(!swiglu || out_features % (2 * ROWS) == 0, "quant_linear_swiglu: ", out_features,
              " outputs are not gate and up halves of a multiple of 16 each");
  const int64_t half = out_features / 2;
  auto out = at::empty({N, swiglu ? half : out_features}, at::kFloat);
  float* o = out.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(wd.data_ptr<at::Half>());
  const uint16_t* mp = wm.numel() ? reinterpret_cast<const uint16_t*>(wm.data_ptr<at::Half>()) : nullptr;
  const int64_t block_bytes = codes.size(2);
  Acts a = a_in;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  // the rows the VNNI tiles run, regrouped: all of them, or on the AMX tiles only a last group of 16 too small for
  // them (amx_tiles)
  int64_t first = 0;
#ifdef GLMSERVE_AMX
  if (use_amx(N, kind)) {
    const int64_t tail = N % AMX_ROWS;
    first = tail > 0 && tail < amx_group_min(kind) ? N - tail : N;
  }
#endif
  if (!a.groups) a.groups = pack_groups(a_in, first, N, kind), a.row0 = first;  // (quant_linear's come grouped)
#elif defined(__AVX2__) && defined(__FMA__)
  if (two_scales(kind)) a.half_offsets = half_offsets(a, N, half_sum_factor(kind));
#endif
#ifdef GLMSERVE_AMX
  if (use_amx(N, kind)) {
    // the activations padded with zero rows (codes and scales) to whole A tiles of 16 rows
    std::vector<int8_t> q_pad;
    std::vector<float> d_pad, s_pad;
    if (N % AMX_ROWS) {
      const int64_t padded = (N + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
      q_pad.assign(padded * a.kp, 0);
      d_pad.assign(padded * a.nb, 0.f);
      s_pad.assign(padded * a.nb, 0.f);
      std::memcpy(q_pad.data(), a.q, N * a.kp);
      std::memcpy(d_pad.data(), a.d, N * a.nb * sizeof(float));
      std::memcpy(s_pad.data(), a.s, N * a.nb * sizeof(float));
      a.q = q_pad.data(), a.d = d_pad.data(), a.s = s_pad.data();
    }
    at::Tensor full = swiglu ? at::empty({N, out_features}, at::kFloat) : out;
    float* y = full.data_ptr<float>();
    at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
      amx_tiles(cp, dp, mp, a, N, begin, end, nblocks, kind, y, out_features);
    });
    if (swiglu) {
      at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
        silu_mul_rows(y + begin * out_features, out_features, end - begin, half, o + begin * half, half);
      });
    }
    return out;
  }
#endif
  // rows in chunks whose int8 activations stay in L2 while a thread's tiles sweep them (SIMD_CHUNK_BYTES)
  const int64_t chunk = std::max<int64_t>(MAX_NB, SIMD_CHUNK_BYTES / a.kp / MAX_NB * MAX_NB);
  auto weights = [&](int64_t t) {
    return Weights{cp + t * nblocks * block_bytes, dp + t * nblocks * ROWS, mp ? mp + t * nblocks * ROWS : nullptr};
  };
  if (!swiglu) {
    const bool stream = stream_output(o, N, out_features);
    at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
      for (int64_t n0 = 0; n0 < N; n0 += chunk) {
        const int64_t rows = std::min(chunk, N - n0);
        for (int64_t t = begin; t < end; ++t)
          simd_rows(weights(t), a, n0, rows, nblocks, kind, o + n0 * out_features + t * ROWS, out_features,
                    static_cast<int>(std::min<int64_t>(ROWS, out_features - t * ROWS)), stream);
      }
#if defined(__AVX512F__)
      if (stream) _mm_sfence();
#endif
    });
    return out;
  }
  const int64_t gate_tiles = half / ROWS;
  at::parallel_for(0, gate_tiles, 2, [&](int64_t begin, int64_t end) {
    // per chunk of rows and run of gate tiles: the run's gate tiles, then its up tiles ([rows][gate outputs | up
    // outputs]), then silu(gate) * up
    const int64_t most = std::max<int64_t>(1, std::min(chunk, N));
    const int64_t longest = std::min(end - begin, std::max<int64_t>(8, SWIGLU_RUN_BYTES / (most * 2 * ROWS * 4)));
    std::vector<float> pair(most * 2 * longest * ROWS);
    for (int64_t n0 = 0; n0 < N; n0 += chunk) {
      const int64_t rows = std::min(chunk, N - n0);
      for (int64_t t0 = begin; t0 < end; t0 += longest) {
        const int64_t run = std::min(longest, end - t0), ld = 2 * run * ROWS;
        for (int64_t t = t0; t < t0 + run; ++t)  // (weights read in order: the run's gate tiles, then its up tiles)
          simd_rows(weights(t), a, n0, rows, nblocks, kind, pair.data() + (t - t0) * ROWS, ld, ROWS);
        for (int64_t t = t0; t < t0 + run; ++t)
          simd_rows(weights(gate_tiles + t), a, n0, rows, nblocks, kind, pair.data() + (run + t - t0) * ROWS, ld, ROWS);
        silu_mul_rows(pair.data(), ld, rows, run * ROWS, o + n0 * half + t0 * ROWS, half);
      }
    }
  });
  return out;
}

// set_amx(enable): whether the AMX tiles run batches of AMX_GROUP_MIN_* rows or more; returns whether they now
// do (false where the build or the CPU has no AMX)
bool set_amx(bool enable) {
#ifdef GLMSERVE_AMX
  amx_wanted.store(enable);
  return enable && glmserve::amx_int8_permitted();
#else
  (void)enable;
  return false;
#endif
}

// One block of 32 activations (x[0..n), n <= 32; the rest zero) given its scale dx: codes
// round(x / dx) as x * (1 / dx) rounded to nearest even and clamped to +-127, and their sum. The AVX-512 and
// AVX2 forms run the same float operations per element as the scalar one (a multiply, a round, two clamps),
// so every variant gives the same codes (tests/test_quant_kernels.py checks it). 32 rows of 576: 17.6 -> 7.7 us
// (AVX-512; bench/RESULTS.md, "Decode-batch linears").
int32_t quantize_block(const float* x, int64_t n, float dx, int8_t* q) {
  const float id = dx > 0.f ? 1.0f / dx : 0.f;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512 vid = _mm512_set1_ps(id), hi = _mm512_set1_ps(127.f), lo = _mm512_set1_ps(-127.f);
  __m512i sum = _mm512_setzero_si512();
  for (int h = 0; h < 2; ++h) {
    const int64_t left = std::max<int64_t>(0, std::min<int64_t>(16, n - 16 * h));
    const __mmask16 keep = static_cast<__mmask16>((1u << left) - 1);
    const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(keep, x + 16 * h), vid);
    const __m512 r = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i c = _mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, r)));
    sum = _mm512_add_epi32(sum, c);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * h), _mm512_cvtepi32_epi8(c));
  }
  return _mm512_reduce_add_epi32(sum);
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 vid = _mm256_set1_ps(id), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
  __m256i sum = _mm256_setzero_si256();
  alignas(32) float pad[QK] = {0.f};
  const float* src = x;
  if (n < QK) {
    std::memcpy(pad, x, n * sizeof(float));
    src = pad;
  }
  for (int h = 0; h < 4; ++h) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(src + 8 * h), vid);
    const __m256 r = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i c = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, r)));
    sum = _mm256_add_epi32(sum, c);
    // 8 int32 in -127..127 -> 8 int8: pack to int16, then int8 (lanes 0-3 and 4-7 sit in the two 128-bit halves)
    const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + 8 * h), _mm_packs_epi16(w16, w16));
  }
  const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xB1)));
#else
  int32_t sum = 0;
  for (int64_t i = 0; i < QK; ++i) {
    const float v = i < n ? std::min(127.f, std::max(-127.f, std::nearbyint(x[i] * id))) : 0.f;
    q[i] = static_cast<int8_t>(v);
    sum += static_cast<int32_t>(v);
  }
  return sum;
#endif
}

// quantize one row of k floats into kp = ceil(k / 32) * 32 int8 codes (the tail zero)
void quantize_row(const float* x, int64_t k, int64_t kp, bool per_token, int8_t* q, float* d, float* s, int32_t* isum) {
  const int64_t nb = kp / QK;
  const float row_amax = per_token ? glmserve::abs_max(x, k) : 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * QK, n = std::min(k, lo + QK) - lo;
    const float dx = (per_token ? row_amax : glmserve::abs_max(x + lo, n)) * INV127;
    const int32_t sum = quantize_block(x + lo, n, dx, q + lo);
    d[b] = dx;
    isum[b] = sum;
    s[b] = dx * static_cast<float>(sum);
  }
}

std::vector<at::Tensor> quantize_activations(const at::Tensor& x_in, bool per_token) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "quantize_activations: x must be a 2-D float32 CPU tensor");
  const auto x = x_in.contiguous();
  const int64_t N = x.size(0), k = x.size(1), nb = (k + QK - 1) / QK, kp = nb * QK;
  auto q = at::empty({N, kp}, at::kChar);
  auto d = at::empty({N, nb}, at::kFloat), s = at::empty({N, nb}, at::kFloat);
  auto isum = at::empty({N, nb}, at::kInt);
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float *dp = d.data_ptr<float>(), *sp = s.data_ptr<float>();
  int32_t* ip = isum.data_ptr<int32_t>();
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      quantize_row(xp + n * k, k, kp, per_token, qp + n * kp, dp + n * nb, sp + n * nb, ip + n * nb);
  });
  return {q, d, s, isum};
}

Acts acts_of(const at::Tensor& q, const at::Tensor& d, const at::Tensor& s, const at::Tensor& isum) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous() && d.is_contiguous() &&
              s.is_contiguous() && isum.is_contiguous(), "quant_matmul: activations as quantize_activations makes them");
  return Acts{q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<float>(), isum.data_ptr<int32_t>(), q.size(1),
              q.size(1) / QK};
}

void check_weights(const at::Tensor& codes, const at::Tensor& wd, const at::Tensor& wm) {
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "quant_matmul: codes [tiles, blocks, bytes] uint8");
  TORCH_CHECK(wd.scalar_type() == at::kHalf && wd.is_contiguous() && wd.numel() == codes.size(0) * codes.size(1) * ROWS,
              "quant_matmul: scales [tiles, blocks, 16] float16");
  TORCH_CHECK(wm.numel() == 0 || (wm.scalar_type() == at::kHalf && wm.is_contiguous() && wm.numel() == wd.numel()),
              "quant_matmul: mins [tiles, blocks, 16] float16, or empty");
}

// out [N, out_features] = activations (already quantized) x packed weights
at::Tensor quant_matmul(const at::Tensor& q, const at::Tensor& d, const at::Tensor& s, const at::Tensor& isum,
                        const at::Tensor& codes, const at::Tensor& wd, const at::Tensor& wm, bool u4, int64_t out_features) {
  check_weights(codes, wd, wm);
  return matmul_impl(acts_of(q, d, s, isum), q.size(0), codes, wd, wm, u4, out_features, false);
}

// quantize_activations, then matmul_impl (swiglu: quant_linear_swiglu). On the VNNI tiles the rows are quantized
// straight into their groups (quantize_row, then put_row, per row): one parallel region instead of two, and no
// quantized tensors in between (the same codes and scales)
at::Tensor linear_impl(const at::Tensor& x_in, bool per_token, const at::Tensor& codes, const at::Tensor& wd,
                       const at::Tensor& wm, bool u4, int64_t out_features, bool swiglu) {
  check_weights(codes, wd, wm);
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  const int64_t N = x_in.dim() == 2 ? x_in.size(0) : 0;
  const Codes kind = codes_of(u4, codes.size(2), "quant_linear");
  if (x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu() && !use_amx(N, kind)) {
    const auto x = x_in.contiguous();
    const int64_t k = x.size(1), nb = (k + QK - 1) / QK, kp = nb * QK;
    GroupWord* groups = group_buffer(static_cast<size_t>(N * nb * group_words(kind)));
    const float* xp = x.data_ptr<float>();
    at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
      std::vector<int8_t> q(kp);
      std::vector<float> d(nb), s(nb);
      std::vector<int32_t> isum(nb);
      for (int64_t n = begin; n < end; ++n) {
        quantize_row(xp + n * k, k, kp, per_token, q.data(), d.data(), s.data(), isum.data());
        put_row(q.data(), d.data(), s.data(), isum.data(), nb, 0, n, N, kind, groups);
      }
    });
    Acts a{nullptr, nullptr, nullptr, nullptr, kp, nb, groups, 0};
    return matmul_impl(a, N, codes, wd, wm, u4, out_features, swiglu);
  }
#endif
  const auto a = quantize_activations(x_in, per_token);
  return matmul_impl(acts_of(a[0], a[1], a[2], a[3]), x_in.size(0), codes, wd, wm, u4, out_features, swiglu);
}

// quantize_activations, then quant_matmul
at::Tensor quant_linear(const at::Tensor& x, bool per_token, const at::Tensor& codes, const at::Tensor& wd,
                        const at::Tensor& wm, bool u4, int64_t out_features) {
  return linear_impl(x, per_token, codes, wd, wm, u4, out_features, false);
}

// quant_linear of a gated MLP's merged gate-up weight (out_features = 2I, I a multiple of 16), returning
// silu(gate) * up [N, I]: silu_and_mul(quant_linear(...)) in one pass, the same floats
at::Tensor quant_linear_swiglu(const at::Tensor& x, bool per_token, const at::Tensor& codes, const at::Tensor& wd,
                               const at::Tensor& wm, bool u4, int64_t out_features) {
  return linear_impl(x, per_token, codes, wd, wm, u4, out_features, true);
}

// The packed weight back as a dense [out_features, kp] matrix (kp = blocks * 32) of w = d * c + m, in bfloat16
// (rounded to nearest even) or float32, written into `out` (a reused scratch): large batches (prefill) run it
// through torch's GEMM (oneDNN: AMX or AVX512-BF16 where the CPU has them), one layer at a time
// (quant/cpu_backend.py `dense_apply`).
template <typename T, Codes C>
void dequantize_tile(const uint8_t* codes, const uint16_t* d, const uint16_t* m, int64_t nblocks, int rows,
                     int64_t kp, T* out) {
  constexpr int64_t bytes = block_bytes_of(C);
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* c = codes + b * bytes;
    float v[ROWS][QK];
    for (int j = 0; j < (C != I8 ? 4 : 8); ++j)
      for (int r = 0; r < ROWS; ++r)
        for (int t = 0; t < 4; ++t) {
          const uint8_t byte = C == Q2 ? 0 : c[(j * ROWS + r) * 4 + t];
          if constexpr (C != I8) {
            v[r][4 * j + t] = static_cast<float>(nibble_code<C>(c, j, r, t, byte & 0x0F));
            v[r][16 + 4 * j + t] = static_cast<float>(nibble_code<C>(c, 4 + j, r, t, byte >> 4));
          } else {
            v[r][4 * j + t] = static_cast<float>(static_cast<int8_t>(byte));
          }
        }
    for (int r = 0; r < rows; ++r) {
      const float dr = half_to_float(d[b * ROWS + r]), mr = m ? half_to_float(m[b * ROWS + r]) : 0.f;
      const float dh = two_scales(C) ? half_to_float(high_scales<C>(c)[r]) : dr;  // inputs 16..31's scale
      const float mh = C == Q2 ? half_to_float(high_mins(c)[r]) : mr;            // and min
      T* o = out + r * kp + b * QK;
      for (int i = 0; i < QK; ++i) {
        const float w = i < QK / 2 ? dr * v[r][i] + mr : dh * v[r][i] + mh;
        if constexpr (std::is_same_v<T, uint16_t>) {  // float -> bfloat16 bits, round to nearest even
          uint32_t u;
          std::memcpy(&u, &w, 4);
          o[i] = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
        } else {
          o[i] = w;
        }
      }
    }
  }
}

at::Tensor dequantize_packed(const at::Tensor& codes, const at::Tensor& wd, const at::Tensor& wm, bool u4,
                             int64_t out_features, bool bf16, at::Tensor out) {
  check_weights(codes, wd, wm);
  const int64_t tiles = codes.size(0), nblocks = codes.size(1), kp = nblocks * QK;
  TORCH_CHECK(tiles * ROWS >= out_features, "dequantize_packed: ", tiles, " tiles of 16 rows hold fewer than ", out_features);
  const Codes kind = codes_of(u4, codes.size(2), "dequantize_packed");
  const auto dtype = bf16 ? at::kBFloat16 : at::kFloat;
  TORCH_CHECK(out.scalar_type() == dtype && out.is_contiguous() && out.numel() >= out_features * kp,
              "dequantize_packed: out must be a contiguous ", dtype, " buffer of at least ", out_features * kp);
  auto w = out.view({-1}).narrow(0, 0, out_features * kp).view({out_features, kp});
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(wd.data_ptr<at::Half>());
  const uint16_t* mp = wm.numel() ? reinterpret_cast<const uint16_t*>(wm.data_ptr<at::Half>()) : nullptr;
  void* op = w.data_ptr();
  const int64_t block_bytes = codes.size(2);
  at::parallel_for(0, tiles, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int rows = static_cast<int>(std::min<int64_t>(ROWS, out_features - t * ROWS));
      const uint8_t* c = cp + t * nblocks * block_bytes;
      const uint16_t* d = dp + t * nblocks * ROWS;
      const uint16_t* m = mp ? mp + t * nblocks * ROWS : nullptr;
      const int64_t at = t * ROWS * kp;
      with_codes(kind, [&](auto format) {
        constexpr Codes C = decltype(format)::value;
        if (bf16) dequantize_tile<uint16_t, C>(c, d, m, nblocks, rows, kp, static_cast<uint16_t*>(op) + at);
        else dequantize_tile<float, C>(c, d, m, nblocks, rows, kp, static_cast<float*>(op) + at);
      });
    }
  });
  return w;
}

// x [M, in] (bf16 or float32) x the packed weight -> [M, out_features] bf16 with float32 sums, on the AMX bf16
// tiles (amx_bf16_gemm above), or with `swiglu` (a merged gate-up weight: out_features = 2I, I a multiple of 16)
// [M, I] = silu(gate) * up, the floats of silu_and_mul on the unfused product; only in the avx512 build on a CPU with
// AMX-BF16 (an error elsewhere)
at::Tensor amx_bf16_gemm_op(const char* name, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& wd,
                            const at::Tensor& wm, bool u4, int64_t out_features, bool swiglu) {
  glmserve::check_bf16_linear_args(name, x, codes, wd, wm, u4, out_features);
  const int64_t tiles = codes.size(0), nblocks = codes.size(1), kp = nblocks * QK;
  TORCH_CHECK(!swiglu || (out_features % (2 * ROWS) == 0 && tiles * ROWS == out_features), name, ": ", out_features,
              " outputs are not gate and up halves of a multiple of 16 each");
#ifdef GLMSERVE_AMX
  TORCH_CHECK(glmserve::amx_bf16_permitted(), name, ": this CPU (or kernel) has no AMX-BF16 tiles");
  const int64_t M = x.size(0);
  auto out = at::empty({M, swiglu ? out_features / 2 : out_features}, at::kBFloat16);
  if (M == 0) return out;
  const at::Tensor a = glmserve::bf16_rows(x, kp);
  at::Tensor tail;  // the last M % 16 rows, zero-padded to one A tile (none where M is a multiple of 16)
  const int64_t full = M / 16 * 16;
  if (full < M) {
    tail = at::zeros({16, kp}, at::kBFloat16);
    tail.narrow(0, 0, M - full).copy_(a.narrow(0, full, M - full));
  }
  amx_bf16_gemm(reinterpret_cast<const uint16_t*>(a.data_ptr<at::BFloat16>()),
                full < M ? reinterpret_cast<const uint16_t*>(tail.data_ptr<at::BFloat16>()) : nullptr, M, codes.data_ptr<uint8_t>(),
                reinterpret_cast<const uint16_t*>(wd.data_ptr<at::Half>()),
                wm.numel() ? reinterpret_cast<const uint16_t*>(wm.data_ptr<at::Half>()) : nullptr,
                codes_of(u4, codes.size(2), name), tiles, nblocks, out_features, swiglu, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  return out;
#else
  TORCH_CHECK(false, name, ": needs the avx512 build on Linux x86-64");
  return {};
#endif
}

at::Tensor amx_bf16_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& wd, const at::Tensor& wm,
                           bool u4, int64_t out_features) {
  return amx_bf16_gemm_op("amx_bf16_linear", x, codes, wd, wm, u4, out_features, false);
}

at::Tensor amx_bf16_linear_swiglu(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& wd,
                                  const at::Tensor& wm, bool u4, int64_t out_features) {
  return amx_bf16_gemm_op("amx_bf16_linear_swiglu", x, codes, wd, wm, u4, out_features, true);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_activations", &quantize_activations, "int8 activations per block of 32 or per row (CPU)");
  m.def("quant_matmul", &quant_matmul, "quantized activations x packed int8/int4 block weights (CPU)");
  m.def("quant_linear", &quant_linear, "quantize_activations, then quant_matmul (CPU)");
  m.def("quant_linear_swiglu", &quant_linear_swiglu,
        "quant_linear of a merged gate-up weight, returning silu(gate) * up (CPU)");
  m.def("set_amx", &set_amx, "use the AMX int8 tiles for batches of 6+ (int8) / 10+ (u4, u5) rows (where the CPU has them)");
  m.def("amx_bf16_linear", &amx_bf16_linear, "x [M, in] bf16/f32 x packed block weights -> [M, out] bf16 on AMX (CPU)");
  m.def("amx_bf16_linear_swiglu", &amx_bf16_linear_swiglu,
        "amx_bf16_linear of a merged gate-up weight, returning silu(gate) * up [M, out / 2] bf16 (CPU)");
  m.def("dequantize_packed", &dequantize_packed, "packed block weights -> dense [out, blocks*32] bf16 or f32 (CPU)");
}
