// Prefill-sized linear layers on CPUs with AVX512-BF16 but no AMX (AMD Zen 4 and later; quant/cpu_backend.py
// dense_apply): bf16 activations x the packed quantized weight (csrc/quant_matmul.cpp's layout), float32 sums,
// bf16 out: amx_bf16_linear's contract, on vdpbf16ps instead of the tiles.
//
// The weight is dequantized panel by panel into bf16 input pairs (bf16_pairs.h: per output tile of 16 rows and
// input pair, one zmm of 16 lanes x 2 bf16, the operand vdpbf16ps takes), once per thread and panel, and no dense
// copy is kept. Blocking (the ideas of oneDNN's brgemm for avx512_core_bf16, src/cpu/x64/brgemm/
// jit_brgemm_kernel.cpp: a B panel resident in L2, blocks of A rows swept over it, an MR x NC register block of
// float32 accumulators over the whole K, A broadcast 32 bits (one input pair) at a time; and llama.cpp's
// ggml/src/ggml-cpu/amx/mmq.cpp for the panel of dequantized weights; the code is our own):
//   a thread takes a contiguous share of output tiles, in panels of at most PANEL_BYTES of bf16 pairs (L2);
//   for each block of MR = 8 activation rows (8 x in x 2 bytes: L1) and each group of NC = 3 tiles of the panel:
//   24 zmm accumulators over all input pairs; per pair 3 loads of B, 8 broadcasts of A, 24 vdpbf16ps; then the
//   sums rounded to bf16 and stored (masked past out_features). Rows past a multiple of MR and tiles past a
//   multiple of NC run the same loop with smaller MR / NC. Inputs past the weight's multiple of 32 come from a
//   zero-padded copy of the activations (a padded input's weight is m, not 0).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "packed_blocks.h"  // bytes per tile block of each code format (bf16_linear_args.h, bf16_pairs.h)
#include "bf16_linear_args.h"
#include "bf16_pairs.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>

namespace {

constexpr int64_t QK = 32;    // inputs per block of the packed weight
constexpr int64_t ROWS = 16;  // output rows per tile

#ifdef GLMSERVE_BF16_TARGET
constexpr int MR = 8;  // activation rows per register block
constexpr int NC = 3;  // output tiles (zmm columns) per register block: MR * NC = 24 accumulators of 32 zmm
constexpr int64_t PANEL_BYTES = 384 * 1024;  // bf16 pairs of one panel (L2: 1-2 MB per core)

// out rows [0, mr) x tiles [0, nc) of 16 columns += a [mr rows, lda apart] x b (nc tiles of `pairs` input pairs,
// bstride elements apart), rounded to bf16 into out (row stride ldo), columns from `cols` on not stored
template <int R, int C>
GLMSERVE_BF16_TARGET void micro_kernel(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t bstride,
                                       int64_t pairs, uint16_t* out, int64_t ldo, int64_t cols) {
  __m512 acc[R][C];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < pairs; ++k) {
    __m512bh bv[C];
    for (int j = 0; j < C; ++j) bv[j] = (__m512bh)_mm512_loadu_si512(b + j * bstride + k * 32);
    for (int i = 0; i < R; ++i) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(a + i * lda + 2 * k));
      for (int j = 0; j < C; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], av, bv[j]);
    }
  }
  for (int j = 0; j < C; ++j) {
    const int64_t left = cols - 16 * j;
    if (left <= 0) break;
    const __mmask16 keep = static_cast<__mmask16>(left >= 16 ? 0xFFFF : (1u << left) - 1);
    for (int i = 0; i < R; ++i)
      _mm256_mask_storeu_epi16(out + i * ldo + 16 * j, keep, (__m256i)_mm512_cvtneps_pbh(acc[i][j]));
  }
}

using MicroKernel = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, uint16_t*, int64_t, int64_t);

template <int R>
constexpr MicroKernel kernel_for_cols(int c) {
  return c == 3 ? micro_kernel<R, 3> : c == 2 ? micro_kernel<R, 2> : micro_kernel<R, 1>;
}

// the R x C micro kernel (1 <= R <= MR, 1 <= C <= NC)
MicroKernel micro_for(int r, int c) {
  static_assert(MR == 8 && NC == 3, "micro_for lists MR x NC");
  switch (r) {
    case 8: return kernel_for_cols<8>(c);
    case 7: return kernel_for_cols<7>(c);
    case 6: return kernel_for_cols<6>(c);
    case 5: return kernel_for_cols<5>(c);
    case 4: return kernel_for_cols<4>(c);
    case 3: return kernel_for_cols<3>(c);
    case 2: return kernel_for_cols<2>(c);
    default: return kernel_for_cols<1>(c);
  }
}

