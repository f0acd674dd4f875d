// What this machine's AMX bf16 tiles reach, for the GFLOP/s of bench/gemm_micro.py --dense to be read against:
// (1) tdpbf16ps alone on 4 accumulator tiles (no loads), the TMUL's own rate (1,024 FLOP per cycle and core:
// 16 x 16 x 32 multiply-adds per instruction, one per 16 cycles); (2) the 2 x 2 accumulator block of
// glmserve/kernels/csrc/quant_matmul.cpp's gemm_block, A and B tiles loaded from L1 (18 blocks of K). One thread,
// best of 7 runs of the calling thread's CPU time.
//
//   g++ -O2 -march=sapphirerapids bench/amx_peak.cpp -o /tmp/amx_peak && taskset -c 0 /tmp/amx_peak
#include <immintrin.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>

namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

double cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

constexpr long K = 18, STEPS = 200000;
alignas(64) uint16_t a[32 * K * 32], b[2 * K * 512];
alignas(64) float c[32 * 32];

__attribute__((target("amx-tile,amx-bf16"))) double products_only() {
  const double t = cpu_seconds();
  for (long i = 0; i < STEPS; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, 128);
  return cpu_seconds() - t;
}

__attribute__((target("amx-tile,amx-bf16"))) double block_from_l1() {
  const double t = cpu_seconds();
  for (long i = 0; i < STEPS / K; ++i) {
    for (long k = 0; k < K; ++k) {
      _tile_loadd(4, a + k * 32, K * 64);
      _tile_loadd(6, b + k * 512, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(7, b + (K + k) * 512, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(5, a + 16 * K * 32 + k * 32, K * 64);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c, 128);
  }
  return cpu_seconds() - t;
}

}  // namespace

__attribute__((target("amx-tile,amx-bf16"))) int main() {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) {
    std::puts("no AMX tile permission (kernel or CPU without AMX)");
    return 1;
  }
  for (long i = 0; i < 32 * K * 32; ++i) a[i] = static_cast<uint16_t>(0x3f80 + (i * 7 & 0x7f));  // bf16 1..2
  for (long i = 0; i < 2 * K * 512; ++i) b[i] = static_cast<uint16_t>(0x3c00 + (i * 13 & 0x3ff));
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  _tile_loadd(4, a, 64);
  _tile_loadd(5, a, 64);
  _tile_loadd(6, b, 64);
  _tile_loadd(7, b, 64);
  double only = 1e9, block = 1e9;
  for (int r = 0; r < 7; ++r) only = std::min(only, products_only()), block = std::min(block, block_from_l1());
  const double flops = STEPS * 4 * 16.0 * 16 * 32 * 2, block_flops = STEPS / K * K * 4 * 16.0 * 16 * 32 * 2;
  std::printf("tile products alone: %.0f GFLOP/s; 2x2 block, tiles loaded from L1: %.0f GFLOP/s\n", flops / only / 1e9,
              block_flops / block / 1e9);
  _tile_release();
  return 0;
}
