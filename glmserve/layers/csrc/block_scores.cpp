// Quest-style block scores straight from the per-block key bounds, on CPU (glmserve/sparse/block.py).
//
// For each decode row b and each of its logical blocks w (physical block tables[b, w]), the upper bound
// of the scaled logit any query head can reach on a key of that block:
//   max over heads h of  scale * sum_d max(q[b,h,d] * lo[blk,kv(h),d], q[b,h,d] * hi[blk,kv(h),d])
// = scale * max_h (relu(q_h) . hi + min(q_h, 0) . lo)   (Tang et al., 2024, "Quest", arXiv:2406.10774).
// Bounds are read in place ([num_blocks, 2, Hkv, D], float32 or bfloat16), one contiguous row per
// block, so the cost is one pass over the row's bounds (1/block_size of its keys and values); no
// gather copy and no skinny GEMM. Work is split over (row, block range) with at::parallel_for.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <limits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(double x) { return static_cast<float>(x); }

template <typename bound_t>
void scores_kernel(const float* q, const bound_t* bounds, const int64_t* tables, const int64_t* num_units,
                   float* out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t W, float scale) {
  const int64_t group = H / Hkv;
  // split each head's query into its positive and negative parts once per row
  std::vector<float> pos(B * H * D), neg(B * H * D);
  for (int64_t i = 0; i < B * H * D; ++i) {
    pos[i] = std::max(q[i], 0.f);
    neg[i] = std::min(q[i], 0.f);
  }
  at::parallel_for(0, B * W, 64, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / W, w = task % W;
      if (w >= num_units[b]) {
        out[task] = -std::numeric_limits<float>::infinity();
        continue;
      }
      const bound_t* blk = bounds + tables[task] * 2 * Hkv * D;
      float best = -std::numeric_limits<float>::infinity();
      for (int64_t k = 0; k < Hkv; ++k) {
        const bound_t* lo = blk + k * D;
        const bound_t* hi = blk + (Hkv + k) * D;
        for (int64_t g = 0; g < group; ++g) {
          const float* qp = pos.data() + (b * H + k * group + g) * D;
          const float* qn = neg.data() + (b * H + k * group + g) * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qp[d] * to_float(hi[d]) + qn[d] * to_float(lo[d]);
          best = std::max(best, s);
        }
      }
      out[task] = best * scale;
    }
  });
}

}  // namespace

at::Tensor block_scores(const at::Tensor& q, const at::Tensor& bounds, const at::Tensor& tables,
                        const at::Tensor& num_units, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: contiguous [B, H, D] float32");
  TORCH_CHECK(bounds.dim() == 4 && bounds.size(1) == 2 && bounds.is_contiguous(), "bounds: [blocks, 2, Hkv, D]");
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.is_contiguous() && tables.dim() == 2, "tables: [B, W] int64");
  TORCH_CHECK(num_units.scalar_type() == at::kLong && num_units.is_contiguous(), "num_units: [B] int64");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = bounds.size(2), W = tables.size(1);
  TORCH_CHECK(bounds.size(3) == D && H % Hkv == 0 && tables.size(0) == B, "shapes do not match");
  auto out = at::empty({B, W}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, bounds.scalar_type(), "block_scores", [&] {
    scores_kernel<scalar_t>(q.data_ptr<float>(), bounds.data_ptr<scalar_t>(), tables.data_ptr<int64_t>(),
                            num_units.data_ptr<int64_t>(), out.data_ptr<float>(), B, H, Hkv, D, W,
                            static_cast<float>(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("block_scores", &block_scores, "Quest block scores (CPU)"); }
