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

// whether `bytes` per tile block is a nibble-code format's (u4, u5, t4)
constexpr bool nibble_block_bytes(int64_t bytes) {
  return bytes == kU4BlockBytes || bytes == kU5BlockBytes || bytes == kT4BlockBytes;
}

}  // namespace glmserve
