// The contract shared by the bf16 GEMMs on the packed quantized weight (quant_matmul.cpp's amx_bf16_linear,
// bf16_gemm.cpp's avx512_bf16_linear): x [M, in] bf16 or float32 times the packed weight (quant/cpu_backend.py's
// layout: codes [tiles, blocks, 512, 256, 320, 272, 416, 288, 304 or 192 bytes] uint8 (packed_blocks.h's formats),
// scales and mins [tiles, blocks, 16] float16) -> [M, out]
// bf16. Its argument checks, and the activation rows as the kernels read them. Needs packed_blocks.h (included first
// by the source: the build stages one level of headers).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace glmserve {

// Checks x and the packed weight against the contract; `name` (the op) starts every message
inline void check_bf16_linear_args(const char* name, const at::Tensor& x, const at::Tensor& codes,
                                   const at::Tensor& wd, const at::Tensor& wm, bool u4, int64_t out_features) {
  constexpr int64_t rows = 16, qk = 32;  // output rows per tile, inputs per block
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.is_contiguous(), name,
              ": codes [tiles, blocks, bytes] uint8");
  const int64_t tiles = codes.size(0), kp = codes.size(1) * qk;
  TORCH_CHECK(wd.scalar_type() == at::kHalf && wd.is_contiguous() && wd.numel() == tiles * codes.size(1) * rows, name,
              ": scales [tiles, blocks, 16] float16");
  TORCH_CHECK(wm.numel() == 0 || (wm.scalar_type() == at::kHalf && wm.is_contiguous() && wm.numel() == wd.numel()),
              name, ": mins [tiles, blocks, 16] float16, or empty");
  TORCH_CHECK(tiles * rows >= out_features, name, ": ", tiles, " tiles of 16 rows hold fewer than ", out_features);
  const int64_t bytes = codes.size(2);
  TORCH_CHECK(u4 ? nibble_block_bytes(bytes) : bytes == kI8BlockBytes, name, ": block bytes ", bytes);
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              name, ": x must be a 2-D bfloat16 or float32 CPU tensor");
  TORCH_CHECK(x.size(1) <= kp && x.size(1) > kp - qk, name, ": x has ", x.size(1), " features, the weight ", kp,
              " (padded to 32)");
}

// x as contiguous bf16 rows of kp inputs: x itself where it already is one, else a converted copy zero-padded to kp
inline at::Tensor bf16_rows(const at::Tensor& x, int64_t kp) {
  if (x.scalar_type() == at::kBFloat16 && x.size(1) == kp && x.is_contiguous()) return x;
  at::Tensor a = at::zeros({x.size(0), kp}, at::kBFloat16);
  a.narrow(1, 0, x.size(1)).copy_(x);
  return a;
}

}  // namespace glmserve
