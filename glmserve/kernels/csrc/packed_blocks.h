// Bytes per tile block (16 output rows x 32 inputs) of each code format of the packed quantized weight
// (quant_matmul.cpp's header; quant/cpu_backend.py `pack`): the one place the kernels read them from, so that a new
// format is a new size here.
#pragma once

#include <cstdint>

namespace glmserve {

constexpr int64_t kI8BlockBytes = 16 * 32;                 // i8: signed int8 codes
constexpr int64_t kU4BlockBytes = 16 * 32 / 2;             // u4: nibbles
constexpr int64_t kU5BlockBytes = kU4BlockBytes + 8 * 8;   // u5: the nibbles, then 8 masks of 64 fifth bits
constexpr int64_t kT4BlockBytes = kU4BlockBytes + 16;      // t4: the nibbles, then their table of 16 int8 values
// q6: the nibbles, then the codes' top two bits (2 x 64 bytes of four 2-bit fields), then the 16 rows' fp16 scales
// of inputs 16..31
constexpr int64_t kQ6BlockBytes = kU4BlockBytes + 2 * 64 + 16 * 2;
// s4: the nibbles, then the 16 rows' fp16 scales of inputs 16..31
constexpr int64_t kS4BlockBytes = kU4BlockBytes + 16 * 2;

// f4: t4 with the second scale (NVFP4's E2M1 values with a scale per 16): the nibbles, their table of 16 codes
// stored as c + 32 (c in [-32, 31]), then the 16 rows' fp16 scales of inputs 16..31
constexpr int64_t kF4BlockBytes = kU4BlockBytes + 16 + 16 * 2;

// q2: 2-bit codes (a min and a scale per 16 inputs: GGUF Q2_K) in q6's top-bit layout (2 x 64 bytes of four 2-bit
// fields, no nibbles), then the 16 rows' fp16 scales and fp16 mins of inputs 16..31
constexpr int64_t kQ2BlockBytes = 2 * 64 + 16 * 2 + 16 * 2;

// where the fp16 scales of inputs 16..31 start in a block of a two-scale format (q6, s4, f4, q2: the tile's d are those
// of inputs 0..15); q2's mins of inputs 16..31 follow them
constexpr int64_t high_scales_at(int64_t bytes) {
  if (bytes == kQ2BlockBytes) return 2 * 64;
  return kU4BlockBytes + (bytes == kQ6BlockBytes ? 2 * 64 : bytes == kF4BlockBytes ? 16 : 0);
}

// whether `bytes` per tile block is the format of codes narrower than a byte (the kernels' `u4` flag: u4, u5, t4, q6,
// s4, f4, q2)
constexpr bool nibble_block_bytes(int64_t bytes) {
  return bytes == kU4BlockBytes || bytes == kU5BlockBytes || bytes == kT4BlockBytes || bytes == kQ6BlockBytes ||
         bytes == kS4BlockBytes || bytes == kF4BlockBytes || bytes == kQ2BlockBytes;
}

}  // namespace glmserve
