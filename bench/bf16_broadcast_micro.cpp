// vdpbf16ps with its broadcast operand loaded per instruction, as the prefill attention's vector engine ran it
// (csrc/prefill_attention.cpp VectorBf16: 16 keys' accumulators, each product with a key pair broadcast from memory),
// against each broadcast serving two accumulators (two query tiles: 8 keys x 2), the form it runs now. Prints G
// vdpbf16ps per second of each, three rounds; the instruction's rate with register operands is 2 a cycle on Zen 5
// (bench/RESULTS.md). One thread, wall clock, the data in L1.
//
//   g++ -O3 -march=x86-64-v4 -mavx512bf16 bench/bf16_broadcast_micro.cpp -o /tmp/bf16_bcast && taskset -c 1 /tmp/bf16_bcast
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <vector>
#include <cstring>
// one query tile: per pair c of D = 64, one Q^T row load and 16 vdpbf16ps, each with its key pair broadcast
__attribute__((noinline)) void scores(const uint16_t* qt, const uint16_t* k, float* s, int reps) {
  for (int it = 0; it < reps; ++it) {
    __m512 acc[16];
    for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
    for (int c = 0; c < 32; ++c) {
      const __m512bh q = (__m512bh)_mm512_loadu_si512(qt + c * 32);
      for (int r = 0; r < 16; ++r) {
        int32_t bits; std::memcpy(&bits, k + r * 64 + 2 * c, 4);
        acc[r] = _mm512_dpbf16_ps(acc[r], q, (__m512bh)_mm512_set1_epi32(bits));
      }
    }
    for (int r = 0; r < 16; ++r) _mm512_store_ps(s + r * 16, acc[r]);
  }
}
// two query tiles: per pair c, two Q^T row loads and 8 key pairs broadcast, each into two accumulators
__attribute__((noinline)) void scores2(const uint16_t* qt, const uint16_t* qt2, const uint16_t* k, float* s, int reps) {
  for (int it = 0; it < reps; ++it) {
    for (int r0 = 0; r0 < 16; r0 += 8) {
    __m512 acc[8], acc2[8];
    for (int r = 0; r < 8; ++r) acc[r] = _mm512_setzero_ps(), acc2[r] = _mm512_setzero_ps();
    for (int c = 0; c < 32; ++c) {
      const __m512bh q = (__m512bh)_mm512_loadu_si512(qt + c * 32);
      const __m512bh q2 = (__m512bh)_mm512_loadu_si512(qt2 + c * 32);
      for (int r = 0; r < 8; ++r) {
        int32_t bits; std::memcpy(&bits, k + (r0 + r) * 64 + 2 * c, 4);
        const __m512bh b = (__m512bh)_mm512_set1_epi32(bits);
        acc[r] = _mm512_dpbf16_ps(acc[r], q, b);
        acc2[r] = _mm512_dpbf16_ps(acc2[r], q2, b);
      }
    }
    for (int r = 0; r < 8; ++r) _mm512_store_ps(s + (r0 + r) * 16, acc[r]), _mm512_store_ps(s + 256 + (r0 + r) * 16, acc2[r]);
    }
  }
}
int main() {
  std::vector<uint16_t> qt(32 * 32, 0x3f80), qt2(32*32, 0x3f80), k(64 * 64, 0x3f80);
  alignas(64) static float s[512];
  const int reps = 200000;
  for (int round = 0; round < 3; ++round) {
    auto t0 = std::chrono::steady_clock::now();
    scores(qt.data(), k.data(), s, reps);
    auto t1 = std::chrono::steady_clock::now();
    scores2(qt.data(), qt2.data(), k.data(), s, reps / 2);
    auto t2 = std::chrono::steady_clock::now();
    double a = std::chrono::duration<double>(t1 - t0).count(), b = std::chrono::duration<double>(t2 - t1).count();
    printf("one tile: %.2f G dp/s   two tiles: %.2f G dp/s\n", reps * 512.0 / a / 1e9, reps / 2 * 1024.0 / b / 1e9);
  }
}
