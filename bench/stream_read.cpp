// What one core reads from DRAM per second in the decode attention's access patterns, for bench/paged_decode_ab.py's
// GB/s to be read against: a 1 GB buffer read by 64-byte loads (each widened and summed, a little arithmetic per line)
// (1) front to back, software-prefetched `dist` bytes ahead into L1 (T0), L2 (T1) or non-temporally (NTA), or not;
// (2) in segments of `seg` bytes visited in random order (a sequence's rows for one KV head: 1,088 B is a block of
// 16 int8 rows of 68 B, 40,960 B about 600 rows in one run), 1, 2 (a key and a value stream), 4 or 8 segments at a
// time read side by side, prefetched `dist` bytes ahead into L2; (3) the decode attention's reads with its
// arithmetic: 30 layers of 64 sequences x 600 rows of 68 B (64 int8 values and a scale) per KV head, each row widened
// to float32 and multiplied into 3 query heads' accumulators (12 FMAs), the keys' pass then the values' per task, the
// 3 KV heads' tasks one at a time or side by side, with the kernel's software prefetch (keys 32 rows ahead, values
// of the row, into L2) or none. One thread, one pass per case, wall clock.
//
//   g++ -O2 -march=native bench/stream_read.cpp -o /tmp/stream_read && taskset -c 1 /tmp/stream_read
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// the first 16 bytes of a line widened to float32 and added (the kernel's int8 row arithmetic, lightly)
inline __m512 add_line(__m512 acc, const int8_t* line) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(line));
  return _mm512_add_ps(acc, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)));
}

inline void prefetch(const int8_t* p, int hint) {
  const char* c = reinterpret_cast<const char*>(p);
  if (hint == 0) _mm_prefetch(c, _MM_HINT_T0);
  else if (hint == 1) _mm_prefetch(c, _MM_HINT_T1);
  else _mm_prefetch(c, _MM_HINT_NTA);
}

float front_to_back(const int8_t* p, size_t n, size_t dist, int hint) {
  __m512 acc = _mm512_setzero_ps();
  for (size_t i = 0; i < n; i += 64) {
    if (dist && i + dist < n) prefetch(p + i + dist, hint);
    acc = add_line(acc, p + i);
  }
  return _mm512_reduce_add_ps(acc);
}

// segments order[0], order[1], ... `streams` at a time, read line by line side by side
float segments(const int8_t* p, const std::vector<size_t>& order, size_t seg, size_t dist, int streams) {
  __m512 acc = _mm512_setzero_ps();
  for (size_t s = 0; s + streams <= order.size(); s += streams) {
    for (size_t i = 0; i < seg; i += 64) {
      for (int k = 0; k < streams; ++k) {
        const int8_t* a = p + order[s + k] * seg;
        if (dist && i + dist < seg) prefetch(a + i + dist, 1);
        acc = add_line(acc, a + i);
      }
    }
  }
  return _mm512_reduce_add_ps(acc);
}

constexpr int64_t kRow = 68, kRows = 600, kKvHeads = 3, kSeqs = 64, kLayers = 30;

// one row's 64 int8 values widened and multiplied into 3 heads' accumulators of 4 x 16 lanes
inline void row_into(const int8_t* row, const __m512 (&q)[3][4], __m512 (&acc)[3][4]) {
  for (int c = 0; c < 4; ++c) {
    const __m512 k = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c * 16))));
    for (int t = 0; t < 3; ++t) acc[t][c] = _mm512_fmadd_ps(q[t][c], k, acc[t][c]);
  }
}

// (3): `side` KV heads' tasks at a time (1 or 3), rows prefetched as the kernel does or not; seconds
double attention_reads(const int8_t* p, int side, bool prefetch, float& sink) {
  const int64_t per_head = kSeqs * kRows * kRow;  // one layer's K (or V) rows of one KV head
  __m512 q[3][4], total = _mm512_setzero_ps();
  for (int t = 0; t < 3; ++t)
    for (int c = 0; c < 4; ++c) q[t][c] = _mm512_set1_ps(1e-3f * static_cast<float>(t + c));
  const auto start = Clock::now();
  for (int64_t layer = 0; layer < kLayers; ++layer) {
    const int8_t* keys = p + layer * 2 * kKvHeads * per_head;
    const int8_t* values = keys + kKvHeads * per_head;
    for (int64_t b = 0; b < kSeqs; ++b) {
      for (int64_t h0 = 0; h0 < kKvHeads; h0 += side) {
        __m512 acc[3][3][4] = {};
        for (int64_t j = 0; j < kRows; ++j) {
          for (int64_t h = h0; h < h0 + side; ++h) {
            const int8_t* k = keys + h * per_head + b * kRows * kRow;
            if (prefetch) {
              _mm_prefetch(reinterpret_cast<const char*>(k + (j + 32) * kRow), _MM_HINT_T1);
              _mm_prefetch(reinterpret_cast<const char*>(values + h * per_head + (b * kRows + j) * kRow), _MM_HINT_T1);
            }
            row_into(k + j * kRow, q, acc[h - h0]);
          }
        }
        for (int64_t j = 0; j < kRows; ++j)
          for (int64_t h = h0; h < h0 + side; ++h) row_into(values + h * per_head + (b * kRows + j) * kRow, q, acc[h - h0]);
        for (int h = 0; h < side; ++h)
          for (int t = 0; t < 3; ++t)
            for (int c = 0; c < 4; ++c) total = _mm512_add_ps(total, acc[h][t][c]);
      }
    }
  }
  sink += _mm512_reduce_add_ps(total);
  return seconds_since(start);
}

}  // namespace

int main() {
  const size_t bytes = size_t(1) << 30;
  int8_t* p = static_cast<int8_t*>(std::aligned_alloc(4096, bytes));
  std::memset(p, 1, bytes);
  float sink = 0.f;
  const char* hints[] = {"T0", "T1", "NTA"};
  for (size_t dist : {0, 1024, 2048, 4096}) {
    for (int hint = 0; hint < (dist ? 3 : 1); ++hint) {
      const auto start = Clock::now();
      sink += front_to_back(p, bytes, dist, hint);
      std::printf("front to back, prefetch %4zu B ahead%s%s: %.1f GB/s\n", dist, dist ? " into " : "",
                  dist ? hints[hint] : "", bytes / seconds_since(start) / 1e9);
    }
  }
  std::mt19937 rng(1);
  for (size_t seg : {1088, 4352, 40960}) {
    std::vector<size_t> order(bytes / seg);
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng);
    for (size_t dist : {0, 1024, 2048}) {
      for (int streams : {1, 2, 4, 8}) {
        const auto start = Clock::now();
        sink += segments(p, order, seg, dist, streams);
        const size_t read = order.size() / streams * streams * seg;
        std::printf("segments of %5zu B, %d at a time, prefetch %4zu B ahead: %.1f GB/s\n", seg, streams, dist,
                    read / seconds_since(start) / 1e9);
      }
    }
  }
  const int64_t attention_bytes = kLayers * 2 * kKvHeads * kSeqs * kRows * kRow;
  for (int side : {1, 3}) {
    for (bool prefetch : {false, true}) {
      const double s = attention_reads(p, side, prefetch, sink);
      std::printf("attention reads, %d KV head(s) at a time, %s software prefetch: %.2f ms a layer, %.1f GB/s\n", side,
                  prefetch ? "with" : "no", s / kLayers * 1e3, attention_bytes / s / 1e9);
    }
  }
  std::printf("(checksum %g)\n", sink);
  std::free(p);
}
