// AMX plumbing shared by kernels that use the tiles: whether this CPU has them and Linux lets this process use
// them, and the 64-byte tile configuration record that _tile_loadconfig reads.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace glmserve {

// Linux granted this process the tile state (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, kernel 5.16+);
// asked once per process
inline bool amx_tiles_granted() {
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

// AMX-TILE (CPUID leaf 7 EDX bit 24) and AMX-INT8 (bit 25), and the tile state granted
inline bool amx_int8_permitted() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1) || !((d >> 25) & 1)) return false;
    return amx_tiles_granted();
  }();
  return ok;
}

// AMX-TILE and AMX-BF16 (leaf 7 EDX bit 22) with AVX512-BF16 (leaf 7 subleaf 1 EAX bit 5), and the tile state granted
inline bool amx_bf16_permitted() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1) || !((d >> 22) & 1)) return false;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !((a >> 5) & 1)) return false;
    return amx_tiles_granted();
  }();
  return ok;
}

struct alignas(64) TileConfig {  // palette 1: per tile its rows and bytes per row
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace glmserve

#define GLMSERVE_HAS_AMX 1
#endif