// tiles [t0, t0 + nt) of the packed weight (nblocks blocks of `block_bytes` each) as bf16 pairs into buf ([nt][nblocks]
// PAIR_TILE)
GLMSERVE_BF16_TARGET void dequantize_panel(const uint8_t* cp, const uint16_t* dp, const uint16_t* mp,
                                           int64_t block_bytes, int64_t t0, int64_t nt, int64_t nblocks, uint16_t* buf) {
  for (int64_t i = 0; i < nt * nblocks; ++i) {
    const int64_t at = t0 * nblocks + i;
    glmserve::dequantize_bf16_block(block_bytes, cp + at * block_bytes, dp + at * ROWS, mp ? mp + at * ROWS : nullptr,
                                    buf + i * glmserve::PAIR_TILE);
  }
}

// output tiles [first, first + count) of out [M, out_features] bf16 = a [M, kp] bf16 x the packed weight, on the
// calling thread, panel by panel
void bf16_tiles(const uint16_t* a, int64_t M, const uint8_t* cp, const uint16_t* dp, const uint16_t* mp,
                int64_t block_bytes, int64_t first, int64_t count, int64_t nblocks, int64_t out_features, uint16_t* out) {
  const int64_t kp = nblocks * QK, pairs = kp / 2, tile_elems = nblocks * glmserve::PAIR_TILE;
  const int64_t pt_max = std::max<int64_t>(NC, PANEL_BYTES / (2 * tile_elems) / NC * NC);
  const int64_t panels = (count + pt_max - 1) / pt_max;
  const int64_t pt = (count + panels - 1) / panels;  // panels of equal size
  uint16_t* buf = static_cast<uint16_t*>(std::aligned_alloc(64, pt * tile_elems * 2));
  for (int64_t t0 = first; t0 < first + count; t0 += pt) {
    const int64_t nt = std::min(pt, first + count - t0);
    dequantize_panel(cp, dp, mp, block_bytes, t0, nt, nblocks, buf);
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
      const int r = static_cast<int>(std::min<int64_t>(MR, M - m0));
      for (int64_t j = 0; j < nt; j += NC) {
        const int c = static_cast<int>(std::min<int64_t>(NC, nt - j));
        const int64_t n0 = (t0 + j) * ROWS;
        micro_for(r, c)(a + m0 * kp, kp, buf + j * tile_elems, tile_elems, pairs, out + m0 * out_features + n0,
                        out_features, out_features - n0);
      }
    }
  }
  std::free(buf);
}
#endif

// x [M, in] (bf16 or float32) x the packed weight -> [M, out_features] bf16 with float32 sums on AVX512-BF16; the
// avx512 build on a CPU with AVX512-BF16 only (an error elsewhere). Threads: the output tiles split into one
// contiguous share per thread, equal to within NC tiles (each thread dequantizes only its own tiles).
at::Tensor avx512_bf16_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& wd,
                              const at::Tensor& wm, bool u4, int64_t out_features) {
  glmserve::check_bf16_linear_args("avx512_bf16_linear", x, codes, wd, wm, u4, out_features);
  const int64_t tiles = codes.size(0), nblocks = codes.size(1), kp = nblocks * QK;
#ifdef GLMSERVE_BF16_TARGET
  TORCH_CHECK(glmserve::avx512_bf16_present(), "avx512_bf16_linear: this CPU has no AVX512-BF16");
  const int64_t M = x.size(0);
  auto out = at::empty({M, out_features}, at::kBFloat16);
  if (M == 0) return out;
  const at::Tensor a = glmserve::bf16_rows(x, kp);
  const auto* ap = reinterpret_cast<const uint16_t*>(a.data_ptr<at::BFloat16>());
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const auto* dp = reinterpret_cast<const uint16_t*>(wd.data_ptr<at::Half>());
  const auto* mp = wm.numel() ? reinterpret_cast<const uint16_t*>(wm.data_ptr<at::Half>()) : nullptr;
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t groups = (tiles + NC - 1) / NC;
  const int64_t shares = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), groups));
  at::parallel_for(0, shares, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const int64_t lo = NC * (groups * s / shares), hi = std::min(tiles, NC * (groups * (s + 1) / shares));
      bf16_tiles(ap, M, cp, dp, mp, codes.size(2), lo, hi - lo, nblocks, out_features, op);
    }
  });
  return out;
#else
  TORCH_CHECK(false, "avx512_bf16_linear: needs the avx512 build on x86-64");
  return {};
#endif
}

// whether this build and CPU run avx512_bf16_linear
bool avx512_bf16_available() {
#ifdef GLMSERVE_BF16_TARGET
  return glmserve::avx512_bf16_present();
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("avx512_bf16_linear", &avx512_bf16_linear,
        "x [M, in] bf16/f32 x packed block weights -> [M, out] bf16 on AVX512-BF16 (CPU)");
  m.def("avx512_bf16_available", &avx512_bf16_available, "whether this build and CPU run avx512_bf16_linear");
}
