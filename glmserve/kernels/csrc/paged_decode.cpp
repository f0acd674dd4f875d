// Decode attention straight from the paged KV pool, on CPU.
//
// One query token per sequence. For each (sequence, kv head) the kernel reads that head's keys
// and values once, by slot, without gathering them into a temporary: scores for the g query
// heads that share the kv head, a softmax, then the weighted sum of values. Work is split over
// (sequence, kv head) pairs with at::parallel_for. Layouts follow glmserve/layers/attention.py:
// q [B, H, D] float32, cache k/v [Hkv, slots, D] (float32 or bfloat16), slots [B, L] int64,
// context lengths [B] int64, out [B, H, D] float32; `paged_decode_lse` also returns each head's
// log-sum-exp of scores [B, H] (float32), to merge with attention over keys elsewhere (KV offload).
// The split into a score pass and a value pass follows the textbook softmax(QK^T)V; see also
// vLLM's csrc/cpu/attention.cpp for the paged layout idea (read, not copied).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(double x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

template <typename cache_t>
void decode_kernel(const float* q, const cache_t* k_cache, const cache_t* v_cache, const int64_t* slots,
                   const int64_t* ctx_lens, float* out, float* lse, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                   int64_t num_slots, int64_t L, float scale) {
  const int64_t group = H / Hkv;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(group * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv;
      const int64_t h = task % Hkv;
      const int64_t n = ctx_lens[b];
      scores.assign(group * n, 0.f);
      const int64_t* seq_slots = slots + b * L;
      const cache_t* kh = k_cache + h * num_slots * D;
      const cache_t* vh = v_cache + h * num_slots * D;
      const float* qh = q + (b * H + h * group) * D;
      for (int64_t j = 0; j < n; ++j) {
        const cache_t* krow = kh + seq_slots[j] * D;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qh + g * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * to_float(krow[d]);
          scores[g * n + j] = dot * scale;
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
        const cache_t* vrow = vh + seq_slots[j] * D;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * n + j];
          float* a = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += p * to_float(vrow[d]);
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
  TORCH_CHECK(k_cache.size(2) == D && H % Hkv == 0, "head sizes do not match");
  auto out = at::empty_like(q);
  auto lse = with_lse ? at::empty({B, H}, q.options()) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(q.data_ptr<float>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            slots.data_ptr<int64_t>(), ctx_lens.data_ptr<int64_t>(), out.data_ptr<float>(),
                            with_lse ? lse.data_ptr<float>() : nullptr, B, H, Hkv, D, num_slots, L,
                            static_cast<float>(scale));
  });
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU)");
  m.def("paged_decode_lse", &paged_decode_lse, "paged decode attention (CPU) and the log-sum-exp per head");
}
