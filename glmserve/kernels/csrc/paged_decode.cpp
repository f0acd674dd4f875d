// Decode attention straight from the paged KV pool, on CPU.
//
// One query token per sequence. For each (sequence, kv head) the kernel reads that head's keys
// and values once, by slot, without gathering them into a temporary: scores for the g query
// heads that share the kv head, a softmax, then the weighted sum of values. Work is split over
// (sequence, kv head) pairs with at::parallel_for. Layouts follow glmserve/layers/attention.py:
// q [B, H, D] float32, cache k/v [Hkv, slots, W], slots [B, L] int64, context lengths [B] int64,
// out [B, H, D] float32; `paged_decode_lse` also returns each head's log-sum-exp of scores [B, H]
// (float32), to merge with attention over keys elsewhere (KV offload).
// Cache rows (glmserve/kv/kv_format.py): float32 / bfloat16 / float16 values (W = D), or quantized
// rows of D 8-bit codes then a float16 scale (W = D + 2): int8 codes (cache dtype int8) or float8
// E4M3 codes (cache dtype uint8, the codes' bits). Quantized rows are dequantized in the kernel: a
// key's dot product is taken over its codes and scaled once, a value's weight is its probability
// times its scale.
// The split into a score pass and a value pass follows the textbook softmax(QK^T)V; see also
// vLLM's csrc/cpu/attention.cpp for the paged layout idea (read, not copied).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/extension.h>

#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kScaleBytes = 2;  // one float16 scale after a quantized row's codes

// Float rows: the values themselves, no scale.
template <typename T>
struct FloatRows {
  using storage = T;
  static constexpr int64_t extra = 0;
  static float value(T x) { return static_cast<float>(x); }
  static float scale(const T*, int64_t) { return 1.f; }
};

inline float half_at(const void* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Quantized rows: D codes, then the row's float16 scale.
struct Int8Rows {
  using storage = int8_t;
  static constexpr int64_t extra = kScaleBytes;
  static float value(int8_t c) { return static_cast<float>(c); }
  static float scale(const int8_t* row, int64_t D) { return half_at(row + D); }
};

const std::array<float, 256> kFp8Values = [] {  // every E4M3 code's value
  std::array<float, 256> table{};
  for (int c = 0; c < 256; ++c)
    table[c] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(c), c10::Float8_e4m3fn::from_bits()));
  return table;
}();

struct Fp8Rows {
  using storage = uint8_t;
  static constexpr int64_t extra = kScaleBytes;
  static float value(uint8_t c) { return kFp8Values[c]; }
  static float scale(const uint8_t* row, int64_t D) { return half_at(row + D); }
};

template <typename Rows>
void decode_kernel(const float* q, const typename Rows::storage* k_cache, const typename Rows::storage* v_cache,
                   const int64_t* slots, const int64_t* ctx_lens, float* out, float* lse, int64_t B, int64_t H,
                   int64_t Hkv, int64_t D, int64_t num_slots, int64_t L, float scale) {
  using cache_t = typename Rows::storage;
  const int64_t group = H / Hkv;
  const int64_t W = D + Rows::extra;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(group * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv;
      const int64_t h = task % Hkv;
      const int64_t n = ctx_lens[b];
      scores.assign(group * n, 0.f);
      const int64_t* seq_slots = slots + b * L;
      const cache_t* kh = k_cache + h * num_slots * W;
      const cache_t* vh = v_cache + h * num_slots * W;
      const float* qh = q + (b * H + h * group) * D;
      for (int64_t j = 0; j < n; ++j) {
        const cache_t* krow = kh + seq_slots[j] * W;
        const float row_scale = scale * Rows::scale(krow, D);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qh + g * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * Rows::value(krow[d]);
          scores[g * n + j] = dot * row_scale;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * n;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
        float sum = 0.f;
        for (int64_t j = 0; j < n; ++j) {
          s[j] = std::exp(s[j] - mx);
          sum += s[j];
        }
        const float inv = 1.f / sum;
        for (int64_t j = 0; j < n; ++j) s[j] *= inv;
        if (lse != nullptr) lse[b * H + h * group + g] = mx + std::log(sum);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < n; ++j) {
        const cache_t* vrow = vh + seq_slots[j] * W;
        const float row_scale = Rows::scale(vrow, D);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * n + j] * row_scale;
          float* a = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += p * Rows::value(vrow[d]);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* o = out + (b * H + h * group + g) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = acc[g * D + d];
      }
    }
  });
}

}  // namespace

std::vector<at::Tensor> run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& slots, const at::Tensor& ctx_lens, double scale, bool with_lse) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: contiguous [B, H, D] float32");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous(), "cache: [Hkv, slots, D]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 2, "slots: [B, L] int64");
  TORCH_CHECK(ctx_lens.scalar_type() == at::kLong && ctx_lens.is_contiguous(), "ctx_lens: [B] int64");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(0), num_slots = k_cache.size(1), L = slots.size(1);
  const auto dtype = k_cache.scalar_type();
  const bool quantized = dtype == at::kChar || dtype == at::kByte;
  TORCH_CHECK(v_cache.scalar_type() == dtype && v_cache.sizes() == k_cache.sizes(), "k/v caches differ");
  TORCH_CHECK(k_cache.size(2) == D + (quantized ? kScaleBytes : 0) && H % Hkv == 0, "head sizes do not match");
  auto out = at::empty_like(q);
  auto lse = with_lse ? at::empty({B, H}, q.options()) : at::Tensor();
  float* lse_ptr = with_lse ? lse.data_ptr<float>() : nullptr;
  auto launch = [&](auto rows) {
    using Rows = decltype(rows);
    using cache_t = typename Rows::storage;
    decode_kernel<Rows>(q.data_ptr<float>(), static_cast<const cache_t*>(k_cache.data_ptr()),
                        static_cast<const cache_t*>(v_cache.data_ptr()), slots.data_ptr<int64_t>(),
                        ctx_lens.data_ptr<int64_t>(), out.data_ptr<float>(), lse_ptr, B, H, Hkv, D, num_slots, L,
                        static_cast<float>(scale));
  };
  if (dtype == at::kChar) {
    launch(Int8Rows{});
  } else if (dtype == at::kByte) {
    launch(Fp8Rows{});
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "paged_decode", [&] {
      launch(FloatRows<scalar_t>{});
    });
  }
  return with_lse ? std::vector<at::Tensor>{out, lse} : std::vector<at::Tensor>{out};
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& slots, const at::Tensor& ctx_lens, double scale) {
  return run(q, k_cache, v_cache, slots, ctx_lens, scale, false)[0];
}

std::vector<at::Tensor> paged_decode_lse(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                         const at::Tensor& slots, const at::Tensor& ctx_lens, double scale) {
  return run(q, k_cache, v_cache, slots, ctx_lens, scale, true);
}

// Test-only: the at::get_thread_num() that ran each of `n` items of an at::parallel_for with grain 1, as
// int64 [n]; tests check that our builds' parallel loops use torch's intra-op threads (build.py, -fopenmp).
at::Tensor parallel_thread_ids(int64_t n) {
  TORCH_CHECK(n > 0, "parallel_thread_ids: n must be positive, got ", n);
  at::Tensor ids = at::full({n}, -1, at::kLong);
  int64_t* out = ids.data_ptr<int64_t>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) out[i] = at::get_thread_num();
  });
  return ids;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU)");
  m.def("paged_decode_lse", &paged_decode_lse, "paged decode attention (CPU) and the log-sum-exp per head");
  m.def("parallel_thread_ids", &parallel_thread_ids, "test-only: the intra-op thread that ran each item");
}
